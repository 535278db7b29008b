"""SamplingParams.n as a demanding user meets it (review of the n feature), against an independent reference (a
single request seeded with seed + j, what completion j is promised to equal; LLM.generate for the HTTP paths): a
completion that fails while its siblings do not (LLM.generate's on_output and to_dict, the CLI's exit code), seeds at
the int64 edges, streams stopped early (LLM.stream, cluster.Client.stream), cluster.Client's n against the server's
own n, and unseeded completions spread over replicas. (The engine-side tests live here too: a second test_n_review.py
under tests/engine would clash with this one's module name in one pytest run, the test directories being no
packages.)"""
import json
import time

import httpx
import pytest

from cluster.client import Client
from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine import RequestFailedError

from test_cluster_http import local_llm  # noqa: F401  (the module fixture: an LLM of the demo model)

P = [[1, 2, 3], [9, 8, 7, 6]]
FAIL_SEED = 10_001   # the seed of the completion the patched sampler fails


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", backend="reference", dtype="float32", max_seq_len=64, seed=3) as m:
        yield m


def _fail_seed(monkeypatch, bad: int) -> None:
    """The engine's host sampler fails every draw of the request seeded `bad` (as a row of NaN logits does): that
    request alone ends with finish_reason "error"."""
    import mpk_runtime.engine.engine as eng
    real = eng.sample

    def sample(logits, params, seed, pos):
        if seed == bad:
            raise ValueError("injected bad logits")
        return real(logits, params, seed, pos)
    monkeypatch.setattr(eng, "sample", sample)


@pytest.fixture
def fail_one_seed(monkeypatch):
    _fail_seed(monkeypatch, FAIL_SEED)


def _one(llm, seed, **kw):
    return llm.generate([P[0]], SamplingParams(seed=seed, **kw), use_tqdm=False)[0]


def test_a_failed_later_completion_keeps_its_error(llm, fail_one_seed):
    """Completion 1 of 3 failed: on_output's output (whose top-level fields are completion 0's, which did not fail)
    lost the failure's message (CompletionOutput had no error) and its to_dict had none either."""
    kw = dict(temperature=1.0, max_tokens=4, ignore_eos=True)
    told = []
    with pytest.raises(RequestFailedError, match="1 of 3 requests failed.*injected bad logits"):
        llm.generate([P[0]], SamplingParams(seed=FAIL_SEED - 1, n=3, **kw), use_tqdm=False,
                     on_output=lambda i, o: told.append(o))
    (o,) = told
    assert [c.finish_reason for c in o.outputs] == ["length", "error", "length"]
    assert "injected bad logits" in o.outputs[1].error and o.outputs[0].error is None and o.error is None
    for j in (0, 2):   # the siblings are the single requests they are promised to be
        assert o.outputs[j].token_ids == _one(llm, FAIL_SEED - 1 + j, **kw).token_ids
    d = json.loads(json.dumps(o.to_dict()))
    assert "injected bad logits" in d["completions"][1]["error"] and "error" not in d["completions"][0]
    assert not llm.engine.has_unfinished() and llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_cli_exits_1_when_a_later_completion_fails(monkeypatch, capsys):
    """`generate --n 3` whose second completion failed printed its line and exited 0: the exit code looked only at
    the line's top-level finish_reason (completion 0's)."""
    from mpk_runtime.__main__ import main
    _fail_seed(monkeypatch, 1)   # (unseeded, --seed 0: a fresh engine's request k draws with seed k)
    rc = main(["generate", "--model", "tiny-qwen3", "--backend", "reference", "--dtype", "float32",
               "--max-tokens", "3", "--temperature", "1", "--n", "3", "--prompt-ids", "1,2"])
    cap = capsys.readouterr()
    (line,) = [json.loads(x) for x in cap.out.splitlines() if x.startswith("{")]
    assert [c["finish_reason"] for c in line["completions"]] == ["length", "error", "length"]
    assert "injected bad logits" in line["completions"][1]["error"]
    assert rc == 1 and "1 of 3 requests failed" in cap.err


def test_cli_exits_1_when_the_engine_fails_without_outputs(monkeypatch, capsys):
    """A RequestFailedError that no request's output carries (the engine could not admit a request) was swallowed:
    nothing printed, exit code 0."""
    from mpk_runtime.__main__ import main
    from mpk_runtime.engine.engine import LLMEngine

    def step(self, *a, **k):
        raise RequestFailedError("cannot admit request '0': injected")
    monkeypatch.setattr(LLMEngine, "step", step)
    rc = main(["generate", "--model", "tiny-qwen3", "--backend", "reference", "--dtype", "float32",
               "--max-tokens", "3", "--n", "2", "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot admit request '0': injected" in err


@pytest.mark.parametrize("seed", [2 ** 63 - 2, 2 ** 64 - 2, -2 ** 63])
def test_seeds_at_the_int64_edges_equal_single_requests(llm, seed):
    """seed + j past int64 (or 2^64) is the single request with that seed (its low 64 bits)."""
    kw = dict(temperature=1.0, max_tokens=4, ignore_eos=True)
    o = llm.generate([P[0]], SamplingParams(seed=seed, n=3, **kw), use_tqdm=False)[0]
    assert [c.token_ids for c in o.outputs] == [_one(llm, seed + j, **kw).token_ids for j in range(3)]


def test_stream_stopped_early_aborts_every_sibling(llm):
    it = llm.stream(P, SamplingParams(temperature=1.0, max_tokens=30, seed=4, n=4, ignore_eos=True))
    for k, _ in enumerate(it):
        if k == 3:
            break
    it.close()
    e = llm.engine
    assert not e.has_unfinished() and e.allocator.num_free == e.allocator.num_pages and not llm._inboxes


def _idle(router) -> bool:
    """Every replica holds no request and no KV page (polled: a closed stream's abort reaches the engine loop a
    moment after the connection closes)."""
    for _ in range(100):
        st = router.stats()
        if all(s["outstanding"] == 0 and s["kv_pages_used"] == 0 for s in st.values()):
            return True
        time.sleep(0.05)
    return False


def test_client_server_and_llm_n_agree_at_the_int64_edge(server, local_llm):  # noqa: F811
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=2 ** 64 - 2, n=3, logprobs=1, stop=["e"],
                        presence_penalty=0.3)
    want = local_llm.generate(P, sp, use_tqdm=False)
    srv, router = server
    with Client(srv.url) as c:
        got = c.generate(P, sp)
    body = {"prompt": P, "max_tokens": 6, "temperature": 1.0, "seed": 2 ** 64 - 2, "n": 3, "logprobs": 1,
            "stop": ["e"], "presence_penalty": 0.3}
    choices = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    flat = [c for w in want for c in w.outputs]
    assert [x["token_ids"] for x in choices] == [c.token_ids for c in flat]
    assert [x["text"] for x in choices] == [c.text for c in flat]
    for g, w in zip(got, want):
        assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in g.outputs] == \
               [(c.index, c.token_ids, c.text, c.finish_reason) for c in w.outputs]
        assert [[sorted(d) for d in c.logprobs] for c in g.outputs] == [[sorted(d) for d in c.logprobs]
                                                                       for c in w.outputs]


def test_client_stream_of_n_closed_early_leaves_the_server_idle(server):
    srv, router = server
    with Client(srv.url) as c:
        it = c.stream(P, SamplingParams(temperature=1.0, max_tokens=50, seed=1, n=4, ignore_eos=True))
        for k, _ in enumerate(it):
            if k == 5:
                break
        it.close()
    assert _idle(router)


@pytest.fixture(scope="module")
def two_replicas(demo_dir):
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router(demo_dir, executor="inprocess", dtype="float32", max_seq_len=64, max_batch=8,
                          num_replicas=2, health_interval=None)
    srv = ServerThread(create_app(router))
    yield srv, router
    srv.stop()
    router.shutdown()


def test_unseeded_n_over_two_replicas_are_not_copies(two_replicas):
    """An unseeded n=4 request to a server of 2 replicas came back as 2 pairs of identical completions (the router
    sends siblings to the least loaded replica, alternately; each replica numbered its own requests 0, 1, ... from
    the shared engine seed). Fixed in session 75: the router seeds unseeded requests from one count (Router.submit)."""
    srv, _ = two_replicas
    body = {"prompt": P[0], "max_tokens": 8, "temperature": 1.0, "n": 4, "ignore_eos": True}
    choices = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    with Client(srv.url) as c:
        got = c.generate([P[0]], SamplingParams(temperature=1.0, max_tokens=8, n=4, ignore_eos=True))[0]
    assert len({tuple(x["token_ids"]) for x in choices}) == 4
    assert len({tuple(x.token_ids) for x in got.outputs}) == 4


def test_router_refuses_n_up_front_and_a_streamed_snapshot_names_its_index():
    from cluster.router import build_router
    from mpk_runtime import LLM
    from mpk_runtime.engine import InvalidRequestError
    router = build_router("tiny-qwen3", executor="inprocess", dtype="float32", max_seq_len=64, health_interval=None)
    try:
        with pytest.raises(InvalidRequestError, match="one completion"):
            router.submit([1, 2], SamplingParams(n=2), lambda o: None)
    finally:
        router.shutdown()
    with LLM("tiny-qwen3", backend="reference", dtype="float32", max_seq_len=64) as llm:
        last = [o for o in llm.stream([[1, 2]], SamplingParams(max_tokens=2, n=2, seed=1)) if o.finished]
    assert sorted(o.to_dict().get("index", 0) for o in last) == [0, 1]
