"""SamplingParams.n through cluster.Client (generate / chat / stream over the HTTP server) and the batch job (one
copy and --replicas 2): the n completions LLM.generate gives, vLLM's outputs[j] (tests/engine/test_n_completions.py
for LLM itself)."""
import json

from cluster.client import Client
from mpk_runtime.engine import SamplingParams

from test_cluster_http import local_llm  # noqa: F401  (the module fixture: an LLM of the demo model)

SEEDED = SamplingParams(temperature=1.0, max_tokens=5, seed=9, n=3, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello"}]


def test_client_n_equals_llm_n(server, local_llm):  # noqa: F811
    prompts = [[1, 2, 3], "hello world"]
    want = local_llm.generate(prompts, SEEDED)
    with Client(server[0].url) as c:
        got = c.generate(prompts, SEEDED)
        chat = c.chat(HELLO, SEEDED)
        streamed = {}
        for o in c.stream(prompts[:1], SEEDED):
            if o.finished:
                streamed[(o.request_id, o.index)] = o.token_ids
    assert len(got) == 2
    for g, w in zip(got, want):
        assert [(x.index, x.token_ids, x.text, x.finish_reason) for x in g.outputs] == \
               [(x.index, x.token_ids, x.text, x.finish_reason) for x in w.outputs]
        assert g.token_ids == w.outputs[0].token_ids
    assert [x.token_ids for x in chat[0].outputs] == [x.token_ids for x in local_llm.chat(HELLO, SEEDED)[0].outputs]
    assert streamed == {("0", 0): want[0].outputs[0].token_ids, ("0-1", 1): want[0].outputs[1].token_ids,
                        ("0-2", 2): want[0].outputs[2].token_ids}


def _job(tmp_path, demo_dir, name, rows, *extra):
    from cluster.jobs.generate import main
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["--model", demo_dir, "--dtype", "float32", "--executor", "inprocess", "--max-seq-len", "64",
               "--max-batch", "4", "--seed", "5", "--input", str(inp), "--output", str(out), *extra])
    return rc, [json.loads(x) for x in out.read_text().splitlines()]


def test_job_lines_with_n_write_their_completions(tmp_path, demo_dir, local_llm):  # noqa: F811
    rows = [{"prompt_token_ids": [1, 2, 3], "temperature": 1.0, "max_tokens": 4, "seed": 9, "n": 3,
             "ignore_eos": True},
            {"prompt": "hello", "temperature": 0, "max_tokens": 3},
            {"prompt_token_ids": [4, 5], "temperature": 0.9, "max_tokens": 4, "n": 2, "ignore_eos": True},
            {"prompt_token_ids": [4, 5], "temperature": 0.9, "max_tokens": 4, "ignore_eos": True}]
    rc1, one = _job(tmp_path, demo_dir, "one", rows)
    rc2, two = _job(tmp_path, demo_dir, "two", rows, "--replicas", "2")
    assert rc1 == rc2 == 0 and len(one) == len(two) == 4
    want = local_llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=4, seed=9, n=3,
                                                          ignore_eos=True))[0]
    assert [c["token_ids"] for c in one[0]["completions"]] == [c.token_ids for c in want.outputs]
    assert one[0]["token_ids"] == want.outputs[0].token_ids and [c["index"] for c in one[0]["completions"]] == [0, 1, 2]
    assert "completions" not in one[1] and "completions" not in one[3]
    # an unseeded line's completions are not the next line's draws (its seed is moved off theirs)
    assert len(one[2]["completions"]) == 2 and one[2]["completions"][1]["token_ids"] != one[3]["token_ids"]
    for a, b in zip(one, two):
        assert (a["token_ids"], a.get("completions")) == (b["token_ids"], b.get("completions"))
