"""Server metrics in the Prometheus text format (no client library needed): throughput, latency quantiles,
queue depth and replica health."""
from __future__ import annotations

import threading
import time
from collections import deque

QUANTILES = (0.5, 0.9, 0.99)


def _quantile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[i]


class Metrics:
    def __init__(self, window_s: float = 10.0, keep: int = 2000):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._tok_events: deque[tuple[float, int]] = deque()
        self.tokens_total = 0
        self.requests = {"finished": 0, "failed": 0, "aborted": 0, "rejected": 0}
        self.series = {"request_latency_seconds": deque(maxlen=keep), "time_to_first_token_seconds": deque(maxlen=keep),
                       "time_per_output_token_seconds": deque(maxlen=keep)}
        # _count / _sum over every finished request (Prometheus counters); the quantiles over the last `keep`
        self.totals = {name: [0, 0.0] for name in self.series}
        # generation requests (completions, chat) the HTTP server accepted and has not answered in full, and those it
        # refused with 429 because --max-concurrent-requests were in flight (the server's admission limit)
        self.in_flight = 0
        self.overloaded = 0

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self.tokens_total += n
            self._tok_events.append((now, n))
            while self._tok_events and self._tok_events[0][0] < now - self.window_s:
                self._tok_events.popleft()

    def on_finish(self, out) -> None:
        with self._lock:
            if out.finish_reason == "error":
                self.requests["failed"] += 1
                return
            if out.finish_reason == "abort":
                self.requests["aborted"] += 1
                return
            self.requests["finished"] += 1
            m = out.metrics
            for name, v in (("request_latency_seconds", None if m.finish_time is None else
                             m.finish_time - m.arrival_time),
                            ("time_to_first_token_seconds", m.time_to_first_token),
                            ("time_per_output_token_seconds", m.per_token_latency)):
                if v is not None:
                    self.series[name].append(v)
                    self.totals[name][0] += 1
                    self.totals[name][1] += v

    def on_submit_failed(self) -> None:
        """A request no replica took (503: every replica down): failed, though no engine ever saw it."""
        with self._lock:
            self.requests["failed"] += 1

    def on_reject(self) -> None:
        with self._lock:
            self.requests["rejected"] += 1

    def on_admit(self) -> None:
        with self._lock:
            self.in_flight += 1

    def on_release(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def on_overloaded(self) -> None:
        with self._lock:
            self.overloaded += 1

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            return sum(n for t, n in self._tok_events if t >= now - self.window_s) / self.window_s

    def render(self, replica_stats: dict[str, dict]) -> str:
        lines = ["# HELP mpk_tokens_per_second Generated tokens per second over the last window",
                 "# TYPE mpk_tokens_per_second gauge", f"mpk_tokens_per_second {self.tokens_per_second():.6g}",
                 "# HELP mpk_generated_tokens_total Tokens generated since start",
                 "# TYPE mpk_generated_tokens_total counter", f"mpk_generated_tokens_total {self.tokens_total}",
                 "# HELP mpk_requests_total Requests by how they ended (rejected: refused as a bad request, 4xx; "
                 "refusals for overload are mpk_requests_overloaded_total)",
                 "# TYPE mpk_requests_total counter"]
        with self._lock:
            lines += [f'mpk_requests_total{{status="{k}"}} {v}' for k, v in self.requests.items()]
            lines += ["# HELP mpk_requests_overloaded_total Generation requests refused with HTTP 429 because "
                      "--max-concurrent-requests were in flight", "# TYPE mpk_requests_overloaded_total counter",
                      f"mpk_requests_overloaded_total {self.overloaded}",
                      "# HELP mpk_requests_in_flight Generation requests (completions, chat) accepted and not yet "
                      "answered in full", "# TYPE mpk_requests_in_flight gauge", f"mpk_requests_in_flight {self.in_flight}"]
            for name, vals in self.series.items():
                sv = sorted(vals)
                count, total = self.totals[name]
                lines += [f"# HELP mpk_{name} Quantiles over the last {vals.maxlen} finished requests; _sum and "
                          "_count over all", f"# TYPE mpk_{name} summary"]
                lines += [f'mpk_{name}{{quantile="{q}"}} {_quantile(sv, q):.6g}' for q in QUANTILES]
                lines += [f"mpk_{name}_sum {total!r}", f"mpk_{name}_count {count}"]
        per_replica = [("queue_depth", "waiting", "gauge", "Requests queued (waiting for pages or a batch slot)"),
                       ("running_requests", "running", "gauge", "Requests in the decode batch"),
                       ("engine_steps_total", "steps", "counter", "Engine steps run"),
                       ("multi_steps_total", "multi_steps", "counter",
                        "Engine steps that ran several decode steps (decode_steps > 1)"),
                       ("multi_step_decode_steps_total", "device_steps_in_multi", "counter",
                        "Decode steps run inside those engine steps"),
                       ("requests_graph_sampled_total", "sampled_graph", "counter",
                        "Requests whose tokens the step's graph draws (greedy, top_k <= 64)"),
                       ("requests_full_sampled_total", "sampled_full", "counter",
                        "Requests drawn from the whole vocabulary on the device (top_k 0 or > 64)"),
                       ("requests_host_sampled_total", "sampled_host", "counter",
                        "Requests sampled on the host (logprobs, penalties; or a runner without the device draws)"),
                       ("prefix_cache_query_tokens_total", "prefix_cache_query_tokens", "counter",
                        "Prompt tokens looked up in the prefix cache at admission (enable_prefix_caching)"),
                       ("prefix_cache_hit_tokens_total", "prefix_cache_hit_tokens", "counter",
                        "Of those, tokens found cached: their prefill was skipped"),
                       ("prefix_cache_evictions_total", "prefix_cache_evictions", "counter",
                        "Cached pages reused for other content"),
                       ("prefix_cache_held_requests_total", "prefix_cache_held", "counter",
                        "Requests whose admission waited for another request to compute their prompt's pages"),
                       ("kv_pages_used", "kv_pages_used", "gauge",
                        "KV cache pages held by requests (cached pages nobody holds count as free)"),
                       ("kv_pages_total", "kv_pages_total", "gauge", "KV cache pages of the replica"),
                       ("stalled_seconds", "stalled_s", "gauge",
                        "Seconds since the replica's engine loop last went round (grows only where it is wedged)"),
                       ("preemptions_total", "preemptions", "counter",
                        "Requests preempted for KV pages (kv_allocation lazy): queued again, computed again later"),
                       ("recomputed_tokens_total", "recomputed_tokens", "counter",
                        "Tokens of preempted requests computed again on readmission"),
                       ("replica_recoveries_total", "recoveries", "counter", "Times the replica's workers were rebuilt"),
                       ("max_batch_size_seen", "max_batch_size_seen", "gauge", "Largest batch in one step")]
        for metric, key, kind, help_ in per_replica:
            lines += [f"# HELP mpk_{metric} {help_}", f"# TYPE mpk_{metric} {kind}"]
            lines += [f'mpk_{metric}{{replica="{r}"}} {s.get(key, 0)}' for r, s in replica_stats.items()]
        lines += ["# HELP mpk_replica_up 1 when the replica serves", "# TYPE mpk_replica_up gauge"]
        lines += [f'mpk_replica_up{{replica="{r}"}} {0 if s.get("dead") else 1}' for r, s in replica_stats.items()]
        return "\n".join(lines) + "\n"
