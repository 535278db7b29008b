"""Review 76 (the Ray layer as a user meets it): a RAY_ADDRESS that names the dashboard's port, and placement groups
left holding GPUs by an executor dropped without shutdown(), a Ctrl+C during the placement wait or a failed start."""
import gc
import http.server
import socket
import threading
import time

import pytest

# the HTTP/2 SETTINGS frame a gRPC server (Ray's GCS) sends as soon as it accepts a connection
GRPC_SETTINGS = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"


def _serve(handler) -> tuple[int, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def run():
        with srv:
            conn, _ = srv.accept()
            with conn:
                handler(conn)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def test_ray_address_of_the_dashboard_is_refused_at_once():
    """RAY_ADDRESS=HEAD:8265 (the dashboard / Job API's port, as submit.py's --address names it, without http://):
    the port is open, so the "nobody answers" check passed and ray.init retried "Failed to get cluster ID from GCS"
    for good (the job, the server and LLM(executor="ray") hung; still retrying after 10 minutes here)."""
    from cluster.ray_utils import check_gcs_reachable

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
    httpd = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="HTTP server.*dashboard.*HEAD_IP:6379"):
            check_gcs_reachable(f"127.0.0.1:{httpd.server_address[1]}")
        assert time.monotonic() - t0 < 10
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_grpc_server_that_speaks_first_passes():
    """A GCS (gRPC) sends its SETTINGS frame at once: nothing is sent to it, and the check passes."""
    from cluster.ray_utils import check_gcs_reachable
    got = []

    def grpc_like(conn):
        conn.sendall(GRPC_SETTINGS)
        conn.settimeout(2)
        try:
            got.append(conn.recv(64))
        except OSError:
            got.append(b"")
    port, t = _serve(grpc_like)
    check_gcs_reachable(f"127.0.0.1:{port}")
    t.join(5)
    assert got == [b""]   # (closed without a request)


def test_real_gcs_passes_the_check(ray_local):
    from cluster.ray_utils import check_gcs_reachable
    check_gcs_reachable(ray_local.get_runtime_context().gcs_address)


def _pg_states(name_part: str) -> list[str]:
    from ray.util.placement_group import placement_group_table
    return [v["state"] for v in placement_group_table().values() if name_part in (v.get("name") or "")]


def _wait_removed(name_part: str, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        states = _pg_states(name_part)
        if all(s == "REMOVED" for s in states) or time.monotonic() > deadline:
            return states


def test_an_executor_dropped_without_shutdown_gives_its_gpus_back(ray_local):
    """`llm = LLM(..., executor="ray", tp=2)` rebound or deleted without shutdown(): Ray killed the actors with their
    last handle, but the placement group stayed CREATED, holding both GPUs for the driver's life, and the next LLM
    waited placement_timeout for a PlacementError blaming "other replicas or jobs"."""
    from cluster.ray_executor import RayExecutor
    ex = RayExecutor(2, name="r76-dropped")
    assert _pg_states("r76-dropped") == ["CREATED"]
    del ex
    gc.collect()
    assert _wait_removed("r76-dropped") == ["REMOVED"]
    deadline = time.monotonic() + 10
    while ray_local.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("GPU", 0) == 2


def test_ctrl_c_while_waiting_for_placement_leaves_no_pending_group(ray_local, monkeypatch):
    """A Ctrl+C (KeyboardInterrupt) during the placement wait skipped the group's removal (`except Exception`): the
    group stayed PENDING in the driver (a notebook) and took the GPUs as soon as they were freed."""
    from cluster.ray_executor import RayExecutor
    real_get = ray_local.get

    def get(refs, *a, timeout=None, **kw):
        if timeout == 7.25:   # (the placement wait: placement_timeout below)
            raise KeyboardInterrupt
        return real_get(refs, *a, timeout=timeout, **kw)
    monkeypatch.setattr(ray_local, "get", get)
    with pytest.raises(KeyboardInterrupt):
        RayExecutor(2, name="r76-interrupted", placement_timeout=7.25)
    monkeypatch.undo()
    assert _wait_removed("r76-interrupted") == ["REMOVED"]


def test_a_failed_actor_start_gives_the_group_back(ray_local, monkeypatch):
    from cluster.ray_executor import RayExecutor

    def boom(self):
        raise ValueError("bad runtime_env")
    monkeypatch.setattr(RayExecutor, "_start_actors", boom)
    with pytest.raises(ValueError, match="bad runtime_env"):
        RayExecutor(2, name="r76-failed-start")
    assert _wait_removed("r76-failed-start") == ["REMOVED"]
