"""The steer admin key (``--steer-admin-key`` / ``VLLM_STEER_ADMIN_KEY``) on vLLM's own app.

vLLM's ``build_app`` builds the API server's app from ``vllm serve``'s parsed arguments (the
plugin's flags included, and the plugin's ``from_cli_args`` hook run on them as at start-up):
vLLM's routes, its ``--api-key`` check, and the plugin's routes. No engine starts: the engine
client behind the routes is a recorder that answers the management ops as an engine core does
and remembers which reached it. Each management route is called with no key, an API key (an
inference key), a wrong key and the admin key; a refused call must not reach the engine.

Also measured here: which of vLLM's routes ``--api-key`` leaves open (docs/serving.md lists
them).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from helpers.vllm_app import vllm_app
from vllm_steer.integrations.frontend.state import frontend_state

INFERENCE, ADMIN, WRONG = "inference-key", "admin-key", "wrong-key"
# (method, path, JSON body, the words of the 401 / 403 message)
ROUTES = [("POST", "/v1/steers", {"name": "detox"}, "load steers"),
          ("DELETE", "/v1/steers/detox", None, "unload steers"),
          ("POST", "/v1/steer-presets", {"name": "polite", "steer": {"detox": 4}},
           "add presets"),
          ("PUT", "/v1/steer-presets/polite", {"steer": {"detox": 2}}, "replace presets"),
          ("DELETE", "/v1/steer-presets/polite", None, "delete presets")]
OPS = {"/v1/steers": "load", "/v1/steers/detox": "unload", "/v1/steer-presets": "preset_add",
       "/v1/steer-presets/polite": "preset_add"}


@pytest.fixture(scope="module")
def steer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("steers")
    (d / "detox.safetensors").write_bytes(b"")  # listed only: the engine is a recorder
    return str(d)


@pytest.fixture(scope="module")
def restore_state():
    old = frontend_state().config
    yield
    frontend_state().reset(old)
    frontend_state().set_engine(None)


def _server(steer_dir, extra, env):
    return vllm_app(["tiny", "--steer-dir", steer_dir, "--enable-steer-updates", *extra], env)


@pytest.fixture(scope="module")
def env_clean():
    """No key in this process's environment, whatever the caller's is."""
    with mock.patch.dict(os.environ):
        for k in ("VLLM_API_KEY", "VLLM_STEER_ADMIN_KEY"):
            os.environ.pop(k, None)
        yield


def _call(client, method, path, body, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.request(method, path, json=body, headers=headers)


def _check_route_by_key(client, engine, method, path, body, what, wrong_status):
    """The route with no key, the API key, a wrong key: refused before the engine; with the
    admin key: served by it."""
    for key, status in ((None, 401), (INFERENCE, 403), (WRONG, wrong_status)):
        before = list(engine.changes())
        r = _call(client, method, path, body, key)
        assert r.status_code == status, (method, path, key, r.status_code, r.text)
        if status in (401, 403) and "error" in r.json() and isinstance(r.json()["error"], dict):
            msg = r.json()["error"]["message"]
            assert what in msg and "--steer-admin-key" in msg, msg
            if key == INFERENCE:
                assert "API key" in msg and "may send requests but not" in msg, msg
        assert engine.changes() == before, f"{method} {path} with {key} reached the engine"
    r = _call(client, method, path, body, ADMIN)
    assert r.status_code == 200, (method, path, r.text)
    assert engine.changes()[-1] == ("preset_delete" if method == "DELETE" and "preset" in path
                                    else OPS[path])


@pytest.mark.parametrize("flag_or_env", ["flag", "env"])
def test_with_api_keys_only_the_admin_key_changes_steers_and_presets(steer_dir, restore_state,
                                                                     env_clean, flag_or_env):
    """``--api-key`` (vLLM checks every /v1 route) and an admin key, given as the flag or as
    the environment variable: per route, no key 401 (vLLM's check), the API key 403, a wrong
    key 401 (vLLM's check), the admin key 200; the API key still serves the read routes."""
    if flag_or_env == "flag":
        client, engine, args = _server(steer_dir, ["--api-key", INFERENCE,
                                                   "--steer-admin-key", ADMIN], {})
    else:
        client, engine, args = _server(steer_dir, [], {"VLLM_API_KEY": INFERENCE,
                                                       "VLLM_STEER_ADMIN_KEY": ADMIN})
        os.environ["VLLM_STEER_ADMIN_KEY"] = ADMIN  # the route reads it as the server does
    try:
        # vLLM's check takes both keys; the admin key hidden from vLLM's argument log
        assert list(args.api_key) == [INFERENCE, ADMIN]
        assert "admin-key" not in repr(vars(args))
        for method, path, body, what in ROUTES:
            _check_route_by_key(client, engine, method, path, body, what, 401)
        for key in (INFERENCE, ADMIN):  # the read routes: both keys
            for path in ("/v1/steers", "/v1/steer-presets"):
                assert _call(client, "GET", path, None, key).status_code == 200, (path, key)
            assert _call(client, "GET", "/v1/steers", None, None).status_code == 401
    finally:
        os.environ.pop("VLLM_STEER_ADMIN_KEY", None)


def test_without_api_keys_the_admin_key_still_guards_the_management_routes(
        steer_dir, restore_state, env_clean):
    """No ``--api-key`` (vLLM checks nothing) and ``VLLM_STEER_ADMIN_KEY``: the management
    routes need the admin key all the same (any other key: 401), everything else stays open."""
    client, engine, args = _server(steer_dir, [], {"VLLM_STEER_ADMIN_KEY": ADMIN})
    os.environ["VLLM_STEER_ADMIN_KEY"] = ADMIN
    try:
        assert args.api_key is None  # vLLM's check stays off: nothing to add the key to
        for method, path, body, what in ROUTES:
            for key in (None, INFERENCE, WRONG):
                before = list(engine.changes())
                r = _call(client, method, path, body, key)
                assert r.status_code == 401, (method, path, key, r.text)
                assert what in r.json()["error"]["message"]
                assert engine.changes() == before
            assert _call(client, method, path, body, ADMIN).status_code == 200, (method, path)
        assert _call(client, "GET", "/v1/steers", None, None).status_code == 200
    finally:
        os.environ.pop("VLLM_STEER_ADMIN_KEY", None)


def test_without_an_admin_key_the_api_key_manages_as_before(steer_dir, restore_state,
                                                            env_clean):
    client, engine, args = _server(steer_dir, ["--api-key", INFERENCE], {})
    assert list(args.api_key) == [INFERENCE]
    for method, path, body, _ in ROUTES:
        assert _call(client, method, path, body, None).status_code == 401  # vLLM's check
        r = _call(client, method, path, body, INFERENCE)
        assert r.status_code == 200, (method, path, r.text)
    assert engine.changes() == ["load", "unload", "preset_add", "preset_add", "preset_delete"]


def test_an_admin_key_equal_to_an_api_key_is_refused_at_start_up(steer_dir, env_clean):
    with pytest.raises(ValueError, match="give the admin key a value of its own"):
        _server(steer_dir, ["--api-key", INFERENCE, "--steer-admin-key", INFERENCE], {})
    frontend_state().reset(None)


def test_every_state_changing_steer_route_is_guarded():
    """The routers' write routes are exactly the ones the admin key guards (a new one must be
    added to ADMIN_ROUTES and to this test's ROUTES)."""
    from vllm_steer.server import admin, lens_route, playground, presets_route, steers_route

    writes = {(m, r.path) for router in (steers_route.router, presets_route.router)
              for r in router.routes for m in r.methods if m not in ("GET", "HEAD")}
    assert writes == set(admin.ADMIN_ROUTES)
    assert {(m, p.replace("detox", "{name}").replace("polite", "{name}"))
            for m, p, _, _ in ROUTES} == set(admin.ADMIN_ROUTES)
    # the lens (a request, like a completion) and the playground change nothing
    others = {(m, r.path) for router in (lens_route.router, playground.router)
              for r in router.routes for m in r.methods if m not in ("GET", "HEAD")}
    assert others == {("POST", "/v1/steer/highlight")}


#: vLLM's routes that answer without the key when ``--api-key`` is set (vLLM 0.32, the
#: "generate" task, no dev mode): docs/serving.md lists them.
OPEN_WITH_API_KEY = {"/health", "/metrics", "/ping", "/version", "/load", "/tokenize",
                     "/detokenize", "/invocations", "/generative_scoring", "/scale_elastic_ep",
                     "/is_scaling_elastic_ep", "/kv_event_sources", "/openapi.json", "/docs",
                     "/docs/oauth2-redirect", "/redoc"}


def test_which_vllm_routes_the_api_key_leaves_open(steer_dir, restore_state, env_clean):
    """Every route of the app, called without a key: vLLM's check answers 401 on the /v1,
    /v2, /inference and /cohere ones, and lets the others through (they answer, or refuse the
    made-up body, but not 401). The open ones are the list docs/serving.md gives."""
    client, _, _ = _server(steer_dir, ["--api-key", INFERENCE], {})
    paths = {r.path for r in client.app.routes if hasattr(r, "methods")}
    guarded = {p for p in paths if p.startswith(("/v1", "/v2", "/inference", "/cohere"))}
    assert "/inference/v1/generate" in guarded and "/v1/steers" in guarded
    assert paths - guarded == OPEN_WITH_API_KEY
    for r in client.app.routes:
        if hasattr(r, "methods") and "{" not in r.path and r.path in guarded:
            method = sorted(r.methods - {"HEAD"})[0]
            assert client.request(method, r.path).status_code == 401, r.path
    # /invocations (SageMaker's entry point) reaches the completions handler without a key:
    # it refuses the made-up body for what it is, not for the missing key
    r = client.post("/invocations", json={"prompt": "hi"})
    assert r.status_code != 401, r.text



def test_the_command_line_client_names_the_key_on_vllms_401(steer_dir, restore_state,
                                                            env_clean, monkeypatch, capsys):
    """``vllm-steer steers|presets ...`` against a server with ``--api-key`` and no key given:
    vLLM's own 401 (its body's ``error`` is a string) is said in one line naming the flag to
    give, not a traceback; with the key the command works."""
    import requests

    from vllm_steer.cli import main

    client, engine, _ = _server(steer_dir, ["--api-key", INFERENCE], {})

    def through_app(method, url, json=None, headers=None, timeout=None):
        return client.request(method, url.replace("http://srv", ""), json=json,
                              headers=headers)

    monkeypatch.setattr(requests, "request", through_app)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for argv in (["steers", "list"], ["presets", "delete", "polite"]):
        assert main([*argv, "--url", "http://srv"]) == 1
        err = capsys.readouterr().err
        assert "HTTP 401: Unauthorized; give the server's key with --api-key" in err, err
        assert "Traceback" not in err
    assert main(["steers", "list", "--url", "http://srv", "--api-key", INFERENCE]) == 0
