#!/usr/bin/env bash
# What is pending on a GPU, in commands of < 9.5 min each (stages time-limited; every stage runs even if an
# earlier one fails; $OUT/pending.tar.gz refreshed after each, so a command cut short still returns what ran).
# Usage on the GPU machine, after `source .gpubundle/install.sh` (PYTHONPATH=$PWD:/tmp/site, NVLS off):
#     OUT=$OUT bash scripts/gpu_pending.sh one      # stages 1-3 (one GPU): tests/gpu, the sampler, the conventional profile
#     (removed in session 20: mode ring, +6..+26% on qwen3-8b; mode kv and the hnd / addnorm variants, no gain)
#     OUT=$OUT bash scripts/gpu_pending.sh cattn    # stage 3c (one GPU): the conventional attention curves (~2-4 min)
#     (removed in session 21: modes swz (swizzled K/V rows, +3..+19%) and defer (deferred appends, now the default))
#     VARS="narrow base" BS=32,128 CTXS=512,4096 OUT=$OUT bash scripts/gpu_pending.sh ab   # A/Bs (MODELS=one model)
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh bench   # stage 4 (one GPU), one model per command
#     OUT=$OUT bash scripts/gpu_pending.sh tattn    # (one GPU, ~8 min): the Triton paged attention: tests, curves, plans
#     OUT=$OUT bash scripts/gpu_pending.sh sweep    # (one GPU, ~5 min): its launch shapes (bench_paged_attention.py), tests
#     (removed in session 32: mode wring, the weight page rings: every layout lost at batch 1, sessions 28-32)
#     SHAPES="tuned 32_264_4_3_ahead" OUT=$OUT bash scripts/gpu_pending.sh pshape   # (one GPU, ~2 min a shape):
#                                                   paged-attention launch shapes in the whole step (conventional plan)
#     (removed in session 40: modes used and append, both switches adopted; mode sw A/Bs any switch the same way)
#     SW=MPK_PAGED_GRID VALS="row head" OUT=$OUT bash scripts/gpu_pending.sh sw   # (one GPU, ~6 min): one kernel
#                                                   switch's two values A/B'd, the op and the conventional step
#     MODELS=llama-3.2-1b OUT=$OUT bash scripts/gpu_pending.sh rowstop   # (one GPU, ~5 min): the engine's key cap
#                                                   and MPK_PAGED_ROW_KEYS in the conventional step
#     OUT=$OUT bash scripts/gpu_pending.sh val      # stage 4d (one GPU): validate_planner ctx 512 + 4096 (default profile)
#     OUT=$OUT bash scripts/gpu_pending.sh attn     # stage 3d (one GPU): tests of the attention switches' other sides
#     OUT=$OUT bash scripts/gpu_pending.sh san      # stage 3g (one GPU): memcheck + racecheck of the defaults
#     OUT=$OUT bash scripts/gpu_pending.sh ncupa    # (one GPU, ~2 min): ncu of the paged attention kernel, one / group
#     OUT=$OUT bash scripts/gpu_pending.sh ncuatt   # stage 4e (one GPU): ncu stall sampling of attention's passes (~5 min)
#     OUT=$OUT bash scripts/gpu_pending.sh launch   # stage 4f (one GPU): a megakernel segment's fixed cost in graphs (~2 min)
#     MODELS=llama-3.2-1b OUT=$OUT bash scripts/gpu_pending.sh engine   # (one GPU, ~3 min a model): LLM.generate's
#                                                   ms per decode step, decode_steps 1 vs 8, B=1 / 8 (planned megakernel)
#     OUT=$OUT bash scripts/gpu_pending.sh loop       # (one GPU, ~2-4 min): TP=2 with both ranks on this GPU
#                                                   (gpu_check_tp_loopback.py; LOOP_MODELS, LOOP_STEPS)
#     OUT=$OUT bash scripts/gpu_pending.sh fulldraw   # (one GPU, ~2 min): the full-vocabulary draw's kernels alone
#     OUT=$OUT bash scripts/gpu_pending.sh kvp        # (one GPU, ~4 min): KV pages short, reserve vs lazy
#     OUT=$OUT bash scripts/gpu_pending.sh drawg      # (one GPU, ~6 min): the full draw as a CUDA graph vs eager
#     MODELS=llama-3.2-1b OUT=$OUT bash scripts/gpu_pending.sh prefix   # (one GPU, ~2 min a model): prefix caching
#                                                   off / on, TTFT with a shared system prompt (bench_prefix_cache.py)
#     OUT=$OUT bash scripts/gpu_pending.sh phase    # stage 4g (one GPU): a batch-1 phase's stream, registers vs TMA (~1 min)
#     OUT=$OUT bash scripts/gpu_pending.sh chain    # stage 4i (one GPU, ~1 min): a batch-1 layer's dependent phases,
#                                                   registers (first round after / before the wait, with and without
#                                                   a linear task's ends) against a producer ring (bench_stream --chain)
#     OUT=$OUT bash scripts/gpu_pending.sh mlp      # stage 4h (one GPU, ~1 min): a batch-1 MLP block, two phases vs
#                                                   the down projection fused into gate_up (bench_mlp.py)
#     MODELS=llama-3.2-1b OUT=$OUT bash scripts/gpu_pending.sh serve   # (one GPU, ~2-4 min a model): the HTTP server
#                                                   under SERVE_N concurrent requests (load_test.py; needs .cache/gbs)
#     OUT=$OUT bash scripts/gpu_pending.sh stamps   # stage 4b (one GPU): stage stamps at B=1,8 (STAMP_BATCHES=32,128 ...)
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh hf   # stage 4c (one GPU): the HF peer alone, B=8..128
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh order   # (one GPU, ~7 min): the bench-order effect on the
#                                                   conventional plan at B=8 (three processes, three orders)
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh profq   # (one GPU, ~3 min): our conventional plan and gpt-fast
#                                                   kernel by kernel at B=8 / 32 ctx 512 and B=8 ctx 4096
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh varq    # (one GPU, ~2-5 min): the conventional plan at B=8
#                                                   in five fresh processes (three kernel profiles, two bench cells)
#     TESTS="tests/gpu/test_attn_fold.py" OUT=$OUT bash scripts/gpu_pending.sh tests   # chosen GPU tests, one log
#     OUT=$OUT bash scripts/gpu_pending.sh two      # stages 5-8 (two GPUs)
#     OUT=$OUT bash scripts/gpu_pending.sh tpeng    # (two GPUs, ~5-8 min): the engine at TP=2 (session 57's default)
# Order for a 30-minute session (one GPU), as session 53 left it (session 53: one H100 for two calls after eight
# refused starts: bench/results/s53; the GPU suite at the defaults passed, the draw graphs measured). A machine stays
# warm only ~30 s after a call and a call can be taken back before it returns: short calls, chained with `;` in one
# command where they fit 600 s (a refused start costs 90-180 s of the budget).
# Before the first device call: `bash scripts/setup.sh` on a fresh machine, then `bash scripts/gpu_prepare.sh` (~1 min
# after a checkout, ~5 min on a fresh machine: the bundle without Ray (.cache/gb), every cubin prebuilt
# (.cache/kc.tar.xz, the pf0 / pf32 builds included), .cache/commit, the 64 MiB check). Carry [".cache/gb",
# ".cache/commit", ".cache/kc.tar.xz"]. Rerun it after any commit.
# 0. (session 57 ran, 1x H200: bench/results/s57 -- tests/gpu 79 passed at b596749 (session 56's start-up captures and
#    kept split builds: planned b128 TTFT 1.46 s -> 191 ms); llama B=8 32k / 131k on the H200 level with gpt-fast
#    (3.290 / 9.216 vs 3.277 / 9.258), h200_v56 out of sample there (regret 0, conventional +7%, mono -7%); the one
#    megakernel's three K / V stages refuted (+35-50%); qwen3-8b B=8's H200 long-key shape adopted (32k 15.30 -> 14.07
#    ms, gpt-fast 14.26).) (session 58, 1x H100 after ~45 min of refused starts: tests/gpu 79 passed at HEAD with
#    that shape as the default; qwen3-8b B=8 16k / 32k level with gpt-fast on the H100; a. ran on the H100 -- a call
#    for nvidia-h200 may get an H100 -- and was kept as the H100's record, not merged: start H200-only items with
#    `nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0`.) (session 59, 1x H100, two calls:
#    bench/results/s59 -- every file of tests/gpu passed at ee50b82 with session 58's YaRN test and the Qwen2 tests;
#    gpu_check_ref on tiny-qwen2 / qwen2.5-0.5b against HF; qwen2.5-7b ctx 512 B=1 5.570 ms vs gpt-fast 6.502, B=8
#    attn-mk 6.558 vs 6.523; the H200 items below were refused; input rows in chunks for K past ~14k passed against
#    pyvm (tiny-llama-k16k B=3 / 8), mono launches at qwen2.5-7b / llama-3.1-8b B=8.) (session 60, 1x H100, four
#    calls: bench/results/s60 -- mode card and mode val at ctx 512 / 2048 / 4096 gave the H100's own profile
#    h100_v1 (the default on an H100); with it picked by the card, ctx 1024 regret 0, 131k llama B=8 regret 3.7%.)
#    (session 61, 1x H100, eleven calls: bench/results/s61 -- val rows at 8k-131k keys found h100_v1 choosing wrong
#    from 32k (regret up to 11.9%); h100_v2 (mk_mixed_attn_sim_scale, fitted on every H100 row) the H100's default: on
#    the GPU at 12288 / 40960 / 49152 keys regret 0 at 8 of 9, 1.6% at the ninth; llama-3.1-8b 32k and qwen2.5-7b
#    16k / 24k (after the paged stand-in fix) regret 0; traces of the attention (run_tr). H200 starts were not tried.)
#    (session 62, 1x H100, nine calls: bench/results/s62 -- tests/gpu 88 passed; issue 3's tables on the H100 with
#    both peers; qwen2.5-7b's paged curve (h100_v3); B=128 at 1024-8192 keys found attn-mk chosen over a conventional
#    plan up to 5.1% faster; h100_v4 (fit --terms mkattn) picks right there: regret 0 at 4 new points.)
#    (session 63, 1x H100, four calls after ~800 s of refused starts: bench/results/s63 -- the B=1 step at 512 keys
#    stage-stamped; h100_v4 out of sample at llama B=128 12k / 16k and qwen3-8b B=32 10k keys, regret 0; the paged
#    curves at B=32-128 past 8193 keys (h100_v5, not adopted); mode serve: llama-3.2-1b 9586 tokens/s, qwen3-8b 5533,
#    the prompt-admitting steps 60-75 ms each. Next: serve again: load_test.json now has graphs_in_window, and the mode
#    fires the load twice in one process (--rounds 2), to split a one-time cost from a per-step one.)
#    (session 64, 1x H100, four calls: bench/results/s64 -- the admission steps separated: the step budget
#    (min(max_seq_len, 4096)) cut each step's prompts, the grouped prefill padded 2.5x, one client process throttled
#    the load; budget 4096, packed prefill, load_test --clients 4: llama-3.2-1b 26837 / 28624 tokens/s, qwen3-8b 7912;
#    mode admit: packed 4.18 / 12.28 ms vs grouped 7.09 / 20.1. Next: `ADMIT_CHUNKS=64 ... admit` (a 64-prompt packed
#    step took 26-31 ms in the server, llama: where), and stamp the admission step inside the server.)
#    (session 65, 1x H100, three calls: bench/results/s65 -- tests 7 + 33 passed; a 64-prompt admission alone 7.1-7.4
#    ms, in the server ~29-34: the engine blocked on the GIL while the HTTP thread answered the finished wave; inputs by
#    pinned buffers copied in by the graph moved the wait, did not remove it. Then (CPU-measured only, no budget left):
#    JSONResponse bodies, non-streaming requests reported at their end. Next, first: `for r in a b; do N=s_$r T=75
#    SERVE_LIM=70 MODELS=llama-3.2-1b SERVE_TAG=_$r bash scripts/gpu_run.sh serve; done; N=s_q T=125 SERVE_LIM=120
#    MODELS=qwen3-8b ... serve` at f7d069a or later: predicted admission prefill ~30 -> ~12-18 ms (laps
#    prefill_*_s), thread_cpu_s mpk-http well below the engine's, llama ~28-31k tokens/s.)
#    (session 66, 1x H100, four calls on one start after ~790 s of refused starts: bench/results/s66 -- in process at
#    252f032 llama 28617-29124 tokens/s (admission prefill 15-18 ms a step: the prediction held); the engine in its
#    own process (--engine-process, now the server's default) 29474-30062, streaming 21872-22781 -> 25577-25642,
#    qwen3-8b 7239-7352 -> 7934-7993; GPU tests 28 + 1 passed. Next: `SERVE_STREAM=1 ... serve` at the wire-form
#    commit (outputs as tuples: predicted the child's deliver 1.07 -> ~0.3 ms a step, streaming ~27-28k tokens/s),
#    with `SERVE_PROC=0` beside it.)
#    (session 67, 1x H100, two calls on one start, ~10 starts refused: bench/results/s67 -- at 402f715 the child's
#    deliver 0.49 / 0.62 ms a step (predicted ~0.3), streaming 25213 / 25122 against 26178 non-streaming in the child
#    (96%); planner at 16k / 10k keys on the H100: regret 0, step MAPE 2.6 / 1.9%. Next: the sender thread (cc55c5f,
#    MPK_PROC_SENDER; predicted the loop's deliver -> ~0.1 ms, streaming +5-7%) in ABBA order:
#    `S="SERVE_LIM=68 SERVE_STREAM=1 MODELS=llama-3.2-1b"; env $S N=s1 T=70 SERVE_TAG=_s1 bash scripts/gpu_run.sh serve;
#    env $S MPK_PROC_SENDER=0 N=s0 T=70 SERVE_TAG=_s0 ... serve; ... s0b; ... s1b` (carry the serve bundle).)
#    On an H100: the attention task terms from run_tr-style traces (planner/trace_fit.py), then refit; B=128 at the
#    long contexts that fit (llama 16k) and qwen3-8b B=32 past 8k keys, both never validated on the H100.
#    On an H200, the same long-key rows would give h200_v56 the new terms (`VAL_CTXS="8192 32768 131072"` ... val,
#    B=128 at 8192 keys (its B=128 rows end at 4096), then planner.fit --terms mkas,mklayer,mkattn,conv
#    --cv-context on them with session 57's rows).
#    (session 68, 1x H100 then 1x H200: bench/results/s68 -- the sender thread ABBA: the loop's deliver 0.21-0.36 ->
#    0.02-0.03 ms a step, tokens/s +1.1% (noise 6-8%): the +5-7% refuted; tests/gpu 92 passed at 69efdc1. On the H200
#    the paged attention's curves past 8193 keys (cattn, 22 s) and 12 long-context validation points under h200_v56
#    (regret 0 at all, step MAPE 8.1%); h200_v57 (curves + regimes 1 / 8 refit, --terms mkas) is the default.)
#    (session 69, 1x H100 twice, the H200 refused six times: bench/results/s69 -- the v57 val call ran on an H100, so
#    under h100_v4 at 8192 / 24576 keys, in sample: regret 0 at 8, step MAPE 2.5 / 2.3%; tests/gpu 92 passed at
#    8bd0404 and at bc59329 (the review fixes). Item a is still open: start it with the H200 check.)
#    (session 70, 1x H100 three starts (both calls for nvidia-h200 got H100s): bench/results/s70 -- the bench tables
#    re-run with session 69's timing (the HF peer's StaticCache seek fixed first); MPK_B1_PREWAIT without spills
#    A/B'd: +3..+4.5% at B=1 on both models, removed; tests/gpu 92 passed and the HTTP server under load (0 errors)
#    at 2eb7266. Item a is still open.)
#    (session 73: one H100 for four calls, then one H200 for two (bench/results/s73). Done: tests/gpu 92 passed at
#    a7e7d23; the HF peer back to back (HF/ours llama B=1 1.45, predicted ~1.4-1.5); planner at 8192 on the H100;
#    the server under load (27k tokens/s, 0 errors); at ace9a0f on the H200 the draw / engine GPU tests (31 passed)
#    and the faster host sampler exact on the GPU host; item a below ran: h200_v57 regret 0 at 8 points, step MAPE
#    2.7%, Spearman < 0.9 at 4 near-tied points; ctx 24576 was cut after 22 of 28 plans. Pending first: tests/gpu at
#    HEAD (the chat / client / admission / --resume changes are CPU-side and CPU-tested), then item a's ctx 24576
#    rest with T=300 on its own if an H200 comes: `N=v57b T=300 VAL_CTXS="24576" VAL_B24576=1,8 ... val`.)
#    (session 74: no machine started; ~12 tries refused or held back, ~800 s of the budget spent on them, then "no
#    new device machine is lent". Pending first, one call at HEAD: `N=tall T=330 LIM=320 bash scripts/gpu_run.sh
#    tests; N=loop T=230 LIM=220 bash scripts/gpu_run.sh loop` - tests/gpu adds test_nan_logits_gpu.py (the device's
#    top-k draw from NaN logits now PAD_INDEX: argmax.cuh changed) and test_tp_loopback.py (TP=2 with both ranks on
#    one GPU, tiny models); mode loop runs gpu_check_tp_loopback.py at llama-3.2-1b / qwen3-8b, B=1 / 8, tp_invariant
#    1 / 2, 64 steps, and the stalled-peer timeout. Then item a's ctx 24576 rest as above if an H200 comes.)
#    (session 75: one H100 for one call at 53eb136, then every start refused (bench/results/s75): tests/gpu 93 of 95
#    passed - test_nan_logits_gpu.py's two found an engine bug (a full-vocabulary row's -1 read as "not drawn"; fixed
#    in 79cb563) - and mode loop all 9 ok (TP=2 with both ranks on one GPU: tp_invariant 2 bitwise TP=1's; a stalled
#    peer a KernelTimeout). Pending first, at HEAD (42e2a85 changed embed.cuh: a token id past the table reads the
#    last row): `N=nan T=150 LIM=140 TESTS="tests/gpu/test_nan_logits_gpu.py tests/gpu/test_full_sampling_gpu.py
#    tests/gpu/test_tp_loopback.py" ... tests; N=bench T=200 BENCH_BUDGET=175 MODELS=llama-3.2-1b BS=1,8 CTXS=512 ...
#    bench; N=eng T=150 ENGINE_LIM=140 MODELS=llama-3.2-1b ENGINE_BS=8 ENGINE_KS=8 ENGINE_SAMPLING=greedy,topk ...
#    engine` (topk's excess over greedy bounds the NaN rule's cost), then tests/gpu whole; item a's ctx 24576 rest on
#    an H200.)
#    (session 76: no machine started; ~8 tries refused or held back (~1250 s of the budget), then "no new device
#    machine is lent". Pending first is session 75's call above, unchanged (no device source changed since 42e2a85);
#    tests/gpu whole after it now also runs the session's host-side changes (logit_bias before the penalties, a model
#    directory's generation_config.json defaults, stop_reason): none changes a greedy bench.)
#    (session 72: no machine started either; every start refused or held back for a neighbour's refusal. Pending
#    first is unchanged: tests/gpu at HEAD (adds: the host sampler drawing as the device does -
#    tests/gpu/test_engine_plans.py's seeded rows, test_full_sampling_gpu.py; the LLM's per-call inboxes through the
#    engine process; plan books with shapes), then the HF peer's back-to-back bench below.)
#    (session 71: no machine started, ~14 refused starts spent the 30 minutes. Pending first, at HEAD: tests/gpu
#    (`N=tall T=330 LIM=320 ... tests`: the KV cache's size check on a GPU, the kernel cache's manifests, the
#    allocator's heap, generate after shutdown), then a short bench for the HF peer's new back-to-back timing
#    (`N=bh T=200 BENCH_BUDGET=175 MODELS=llama-3.2-1b BS=1,8 CTXS=512 ... bench`: predicted HF/ours at B=1 falls from
#    1.63 towards ~1.4-1.5, its host work no longer counted). gpu_prepare rebuilt .cache/kc with manifests: carry it.)
#    Next, one call each:
#    a. h200_v57 out of sample on an H200, at points it was not fitted on: `N=v57 T=300 VAL_CTXS="8192 24576"
#       VAL_B8192=1,8 VAL_B24576=1,8 VAL_MODELS=llama-3.2-1b,qwen3-8b VAL_LIM=290 bash scripts/gpu_run.sh val`
#       (predicted: regret 0, step MAPE ~2-3%, the step bands -4..+5%).
#    b. qwen3-8b B=8 / 32 at long contexts against gpt-fast on the H200 with the adopted shape (`N=longq T=300
#       MODELS=qwen3-8b LONG_LENS= LONG_BS=8,32 LONG_CTXS=16384,32768 bash scripts/gpu_run.sh long`; predicted B=8 32k
#       ~14.1 ms against gpt-fast's ~14.3), and the H200 sweep at qwen3-8b B=32 / llama B=32 past 8192 keys (their
#       shapes are the H100's too: `bench_paged_attention.py --batches 32 --keys 16384,32768,131072`).
#    b2. Long contexts on an H200 through the engine: `N=long T=560 LONG_BS=1,8 bash scripts/gpu_run.sh long` and
#       `MODELS=qwen3-8b LONG_LENS=8192,40800 LONG_CTXS=8192,32768`.
#    c. The megakernel's attention at B=8 32k, stamped (`STAMP_BATCHES=8 STAMP_CTX=32768 ... stamps`), and the paged
#       sweep at B=1 / 128 past 8192 keys (TUNED's long-key points are B=8 / 32 only).
#    d. h200_v52 at the points not yet seen out of sample (`N=val52 T=340 VAL_CTXS="512 4096" VAL_B512=1,8
#       VAL_B4096=32 VAL_LIM=160 bash scripts/gpu_run.sh val`; refused twice in session 54).
#    e. B=128 at max_seq_len 512 vs 8192 with more runs (session 54's cells spread 2.0-2.5 ms within a process): the
#       `engine` mode at ENGINE_BS=128 with and without ENGINE_MSL=8192, twice each, alternated.
#    f. on an H200, session 52 / 53's H100 cells (async, prefix, drawg) beside the H200 tables; `sat` at 128 slots
#       (`SAT_SLOTS=128 SAT_KV=160`).
# 1. The whole GPU set at the default (`N=run1_one T=330 bash scripts/gpu_run.sh one`).
# 2. The engine's per-token time at the default and where the rest of it goes at k=8 (llama B=1: 1.152 ms against the
#    kernel's ~1.07): `N=engd T=150 MODELS=llama-3.2-1b ENGINE_BS=1,128 ENGINE_KS=8 bash scripts/gpu_run.sh engine`.
#    Candidates for the remaining ~0.08 ms: the three feedback ops a step outside the graph (launch gaps), the burst's
#    fill_step / sync / read-back, the prefill share of a 128-token run.
# 3. h200_v52 at the points not yet seen out of sample: ctx 512 B=1 / 8 and ctx 4096 B=32
#    (`N=val49 T=330 VAL_CTXS="512 4096" VAL_B512=1,8 VAL_B4096=32 VAL_LIM=150 bash scripts/gpu_run.sh val`).
# 4. llama-3.2-1b's table at the default with peers (`N=bl T=560 BENCH_BUDGET=540 MODELS=llama-3.2-1b CTXS=512,4096
#    bash scripts/gpu_run.sh bench`): the README's llama rows are session 45's.
# 5. Batch 1's device-side levers tried before a phase's wait are exhausted for now: registers do not fit the kernel
#    (s46), staging in shared memory (s47, +6..+8%) and attention's K / V into L2 (s49, +0.5..+3%) are slower; only the
#    weights' L2 prefetch (PF_CUR, default) paid. Nothing queued.
# 6. The bench-order effect is gpt-fast's batch-1 torch.compile cell (session 45); the bench runs the planned cells
#    first, so its table is clean.
# 7. The paged kernel is register-bound at 121-128 registers (docs/perf-notes.md session 41): the next kernel work is
#    built on CPU first (scripts/paged_build_report.py); nothing of it is queued yet.
# The device tool returns at most ~8 files of $OUT: tar the rest (session 27 lost run 3's ctx 512 rows to that).
# With two GPUs first: `two` (TP=2 has not run since session 11), then `tpeng`: session 57's engine at tp > 1 (one
# megakernel or the conventional plan per batch bucket, MPK_TP_BURSTS; predictions in docs/perf-notes.md session 57),
# then tests/gpu2 (test_engine_tp2_runs_each_buckets_plan).
# The device tool copies the working tree only under 64 MiB (tracked files + the bundle in `carry`): commit result
# files compressed and small (session 22 moved 20 MB of old traces to git history: bench/results/ARCHIVED.md).
# Modes two and tpeng need Ray: `RAY=1 bash scripts/gpu_prepare.sh` keeps it in the bundle (+28 MB: check the 64 MiB line).
#  1. tests/gpu (49 passed at bca6d81 and at 5a47206)
#  2. the sampler alone: gpu_check_sampling (bitwise vs the CPU semantics) and --profile
#  3. profile_conventional.py --family attn-mk, llama-3.2-1b B=32,128 (s18: attention megakernels 551 / 1558 us per step),
#     then --family gptfast: the peer's kernels at the same points (where its 1.53 / 2.21 ms go)
#  3d (mode attn) the non-default sides of the attention switches: -DMPK_ATT_WARP_PIPE=0, MPK_ATT_GROUPS=1,
#     -DMPK_ATT_STAGES=3 (s18: groups1 26 passed, stages3 19 passed; nowarp not rerun since s17)
#  4. bench_decode, B=1,8,32,128 x ctx 512,4096 with both peers at every batch, one model per command (s18 table in
#     docs/benchmarks.md)
#  4d (mode val) validate_planner TP=1, ctx 512 B=1,8,32,128 and ctx 4096 B=1,8,32, all families
#  5. (2 GPUs) bench_allreduce.py: the LL candidate beside the signal protocol and NCCL (16 KiB target <= 3 us)
#  6. (2 GPUs) gpu_check_tp.py --tp-invariant 2 (the fold is the default since session 12)
#  7. (2 GPUs) bench_decode --tp 2 with the PyTorch TP peer, B=1,8 (qwen3-8b B=8 peer was skipped in session 11)
#  8. (2 GPUs) the LL all-reduce in the megakernel (MPK_AR_LL=1): bitwise TP=1 == TP=2, and the TP=2 bench (compare
#     with stage 7's megakernel column); then validate_planner --tp 2 (issue 5) if time is left
set -u
OUT=${OUT:-gpu_out}
FOLD=${FOLD:-1}
mkdir -p "$OUT"/{ref,val,prof,bench,ar,tp,tpbench,san,ncu}
# the measured steps of a validate_planner run's rows, one line each, labelled
measured_rows() {
python3 - "$1" "$2" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/planner_validation_rows.jsonl"):
    r = json.loads(l)
    if r.get("measured_us"):
        print(f"[{sys.argv[2]}] {r['model']} B={r['batch']} ctx={r['context']} {r['plan']}: {r['measured_us']:.0f} us")
PY
}
snap() { tar -czf "$OUT/pending.tar.gz" -C "$OUT" ref val prof bench ar tp tpbench san ncu pytest_gpu.log pytest_gpu_nowarp.log pytest_gpu_groups1.log pytest_gpu_stages.log 2>/dev/null; }
st() { echo "[$(date +%T)] $*"; }
# an nvidia-smi trace (SM / memory clocks, power, temperature, clock-event reasons every 0.5 s) beside a measurement,
# joined to bench_decode's cells by scripts/smi_join.py (session 43: the bench ran the same plan 4-8% slower than the
# A/B harness on one machine start, with no record of the clocks)
smi_start() {
  local q
  for q in timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
           timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu; do
    if nvidia-smi --query-gpu=$q --format=csv > /dev/null 2>&1; then
      nvidia-smi --query-gpu=$q --format=csv -lms 500 > "$1" 2>&1 & SMI_PID=$!; return 0
    fi
  done
}
smi_stop() { [ -z "${SMI_PID:-}" ] || kill "$SMI_PID" 2> /dev/null; SMI_PID=; }
MODE=${1:-one}
if [ "$MODE" = one ]; then
st "1 tests/gpu and the GPU-marked tests in tests/runtime (graph replay, PDL launches, conventional op counts)"
timeout 450 python3 -m pytest -v --durations=10 -m gpu tests/gpu tests/runtime/test_plan_exec_graph.py \
    tests/runtime/test_conventional_op_count.py tests/runtime/test_skinny_gemm.py tests/runtime/test_paged_attention.py \
    > "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -6
# the paged attention's interpreter tests need Triton, which the CPU machine's torch lacks: here (triton 3.6, as built)
TRITON_INTERPRET=1 timeout 120 python3 -m pytest -q tests/runtime/test_paged_attention.py -k interpreter \
    >> "$OUT/pytest_gpu.log" 2>&1
# (every interpreter test, these and the 18 no GPU command selected, also runs in CI since session 48: scripts/test.sh)
# and the offline sm_90 builds of the Triton kernels (SASS checks: no spills, pipelined loads, the append paths)
timeout 60 python3 -m pytest -q tests/runtime/test_triton_build.py >> "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -3; snap
st "2 the sampler: bitwise check and profile"
OUT="$OUT/val" timeout 100 python3 scripts/gpu_check_sampling.py --trials 30 > "$OUT/val/sampling.log" 2>&1
grep -E "^sampler V=|^tiny|PASS|FAIL" "$OUT/val/sampling.log"
OUT="$OUT/val" timeout 80 python3 scripts/gpu_check_sampling.py --profile > "$OUT/val/sampler_profile.log" 2>&1
grep "^profile" "$OUT/val/sampler_profile.log"; snap
st "3 profile attn-mk's conventional segments (fused norms)"
timeout 60 python3 scripts/profile_conventional.py --models llama-3.2-1b --batches 32,128 --family attn-mk \
    --out "$OUT/prof" > "$OUT/prof/profile_eager.log" 2>&1
head -30 "$OUT/prof/profile_eager.log"; snap
st "3p the gpt-fast peer's step, kernel by kernel, at the same points"
timeout 150 python3 scripts/profile_conventional.py --models llama-3.2-1b --batches 32,128 --family gptfast \
    --out "$OUT/prof" > "$OUT/prof/profile_gptfast.log" 2>&1
grep -A14 "^==" "$OUT/prof/profile_gptfast.log" | head -32; snap
elif [ "$MODE" = attn ]; then
# ATTN_SETS: which of the switches' test sets (default all: up to ~9.5 min of timeouts; name fewer to stay short)
SETS=" ${ATTN_SETS:-nowarp groups1 stages3} "
has() { case "$SETS" in *" $1 "*) return 0;; esac; return 1; }
st "3d the attention switches' other sides:$SETS(-DMPK_ATT_WARP_PIPE=0, MPK_ATT_GROUPS=1, -DMPK_ATT_STAGES=3)"
if has nowarp; then
MPK_NVCC_DEFINES=-DMPK_ATT_WARP_PIPE=0 timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_megakernel.py \
    tests/gpu/test_attention_long.py tests/gpu/test_attn_fold.py > "$OUT/pytest_gpu_nowarp.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_nowarp.log" | tail -6; snap
fi
if has groups1; then
MPK_ATT_GROUPS=1 timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_megakernel.py tests/gpu/test_attention_long.py \
    tests/gpu/test_engine_plans.py > "$OUT/pytest_gpu_groups1.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_groups1.log" | tail -6; snap
fi
if has stages3; then
MPK_NVCC_DEFINES=-DMPK_ATT_STAGES=3 timeout 90 python3 -m pytest -q -m gpu \
    tests/gpu/test_megakernel.py tests/gpu/test_attention_long.py > "$OUT/pytest_gpu_stages.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_stages.log" | tail -6; snap
fi
elif [ "$MODE" = san ]; then
st "3g compute-sanitizer memcheck + racecheck of the defaults (warp pipe, grouped attention; tiny configs, incl. one split)"
OUT="$OUT/san" timeout 400 bash scripts/gpu_memcheck.sh; snap
elif [ "$MODE" = cattn ]; then
st "3c the conventional attention op measured whole (scripts/profile_conv_attn.py): llama-3.2-1b / qwen3-8b shapes at TP 1 and 2"
mkdir -p "$OUT/prof"; OUT="$OUT/prof" timeout ${CATTN_LIM:-420} python3 scripts/profile_conv_attn.py --out "$OUT/prof" --cycle-mb 200 \
    --tp ${CATTN_TP:-1,2} --merge ${CATTN_BASE:-h200_v48} --name ${CATTN_NAME:-h200_v49} \
    ${CATTN_KEYS:+--keys $CATTN_KEYS} ${CATTN_BS:+--batches $CATTN_BS} \
    --budget-s ${CATTN_BUDGET:-400} > "$OUT/prof/conv_attn.log" 2>&1
tail -4 "$OUT/prof/conv_attn.log"; snap
elif [ "$MODE" = ab ]; then
# ab: VARS="..." BS=... CTXS=... of the variants below (one megakernel up to B=${MKB:-8}, the planned plan above), one table;
# TRACE=1: per-task traces of the megakernel cells too (scripts/trace_phases.py reads them)
VARS=${VARS:-base nowarp}; BS=${BS:-32,128}; CTXS=${CTXS:-512}; LIM=${LIM:-185}
st "3d' $MODE: $VARS at B=$BS ctx $CTXS"
ABD=""   # one folder per run: a variant named twice (ABBA orders) gets ab_<v>_2, so neither run overwrites the other
for V in $VARS; do
  n=1; while [[ " $ABD " == *" ab_${V}$([ $n = 1 ] || echo _$n) "* ]]; do n=$((n + 1)); done
  VD="ab_${V}$([ $n = 1 ] || echo _$n)"; ABD="$ABD $VD"
  W=""; KD=""; PDL=""; GM=""; AS=""; GF=""; TL=""; TA=""; PSH=""; QF=""; QN=""; PFK=""; SK=""; SO=""; SC=""
  case $V in base) D=""; G="";; nowarp) D="-DMPK_ATT_WARP_PIPE=0"; G="";; nogroups) D=""; G=1;;
             stages3) D="-DMPK_ATT_STAGES=3"; G="";; old) D="-DMPK_ATT_WARP_PIPE=0"; G=1;;
             narrow) D=""; G=""; W=0;; nodefer) D=""; G=""; KD=0;;
             pv1) D="-DMPK_ATT_PV_SPLIT=0"; G="";; diagl2) D="-DMPK_ATT_DIAG_L2=1"; G="";;
             pdl) D=""; G=""; PDL=1;;
             g8) D=""; G=""; GM=8;; g2) D=""; G=""; GM=2;;
             s1|s2|s4|s8|s16) D=""; G=""; AS=${V#s};;   # attention key splits of the one-megakernel cells
             greedyfast) D=""; G=""; GF=1;;   # the conventional greedy argmax in 5-8 kernels, not 26 (the default since s26)
             greedyold) D=""; G=""; GF=0;;   # the older greedy argmax path (26 kernels a step; s26 A/B -0.3..-1.3% on llama)
             tlmhead) D=""; G=""; TL=1;;     # the conventional LM head through the Triton skinny matmul at B <= 32 (s26, opt-in)
             tattn0) D=""; G=""; TA=0;;      # the conventional attention by gather + SDPA (the paged kernel is the default since s27)
             qkvflat) D=""; G=""; QF=1;;    # qwen3-8b's batch-1 q / k rows as flat linear tiles (MPK_QKV_FLAT, default since s32)
             headparts) D=""; G=""; QF=0;;  # ... as head parts (MPK_QKV_FLAT=0, the default before s32; -1.4% s32)
             qknorm) D=""; G=""; QN=1;;     # attention norms qwen3's q / k heads itself (MPK_ATTN_QKNORM, default since s33)
             noqknorm) D=""; G=""; QN=0;;   # ... the qk_norm_rope tasks instead (MPK_ATTN_QKNORM=0; s33: +0.5% B=1, +3.2% B=8)
             pf0|pf32|pf64|pf128) D=""; G=""; PFK=${V#pf};;   # each task's first KiB of weights bulk-prefetched into
                                             # L2 before its waits (MPK_PF_CUR_KB; 64 = base since session 46, 0 = off)
             stg64|stg64pf0|stgall) D=""; G=""; SK=auto; SO=.; SC=64   # every CUDA-core tile's first 64 KiB of
                                             # weights staged in shared memory (TMA) while it waits, within the
                                             # graph's shared memory (session 47); pf0: without the L2 prefetch
               [ $V = stg64pf0 ] && PFK=0; [ $V = stgall ] && SC=0;;
             # (removed in session 70: pw4 / pw7, MPK_B1_PREWAIT, +3..+4.5% at B=1; bench/results/s70)
             ps_*) D=""; G=""; PSH=$(echo "${V#ps_}" | tr _ ,);;   # one paged-attention launch shape for every call
                                             # (MPK_PAGED_SHAPE), e.g. ps_32_264_4_3_ahead
             *) echo "unknown variant $V"; continue;; esac
  d="$OUT/bench/$VD"; mkdir -p "$d"
  MPK_STAGE_KB=$SK MPK_STAGE_OPS=$SO MPK_STAGE_CAP_KB=$SC MPK_PF_CUR_KB=$PFK MPK_ATTN_QKNORM=$QN MPK_QKV_FLAT=$QF MPK_PAGED_SHAPE=$PSH MPK_CONV_TRITON_ATTN=$TA MPK_CONV_TRITON_LMHEAD=$TL MPK_CONV_GREEDY_FAST=$GF MPK_ATT_GROUPS_MAX=$GM MPK_MK_PDL=$PDL MPK_KV_DEFER=$KD MPK_ATT_WIDE=$W MPK_ATT_GROUPS=$G MPK_NVCC_DEFINES="$D" OUT="$d" timeout $LIM python3 scripts/bench_decode.py --models ${MODELS:-llama-3.2-1b,qwen3-8b} \
      --batches $BS --contexts $CTXS --mk-max-batch ${MKB:-8} --no-peers --budget-s $((LIM - 15)) ${AS:+--attn-splits $AS} ${TRACE:+--trace} \
      > "$d/bench.log" 2>&1
  grep -A20 "====" "$d/bench.log" | sed "s/^/[$V] /"; snap
done
python3 scripts/ab_table.py $(for D in $ABD; do echo "${D#ab_}=$OUT/bench/$D/bench_decode.json"; done)
python3 scripts/ab_table.py --kv-rates $(for D in $ABD; do echo "${D#ab_}=$OUT/bench/$D/bench_decode.json"; done)
elif [ "$MODE" = rowstop ]; then
# rowstop (session 38): the conventional plan under the engine's key cap (MPK_MEASURE_CAP=serving: the power of two
# above the rows, e.g. 2048 at ctx 1024) with the paged kernel's programs walking the cap's blocks (cap), stopping at
# their row's last (stop) or splitting the row's own keys (split), and the tight cap (context + 1) for reference;
# ~1 min a run per model
PM=${MODELS:-llama-3.2-1b}
st "rowstop: $PM, B=${BS:-32,128} ctx ${CTXS:-1024}, the conventional plan, serving cap x MPK_PAGED_ROW_KEYS"
n=0
for V in tight_cap serving_cap serving_stop serving_split serving_cap serving_split; do
  n=$((n + 1)); d="$OUT/rowstop/${n}_$V"; mkdir -p "$d"
  MPK_MEASURE_CAP=${V%%_*} MPK_PAGED_ROW_KEYS=${V##*_} timeout ${LIM:-75} python3 scripts/validate_planner.py --tp 1 \
      --models "$PM" --context ${CTXS:-1024} --batches ${BS:-32,128} --families conventional \
      --budget-s $((${LIM:-75} - 15)) --out "$d" > "$d/validate.log" 2>&1
  measured_rows "$d" "$V"
  tar -czf "$OUT/rowstop.tar.gz" -C "$OUT" rowstop 2>/dev/null
done
elif [ "$MODE" = sw ]; then
# sw (session 40): one kernel switch's values A/B'd, $SW over "$VALS" (e.g. SW=MPK_PAGED_GRID VALS="row head", or
# SW=MPK_PAGED_HEADS VALS="one group all"), each value run twice, in turn. The op alone (both models' shapes, B
# ${OP_BATCHES:-32,128} at ${OP_KEYS:-2049,4097} keys, $OP_ARGS added, e.g. --appends; ~40 s a run), then the
# conventional step at ${MODELS:-llama-3.2-1b} B=${BS:-32,128} ctx ${CTXS:-4096} (~50 s a run): two values ~6 min,
# three ~9 min (split them over two calls with OPS=0 / STEPS=0). Session 40's used / append A/Bs were this with
# SW=MPK_PAGED_USED_SPLITS VALS="0 1" OP_BATCHES=1,8 OP_KEYS=2049,8193 BS=8 CTXS=2048, and SW=MPK_PAGED_APPEND
# VALS="regs cache" OP_ARGS=--appends MODELS=qwen3-8b CTXS=2048.
SW=${SW:?set SW to the switch, e.g. MPK_PAGED_GRID}; VALS=${VALS:?set VALS to its values, e.g. \"row head\"}
if [ "${OPS:-1}" = 1 ]; then
  st "sw: the op alone (profile_conv_attn.py), $SW over $VALS, twice"
  for R in 1 2; do
    for V in $VALS; do
      d="$OUT/sw/op${R}_$V"; mkdir -p "$d"
      env $SW=$V timeout 40 python3 scripts/profile_conv_attn.py --out "$d" --cycle-mb 200 --tp 1 \
          --batches ${OP_BATCHES:-32,128} --keys ${OP_KEYS:-2049,4097} ${OP_ARGS:-} --budget-s 30 \
          > "$d/conv_attn.log" 2>&1
      grep "us per layer" "$d/conv_attn.log" | sed "s/^/[$V] /"
    done
  done
fi
if [ "${STEPS:-1}" = 1 ]; then
  st "sw: $SW over $VALS, twice, ${MODELS:-llama-3.2-1b} B=${BS:-32,128} ctx ${CTXS:-4096}, conventional"
  n=0
  for V in $VALS $VALS; do
    n=$((n + 1)); d="$OUT/sw/${n}_$V"; mkdir -p "$d"; smi_start "$d/smi_trace.csv"
    env $SW=$V timeout ${LIM:-50} python3 scripts/validate_planner.py --tp 1 --models ${MODELS:-llama-3.2-1b} \
        --context ${CTXS:-4096} --batches ${BS:-32,128} --families conventional --budget-s $((${LIM:-50} - 12)) \
        --out "$d" > "$d/validate.log" 2>&1
    smi_stop; measured_rows "$d" "$V"; python3 scripts/smi_join.py - "$d/smi_trace.csv" | sed "s/^/[$V clocks] /"
    snap
  done
fi
elif [ "$MODE" = pshape ]; then
# pshape: paged-attention launch shapes A/B'd in the whole decode step (session 30: the kernel-alone sweep and the
# step ranked qwen3-8b's read-ahead shapes oppositely). The conventional plan alone (validate_planner --families
# conventional), one run per shape in $SHAPES ("tuned" = paged_shapes.TUNED; else MPK_PAGED_SHAPE's
# block_n_target_warps_stages[_ahead][_i32|_i64], the last the page tables' type, int32 where unnamed: "tuned" takes
# TUNED's own per point, so name the type a candidate was swept with), in order, twice over (ABAB) so drift shows.
SHAPES=${SHAPES:-"tuned 32_264_4_3_ahead tuned 32_264_4_3_ahead"}; PM=${MODELS:-qwen3-8b}
st "pshape: $SHAPES, $PM, B=${BS:-32,128} ctx ${CTXS:-4096}, the conventional plan"
n=0
for V in $SHAPES; do
  n=$((n + 1)); d="$OUT/pshape/${n}_$V"; mkdir -p "$d"; smi_start "$d/smi_trace.csv"
  PSH=""; [ "$V" = tuned ] || PSH=$(echo "$V" | tr _ ,)
  MPK_PAGED_SHAPE=$PSH timeout ${LIM:-120} python3 scripts/validate_planner.py --tp 1 --models "$PM" \
      --context ${CTXS:-4096} --batches ${BS:-32,128} --families conventional --budget-s $((${LIM:-120} - 15)) \
      --out "$d" > "$d/validate.log" 2>&1
  smi_stop; measured_rows "$d" "$V"; python3 scripts/smi_join.py - "$d/smi_trace.csv" | sed "s/^/[$V clocks] /"
  snap
done
elif [ "$MODE" = sweep ]; then
# sweep: the paged attention's launch shapes at both models' points, K / V from HBM (scripts/bench_paged_attention.py;
# prints TUNED entries), then the kernel's GPU tests (~4-5 min)
mkdir -p "$OUT/prof/sweep"
st "sweep: bench_paged_attention.py (shapes x points; TUNED entries at the end)"
timeout 330 python3 scripts/bench_paged_attention.py --budget-s ${SWEEP_BUDGET:-300} ${SWEEP_ARGS:-} --out "$OUT/prof/sweep" > "$OUT/prof/sweep/sweep.log" 2>&1
grep -vE "^\s*$" "$OUT/prof/sweep/sweep.log" | tail -40; snap
st "sweep: the kernel's GPU tests"
timeout 120 python3 -m pytest -q -m gpu tests/runtime/test_paged_attention.py > "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -6; snap
elif [ "$MODE" = tattn ]; then
# tattn: the conventional attention straight from the KV pages (runtime/paged_attention.py, Triton, opt-in
# MPK_CONV_TRITON_ATTN=1, with the deferred appends in its kernel; session 26, CPU-tested under Triton's interpreter)
export MPK_CONV_TRITON_ATTN=1
st "tattn 1: GPU tests with it on (the kernel vs a reference, bf16 steps vs the gather path, plans in the engine)"
timeout 200 python3 -m pytest -q -m gpu tests/runtime/test_paged_attention.py tests/runtime/test_skinny_gemm.py \
    tests/runtime/test_kv_defer.py tests/gpu/test_engine_plans.py > "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -6; snap
st "tattn 2: its per-layer curves (profile_conv_attn.py: compare with h200_v36_cal's conv_attn_us_by_shape)"
timeout 150 python3 scripts/profile_conv_attn.py --tp 1 --batches 1,8,32,128 --keys 513,4097 --budget-s 130 \
    --out "$OUT/prof" > "$OUT/prof/conv_attn.log" 2>&1
tail -12 "$OUT/prof/conv_attn.log"; snap
st "tattn 3: the conventional plan with it against attn-mk, measured (validate_planner --families)"
for C in 512 4096; do
  d="$OUT/val/t$C"; mkdir -p "$d"
  timeout 110 python3 scripts/validate_planner.py --tp 1 --context $C --batches 8,32,128 --families conventional,attn-mk \
      --budget-s 100 --out "$d" > "$d/validate.log" 2>&1
  grep -E "B=" "$d/validate.log" | tail -6; snap
done
elif [ "$MODE" = val ]; then
# VAL_CTXS (default "512 4096"), VAL_B<ctx> the batches at each (defaults: 1,8,32,128 at 512, else 1,8,32), VAL_MODELS,
# VAL_FAMILIES (plan families, validate_planner --families), VAL_TRACE (plan names or all: their megakernel segments'
# task windows in the rows, segment_spans, and the log's "span" lines; Chrome traces under val/c<ctx>/traces)
st "4d validate_planner TP=1, all families, ctx ${VAL_CTXS:-512 4096} (the default profile out of sample)"
for C in ${VAL_CTXS:-512 4096}; do
  v=VAL_B$C; d="$OUT/val/c$C"; mkdir -p "$d"; [ $C = 512 ] && BB=${!v:-1,8,32,128} || BB=${!v:-1,8,32}
  timeout ${VAL_LIM:-270} python3 scripts/validate_planner.py --tp 1 --context $C --batches $BB \
      ${VAL_MODELS:+--models $VAL_MODELS} ${VAL_FAMILIES:+--families $VAL_FAMILIES} ${VAL_TRACE:+--trace-plans $VAL_TRACE} \
      --budget-s $((${VAL_LIM:-270} - 15)) --out "$d" > "$d/validate.log" 2>&1
  grep -E "spearman|MAPE|regret" "$d/validate.log" | tail -14; snap
done
elif [ "$MODE" = bench ]; then
st "4 bench_decode with both peers"
# BS / CTXS pick cells (qwen3-8b's whole table needs ~9-10 min: one call a context); BENCH_BUDGET the run's seconds;
# PEER_BS / HF_BS the peers' batches (default BS; set empty for none); BEFORE cells ahead of the order (--before);
# ISOLATE=1 one fresh process per system (--isolate)
mkdir -p "$OUT/bench"; smi_start "$OUT/bench/smi_trace.csv"
OUT="$OUT/bench" timeout $((${BENCH_BUDGET:-540} + 20)) python3 scripts/bench_decode.py --models "${MODELS:-llama-3.2-1b}" \
    --batches ${BS:-1,8,32,128} --contexts ${CTXS:-512,4096} --mk-max-batch ${MKMAX:-128} \
    --peer-batches "${PEER_BS-${BS:-1,8,32,128}}" --hf-batches "${HF_BS-${BS:-1,8,32,128}}" --budget-s ${BENCH_BUDGET:-540} \
    ${BEFORE:+--before $BEFORE} ${ISOLATE:+--isolate} > "$OUT/bench/bench.log" 2>&1
smi_stop
grep -A30 "====" "$OUT/bench/bench.log" | head -40
python3 scripts/smi_join.py "$OUT/bench/bench_decode.json" "$OUT/bench/smi_trace.csv" > "$OUT/bench/clocks.log" 2>&1
cat "$OUT/bench/clocks.log"; snap
elif [ "$MODE" = hf ]; then
st "4c the HF peer alone at B=${HF_BS:-8,32,128} x ctx ${HF_CTXS:-512,4096} (cells the bench's budget cuts)"
OUT="$OUT/bench" timeout 560 python3 scripts/bench_decode.py --models "${MODELS:-qwen3-8b}" --batches ${HF_BS:-8,32,128} \
    --contexts ${HF_CTXS:-512,4096} --mk-max-batch 0 --no-planned --peer-batches "" --hf-batches ${HF_BS:-8,32,128} --budget-s 540 \
    > "$OUT/bench/hf.log" 2>&1
grep -A12 "====" "$OUT/bench/hf.log"; snap
elif [ "$MODE" = ncuatt ]; then
st "4e ncu of one attention megakernel of the planned (attn-mk) step, llama-3.2-1b, at B:ctx in ${NCU_POINTS:-128:4096 32:512}:"
st "   where attn_partial's wide passes stall (long scoreboard = waiting for K/V; lg_throttle = the cp.async issue;"
st "   no_instruction = instruction fetch, a suspect for the segment's ~20 us beyond its tasks)"
for PT in ${NCU_POINTS:-128:4096 32:512}; do
  NB=${PT%%:*}; NC=${PT##*:}; d="$OUT/ncu/b${NB}_c${NC}"; mkdir -p "$d"; NCU_LOG="$d/ncu.log"
  # NCU_MONO=1: the one-megakernel step instead (batch 1 / 8: where the linear tiles' batch-1 loops stall)
  if [ "${NCU_MONO:-0}" = 1 ]; then SYS="--mk-max-batch $NB --no-planned"; else SYS="--mk-max-batch 0"; fi
  timeout 240 ncu --section WarpStateStats --section SourceCounters --section SpeedOfLight --section MemoryWorkloadAnalysis \
      -k regex:mpk --launch-skip 2 --launch-count 1 -f -o "$d/prof" python3 scripts/bench_decode.py --models llama-3.2-1b \
      --batches $NB --contexts $NC $SYS --no-peers --budget-s 200 > "$NCU_LOG" 2>&1
  tail -3 "$NCU_LOG"
  timeout 60 ncu -i "$d/prof.ncu-rep" --page source --csv --print-source sass > "$d/src.csv" 2>> "$NCU_LOG"
  timeout 60 ncu -i "$d/prof.ncu-rep" --page details --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats > "$d/details.txt" 2>> "$NCU_LOG"
  grep -iE "duration|dram throughput|memory throughput|l2 hit|stall" "$d/details.txt" | head -14
  gzip -f "$d/src.csv"; rm -f "$d/prof.ncu-rep"; snap
done
cp "$(python3 -c 'from mpk_runtime.codegen import nvcc; print(nvcc.build().cubin)')" "$OUT/ncu/"; snap   # (the profiled build)
# here: nvdisasm -gi megakernel.cubin > mk.sass; python3 scripts/ncu_stalls.py mk.sass src.csv --function attn_partial
elif [ "$MODE" = ncupa ]; then
# ncupa (session 40): ncu of the paged attention's partial kernel (the conventional attention) at llama-3.2-1b
# B:keys in ${NCU_POINTS:-32:4097 128:4097}, for each MPK_PAGED_HEADS value in ${NCU_HEADS:-one group}: what a CTA
# waits on (long scoreboard = its K / V loads; barrier; math pipe throttle), DRAM throughput and the bytes a request
# moves (docs/perf-notes.md session 40: ~6 GB/s a CTA at head dim 64 whatever the block size or stages; ~2 min).
for PT in ${NCU_POINTS:-32:4097 128:4097}; do
  for H in ${NCU_HEADS:-one group}; do
    NB=${PT%%:*}; NK=${PT##*:}; d="$OUT/ncupa/b${NB}_k${NK}_$H"; mkdir -p "$d"
    MPK_PAGED_HEADS=$H timeout 120 ncu --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats -k regex:_partial_kernel \
        --launch-skip 1 --launch-count 1 -f -o "$d/prof" python3 scripts/profile_conv_attn.py --out "$d" \
        --models ${MODELS:-llama-3.2-1b} --tp 1 --batches $NB --keys $NK --cycle-mb 200 --budget-s 60 \
        > "$d/ncu.log" 2>&1
    timeout 60 ncu -i "$d/prof.ncu-rep" --page details > "$d/details.txt" 2>> "$d/ncu.log"
    echo "[$H B=$NB keys=$NK]"; grep -iE "duration|dram throughput|memory throughput|achieved occupancy|stall|registers" \
        "$d/details.txt" | head -16
    rm -f "$d/prof.ncu-rep"; snap
  done
done
elif [ "$MODE" = launch ]; then
st "4f what a megakernel segment costs beyond its tasks, in CUDA graphs (scripts/bench_mk_launch.py)"
OUT="$OUT/bench" timeout 200 python3 scripts/bench_mk_launch.py --batches ${LAUNCH_BATCHES:-1,32,128} > "$OUT/bench/mk_launch.log" 2>&1
tail -12 "$OUT/bench/mk_launch.log"; snap
elif [ "$MODE" = engine ]; then
# engine (session 49): LLM.generate end to end through the planned megakernel, ms per decode step with one decode step
# per engine step and with bursts of 8 (LLM(decode_steps=8): drawn tokens fed back on the device); bench_decode's
# graph-replay time of the same plan is the kernel-only reference
st "4j the engine's time per token through the planned megakernel, decode_steps 1 and 8 (bench_engine_overhead.py)"
for m in ${MODELS:-llama-3.2-1b qwen3-8b}; do
  OUT="$OUT/bench/engine_$m" timeout ${ENGINE_LIM:-200} python3 scripts/bench_engine_overhead.py --backend megakernel \
      --plan auto --model "$m" --requests ${ENGINE_BS:-1,8} --decode-steps ${ENGINE_KS:-1,8} --max-tokens 128 \
      --prompt-len 16,48 --sampling ${ENGINE_SAMPLING:-greedy} ${ENGINE_ASYNC:+--async-bursts} \
      ${ENGINE_MSL:+--max-seq-len $ENGINE_MSL} ${ENGINE_PROFILE:+--profile $ENGINE_PROFILE} \
      > "$OUT/bench/engine_$m.log" 2>&1
  grep -E "ms per decode step|x greedy|^profile" "$OUT/bench/engine_$m.log" | tail -20
done; snap
elif [ "$MODE" = fulldraw ]; then
# fulldraw (session 51): the full-vocabulary draw alone, split Triton kernels vs the torch twin vs argmax
st "4l the full-vocabulary draw's kernels (bench_full_draw.py)"
mkdir -p "$OUT/bench"
OUT="$OUT/bench" timeout ${FULLDRAW_LIM:-150} python3 scripts/bench_full_draw.py > "$OUT/bench/fulldraw.log" 2>&1
grep -E "triton" "$OUT/bench/fulldraw.log" | tail -24; snap
elif [ "$MODE" = drawg ]; then
# drawg (session 53): the full draw replayed as one CUDA graph (runtime/draw_graphs.py) against session 52's eager
# launches: the kernels alone (bench_full_draw, impls triton / graph), then LLM.generate's ms per decode step with the
# graphs on and off (MPK_DRAW_GRAPHS=1 / 0, greedy in each run as the baseline), each cell profiled once (kernel
# times, the device's busy share, the gaps: bench_engine_overhead --profile)
st "4n the full draw as a CUDA graph: the kernels alone, then the engine with MPK_DRAW_GRAPHS=1 / 0"
mkdir -p "$OUT/bench"
OUT="$OUT/bench" timeout 60 python3 scripts/bench_full_draw.py --vocab 128256 --batch 1,8,128 --modes plain,nucleus \
    --impls triton,graph > "$OUT/bench/fulldraw.log" 2>&1
grep -E "triton|graph" "$OUT/bench/fulldraw.log" | tail -12; snap
for g in 1 0; do
  MPK_DRAW_GRAPHS=$g OUT="$OUT/bench/engine_g$g" timeout ${ENGINE_LIM:-170} python3 scripts/bench_engine_overhead.py \
      --backend megakernel --plan auto --model ${MODELS:-llama-3.2-1b} --requests ${ENGINE_BS:-1,128} --decode-steps 8 \
      --max-tokens 128 --prompt-len 16,48 --sampling ${ENGINE_SAMPLING:-greedy,plain,nucleus} --profile 32 \
      > "$OUT/bench/engine_g$g.log" 2>&1
  grep -E "ms per decode step|x greedy|^profile" "$OUT/bench/engine_g$g.log" | tail -20; snap
done
elif [ "$MODE" = hostgap ]; then
# hostgap (session 53): the engine's host turnaround between two bursts at llama B=1 (~0.7-0.96 ms a burst of 8 on an
# H100, session 53's profiles): one greedy cell profiled with the Python tracer (python_function events)
st "4o the host between bursts: B=1 greedy k=8 under the Python tracer"
mkdir -p "$OUT/bench"
OUT="$OUT/bench/hostgap" timeout ${HG_LIM:-150} python3 scripts/bench_engine_overhead.py --backend megakernel --plan auto \
    --model llama-3.2-1b --requests 1 --decode-steps 8 --max-tokens 128 --prompt-len 16,48 --sampling greedy \
    --repeats 2 --profile 32 --profile-stack > "$OUT/bench/hostgap.log" 2>&1
grep -E "ms per decode step|^profile" "$OUT/bench/hostgap.log" | tail -4; snap
elif [ "$MODE" = prefix ]; then
# prefix (session 51): prefix caching on a chat-like workload through the planned megakernel, off and on in one run
# (bench_prefix_cache.py): TTFT of requests sharing a system prompt, and a batch of them
st "4k prefix caching off / on: TTFT and a batch sharing a ${PREFIX_SYSTEM:-1024}-token system prompt"
for m in ${MODELS:-llama-3.2-1b}; do
  OUT="$OUT/bench/prefix_$m" timeout ${PREFIX_LIM:-200} python3 scripts/bench_prefix_cache.py --backend megakernel \
      --plan auto --model "$m" --system ${PREFIX_SYSTEM:-1024} --suffix 32 --requests ${PREFIX_REQS:-16} \
      --max-tokens 16 > "$OUT/bench/prefix_$m.log" 2>&1
  tail -4 "$OUT/bench/prefix_$m.log"
done; snap
elif [ "$MODE" = kvp ]; then
# kvp (session 52): KV pages short of the batch, kv_allocation reserve vs lazy through the planned megakernel
# (bench_kv_pressure.py; lengths set by its LengthOracle runner around the megakernel, unknown to the engine)
st "4m KV pages short of the batch: reserve vs lazy (bench_kv_pressure.py)"
for m in ${MODELS:-llama-3.2-1b}; do
  OUT="$OUT/bench/kvp_$m" timeout ${KVP_LIM:-280} python3 scripts/bench_kv_pressure.py --backend megakernel \
      --plan auto --model "$m" --requests ${KVP_REQS:-256} --max-tokens 512 --mean-out 100 --max-seq-len 1024 \
      --max-batch 128 --kv-seqs ${KVP_SEQS:-8,16,64} --prompt-len 64,256 > "$OUT/bench/kvp_$m.log" 2>&1
  grep -E "^kv|differ" "$OUT/bench/kvp_$m.log"
done; snap
elif [ "$MODE" = phase ]; then
st "4g one batch-1 phase's weight stream per SM: registers (64 KiB in flight) against TMA rings (bench_stream --phase)"
OUT="$OUT/bench" timeout 120 python3 scripts/bench_stream.py --phase > "$OUT/bench/phase.log" 2>&1
tail -32 "$OUT/bench/phase.log"; snap
elif [ "$MODE" = chain ]; then
# chain (session 44): a batch-1 layer's four dependent linear phases, registers after each wait (today) against one
# producer per SM streaming through a TMA ring across the waits (bench_stream --chain; docs/perf-notes.md session 44);
# since session 45 also the first round issued before the wait, and both with a linear task's ends (x, norm, stores)
st "4i a batch-1 layer's dependent phases: registers against a producer ring (bench_stream --chain)"
mkdir -p "$OUT/bench"
OUT="$OUT/bench" timeout 150 python3 scripts/bench_stream.py --chain > "$OUT/bench/chain.log" 2>&1
tail -24 "$OUT/bench/chain.log"; snap
elif [ "$MODE" = mlp ]; then
# mlp (session 37): a batch-1 MLP block at llama-3.2-1b / qwen3-8b shapes, today's two phases against the down
# projection fused into the gate_up tile (device_kernels/bench_mlp.cu; docs/perf-notes.md session 37's prediction),
# then the kernel's GPU test (every mode against torch)
st "4h the fused down projection's block time against two phases (bench_mlp), and its GPU test"
mkdir -p "$OUT/bench"
OUT="$OUT/bench" timeout 150 python3 scripts/bench_mlp.py > "$OUT/bench/mlp.log" 2>&1
tail -8 "$OUT/bench/mlp.log"
timeout 120 python3 -m pytest -q -rs tests/gpu/test_mlp_block_bench.py > "$OUT/bench/mlp_test.log" 2>&1
tail -3 "$OUT/bench/mlp_test.log"; snap
elif [ "$MODE" = serve ]; then
# serve (session 63): the OpenAI-compatible HTTP server (cluster/server.py) under a concurrent load on one GPU, the
# in-process executor, the megakernel backend at its defaults (plan "auto", pipelined decode bursts of 4, lazy KV pages):
# scripts/load_test.py fires SERVE_N requests at once (4-24 prompt tokens, SERVE_TOKENS new tokens, greedy) from a
# client process, SERVE_ROUNDS times in one server process (default 2: the last one is measured, the first warms it
# up; session 63 ran one round). Needs the serve bundle (.cache/gbs: `SERVE=1 bash scripts/gpu_prepare.sh`, carry it).
st "serve: HTTP load through the server, one GPU, in-process executor (load_test.py)"
mkdir -p "$OUT/bench"
# each replica's engine in a process of its own (--engine-process, the default since session 66); SERVE_PROC=0: in the
# server's process (--no-engine-process)
for m in ${MODELS:-llama-3.2-1b qwen3-8b}; do   # SERVE_TAG: a suffix of the folder's and log's names; SERVE_STREAM=1: SSE
  OUT="$OUT/bench/serve_$m${SERVE_TAG:-}" timeout ${SERVE_LIM:-240} python3 scripts/load_test.py --model "$m" \
      --backend megakernel --requests ${SERVE_N:-256} --max-tokens ${SERVE_TOKENS:-128} --max-batch ${SERVE_BATCH:-64} \
      --max-seq-len ${SERVE_MSL:-256} --rounds ${SERVE_ROUNDS:-2} ${SERVE_STREAM:+--stream} \
      $([ "${SERVE_PROC:-1}" = 0 ] && echo --no-engine-process) > "$OUT/bench/serve_$m${SERVE_TAG:-}.log" 2>&1
  grep -E '"(succeeded|errors|tokens_per_s|latency_p50_s|latency_p99_s|ttft_p50_s|ttft_p99_s|mean_batch_occupancy|machine)"|ms/step|^round|CUDA graphs|CPU seconds|engine (events|idle)|Error|error' \
      "$OUT/bench/serve_$m${SERVE_TAG:-}.log" | head -26
done; snap
elif [ "$MODE" = admit ]; then
# admit (session 64): a serving step's prompt chunks through ConventionalPrefill alone (profile_prefill.py: 11 chunks
# of 4-24 tokens a step, as load_test's admissions, start-up graphs captured first), packed (one graph, rows back to
# back) against grouped by length (packed_rows 0: a left-padded graph per power-of-two length, session 63's path)
st "admit: prompt chunks of a serving step through the prefill graphs, packed vs grouped"
mkdir -p "$OUT/bench"
for m in ${MODELS:-llama-3.2-1b qwen3-8b}; do for pr in ${ADMIT_PR:-2048 0}; do   # ADMIT_BUSY=1: a spinning thread beside
  OUT="$OUT/bench" timeout 150 python3 scripts/profile_prefill.py --model "$m" --chunks ${ADMIT_CHUNKS:-11} \
      --steps 16 --warm --packed-rows $pr ${ADMIT_BUSY:+--busy-thread} --tag "_${m}_p$pr${ADMIT_BUSY:+_busy}" \
      > "$OUT/bench/admit_${m}_p$pr${ADMIT_BUSY:+_busy}.log" 2>&1
  grep -E '"(packed_rows|graph_runs_per_step|packed_runs|steady_ms_median|profiled_step_ms|cuda_total_ms|inputs|launch|wait|device|wall)"|Error' \
      "$OUT/bench/admit_${m}_p$pr${ADMIT_BUSY:+_busy}.log"
done; done; snap
elif [ "$MODE" = stamps ]; then
st "4b stage stamps of the one-megakernel step at B=1, 8 (qwen3-8b B=8 is 0.82x gpt-fast; session 10's stamps are old)"
st "   and B=32, 128 (attention's passes; session 16 has them for the default build)"
MPK_NVCC_DEFINES=-DMPK_STAGE_WORDS=${STAMP_K:-12} OUT="$OUT/bench" timeout 300 python3 scripts/bench_decode.py \
    --models llama-3.2-1b,qwen3-8b --batches ${STAMP_BATCHES:-1,8} --contexts ${STAMP_CTX:-512} --mk-max-batch 128 --no-peers --no-planned \
    --trace --budget-s 280 > "$OUT/bench/stamps.log" 2>&1
tail -12 "$OUT/bench/stamps.log"; snap
elif [ "$MODE" = order ]; then
# order (session 35): the conventional plan at qwen3-8b B=8 ctx 512 measured 5.26-5.29 ms in A/B runs without peers
# and 5.547 inside the full bench (session 33: 5.447 / 5.714). Three bench_decode runs of the same planned cell,
# each a fresh process, in orders that separate the suspects: (a) after the one megakernel at B=128 (its KV and
# its 72 ms steps), no peers; (b) after the B=1 peers (their torch.compile graphs), no big megakernel cells;
# (c) alone (the A/B's order). ~6-7 min.
OM=${MODELS:-qwen3-8b}
for V in a_after_mk128 b_after_peers c_alone; do
  d="$OUT/order/$V"; mkdir -p "$d"
  case $V in   # (b): the B=1 HF peer takes ~90 s with its compile, hence its longer limit
    a_after_mk128) A="--batches 8,128 --mk-max-batch 128 --no-peers"; L=150;;
    b_after_peers) A="--batches 1,8 --mk-max-batch 8 --peer-batches 8 --hf-batches 1"; L=220;;
    c_alone) A="--batches 8 --mk-max-batch 8 --no-peers"; L=90;;
  esac
  OUT="$d" timeout $L python3 scripts/bench_decode.py --models "$OM" --contexts 512 $A --budget-s $((L - 15)) \
      > "$d/bench.log" 2>&1
  grep -E "^$OM +8 +512 (planned|gptfast)" "$d/bench.log" | sed "s/^/[$V] /"
  tar -czf "$OUT/order.tar.gz" -C "$OUT" order 2>/dev/null
done
elif [ "$MODE" = long ]; then
# long (session 55): contexts of 8k-128k tokens, never run before on a GPU: prefill in 4096-token chunks (the engine's
# new default step budget) and decode against the reference (scripts/gpu_check_long.py), then the kernel alone with the
# gpt-fast peer at the same contexts (bench_decode, B=1)
st "long contexts: gpu_check_long ${LONG_LENS:-8192,32768,130944}, then bench_decode ctx ${LONG_CTXS:-8192,32768,131072}"
mkdir -p "$OUT/long"
if [ -n "${LONG_LENS-x}" ]; then   # (LONG_LENS= : the bench alone)
OUT="$OUT/long" timeout ${LONG_LIM:-300} python3 scripts/gpu_check_long.py --models ${MODELS:-llama-3.2-1b} \
    --lens ${LONG_LENS:-8192,32768,130944} ${LONG_ARGS:---book-at-ctx} > "$OUT/long/check.log" 2>&1
sed -n '/==== gpu_check_long/,$p' "$OUT/long/check.log" | cut -c1-700; tail -3 "$OUT/long/check.log"; snap
fi
if [ -n "${LONG_CTXS-x}" ]; then
OUT="$OUT/long" timeout ${LONG_BENCH_LIM:-240} python3 scripts/bench_decode.py --models ${MODELS:-llama-3.2-1b} \
    --batches ${LONG_BS:-1} --contexts ${LONG_CTXS:-8192,32768,131072} --peer-batches ${LONG_BS:-1} --hf-batches "" \
    --budget-s 220 > "$OUT/long/bench.log" 2>&1
grep -E "ms/token|FAILED|%floor" -A12 "$OUT/long/bench.log" | tail -16; snap
fi
elif [ "$MODE" = sat ]; then
# sat (session 54 item 0d): bursts under a full batch with a queue, through the megakernel: decode_steps 1 (what a
# saturated server ran before) against 4, 512 requests through 32 slots (bench_kv_pressure's length oracle)
st "saturated server: 512 requests through ${SAT_SLOTS:-32} slots, decode_steps 1 vs 4"
mkdir -p "$OUT/sat"
for k in ${SAT_KS:-1 4}; do
  OUT="$OUT/sat/k$k" timeout ${SAT_LIM:-120} python3 scripts/bench_kv_pressure.py --backend megakernel --plan auto \
      --requests ${SAT_REQ:-512} --max-batch ${SAT_SLOTS:-32} --kv-seqs ${SAT_KV:-64} --modes lazy --decode-steps $k \
      > "$OUT/sat/k$k.log" 2>&1
  tail -4 "$OUT/sat/k$k.log"
done; snap
elif [ "$MODE" = card ]; then
# card (session 60): this card's own hardware profile, the measured parts (~5 min): shared/gpu/sync_bw.cu's flag /
# barrier latencies and read-only stream by SMs (.cache/sync_bw, built on the CPU machine by gpu_prepare.sh) into a
# copy of CARD_BASE (scripts/card_base.py), then profile_hw.py on it (linear tiles by SMs, launch, task terms, the
# conventional ops' fixed costs), then the conventional paged attention's curves (profile_conv_attn.py, TP 1 and 2 shapes).
# The regimes (calibration) are fitted on the CPU afterwards from this card's validate_planner rows (mode val).
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200|H20|A100|B200|GH200' | head -1 | tr A-Z a-z)
CARD=${CARD:-gpu}; mkdir -p "$OUT/prof"
st "card: the $CARD's profile, measured parts (base ${CARD_BASE:-h200_v56})"
timeout 120 .cache/sync_bw > "$OUT/prof/sync_bw.log" 2>&1; cat "$OUT/prof/sync_bw.log"
python3 scripts/card_base.py --sync-log "$OUT/prof/sync_bw.log" --base ${CARD_BASE:-h200_v56} \
    --out "$OUT/prof/${CARD}_base.json" && \
timeout ${CARD_HW_LIM:-200} python3 scripts/profile_hw.py --name ${CARD}_measured --base "$OUT/prof/${CARD}_base.json" \
    --out "$OUT/prof" > "$OUT/prof/profile_hw.log" 2>&1; tail -30 "$OUT/prof/profile_hw.log"; snap
MPK_CONV_TRITON_ATTN=1 timeout ${CATTN_LIM:-300} python3 scripts/profile_conv_attn.py --out "$OUT/prof" --cycle-mb 200 \
    --tp ${CATTN_TP:-1,2} ${CATTN_KEYS:+--keys $CATTN_KEYS} ${CATTN_BS:+--batches $CATTN_BS} --budget-s ${CATTN_BUDGET:-270} \
    > "$OUT/prof/conv_attn.log" 2>&1
tail -4 "$OUT/prof/conv_attn.log"; snap
elif [ "$MODE" = tests ]; then
# tests: TESTS="<pytest ids or -k expressions>" of the GPU tests, one log ($OUT/pytest_sel.log)
st "tests: ${TESTS:-tests/gpu}"
timeout ${LIM:-300} python3 -m pytest -v -m gpu ${TESTS:-tests/gpu} > "$OUT/pytest_sel.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_sel.log" | tail -6; tar -czf "$OUT/pending.tar.gz" -C "$OUT" pytest_sel.log
elif [ "$MODE" = loop ]; then
# loop (session 74): the TP=2 megakernel with both ranks on this one GPU (scripts/gpu_check_tp_loopback.py: the
# device protocol - pushes, remote signals, cross-rank waits - against TP=1; not the NVLink transport, not TP speed)
st "loop: TP=2 ranks on one GPU, ${LOOP_MODELS:-llama-3.2-1b,qwen3-8b}"
timeout ${LIM:-300} python3 scripts/gpu_check_tp_loopback.py --models ${LOOP_MODELS:-llama-3.2-1b,qwen3-8b} \
    --steps ${LOOP_STEPS:-64} ${LOOP_ARGS:-} > "$OUT/loopback.log" 2>&1
tail -14 "$OUT/loopback.log"
elif [ "$MODE" = varq ]; then
# varq (session 36): the conventional plan at qwen3-8b B=8 ctx 512 measured 5.26 / 5.29 (s35, two processes, alone),
# 5.547 (s35, full bench) and 5.645 / 5.635 / 5.883 (s36 order: alone / after B=128 / after the peers) while the one
# megakernel moved 1.3%. Which kernel moves between processes: the plan kernel by kernel in three fresh processes,
# then the bench cell alone in two more (~5 min).
# CLEAR=1: each process with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR fresh), so each times its reductions'
# launch configs anew (docs/perf-notes.md session 36: the picks are cached per machine)
mkdir -p "$OUT/varq"
for i in 1 2 3; do
  ${CLEAR:+env TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)} timeout 75 python3 scripts/profile_conventional.py --models ${MODELS:-qwen3-8b} --batches 8 --context 512 \
      --family conventional --top 40 --out "$OUT/varq/p$i" > "$OUT/varq/profile_p$i.log" 2>&1
  grep "^==" "$OUT/varq/profile_p$i.log" | sed "s/^/[p$i] /"
done
for i in 1 2; do
  d="$OUT/varq/b$i"; mkdir -p "$d"
  ${CLEAR:+env TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)} OUT="$d" timeout 60 python3 scripts/bench_decode.py \
      --models ${MODELS:-qwen3-8b} --contexts 512 --batches 8 \
      --mk-max-batch 0 --no-peers --budget-s 50 > "$d/bench.log" 2>&1
  grep -E " planned " "$d/bench.log" | tail -1 | sed "s/^/[b$i] /"
done
python3 scripts/kernel_spread.py "$OUT"/varq/profile_p[123].log --top 8 2>&1 | sed "s/^/[spread] /"
tar -czf "$OUT/varq.tar.gz" -C "$OUT" varq 2>/dev/null
elif [ "$MODE" = profq ]; then
# profq (session 35): where our conventional plan and the gpt-fast peer spend a step, kernel by kernel, at the
# qwen3-8b points where gpt-fast leads (B=8 / 32 ctx 512 and B=8 ctx 4096 in session 35's table; ~3 min).
# PROF_FAMS (families, or gptfast) and PROF_POINTS ("ctx:batches ...") choose others, e.g. session 39's composition
# gap: PROF_FAMS="conventional attn-mk attn-conv" PROF_POINTS="2048:128" MODELS=qwen3-8b
mkdir -p "$OUT/prof"
for F in ${PROF_FAMS:-conventional gptfast}; do
  for P in ${PROF_POINTS:-512:8,32 4096:8}; do
    C=${P%%:*}; BB=${P#*:}; mkdir -p "$OUT/prof/${F}_c$C"
    timeout 100 python3 scripts/profile_conventional.py --models ${MODELS:-qwen3-8b} --batches $BB --context $C \
        --family $F --top 30 --out "$OUT/prof/${F}_c$C" > "$OUT/prof/profile_${F}_c$C.log" 2>&1
    grep "^==" "$OUT/prof/profile_${F}_c$C.log"
  done
done
tar -czf "$OUT/profq.tar.gz" -C "$OUT" prof 2>/dev/null
elif [ "$MODE" = tpeng ]; then   # (two GPUs, ~5-8 min: a call of its own)
    [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && { echo "mode tpeng needs two GPUs"; exit 2; }
    st "the engine at TP=2: each bucket's plan (the default since session 57) vs plan=None and MPK_TP_BURSTS=1, Ray vs in-process"
    mkdir -p "$OUT/tpeng"
    OUT="$OUT/tpeng" timeout 540 python3 scripts/gpu_check_ray.py --model llama-3.2-1b --max-batch 32 --compare-plan-none \
        --compare-tp-bursts > "$OUT/tpeng/stdout.log" 2>&1; tail -5 "$OUT/tpeng/stdout.log"; snap
elif [ "$MODE" != two ]; then
    echo "unknown mode $MODE (see the usage at the top of $0)"; exit 2
elif [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    echo "mode two needs two GPUs"; exit 2
else
    st "5 all-reduce (LL candidate)"
    OUT="$OUT/ar" timeout 90 python3 scripts/bench_allreduce.py > "$OUT/ar/log" 2>&1; tail -10 "$OUT/ar/log"; snap
    st "6 TP=1 == TP=2 (fold on by default)"
    OUT="$OUT/tp" timeout 90 python3 scripts/gpu_check_tp.py --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --steps 32 --no-timing --skip-stall --tp-invariant 2 > "$OUT/tp/stdout.log" 2>&1
    grep -o '"ok": [a-z]*' "$OUT/tp/gpu_check_tp.json" | sort | uniq -c; snap
    st "7 TP=2 bench with the PyTorch TP peer"
    MPK_ATTN_FOLD=$FOLD OUT="$OUT/tpbench" timeout 150 python3 scripts/bench_decode.py --tp 2 \
        --models llama-3.2-1b,qwen3-8b --batches 1,8 --budget-s 130 > "$OUT/tpbench/bench_tp2.log" 2>&1
    grep -A8 "====" "$OUT/tpbench/bench_tp2.log"; snap
    st "8 the LL all-reduce in the megakernel (MPK_AR_LL=1): TP=1 == TP=2, then TP=2 bench without peers"
    mkdir -p "$OUT/tp_ll" "$OUT/tpbench_ll"
    MPK_AR_LL=1 OUT="$OUT/tp_ll" timeout 80 python3 scripts/gpu_check_tp.py --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --steps 32 --no-timing --skip-stall --tp-invariant 2 > "$OUT/tp_ll/stdout.log" 2>&1
    grep -o '"ok": [a-z]*' "$OUT/tp_ll/gpu_check_tp.json" | sort | uniq -c
    MPK_AR_LL=1 OUT="$OUT/tpbench_ll" timeout 70 python3 scripts/bench_decode.py --tp 2 --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --peer-batches "" --budget-s 55 > "$OUT/tpbench_ll/bench_tp2.log" 2>&1
    grep -A6 "====" "$OUT/tpbench_ll/bench_tp2.log"; tar -czf "$OUT/pending_ll.tar.gz" -C "$OUT" tp_ll tpbench_ll
fi
st done
