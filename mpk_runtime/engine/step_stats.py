"""Where an engine step's time goes: always-on phase totals kept in `LLMEngine.stats` / `EngineLoop.stats()`.

Totals and counts only (a few `time.perf_counter` calls per step, nothing that grows with the run), so they are
summed over replicas and differenced between two snapshots like the other counters. Seconds, wall clock:

  step (LLMEngine.step, counted for steps that ran) = schedule + execute + output + free (+ a few microseconds)
    t_schedule_s   scheduler + building the step's SeqChunks (host prep)
    t_execute_s    executor.collective_rpc("execute"): dispatch to every rank until every rank's result is back
    t_output_s     after execute: sampling / device tokens, stop checks, detokenizing, output snapshots
    t_free_s       the collective "free" call for the sequences that finished in this step (free_calls of them)
    t_step_cpu_s   CPU time of the engine thread over the steps (step - cpu = blocked: workers, GIL, I/O)
  execute, as the executor measured it (timed_steps: steps whose executor reports `last_timing`):
    t_exec_dispatch_s    submitting the call to every rank (Ray: .remote(), serializes the chunks)
    t_exec_wait_s        waiting for / fetching every rank's result (Ray: ray.wait + ray.get)
    t_exec_to_worker_s   submit -> the critical rank (the last to finish) entered `Worker.execute` (wall clocks
                         of two processes: meaningful when the driver and the rank share a host)
    t_exec_worker_s      the critical rank's time inside `runner.step` (the model itself)
    t_exec_from_worker_s that rank returned -> the driver had every result (Ray: result serialization, transfer)
  split by step type: a "prefill" step has at least one prompt chunk, a "decode" step only decode rows:
    prefill_steps / decode_steps, t_step_{prefill,decode}_s, t_execute_{prefill,decode}_s, t_exec_worker_*
  rows: prompt_chunks, decode_rows (decode_rows_in_prefill_steps of them rode along in prefill steps),
    logits_bytes (host logits the runner returned; 0 when every row was sampled on the device)
  engine loop (EngineLoop, the thread that drives a served engine):
    loop_idle_s (blocked waiting for a request: nothing to run), loop_apply_s (admitting requests/aborts),
    loop_step_s (inside LLMEngine.step), loop_deliver_s (handing outputs to the server's callbacks),
    loop_health_s (idle health checks)
"""
from __future__ import annotations

STEP_COUNTERS = ("prefill_steps", "decode_steps", "prompt_chunks", "decode_rows", "decode_rows_in_prefill_steps",
                 "free_calls", "timed_steps", "logits_bytes")
STEP_TIMES = ("t_step_s", "t_step_prefill_s", "t_step_decode_s", "t_step_cpu_s", "t_schedule_s", "t_execute_s",
              "t_execute_prefill_s", "t_execute_decode_s", "t_output_s", "t_free_s", "t_exec_dispatch_s",
              "t_exec_wait_s", "t_exec_to_worker_s", "t_exec_worker_s", "t_exec_from_worker_s",
              "t_exec_worker_prefill_s", "t_exec_worker_decode_s")
LOOP_TIMES = ("loop_idle_s", "loop_apply_s", "loop_step_s", "loop_deliver_s", "loop_health_s")
# stats that are not running totals (a snapshot difference keeps the later value)
GAUGES = ("last_batch_size", "max_batch_size_seen", "waiting", "running", "outstanding", "dead")


def new_step_stats() -> dict:
    return {**{k: 0 for k in STEP_COUNTERS}, **{k: 0.0 for k in STEP_TIMES}}


def new_loop_stats() -> dict:
    return {k: 0.0 for k in LOOP_TIMES}


def diff_stats(after: dict, before: dict) -> dict:
    """after - before for the running totals (numbers), the later value for gauges and anything else."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if k not in GAUGES and isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b, (int, float)):
            out[k] = v - b
        else:
            out[k] = v
    return out


def sum_stats(stats: list[dict]) -> dict:
    """Replicas' stats added up (totals summed; max_batch_size_seen the max)."""
    out: dict = {}
    for s in stats:
        for k, v in s.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            out[k] = max(out.get(k, 0), v) if k == "max_batch_size_seen" else out.get(k, 0) + v
    return out


def breakdown(s: dict, wall_s: float | None = None) -> dict:
    """Milliseconds per step by phase from (summed, differenced) stats; wall_s: the measured run's wall time."""
    def ms(key: str, n: float) -> float:
        return round(1e3 * s.get(key, 0.0) / n, 3) if n else 0.0

    steps = s.get("steps", 0)
    pre, dec, timed = s.get("prefill_steps", 0), s.get("decode_steps", 0), s.get("timed_steps", 0)
    per_step = {k: ms(f"t_{k}_s", steps) for k in ("step", "schedule", "execute", "output", "free")}
    per_step["cpu"] = ms("t_step_cpu_s", steps)
    ex = {k: ms(f"t_exec_{k}_s", timed) for k in ("dispatch", "wait", "to_worker", "worker", "from_worker")}
    if timed:
        ex["overhead"] = round(ex["dispatch"] + ex["wait"] - ex["worker"], 3)  # the call minus the model
    out = {"steps": steps, "prefill_steps": pre, "decode_steps": dec,
           "prompt_chunks_per_prefill_step": round(s.get("prompt_chunks", 0) / pre, 2) if pre else 0.0,
           "decode_rows_per_step": round(s.get("decode_rows", 0) / steps, 2) if steps else 0.0,
           "ms_per_step": per_step, "execute_ms_per_step": ex,
           "prefill_ms_per_step": {"step": ms("t_step_prefill_s", pre), "execute": ms("t_execute_prefill_s", pre),
                                   "worker": ms("t_exec_worker_prefill_s", pre)},
           "decode_ms_per_step": {"step": ms("t_step_decode_s", dec), "execute": ms("t_execute_decode_s", dec),
                                  "worker": ms("t_exec_worker_decode_s", dec)},
           "logits_kb_per_step": round(s.get("logits_bytes", 0) / 1024 / steps, 1) if steps else 0.0,
           "free_calls": s.get("free_calls", 0)}
    if any(k in s for k in LOOP_TIMES):
        out["loop_ms_per_step"] = {k[5:-2]: ms(k, steps) for k in LOOP_TIMES}
        out["loop_s"] = {k[5:-2]: round(s.get(k, 0.0), 4) for k in LOOP_TIMES}
    if wall_s:
        out["wall_s"] = round(wall_s, 4)
        out["wall_ms_per_step"] = round(1e3 * wall_s / steps, 3) if steps else 0.0
        out["steps_share_of_wall"] = round(s.get("t_step_s", 0.0) / wall_s, 4)
        if "loop_ms_per_step" in out and steps:  # wall time the loop's phases do not account for (slightly
            # negative when idle time before the measured window's first request is counted)
            out["loop_ms_per_step"]["other"] = round(out["wall_ms_per_step"] - sum(out["loop_ms_per_step"].values()), 3)
    return out


def format_breakdown(b: dict) -> str:
    """A few lines of text: where the time went, ms per step."""
    def row(d: dict) -> str:
        return "  ".join(f"{k} {v:.2f}" for k, v in d.items())

    lines = [f"where the time went: {b['steps']} steps ({b['prefill_steps']} with prefill, avg "
             f"{b['prompt_chunks_per_prefill_step']} prompt chunks; {b['decode_steps']} decode-only), "
             f"{b['decode_rows_per_step']} decode rows/step, logits {b['logits_kb_per_step']} KiB/step, "
             f"{b['free_calls']} free calls"]
    if "wall_ms_per_step" in b:
        lines.append(f"  wall/step {b['wall_ms_per_step']:.2f} ms; steps cover {100 * b['steps_share_of_wall']:.1f}% "
                     "of the wall time")
    if "loop_ms_per_step" in b:
        lines.append("  engine loop ms/step: " + row(b["loop_ms_per_step"]))
    lines.append("  step ms/step:        " + row(b["ms_per_step"]))
    if b["execute_ms_per_step"]:
        lines.append("  execute ms/step:     " + row(b["execute_ms_per_step"]))
    lines.append("  prefill steps ms:    " + row(b["prefill_ms_per_step"]))
    lines.append("  decode steps ms:     " + row(b["decode_ms_per_step"]))
    return "\n".join(lines)
