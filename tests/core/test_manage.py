"""``vllm-steer steers ...`` and ``vllm-steer presets ...`` against a stand-in HTTP server
that answers like vllm-steer's routes (the real routes: tests/e2e/test_vllm_steer_updates.py)
and records what the client sent."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from vllm_steer.cli import main

PRESETS = {"object": "list",
           "data": [{"name": "polite", "steer": {"detox": 4.0}, "source": "--steer-preset"},
                    {"name": "kind", "steer": {"detox": 4.0, "sentiment": -2.0},
                     "source": "api"}],
           "defaults": {"detox": 2.0}, "floors": {}, "updates_enabled": True}
STEERS = {"object": "list", "max_steers": 8, "steer_dir": None,
          "data": [{"name": "detox", "rank": 16, "hidden_size": 576, "source": "--steer",
                    "load_id": 1, "requests_served": 3, "file": "/s/detox.safetensors"}]}


@pytest.fixture
def server():
    """(url, requests seen); answers GET/POST/DELETE on the steers and presets routes."""
    seen: list[tuple[str, str, object]] = []

    class H(http.server.BaseHTTPRequestHandler):
        def _answer(self, status, body):
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _body(self):
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n)) if n else None

        def do_GET(self):
            seen.append(("GET", self.path, None))
            self._answer(200, {"/v1/steer-presets": PRESETS, "/v1/steers": STEERS}[self.path])

        def do_POST(self):
            body = self._body()
            seen.append(("POST", self.path, body))
            if self.path == "/v1/steer-presets":
                if body["name"] == "tiny":
                    return self._answer(400, {"error": {"message": "the name 'tiny' is the "
                                                        "served model name"}})
                return self._answer(200, {"object": "steer_preset", "name": body["name"],
                                          "steer": {"detox": 4.0, "sentiment": -2.0},
                                          "source": "api"})
            self._answer(200, {"object": "steer", "name": body["name"], "rank": 16,
                               "load_id": 2, "file": body.get("path"), "evicted": None})

        def do_DELETE(self):
            seen.append(("DELETE", self.path, None))
            name = self.path.rsplit("/", 1)[1]
            if name == "gone":
                return self._answer(404, {"error": {"message": "no run-time preset 'gone'; "
                                                    "run-time presets: kind"}})
            self._answer(200, {"object": "steer_preset", "deleted": True, "name": name})

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()


def test_presets_list_add_delete(server, capsys):
    url, seen = server
    assert main(["presets", "list", "--url", url]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[0].split() == ["name", "steer", "source"]
    assert out[1].split() == ["polite", "detox:4", "--steer-preset"]
    assert out[2].split() == ["kind", "detox:4,sentiment:-2", "api"]
    assert out[3] == "2 preset(s); defaults detox:2"

    assert main(["presets", "add", "kind", "detox:4,sentiment:-2", "--url", url]) == 0
    assert seen[-1] == ("POST", "/v1/steer-presets",
                        {"name": "kind", "steer": "detox:4,sentiment:-2"})
    assert "added preset kind (detox:4,sentiment:-2)" in capsys.readouterr().out

    assert main(["presets", "delete", "kind", "--url", url, "--json"]) == 0
    assert seen[-1] == ("DELETE", "/v1/steer-presets/kind", None)
    assert json.loads(capsys.readouterr().out)["deleted"] is True


def test_presets_errors_name_the_servers_reason(server, capsys):
    url, _ = server
    assert main(["presets", "add", "tiny", "detox:4", "--url", url]) == 1
    assert "HTTP 400: the name 'tiny' is the served model name" in capsys.readouterr().err
    assert main(["presets", "delete", "gone", "--url", url]) == 1
    assert "HTTP 404: no run-time preset 'gone'" in capsys.readouterr().err


def test_steers_list_load_unload(server, capsys, tmp_path):
    url, seen = server
    assert main(["steers", "list", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "detox" in out and "1 of 8 steer slots used" in out
    f = tmp_path / "formal.safetensors"
    f.write_bytes(b"x")
    assert main(["steers", "load", "formal", str(f), "--url", url]) == 0
    assert seen[-1] == ("POST", "/v1/steers", {"name": "formal", "path": str(f)})
    assert main(["steers", "unload", "formal", "--url", url]) == 0
    assert seen[-1] == ("DELETE", "/v1/steers/formal", None)


def test_steers_load_sends_a_relative_path_as_given(server, capsys, tmp_path, monkeypatch):
    """The path names a file on the server (a relative one inside its --steer-dir), so a
    same-named file in the client's working directory must not turn it into the client's
    absolute path."""
    url, seen = server
    monkeypatch.chdir(tmp_path)
    (tmp_path / "formal.safetensors").write_bytes(b"x")  # exists here, on the client
    assert main(["steers", "load", "formal", "formal.safetensors", "--url", url]) == 0
    assert seen[-1] == ("POST", "/v1/steers", {"name": "formal", "path": "formal.safetensors"})
    assert "from formal.safetensors" in capsys.readouterr().out
    assert main(["steers", "load", "formal", "sub/other.safetensors", "--url", url]) == 0
    assert seen[-1] == ("POST", "/v1/steers",
                        {"name": "formal", "path": "sub/other.safetensors"})


def test_an_unreachable_server_is_named(capsys):
    assert main(["presets", "list", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://localhost:8000", "http://"])
def test_a_url_without_http_scheme_is_a_usage_error_naming_it(url, capsys):
    """`--url localhost:8000` is refused at parse time (exit 2) naming the value and the fix,
    not sent to the HTTP library (``No connection adapters were found``)."""
    with pytest.raises(SystemExit) as e:
        main(["steers", "list", "--url", url])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert repr(url) in err and "http://" in err
