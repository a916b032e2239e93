"""``POST /v1/steers`` and ``DELETE /v1/steers/NAME`` on vLLM's own app: which file a path
names, which paths are refused before the engine, and a server with no engine behind it.

The engine client is a recorder (no engine starts); what reached it is what would be loaded.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from helpers.vllm_app import vllm_app
from vllm_steer.integrations.frontend.state import frontend_state


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    steer_dir = root / "steers"
    (steer_dir / "sub").mkdir(parents=True)
    (steer_dir / "a.safetensors").write_bytes(b"")  # read by the (recording) engine only
    (root / "outside.safetensors").write_bytes(b"")
    return root, steer_dir


@pytest.fixture(scope="module")
def app(dirs):
    old = frontend_state().config
    with mock.patch.dict(os.environ):
        for k in ("VLLM_API_KEY", "VLLM_STEER_ADMIN_KEY"):
            os.environ.pop(k, None)
        client, engine, _ = vllm_app(["tiny", "--steer-dir", str(dirs[1]),
                                      "--enable-steer-updates"], {})
        yield client, engine
    frontend_state().reset(old)
    frontend_state().set_engine(None)


def _loads(engine) -> list[str]:
    return [op for op in engine.changes() if op == "load"]


def test_a_relative_path_is_the_file_inside_the_steer_dir(app, dirs, monkeypatch):
    client, engine = app
    monkeypatch.chdir(dirs[0])  # the server's working directory is not --steer-dir
    r = client.post("/v1/steers", json={"name": "x", "path": "a.safetensors"})
    assert r.status_code == 200, r.text
    assert r.json()["path"] == str(dirs[1] / "a.safetensors")


@pytest.mark.parametrize("path", ["../outside.safetensors", "sub/../../outside.safetensors"])
def test_a_relative_path_leaving_the_steer_dir_is_403_whatever_the_working_directory(
        app, dirs, monkeypatch, path):
    """Checked where it is loaded: from ``steers/sub`` the path ``../outside.safetensors``
    would name a file inside ``--steer-dir``, but the file loaded is ``--steer-dir``'s
    ``../outside.safetensors``, outside it."""
    client, engine = app
    before = _loads(engine)
    monkeypatch.chdir(dirs[1] / "sub")
    r = client.post("/v1/steers", json={"name": "x", "path": path})
    assert r.status_code == 403, r.text
    assert "inside --steer-dir" in r.json()["error"]["message"]
    assert _loads(engine) == before


def test_without_an_engine_the_management_routes_are_503(app):
    client, engine = app
    client.app.state.vllm_steer_engine_client = None
    before = engine.changes()
    for method, path, body in (("POST", "/v1/steers", {"name": "a"}),
                               ("DELETE", "/v1/steers/a", None)):
        r = client.request(method, path, json=body)
        assert r.status_code == 503, (method, r.text)
        assert "no engine" in r.json()["error"]["message"]
    client.app.state.vllm_steer_engine_client = engine
    assert engine.changes() == before
