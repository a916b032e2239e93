"""A server with ``--api-key``: every route the plugin adds refuses a missing or wrong key and
changes nothing; presets replaced with ``PUT`` under traffic with no gap; a presets file
re-read on change; the playground asking for the key. One server for the module.

The server: ``--api-key``, ``--api-server-count 2`` (every check reaches both API servers),
``--enable-steer-updates``, ``--steer-dir``, ``--steer-preset polite=detox:4`` and
``--steer-presets-file`` (polled every 0.3 s here), with the lens and playground routes
(``VLLM_PLUGINS=vllm_steer,vllm_steer_lens``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import threading
import time

import pytest
import requests

from helpers.steers import random_steer
from vllm_steer.format import save_steer

pytestmark = pytest.mark.vllm
KEY = "sk-steer-test-3f9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 504, 3458, 314, 253, 655]  # token ids
STATE: dict = {}
FILE_POLL = 0.3  # seconds (VLLM_STEER_PRESETS_FILE_POLL_SECONDS)


def write_presets(doc) -> None:
    """Replace the presets file in one step (write a sibling, rename), as operators should."""
    path = STATE["presets_file"]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from vllm_steer.server.launch import serve

    root = tmp_path_factory.mktemp("auth")
    d = root / "steers"
    d.mkdir()
    for name, seed in (("a", 11), ("b", 12)):
        save_steer(d / f"{name}.safetensors", random_steer(64, 8, name, seed=seed, scale=3.0))
    save_steer(root / "detox.safetensors", random_steer(64, 8, "detox", seed=1, scale=3.0))
    STATE.update(root=root, presets_file=root / "presets.json")
    write_presets({"presets": {"house": {"detox": 2}}})
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={root / 'detox.safetensors'}", "--steer-dir", d,
            "--enable-steer-updates", "--steer-preset", "polite=detox:4",
            "--steer-presets-file", STATE["presets_file"], "--api-key", KEY,
            "--api-server-count", 2,
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    env = {"VLLM_PLUGINS": "vllm_steer,vllm_steer_lens",
           "VLLM_STEER_PRESETS_FILE_POLL_SECONDS": str(FILE_POLL)}
    with serve(args, root / "server.log", env=env) as url:
        yield url


def call(url, method, path, body=None, headers=AUTH, **kw):
    return requests.request(method, url + path, json=body, headers=headers, timeout=120, **kw)


def complete(url, model="tiny", max_tokens=2, headers=AUTH, **body):
    return call(url, "POST", "/v1/completions",
                {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                 "ignore_eos": True, **body}, headers=headers)


def presets(url) -> dict:
    r = call(url, "GET", "/v1/steer-presets")
    assert r.status_code == 200, r.text
    return {p["name"]: (p["steer"], p["source"]) for p in r.json()["data"]}


def world(url) -> dict:
    """What a refused call must not change: the steers, the presets, the model names."""
    steers = call(url, "GET", "/v1/steers")
    models = call(url, "GET", "/v1/models")
    assert steers.status_code == models.status_code == 200, (steers.text, models.text)
    return {"steers": sorted(s["name"] for s in steers.json()["data"]),
            "presets": presets(url),
            "models": sorted(m["id"] for m in models.json()["data"])}


# Every route the plugin adds (and the OpenAI routes with a steer), as a user would call it.
ROUTES = [
    ("GET", "/v1/steers", None),
    ("POST", "/v1/steers", {"name": "b"}),
    ("DELETE", "/v1/steers/b", None),
    ("GET", "/v1/steer-presets", None),
    ("POST", "/v1/steer-presets", {"name": "evil", "steer": {"detox": 1}}),
    ("PUT", "/v1/steer-presets/kept", {"steer": {"detox": -1}}),
    ("DELETE", "/v1/steer-presets/kept", None),
    ("GET", "/v1/steer/info", None),
    ("POST", "/v1/steer/highlight", {"text": "you are kind", "steer": {"detox": 1}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                 "steer": {"detox": 3}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                 "steer": {"detox": 3}, "stream": True}),
    ("POST", "/v1/completions", {"model": "polite", "prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "house", "prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "steer": {"detox": 3},
                                      "messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/v1/models", None),
]


def test_every_route_refuses_a_missing_or_wrong_key_and_changes_nothing(server):
    assert call(server, "PUT", "/v1/steer-presets/kept",
                {"steer": {"detox": 1}}).status_code == 200
    before = world(server)
    assert before == {"steers": ["detox"],
                      "presets": {"polite": ({"detox": 4.0}, "--steer-preset"),
                                  "house": ({"detox": 2.0}, "file"),
                                  "kept": ({"detox": 1.0}, "api")},
                      "models": ["house", "kept", "polite", "tiny"]}
    for method, path, body in ROUTES + [("DELETE", "/v1/steers/detox", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong-key"},
                        {"Authorization": KEY},  # no "Bearer": refused too
                        {"Authorization": f"Basic {KEY}"}):
            r = call(server, method, path, body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert r.json() == {"error": "Unauthorized"}, (method, path, r.text)
            assert "x-vllm-steer-applied" not in r.headers
    # nothing changed: steer b not loaded, detox not unloaded, no preset added or replaced,
    # kept not deleted (read through both API servers)
    for _ in range(4):
        assert world(server) == before
    # the page and the health check are not behind the key (the page asks for it)
    assert requests.get(server + "/steer/").status_code == 200
    assert requests.get(server + "/health").status_code == 200


def test_every_route_works_with_the_key(server):
    ok = {}
    for method, path, body in ROUTES:
        r = call(server, method, path, body)
        ok[(method, path, json.dumps(body))] = r.status_code
        assert r.status_code == 200, (method, path, r.text)
        if path == "/v1/completions" and body["model"] != "tiny":
            assert r.headers["x-vllm-steer-applied"] == \
                {"polite": "detox=4", "house": "detox=2"}[body["model"]]
        if path == "/v1/completions" and body["model"] == "tiny" and not body.get("stream"):
            assert r.headers["x-vllm-steer-applied"] == "detox=3"
    # the writes took: evil added, kept replaced then deleted (b loaded, then unloaded)
    after = world(server)
    assert after["steers"] == ["detox"]
    assert after["presets"] == {"polite": ({"detox": 4.0}, "--steer-preset"),
                                "house": ({"detox": 2.0}, "file"),
                                "evil": ({"detox": 1.0}, "api")}
    assert call(server, "DELETE", "/v1/steer-presets/evil").status_code == 200


def test_a_steer_that_presets_name_is_not_unloaded_unless_its_use_can_load_it_again(server):
    """Unloading ``detox`` (a --steer file, not in --steer-dir) would make every request to
    the presets naming it fail: refused with 409 naming each and how to change it, and the
    presets keep serving. A --steer-dir steer a preset names is unloaded: its next use loads
    it again."""
    assert call(server, "PUT", "/v1/steer-presets/mild", {"steer": {"detox": 1}}).status_code \
        == 200
    r = call(server, "DELETE", "/v1/steers/detox")
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["type"] == "ConflictError" and "x-vllm-steer-applied" not in r.headers
    msg = err["message"]
    assert msg.startswith("steer 'detox' is named by --steer-preset polite (restart without "
                          "it); the presets file's preset 'house' (edit --steer-presets-file)"
                          "; the preset 'mild' (DELETE /v1/steer-presets/mild, or PUT it "
                          "without 'detox')"), msg
    assert "no file of --steer-dir" in msg
    assert "detox" in world(server)["steers"]
    for model, applied in (("polite", "detox=4"), ("mild", "detox=1")):
        got = complete(server, model=model)
        assert got.status_code == 200 and got.headers["x-vllm-steer-applied"] == applied
    # a --steer-dir steer named by a preset: unloaded, and loaded again at the preset's use
    assert call(server, "PUT", "/v1/steer-presets/mild", {"steer": {"a": 2}}).status_code == 200
    assert complete(server, model="mild").headers["x-vllm-steer-applied"] == "a=2"
    assert call(server, "DELETE", "/v1/steers/a").status_code == 200
    got = complete(server, model="mild")
    assert got.status_code == 200 and got.headers["x-vllm-steer-applied"] == "a=2"
    assert call(server, "DELETE", "/v1/steer-presets/mild").status_code == 200
    assert call(server, "DELETE", "/v1/steers/a").status_code == 200


def test_adding_a_preset_named_like_one_of_the_presets_file_says_so(server):
    r = call(server, "POST", "/v1/steer-presets", {"name": "house", "steer": {"detox": 1}})
    assert r.status_code == 400
    assert "a preset of the presets file (--steer-presets-file; edit the file to change it)" \
        in r.json()["error"]["message"], r.text


MIXES = [{"detox": 2.0}, {"detox": -3.0}, {"a": 2.0, "detox": 1.0}]
HEADERS = {"detox=2", "detox=-3", "a=2,detox=1"}  # x-vllm-steer-applied of each


def test_put_replaces_a_preset_50_times_under_traffic_with_no_gap(server):
    """Four client threads send completions with ``"model": "live"`` the whole time (one of
    them streaming) while ``PUT /v1/steer-presets/live`` switches the mix 50 times: every answer
    is 200 and is served with one of the mixes, and right after each PUT a request to either
    API server gets the new mix."""
    r = call(server, "PUT", "/v1/steer-presets/live", {"steer": MIXES[0]})
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "steer_preset", "name": "live", "steer": MIXES[0],
                        "source": "api", "replaced": None}
    stop = threading.Event()
    seen: list[tuple[int, str | None, str]] = []

    def client(i):
        while not stop.is_set():
            if i == 0:
                resp = complete(server, "live", stream=True)
                body = resp.text
            else:
                resp = complete(server, "live")
                body = resp.text
            seen.append((resp.status_code, resp.headers.get("x-vllm-steer-applied"), body))

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client, i) for i in range(4)]
        try:
            after_put = []
            for n in range(1, 51):
                mix = MIXES[n % len(MIXES)]
                r = call(server, "PUT", "/v1/steer-presets/live", {"steer": mix})
                assert r.status_code == 200, r.text
                assert r.json()["replaced"] == MIXES[(n - 1) % len(MIXES)]
                got = complete(server, "live", max_tokens=1)  # a new connection: either server
                after_put.append((got.status_code, got.headers.get("x-vllm-steer-applied"),
                                  ",".join(f"{k}={v:g}" for k, v in sorted(mix.items()))))
        finally:
            stop.set()
            for f in futures:
                f.result()
    bad = [s for s in seen if s[0] != 200 or s[1] not in HEADERS]
    assert not bad, bad[:5]
    assert len(seen) >= 20, len(seen)  # the traffic ran throughout
    assert len({s[1] for s in seen}) >= 2  # and saw the mix change
    assert all(c == 200 and got == want for c, got, want in after_put), after_put
    # the final mix's tokens are the mix's: the same as the steer field on the base model
    final = MIXES[50 % len(MIXES)]
    by_name = complete(server, "live", max_tokens=8)
    by_body = complete(server, "tiny", max_tokens=8, steer=final)
    assert by_name.json()["choices"][0]["text"] == by_body.json()["choices"][0]["text"]
    assert call(server, "DELETE", "/v1/steer-presets/live").status_code == 200


def headers_everywhere(url, model, tries=6) -> list:
    """``x-vllm-steer-applied`` of ``model`` over several new connections (both servers), or
    the HTTP status where it is refused."""
    out = []
    for _ in range(tries):
        r = complete(url, model, max_tokens=1)
        out.append(r.headers.get("x-vllm-steer-applied") if r.status_code == 200
                   else r.status_code)
    return out


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(FILE_POLL)


def test_the_presets_file_is_reread_when_it_changes(server):
    assert headers_everywhere(server, "house") == ["detox=2"] * 6
    # a run-time preset the next version of the file takes over
    assert call(server, "PUT", "/v1/steer-presets/calm",
                {"steer": {"detox": 1}}).status_code == 200
    write_presets({"presets": {"house": {"detox": -2}, "calm": "a:3"}})
    assert wait_for(lambda: headers_everywhere(server, "calm") == ["a=3"] * 6)
    assert headers_everywhere(server, "house") == ["detox=-2"] * 6
    assert presets(server) == {"polite": ({"detox": 4.0}, "--steer-preset"),
                               "house": ({"detox": -2.0}, "file"),
                               "calm": ({"a": 3.0}, "file")}
    models = {m["id"]: m for m in call(server, "GET", "/v1/models").json()["data"]}
    assert models["calm"]["steer"] == {"a": 3.0} and models["calm"]["parent"] == "tiny"
    # the file's presets cannot be replaced or deleted over HTTP
    r = call(server, "PUT", "/v1/steer-presets/house", {"steer": {"detox": 1}})
    assert r.status_code == 400 and "presets file" in r.json()["error"]["message"], r.text
    r = call(server, "DELETE", "/v1/steer-presets/house")
    assert r.status_code == 400 and "remove it from the file" in r.json()["error"]["message"]
    r = call(server, "PUT", "/v1/steer-presets/polite", {"steer": {"detox": 1}})
    assert r.status_code == 400 and "set by --steer-preset" in r.json()["error"]["message"]
    # a preset dropped from the file is gone (vLLM's 404 for an unknown model)
    write_presets({"presets": {"house": {"detox": -2}}})
    assert wait_for(lambda: headers_everywhere(server, "calm") == [404] * 6)


@pytest.mark.parametrize("doc, fragment", [
    ('{"presets": {"house": {"detox": 1}', "not valid JSON"),
    ({"presets": {"house": {"toxic": 1}}}, "unknown steer 'toxic'"),
    ({"presets": {"house": {"detox": 99}}}, "exceeds the server's maximum |strength| 50"),
    ({"presets": {"tiny": {"detox": 1}}}, "preset name 'tiny' is already the served model"),
    ({"presets": {"polite": {"detox": 1}}}, "'polite' is already a preset set by --steer"),
    ({"preset": {}}, "unknown key(s) 'preset'"),
])
def test_a_bad_presets_file_is_logged_and_the_presets_before_it_stay(server, doc, fragment):
    log = STATE["root"] / "server.log"
    size = log.stat().st_size
    write_presets(doc)

    def logged():
        text = log.read_text(errors="replace")[size:]
        return [line for line in text.splitlines() if "was not loaded" in line]

    lines = wait_for(logged)
    assert lines and fragment in lines[0], lines
    assert str(STATE["presets_file"]) in lines[0]
    assert "the presets in force before stay (house)" in lines[0]
    # served as before, on every API server
    assert headers_everywhere(server, "house") == ["detox=-2"] * 6
    assert presets(server)["house"] == ({"detox": -2.0}, "file")
    write_presets({"presets": {"house": {"detox": -2}}})  # the good version back


def test_the_page_asks_for_the_key_and_generates_with_it(server):
    """The playground on the keyed server, in headless chromium: it asks for the key, says so
    when the key is wrong, and with the right one lists the steers and generates what the API
    returns; the key is kept nowhere but in the page's memory."""
    missing = [exe for exe in ("chromium", "chromedriver") if shutil.which(exe) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select, WebDriverWait
    except ImportError:
        missing.append("selenium")
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/install.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1400,1000"):
        opts.add_argument(a)
    drv = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))

    def wait(cond, timeout=60):
        return WebDriverWait(drv, timeout).until(cond)

    def shown(id_):
        return drv.find_element(By.ID, id_).is_displayed()

    try:
        drv.get(server + "/steer/")
        wait(lambda d: shown("key-form"))
        assert "needs an API key (HTTP 401 Unauthorized)" in \
            drv.find_element(By.ID, "key-error").text
        assert drv.find_element(By.ID, "server-text").text == "API key needed"
        assert not drv.find_elements(By.ID, "sl-detox")
        drv.find_element(By.ID, "api-key").send_keys("wrong-key")
        drv.find_element(By.ID, "key-submit").click()
        wait(lambda d: "refused this API key" in d.find_element(By.ID, "key-error").text)
        assert "--api-key" in drv.find_element(By.ID, "key-error").text
        assert shown("key-form") and not drv.find_elements(By.ID, "sl-detox")
        drv.find_element(By.ID, "api-key").send_keys(KEY)
        drv.find_element(By.ID, "key-submit").click()
        wait(lambda d: d.find_elements(By.ID, "sl-detox"))
        assert not shown("key-form") and not shown("global-error")
        assert "tiny" in drv.find_element(By.ID, "server-text").text
        # the presets of every source are listed (read from /v1/models with the key)
        options = [o.get_attribute("value") for o in
                   Select(drv.find_element(By.ID, "preset-select")).options][1:]
        assert sorted(options) == ["house", "polite"]
        for id_, value in (("prompt", "Once upon a time"), ("max-tokens", 4),
                           ("temperature", 0), ("num-detox", 3)):
            e = drv.find_element(By.ID, id_)
            e.clear()
            e.send_keys(str(value))
        Select(drv.find_element(By.ID, "layout")).select_by_value("single")
        drv.find_element(By.ID, "generate").click()
        cols = wait(lambda d: (lambda c: c if len(c) == 2 and all(
            "finished" in x["classes"] or "failed" in x["classes"] for x in c) else False)(
            d.execute_script("return Array.from(document.querySelectorAll('#columns .column'),"
                             " c => ({classes: c.className, error: c.querySelector("
                             "'[data-role=error]').textContent, text: c.querySelector("
                             "'[data-role=output]').textContent, request: c.querySelector("
                             "'details.req pre').textContent}))")))
        assert [c["error"] for c in cols] == ["", ""]
        assert all("finished" in c["classes"] for c in cols)
        with cf.ThreadPoolExecutor(2) as pool:  # the same batch as the page's two requests
            api = list(pool.map(lambda st: requests.post(
                server + "/v1/completions", headers=AUTH, json={
                    "model": "tiny", "prompt": "Once upon a time", "max_tokens": 4,
                    "temperature": 0, "seed": 0, **({"steer": st} if st else {})}).json()
                ["choices"][0]["text"], [None, {"detox": 3}]))
        assert [c["text"] for c in cols] == api
        # the request a column shows reads the key from the shell: the key is not in the page
        assert all('-H "Authorization: Bearer $VLLM_API_KEY"' in c["request"] for c in cols)
        assert KEY not in drv.page_source
        assert drv.execute_script("return [localStorage.length, sessionStorage.length, "
                                  "document.cookie]") == [0, 0, ""]
        assert drv.get_cookies() == []
        # a reload forgets the key
        drv.get(server + "/steer/")
        wait(lambda d: shown("key-form"))
    finally:
        drv.quit()


def test_the_server_log_shows_the_file_loads(server):
    log = (STATE["root"] / "server.log").read_text(errors="replace")
    assert re.search(r"vllm-steer: presets file \S+presets\.json loaded: 2 preset\(s\) "
                     r"\(added calm; changed house; taken over from the run-time presets calm\)",
                     log), log[-3000:]
