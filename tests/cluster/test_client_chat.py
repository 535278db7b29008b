"""Client.chat: the LLM.chat interface over the HTTP server's /v1/chat/completions."""
import pytest

from cluster.client import Client
from mpk_runtime.engine import InvalidRequestError, NoTokenizerError, SamplingParams

from test_cluster_http import local_llm  # noqa: F401  (the module fixture: an LLM of the demo model)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello"}]
TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "the quick brown fox"}]


def test_client_chat_equals_llm_chat(server, local_llm):  # noqa: F811
    with Client(server[0].url) as c:
        one = c.chat(HELLO, GREEDY)
        two = c.chat([HELLO, TURNS], GREEDY)
    want = local_llm.chat([HELLO, TURNS], GREEDY)
    assert len(one) == 1 and one[0].text == want[0].text and one[0].token_ids == want[0].token_ids
    assert [o.text for o in two] == [o.text for o in want]
    assert [o.token_ids for o in two] == [o.token_ids for o in want]
    assert [o.request_id for o in two] == ["0", "1"]
    assert all(o.finished and o.finish_reason == "length" for o in two)
    assert [o.metrics.num_prompt_tokens for o in two] == [len(o.prompt_token_ids) for o in want]


def test_client_chat_sends_the_sampling_fields(server, local_llm):  # noqa: F811
    """max_tokens past the context stops at it (truncate_max_tokens, as LLM.chat), stop strings and per-conversation
    params reach the server."""
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    with Client(server[0].url) as c:
        got = c.chat([HELLO, TURNS], [long, GREEDY])
        want = local_llm.chat([HELLO, TURNS], [long, GREEDY])
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].finish_reason == "length" and len(got[0].token_ids) == 64 - len(want[0].prompt_token_ids)
        until = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)   # None: until the context
        assert c.chat(HELLO, until)[0].token_ids == local_llm.chat(HELLO, until)[0].token_ids
        biased = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={42: 100})
        assert c.chat(HELLO, biased)[0].token_ids == [42] * 3


def test_client_chat_errors_are_typed(server):
    with Client(server[0].url) as c:
        with pytest.raises(InvalidRequestError, match="usr"):
            c.chat([{"role": "usr", "content": "hi"}], GREEDY)
        with pytest.raises(InvalidRequestError, match="empty"):
            c.chat([], GREEDY)
        with pytest.raises(InvalidRequestError, match="logprobs"):
            c.chat(HELLO, SamplingParams(temperature=0, max_tokens=2, logprobs=2))


def test_client_chat_without_a_tokenizer_is_no_tokenizer_error():
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router("tiny-qwen3", executor="inprocess", dtype="float32", max_seq_len=64, health_interval=None)
    srv = ServerThread(create_app(router))
    try:
        with Client(srv.url) as c:
            with pytest.raises(NoTokenizerError, match="tokenizer"):
                c.chat(HELLO, GREEDY)
    finally:
        srv.stop()
        router.shutdown()
