"""`vllm_steer.server.launch.serve`: start, wait for /health, stop; errors carry the log.

A stand-in `vllm` script plays the server (the real one: test_vllm_server, demo, bench_serve).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import requests

from vllm_steer.server import launch


def fake_vllm(tmp_path, monkeypatch, body: str):
    exe = tmp_path / "vllm"
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    exe.chmod(0o755)
    monkeypatch.setattr(launch, "vllm_executable", lambda: str(exe))


def test_serves_until_the_block_ends_then_stops(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch, """
        import http.server, os, sys
        port = int(sys.argv[sys.argv.index("--port") + 1])
        assert sys.argv[1:3] == ["serve", "MODEL"] and os.environ["X_TEST"] == "1"
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        print("listening", flush=True)
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)
    waited = []
    with launch.serve(["MODEL"], tmp_path / "log", env={"X_TEST": "1"},
                      on_wait=waited.append) as url:
        assert requests.get(url + "/health", timeout=5).status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=5)  # stopped with the block
    assert "listening" in (tmp_path / "log").read_text()


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch, """
        import sys
        print("error: bad steer file /x.safetensors")
        sys.exit(3)
    """)
    with pytest.raises(launch.ServerStartError, match=r"(?s)exited with code 3.*bad steer file"):
        with launch.serve(["MODEL"], tmp_path / "log"):
            pytest.fail("the block must not run")


def test_a_server_that_never_answers_times_out_and_is_killed(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch, """
        import time
        print("loading...", flush=True)
        time.sleep(600)
    """)
    with pytest.raises(launch.ServerStartError, match=r"(?s)within 2 s.*loading"):
        with launch.serve(["MODEL"], tmp_path / "log", timeout=2):
            pass


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tmp_path, monkeypatch):
    """Another process may bind the chosen port first: the server starts on a fresh one."""
    fake_vllm(tmp_path, monkeypatch, """
        import http.server, sys
        port = int(sys.argv[sys.argv.index("--port") + 1])
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], launch.free_port()])
    monkeypatch.setattr(launch, "free_port", lambda: next(ports))
    try:
        with launch.serve(["MODEL"], tmp_path / "log") as url:
            assert requests.get(url + "/health", timeout=5).status_code == 200
            assert not url.endswith(f":{taken.getsockname()[1]}")
    finally:
        taken.close()


def test_a_port_the_caller_chose_is_not_replaced_when_taken(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch, """
        import socket, sys
        port = int(sys.argv[sys.argv.index("--port") + 1])
        socket.socket().bind(("127.0.0.1", port))
    """)
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(launch.ServerStartError, match=f"port {port} is in use"):
            with launch.serve(["MODEL"], tmp_path / "log", port=port):
                pytest.fail("the block must not run")


def test_free_ports_are_outside_the_kernels_ephemeral_range():
    assert all(20000 <= launch.free_port() < 32768 for _ in range(20))
