"""Running the OpenAI-compatible app of cluster/server.py: in a background thread (`ServerThread`: tests,
notebooks) or as the command line (`python -m cluster.server`, `main`): the socket bound before the model loads, the
router built, the tokenizer loaded, uvicorn run until Ctrl+C."""
from __future__ import annotations

import argparse
import sys
import threading
import time

from mpk_runtime.engine.cli_flags import add_engine_flags, engine_kwargs
from .admission import MAX_REQUEST_BYTES


class ServerThread:
    """uvicorn in a background thread (tests, notebooks). `url` is ready when the constructor returns."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import socket

        import uvicorn
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = draining_server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="mpk-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.05)

    def stop(self) -> None:
        _drain(self.server.config.app)   # (as a signal would: requests in flight answered "shutting down")
        self.server.should_exit = True
        self.thread.join(10)


def _drain(app) -> None:
    drain = getattr(getattr(app, "state", None), "drain", None)
    if drain is not None:
        drain()


def draining_server(config):
    """uvicorn.Server whose exit (SIGINT / SIGTERM, or handle_exit called) first drains the app (create_app's
    app.state.drain: requests in flight aborted and answered 503 "shutting down"), so that uvicorn's graceful
    shutdown finds them answered instead of cancelling their handlers (a traceback each in the log)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            _drain(self.config.app)
            super().handle_exit(sig, frame)
    return _Server(config)


def _max_concurrent(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: give a positive number of generation requests in flight at once "
                                         "(e.g. 64), or leave the flag out for no limit")
    return n


def _positive_bytes(v: str) -> int:
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: give the largest request body to accept, in bytes (e.g. 67108864)")
    return int(v)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="OpenAI-compatible server for mpk-runtime")
    ap.add_argument("--model", required=True, help="preset name or local Hugging Face model directory")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--executor", default="inprocess", choices=["inprocess", "ray"])
    ap.add_argument("--ray-address", default=None, help="connect to this Ray cluster (default: RAY_ADDRESS or a local one)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--step-timeout", type=float, default=30.0)
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="run each replica's engine and its workers in a process of its own, so the HTTP handlers do "
                         "not share a GIL with the engine loop (engine/engine_process.py; session 66 on one H100: "
                         "+3%% tokens/s non-streaming, +13-17%% streaming for llama-3.2-1b, +8-10%% qwen3-8b). "
                         "Default: on with --executor inprocess; with --executor ray pass it to drive each replica's "
                         "actors from a process of its own (joined to the same cluster) rather than the server's")
    add_engine_flags(ap)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-concurrent-requests", type=_max_concurrent, default=None, metavar="N",
                    help="admit at most N generation requests (completions, chat; streaming or not) at once: one more "
                         "is answered 429 with Retry-After at once instead of queued (default: no limit)")
    ap.add_argument("--max-request-bytes", type=_positive_bytes, default=MAX_REQUEST_BYTES, metavar="B",
                    help="refuse a request body larger than B bytes with 413 before reading it whole (default "
                         f"{MAX_REQUEST_BYTES >> 20} MiB)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The server's command line: 0 after Ctrl+C; 2, with one line, for what the user must fix at start-up (an
    unknown --model, a bad flag value, a Ray address nobody answers, replicas the cluster cannot hold, a model
    directory whose tokenizer does not load)."""
    from .jobs.generate import user_errors_exit_2
    return user_errors_exit_2(_main, argv)


def _main(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    from mpk_runtime.engine.generation_config import sampling_defaults
    sampling_defaults(a.model, a.generation_config)   # (a bad file or flag: exit 2 before the model loads)
    sock = listen_socket(a.host, a.port)   # before the model loads (minutes at 8B), not after
    try:
        if a.executor == "ray":
            from .ray_utils import ensure_ray
            ensure_ray(a.ray_address)
        from .router import build_router
        engine_process = a.executor == "inprocess" if a.engine_process is None else a.engine_process
        router = build_router(a.model, backend=a.backend, tp=a.tp, num_replicas=a.replicas, executor=a.executor,
                              step_timeout=a.step_timeout, dtype=a.dtype, seed=a.seed, max_batch=a.max_batch,
                              max_seq_len=a.max_seq_len, engine_process=engine_process, **engine_kwargs(a))
    except BaseException:   # (a bad --model, no Ray: the port goes back at once)
        sock.close()
        raise
    try:   # the model's tokenizer now: a damaged one is a start-up error naming it (it was every request's 400)
        router.tokenizer
    except BaseException:
        sock.close()
        router.shutdown()
        raise
    import uvicorn

    from .server import create_app, served_name   # (here: server.py imports this module's names)
    try:
        app = create_app(router, a.served_model_name, a.max_concurrent_requests, a.max_request_bytes,
                         a.generation_config)
        config = uvicorn.Config(app, host=a.host, port=a.port, log_level="info")
        # (uvicorn prints its own address line only when it binds the socket itself)
        print(f"serving {served_name(a.model, a.served_model_name)} on http://{a.host}:{a.port}/v1 (Ctrl+C to stop)",
              file=sys.stderr, flush=True)
        draining_server(config).run(sockets=[sock])
    except KeyboardInterrupt:   # (uvicorn has shut the app down by then: no traceback for Ctrl+C)
        pass
    finally:
        sock.close()
        router.shutdown()
    return 0


def listen_socket(host: str, port: int):
    """The server's socket, bound to host:port; SystemExit saying what to do when it cannot be (a port in use was
    uvicorn's "address already in use" after the model had loaded)."""
    import socket
    if not 0 < port < 65536:
        raise SystemExit(f"--port {port}: give a port in 1-65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (as uvicorn: a restart reuses a TIME_WAIT port)
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror or e}. Pick another --port (or --host), or stop "
                         "the process that holds it") from None
    sock.set_inheritable(True)
    return sock
