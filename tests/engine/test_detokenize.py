"""Incremental detokenization (engine/detokenize.py) against decoding the whole output each token (what the engine did
before, and what a user would compare with): byte-level BPE (Llama-3 / Qwen style, the demo tokenizer) and a
SentencePiece-style Metaspace tokenizer, random token streams with broken UTF-8 and special tokens, stop strings."""
import random

import pytest

from mpk_runtime.engine.detokenize import IncrementalText, text_decoder
from mpk_runtime.engine.stop_strings import visible_text

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog. ", "naïve café über straße ünïcödé ⌘ 日本語 テスト",
          "The capital of France is Paris . Once upon a time , there was a model !"] * 3


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    from transformers import AutoTokenizer

    from mpk_runtime.engine.demo_model import save_demo_model
    return AutoTokenizer.from_pretrained(save_demo_model(str(tmp_path_factory.mktemp("d") / "demo")))


@pytest.fixture(scope="module")
def metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _streams(tok, n=60, length=80):
    rng = random.Random(0)
    V = len(tok)
    real = [tok.encode(t, add_special_tokens=False) for t in CORPUS]
    for i in range(n):
        if i % 2:   # text the tokenizer made, with special tokens mixed in
            ids = [t for t in rng.choice(real)[:length]]
            for _ in range(3):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(tok.all_special_ids))
        else:       # any ids: broken UTF-8 sequences (byte-level), odd spacing
            ids = [rng.randrange(V) for _ in range(length)]
        yield ids


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_incremental_text_equals_the_whole_decode(name, request):
    tok = request.getfixturevalue(name)
    dec = text_decoder(tok)
    assert dec.whole is None and dec.clean is None   # the fast path
    for ids in _streams(tok):
        it, shown = IncrementalText(dec), ""
        for n in range(1, len(ids) + 1):
            it.add(ids[:n], final=False)
            whole = tok.decode(ids[:n], skip_special_tokens=True)
            assert whole.startswith(it.text), (ids[:n], it.text, whole)   # never ahead of the truth
            assert it.text.startswith(shown)                             # never takes text back
            shown = it.text
            if not whole.endswith("\ufffd"):   # complete: the whole decode exactly
                assert it.text == whole, (ids[:n], it.text, whole)
        it.add(ids, final=True)
        assert it.text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_stop_strings_over_the_incremental_text(name, request):
    """visible() token by token equals stop_strings.visible_text over the whole decode, until the first stop."""
    tok = request.getfixturevalue(name)
    rng = random.Random(1)
    for ids in _streams(tok, n=30):
        text = tok.decode(ids, skip_special_tokens=True)
        stops = tuple({text[i:i + rng.randint(1, 4)] for i in (rng.randrange(max(1, len(text))) for _ in range(2))
                       if text[i:i + 1]}) or ("zz",)
        it = IncrementalText(text_decoder(tok))
        for n in range(1, len(ids) + 1):
            final = n == len(ids)
            if not it.add(ids[:n], final) and not final:
                continue
            got = it.visible(stops, False, final)
            assert got == visible_text(it.text, stops, False, final), (stops, it.text)
            if got[1]:
                whole = tok.decode(ids[:n], skip_special_tokens=True)
                assert got == visible_text(whole, stops, False, final)
                break


@pytest.mark.parametrize("kind", ["cleanup", "cannot_tell"])
def test_tokenizers_with_space_cleanup(kind, wordlevel):
    """transformers' cleanup (" ." -> ".", " n't" -> "n't") is not local to a window: applied over the whole text
    where the tokenizer applies it ("cleanup"), or the whole output decoded each token where a probe cannot tell
    ("cannot_tell": a vocabulary without those pieces); equal to the whole decode at every token either way."""
    tok = wordlevel() if kind == "cleanup" else wordlevel(vocab_extra=())
    dec = text_decoder(tok)
    assert (dec.clean is not None) if kind == "cleanup" else (dec.whole is not None)
    rng = random.Random(2)
    V = len(tok)
    for trial in range(40):
        ids = [3, 2, 14] + [rng.randrange(V) for _ in range(30)]   # "\u2581a", "\u2581", ".": "a." (not "a .")
        it = IncrementalText(dec)
        for n in range(1, len(ids) + 1):
            it.add(ids[:n], final=n == len(ids))
            assert it.text == tok.decode(ids[:n], skip_special_tokens=True), (ids[:n], it.text)
        stops = (tok.decode(ids[5:7], skip_special_tokens=True) or "zz",)
        it2, whole = IncrementalText(dec), None
        for n in range(1, len(ids) + 1):
            final = n == len(ids)
            if it2.add(ids[:n], final) or final:
                got = it2.visible(stops, False, final)
                whole = tok.decode(ids[:n], skip_special_tokens=True)
                want = visible_text(whole, stops, False, final)   # streamed: a prefix of it that later text keeps
                assert got[1] == want[1] and want[0].startswith(got[0])
                assert got == want or not (final or got[1])
                if got[1]:
                    break


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_text_decoder_is_the_tokenizers_decode(name, request):
    """With the cleanup flag off and on: the incremental text is the tokenizer's decode."""
    tok = request.getfixturevalue(name)
    for clean in (False, True):   # (BPE: transformers 5 ignores the flag; either way the texts must agree)
        tok.clean_up_tokenization_spaces = clean
        dec = text_decoder(tok)
        for ids in _streams(tok, n=20):
            it = IncrementalText(dec)
            for n in range(1, len(ids) + 1):
                it.add(ids[:n], final=n == len(ids))
            assert it.text == tok.decode(ids, skip_special_tokens=True)
    tok.clean_up_tokenization_spaces = False
