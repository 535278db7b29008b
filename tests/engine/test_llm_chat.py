"""LLM.chat: conversations rendered with the model tokenizer's chat template (engine/chat.py `render_chat`, shared
with the HTTP server's /v1/chat/completions), then generated as LLM.generate generates the rendered prompt."""
import pytest

from mpk_runtime.engine import LLM, InvalidRequestError, NoTokenizerError, SamplingParams
from mpk_runtime.engine.chat import CHAT_ROLES, render_chat

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello"}]
TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def llm(demo_dir):
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as m:
        yield m


def _rendered(tok, msgs) -> tuple[list[int], str]:
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False), text


def test_chat_of_one_conversation_is_generate_on_the_rendered_prompt(llm):
    ids, text = _rendered(llm.tokenizer, HELLO)
    want = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    got = llm.chat(HELLO, GREEDY)
    assert isinstance(got, list) and len(got) == 1
    got = got[0]
    assert got.prompt == text and got.prompt.endswith("<|im_start|>assistant\n")
    assert got.prompt_token_ids == ids
    assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == "length"


def test_chat_of_two_conversations_in_order(llm):
    want = [llm.generate([_rendered(llm.tokenizer, m)[0]], GREEDY, use_tqdm=False)[0] for m in (HELLO, TURNS)]
    got = llm.chat([HELLO, TURNS], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.prompt for o in got] == [_rendered(llm.tokenizer, m)[1] for m in (HELLO, TURNS)]
    # one SamplingParams a conversation, as generate takes one a prompt
    two = llm.chat([HELLO, TURNS], [GREEDY, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    assert two[0].token_ids == want[0].token_ids and two[1].token_ids == want[1].token_ids[:2]
    # a tuple of messages is one conversation too
    assert llm.chat(tuple(HELLO), GREEDY)[0].token_ids == want[0].token_ids


def test_text_content_parts_are_joined(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    assert llm.chat(parts, GREEDY)[0].prompt == llm.chat(HELLO, GREEDY)[0].prompt
    # content None (an assistant turn with tool calls) renders as ""
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert render_chat(llm.tokenizer, turn)[1] == \
        _rendered(llm.tokenizer, [turn[0], {"role": "assistant", "content": ""}])[1]


def test_render_chat_returns_the_ids_and_text(llm):
    assert render_chat(llm.tokenizer, TURNS) == _rendered(llm.tokenizer, TURNS)


@pytest.mark.parametrize("messages, words", [
    ([], ["messages", "empty"]),
    ([[]], ["messages", "empty"]),
    ([{"role": "usr", "content": "hi"}], ["'usr'", "user", "assistant", "system"]),
    ([{"content": "hi"}], ["role"]),
    ([{"role": 1, "content": "hi"}], ["role"]),
    ([{"role": "user", "content": 5}], ["content", "string"]),
    ([{"role": "user", "content": {"text": "hi"}}], ["content", "string"]),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ["content part", "text"]),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], ["content part"]),
    # OpenAI refuses these (only an assistant turn may have no content); they were rendered as an empty turn
    ([{"role": "user", "content": None}], ["messages[0].content", "null", "user"]),
    ([{"role": "user"}], ["messages[0].content", "missing"]),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], ["messages[0].content", "system"]),
    ([{"role": "user", "content": []}], ["messages[0].content", "empty list"]),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}], ["messages[1].content", "empty"]),
    (["hello"], ["dict", "role"]),
    ("hello", ["list"]),
    (None, ["list"]),
])
def test_bad_messages_are_invalid_requests(llm, messages, words):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(messages, GREEDY)
    assert not isinstance(e.value, NoTokenizerError)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_bad_conversation_rejects_the_whole_call_and_is_named(llm):
    with pytest.raises(InvalidRequestError, match=r"conversation 1.*'usr'"):
        llm.chat([HELLO, [{"role": "usr", "content": "hi"}]], GREEDY)
    assert not llm.engine.has_unfinished()   # (the good conversation was not queued)
    with pytest.raises(InvalidRequestError, match="2 sampling params for 1"):
        llm.chat(HELLO, [GREEDY, GREEDY])


def test_a_template_that_refuses_the_messages_is_an_invalid_request(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template",
                        "{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    with pytest.raises(InvalidRequestError, match="chat template refused the messages.*roles must alternate"):
        llm.chat(HELLO, GREEDY)


def test_a_model_without_a_tokenizer_says_what_to_do():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64) as m:
        with pytest.raises(NoTokenizerError) as e:
            m.chat(HELLO, GREEDY)
    msg = str(e.value)
    assert "tokenizer" in msg and "generate" in msg and "token ids" in msg, msg


def test_a_tokenizer_without_a_chat_template_says_what_to_do(tmp_path):
    from mpk_runtime.engine.demo_model import save_demo_model
    path = save_demo_model(str(tmp_path / "no-template"), chat_template=False)
    with LLM(path, dtype="float32", max_seq_len=64) as m:
        with pytest.raises(NoTokenizerError, match="no chat template") as e:
            m.chat(HELLO, GREEDY)
        assert "generate" in str(e.value)
        # render_chat itself, with no tokenizer at all
        with pytest.raises(NoTokenizerError, match="needs a tokenizer"):
            render_chat(None, HELLO)


def test_the_roles_are_the_servers():
    from cluster.protocol import CHAT_ROLES as SERVER_ROLES
    assert tuple(CHAT_ROLES) == tuple(SERVER_ROLES)


def test_render_chat_is_exported():
    import mpk_runtime.engine as engine
    assert engine.render_chat is render_chat
