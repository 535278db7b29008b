"""Review of how generated ids become text (engine/detokenize.py, stop_strings.py, tokenizer.py): the streamed text
against the tokenizer's own decode of the same ids, and stop strings against a plain re-implementation."""
import random

import pytest

from mpk_runtime.engine.detokenize import IncrementalText, text_decoder


def _llama2_style():
    """A SentencePiece-style tokenizer with byte-fallback tokens (<0x00>..<0xFF>) and Llama-2 / Mistral's decoder
    (Replace, ByteFallback, Fuse, Strip): a run of byte tokens decodes as a whole, all of it "\ufffd" if invalid."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["\u2581", "\u2581hello", "\u2581world", "a", "b", "\u2581a", ".", ",", "\u65e5\u672c", "\u2581x"]:
        vocab[w] = len(vocab)
    t = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte(tok, b):
    return tok.convert_tokens_to_ids(f"<0x{b:02X}>")


def _stream(dec, ids):
    """IncrementalText fed ids one at a time (the last add final): the texts shown after each token."""
    it, shown = IncrementalText(dec), []
    for n in range(1, len(ids) + 1):
        it.add(ids[:n], final=n == len(ids))
        shown.append(it.text)
    return shown


def test_byte_fallback_run_cut_by_max_tokens():
    """A byte-fallback run decodes as a whole ("\ufffd" for every byte when invalid): "\u65e5" shown from a valid run was
    later contradicted when the run went invalid (max_tokens mid-character), so the final text was not
    tok.decode(ids) and the streamed text was not a prefix of it."""
    tok = _llama2_style()
    dec = text_decoder(tok)
    hello, eos = tok.convert_tokens_to_ids("\u2581hello"), tok.eos_token_id
    nl = _byte(tok, 0x0A)
    day = [_byte(tok, b) for b in "\u65e5".encode()]
    cases = [[hello] + day + [_byte(tok, 0xE6)],                 # truncated after a complete character
             [hello, nl, _byte(tok, 0xE6), hello],              # a newline byte, then a broken character
             [nl, eos, _byte(tok, 0xA5), hello],                # a skipped special token inside a run
             [hello] + day + day[:2]]
    for ids in cases:
        whole = tok.decode(ids, skip_special_tokens=True)
        shown = _stream(dec, ids)
        assert shown[-1] == whole, (tok.convert_ids_to_tokens(ids), shown, whole)
        for s in shown:
            assert whole.startswith(s), (tok.convert_ids_to_tokens(ids), shown, whole)


def test_byte_fallback_random_streams():
    """Random ids over a byte-fallback tokenizer: every text shown is a prefix of the final decode, which it ends
    equal to (the shown text was contradicted by a later invalid byte in the same run)."""
    tok = _llama2_style()
    dec = text_decoder(tok)
    rng = random.Random(0)
    specials = [tok.bos_token_id, tok.eos_token_id]
    byte_ids = [_byte(tok, b) for b in range(256)]
    for _ in range(400):
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.choice(specials) if rng.random() < 0.2
               else rng.randrange(len(tok)) for _ in range(rng.randint(1, 14))]
        whole = tok.decode(ids, skip_special_tokens=True)
        shown = _stream(dec, ids)
        assert shown[-1] == whole, tok.convert_ids_to_tokens(ids)
        assert all(whole.startswith(s) for s in shown), (tok.convert_ids_to_tokens(ids), shown, whole)


def test_cleanup_tokenizer_streamed_text_only_grows(wordlevel):
    """With a space-cleanup tokenizer the shown text was clean(text so far), which a later token rewrites ("b '" then
    "b's" once "s" comes): text already streamed was contradicted, so the deltas did not add up to the final text."""
    tok = wordlevel()
    dec = text_decoder(tok)
    assert dec.clean is not None
    rng = random.Random(3)
    for trial in range(300):
        ids = [rng.randrange(2, len(tok)) for _ in range(rng.randint(1, 16))]
        stops = () if trial % 2 else ("zz", "e f")
        whole = tok.decode(ids, skip_special_tokens=True)
        it, shown = IncrementalText(dec), []
        for n in range(1, len(ids) + 1):
            final = n == len(ids)
            if it.add(ids[:n], final) or final:
                shown.append(it.visible(stops, False, final)[0])
        if "e f" not in whole:
            assert shown[-1] == whole
        assert all(shown[-1].startswith(s) for s in shown), (tok.convert_ids_to_tokens(ids), shown)


def test_cleanup_tokenizer_deltas_through_the_engine(wordlevel):
    """The same through LLM.stream: the concatenated delta_text was not the final text (nor tok.decode)."""
    from mpk_runtime import LLM, SamplingParams
    tok = wordlevel()
    bias = {i: 50.0 for i in range(2, len(tok))}   # sample only the tokenizer's words
    with LLM("tiny-qwen3", backend="reference", dtype="float32", max_seq_len=64, tokenizer=tok) as llm:
        for seed in range(6):
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True, logit_bias=bias)
            parts = list(llm.stream([3, 4, 5], sp))
            final = parts[-1]
            assert "".join(p.delta_text or "" for p in parts) == final.text
            assert final.text == tok.decode(final.token_ids, skip_special_tokens=True)
