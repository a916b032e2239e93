"""The playground page (``/steer/``) in Debian's headless chromium, against a real `vllm serve`.

One server (tiny random Llama, two random steers, max |strength| 20) and one browser for the
module (tests marked ``vllm``). They skip cleanly when chromium / chromedriver / selenium are
missing (scripts/install.sh installs them). What is asserted is what the user sees in the
page, compared with what the server's API returns for the same requests. The first tests
check the routes' own logic without a server.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import requests

from helpers.models import make_tiny_llama
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.server.launch import serve

STATIC = Path(__file__).resolve().parents[2] / "vllm_steer" / "server" / "static"
MAX_TOKENS = 8
WAIT = 60  # seconds for a page update (generation on a loaded 2-core CPU)


def _browser_missing() -> str | None:
    for exe, pkg in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(exe) is None:
            return (f"{exe} not found: the browser test needs Debian's {pkg} "
                    f"(scripts/install.sh installs it as root: apt-get install {pkg})")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e .[test])"
    return None


MISSING = _browser_missing()
# presets served as model names (--steer-preset; issue 24, the presets branch)
HAS_PRESETS = ("presets" in
               __import__("vllm_steer.config").config.SteerServerConfig.__dataclass_fields__)
browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def model_without_eos(out):
    """The tiny random model with its end-of-sequence row of the LM head zeroed: the EOS logit
    is 0 whatever the hidden state, far below the largest of 49,151 random logits, so every
    completion runs to max_tokens. Greedy texts from a random model can still differ
    between batches of different composition where two logits nearly tie; an EOS on one side
    of such a tie ended a column early (seen once in `make test`; a column one token short is
    also what the test's old, non-atomic read of a streaming column gave: see `columns`)."""
    from safetensors.torch import load_file, save_file

    make_tiny_llama(out)
    f = out / "model.safetensors"
    w = load_file(f)
    w["lm_head.weight"][2] = 0.0  # eos_token_id = 2
    save_file(w, f, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("playground")
    tiny_model_dir = model_without_eos(d / "model")
    for name, seed, rec in (("detox", 1, 5.0), ("sentiment", 2, None)):
        steer = random_steer(64, 8, name, seed=seed, scale=3.0)
        steer.metadata.recommended_strength = rec
        steer.metadata.labels = {"positive": f"more {name}", "negative": f"less {name}"}
        if name == "detox":  # as the shipped detox steer: its negative side makes text toxic
            steer.metadata.labels["harmful"] = "negative"
        save_steer(d / f"{name}.safetensors", steer)
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={d / 'detox.safetensors'}",
            "--steer", f"sentiment={d / 'sentiment.safetensors'}",
            "--steer-max-strength", "20",
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
            "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    if HAS_PRESETS:
        args += ["--steer-preset", "polite=detox:4,sentiment:-2"]
    with serve(args, d / "server.log", env={"VLLM_PLUGINS": "vllm_steer,vllm_steer_lens"}) as url:
        yield url


@pytest.fixture(scope="module")
def driver(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1400,1000", "--force-prefers-reduced-motion"):
        opts.add_argument(a)
    drv = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture()
def page(driver, server):
    """The playground freshly loaded, its steers listed."""
    from selenium.webdriver.common.by import By

    driver.get(server + "/steer/")
    wait(driver, lambda d: d.find_elements(By.ID, "sl-detox"))
    return driver


# ------------------------------------------------------------ without a server

def test_static_files_fetch_nothing_from_outside():
    names = sorted(f.name for f in STATIC.iterdir())
    assert names == ["index.html", "playground.css", "playground.js"]
    for f in STATIC.iterdir():  # no CDN, no web font, no absolute URL at all
        text = f.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), f.name
        assert "@import" not in text and "url(" not in text, f.name
    html = (STATIC / "index.html").read_text()
    assert re.findall(r'(?:src|href)="([^"]+)"', html) == ["data:,", "playground.css",
                                                          "playground.js"]


def test_only_the_pages_files_are_served():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_steer.server.playground import router

    app = FastAPI()
    app.include_router(router)
    c = TestClient(app)
    for name, ctype in (("", "text/html"), ("playground.js", "text/javascript"),
                        ("playground.css", "text/css")):
        r = c.get("/steer/" + name)
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype)
        assert r.text == (STATIC / (name or "index.html")).read_text()
        assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert c.get("/steer", follow_redirects=False).headers["location"] == "/steer/"
    for name in ("secret.txt", "..%2F..%2Fplayground.py", "static/index.html", "static/"):
        r = c.get("/steer/" + name)
        assert r.status_code == 404 and "no playground file" in r.text, name
    assert c.get("/steer/../lens_route.py").status_code == 404


def test_info_lists_each_steer_with_its_metadata(tmp_path):
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.server.playground import info_dict

    steer = random_steer(64, 8, "toxicity", seed=1)
    steer.metadata.recommended_strength = 4.0
    steer.metadata.labels = {"positive": "polite", "negative": "rude"}
    steer.metadata.data = {"files": {"/secret/train.csv": {}}}
    steer.metadata.metrics = {"dev_loss": 1.5, "history": [1, 2, 3]}
    save_steer(tmp_path / "t.safetensors", steer)
    cfg = SteerServerConfig(steers={"detox": str(tmp_path / "t.safetensors"),
                                    "gone": str(tmp_path / "gone.safetensors")},
                            max_strength=20)
    info = info_dict(cfg, "tiny")
    assert (info["model"], info["max_strength"]) == ("tiny", 20.0)
    detox, gone = info["steers"]
    assert (detox["name"], detox["name_in_file"], detox["file"]) == \
        ("detox", "toxicity", "t.safetensors")
    assert (detox["recommended_strength"], detox["labels"], detox["rank"],
            detox["hidden_size"]) == (4.0, {"positive": "polite", "negative": "rude"}, 8, 64)
    assert detox["metrics"] == {"dev_loss": 1.5} and "data" not in detox
    assert gone["name"] == "gone" and "gone.safetensors" in gone["error"]
    assert info_dict(None, "tiny") == {"model": "tiny", "max_strength": 50.0, "steers": [],
                                       "presets": []}


# ------------------------------------------------------------ in chromium, against vllm serve

def wait(driver, cond, timeout=WAIT):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(cond)


def api_completion(server, steer=None, prompt="Once upon a time", seed=0, temperature=0.0,
                   model="tiny"):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "seed": seed,
            "temperature": temperature}
    if steer:
        body["steer"] = steer
    r = requests.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def set_field(driver, id_, value):
    from selenium.webdriver.common.by import By

    e = driver.find_element(By.ID, id_)
    e.clear()
    e.send_keys(str(value))


# One snapshot of every column, taken by one script in the page: the page's JavaScript runs
# to completion between two events, so no streamed delta can land between reading a column's
# text and its classes. (Reading them with one WebDriver call each, as this test once did,
# let a column's last delta and its "finished" class both arrive between the two reads: the
# text was one token short yet the column counted as finished.)
COLUMNS_JS = """
return Array.from(document.querySelectorAll('#columns .column:not(.withheld)'), (col) => ({
  title: col.querySelector('h2').textContent,
  steer: col.getAttribute('data-steer'),
  text: col.querySelector('[data-role=output]').textContent,
  error: col.querySelector('[data-role=error]').textContent,
  classes: col.className,
  request: col.querySelector('details.req pre').textContent,
}));
"""


def columns(driver):
    out = []
    for col in driver.execute_script(COLUMNS_JS):
        out.append({
            "title": col["title"].strip(),
            "steer": json.loads(col["steer"] or "null"),
            "text": col["text"],
            "error": col["error"],
            "classes": col["classes"].split(),
            # the request the column shows as a curl command (details > pre)
            "request": json.loads(re.search(r"-d '(.*)'$", col["request"], re.S)[1]),
        })
    return out


def withheld(driver) -> list[dict]:
    """The columns the page did not generate (a side a steer file marks harmful)."""
    return driver.execute_script("""
return Array.from(document.querySelectorAll('#columns .column.withheld'), (col) => ({
  title: col.querySelector('h2').textContent, steer: JSON.parse(col.getAttribute('data-steer')),
  why: col.querySelector('[data-role=why]').textContent}));
""")


def settled(driver):
    """The columns once every one has finished or failed (else False): its text is then final,
    as the page marks a column finished only after its stream's end."""
    cols = columns(driver)
    return cols if cols and all({"finished", "failed"} & set(c["classes"]) for c in cols) \
        else False


def _screenshot_script():
    """scripts/playground_screenshot.py, loaded as a module."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "playground_screenshot.py"
    spec = importlib.util.spec_from_file_location("playground_screenshot", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.vllm
@browser
def test_the_screenshot_scripts_wait_ends_on_the_default_page_and_times_out_naming_a_column(
        page, server):
    """The screenshot script's wait, on the real page: the default Generate withholds the
    side marked harmful (detox's negative side), and the wait still ends once the generated
    columns have finished (checked with this module's own reading of the columns); a column
    that never settles ends it with a message naming that column."""
    from selenium.webdriver.common.by import By

    shot = _screenshot_script()
    set_field(page, "prompt", "Once upon a time")
    set_field(page, "max-tokens", MAX_TOKENS)
    page.find_element(By.ID, "generate").click()
    shot.wait_for_columns(page, timeout=WAIT)
    assert [h["steer"] for h in withheld(page)] == [{"detox": -5}]
    cols = settled(page)
    assert cols and [c["steer"] for c in cols] == [None, {"detox": 5}]
    assert all(c["text"] for c in cols), cols
    page.execute_script("const a = document.createElement('article'); a.className = 'column'; "
                        "a.innerHTML = '<h2>still going</h2>'; "
                        "document.querySelector('#columns').append(a);")
    with pytest.raises(shot.ScreenshotTimeout, match="still running: still going"):
        shot.wait_for_columns(page, timeout=1)


@pytest.mark.vllm
@browser
def test_server_serves_the_page_with_a_same_origin_policy_and_the_info(server):
    r = requests.get(server + "/steer/")
    assert r.status_code == 200 and "vllm-steer playground" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert requests.get(server + "/steer", allow_redirects=False).headers["location"] == "/steer/"
    info = requests.get(server + "/v1/steer/info").json()
    assert info["model"] == "tiny" and info["max_strength"] == 20
    assert [(s["name"], s["recommended_strength"]) for s in info["steers"]] == \
        [("detox", 5.0), ("sentiment", None)]


@pytest.mark.vllm
@browser
def test_page_lists_the_steers_with_sliders_and_metadata(page, server):
    from selenium.webdriver.common.by import By

    # the first steer with a recommended strength starts there (its file's metadata: 5)
    for name, start in (("detox", "5"), ("sentiment", "0")):
        s = page.find_element(By.ID, f"sl-{name}")
        assert (s.get_attribute("min"), s.get_attribute("max"), s.get_attribute("step"),
                s.get_property("value")) == ("-20", "20", "0.5", start)
        assert page.find_element(By.ID, f"num-{name}").get_property("value") == start
        label = page.find_element(By.CSS_SELECTOR, f"label[for=sl-{name}]")
        assert label.text == name
    marks = page.find_elements(By.CSS_SELECTOR, ".mark.rec")
    assert sorted(m.get_attribute("title") for m in marks) == ["recommended +5",
                                                               "recommended \u22125"]
    page.find_element(By.ID, "tab-steers").click()
    cards = wait(page, lambda d: [c for c in d.find_elements(By.CSS_SELECTOR, ".steer-card")
                                  if c.is_displayed()])
    assert [c.find_element(By.TAG_NAME, "h2").text for c in cards] == ["detox", "sentiment"]
    assert "more detox" in cards[0].text and "less detox" in cards[0].text
    assert "tiny" in page.find_element(By.ID, "server-text").text
    origin = server.rstrip("/")
    loaded = page.execute_script("return performance.getEntriesByType('resource')"
                                 ".map(e => e.name)")
    assert loaded and all(u.startswith(origin + "/") for u in loaded), loaded


@pytest.mark.vllm
@browser
def test_no_key_is_asked_on_a_server_without_api_key(page, server):
    """The API-key box shows only on a 401 (a server started with --api-key: tested on the
    keyed server of tests/e2e/test_vllm_auth_presets.py); here every call is answered."""
    from selenium.webdriver.common.by import By

    assert requests.get(server + "/v1/steer/info").status_code == 200  # no key needed
    assert not page.find_element(By.ID, "key-form").is_displayed()
    assert not page.find_element(By.ID, "global-error").is_displayed()
    set_field(page, "max-tokens", 2)
    page.find_element(By.ID, "generate").click()
    cols = wait(page, settled)
    assert all("finished" in c["classes"] for c in cols)
    shown = page.execute_script("return Array.from(document.querySelectorAll("
                                "'#columns details.req pre'), p => p.textContent)")
    assert shown and not any("Authorization" in t for t in shown), shown
    assert not page.find_element(By.ID, "key-form").is_displayed()


@pytest.mark.vllm
@browser
def test_first_generate_gives_three_steered_columns_as_the_api_returns_them(page, server):
    """No slider touched: the first press of Generate already shows the recommended steer, but
    not the side its file marks harmful (detox's negative side: toxic text): that column says
    why and is generated only when the user asks for it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    info = requests.get(server + "/v1/steer/info").json()
    assert info["steers"][0]["labels"]["harmful"] == "negative"  # read from the file
    set_field(page, "prompt", "Once upon a time")
    set_field(page, "max-tokens", MAX_TOKENS)
    # greedy: a sampled token of a random model can flip with the batch's float rounding
    set_field(page, "temperature", 0)
    assert page.find_element(By.ID, "num-detox").get_property("value") == "5"
    head = page.find_element(By.ID, "desc-detox").text
    assert "negative side (less detox) marked harmful in the file" in head, head
    box = page.find_element(By.ID, "show-harmful")
    assert box.is_displayed() and not box.is_selected()
    page.execute_script("window.sentBodies = []; const orig = window.fetch; window.fetch = "
                        "(u, o) => { if (o && o.method === 'POST') window.sentBodies.push("
                        "JSON.parse(o.body)); return orig(u, o); };")
    page.find_element(By.ID, "generate").click()
    cols = wait(page, settled)
    assert [c["steer"] for c in cols] == [None, {"detox": 5}]
    hidden = withheld(page)
    assert [(h["title"], h["steer"]) for h in hidden] == \
        [("detox \u22125 (not generated)", {"detox": -5})]
    assert "detox at \u22125 moves towards less detox" in hidden[0]["why"]
    assert "marks harmful (labels.harmful)" in hidden[0]["why"]
    assert "Show sides marked harmful" in hidden[0]["why"]
    sent = page.execute_script("return window.sentBodies")
    assert [b.get("steer") for b in sent] == [None, {"detox": 5}]  # nothing asked for -5
    # the user asks for it: the column's button ticks the box and generates all three
    page.find_element(By.CSS_SELECTOR, "#columns .withheld button[data-role=show-harmful]").click()
    cols = wait(page, lambda d: len(columns(d)) == 3 and settled(d))
    assert page.find_element(By.ID, "show-harmful").is_selected() and not withheld(page)
    assert [c["steer"] for c in cols] == [{"detox": -5}, None, {"detox": 5}]
    assert [c["title"] for c in cols] == ["detox \u22125", "plain", "detox +5"]
    texts = [c["text"] for c in cols]
    assert all(texts) and len(set(texts)) == 3, texts
    # The page sends its three requests at once, so the engine runs them as one batch; the
    # API is asked the same way. (A random tiny model has near-ties that a batch of another
    # size can flip through float rounding: solo requests are not the same computation.)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(3) as pool:
        api = list(pool.map(lambda st: api_completion(server, st),
                            [{"detox": -5}, None, {"detox": 5}]))
    assert texts == api
    for c in cols:  # what the page says it sent: the same prompt, seed, no steer when plain
        assert c["request"] == {"model": "tiny", "prompt": "Once upon a time",
                                "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0,
                                **({"steer": c["steer"]} if c["steer"] else {})}
    slider = page.find_element(By.ID, "sl-detox")
    slider.send_keys(*[Keys.ARROW_LEFT] * 2)  # keyboard: 2 steps of 0.5
    assert page.find_element(By.ID, "num-detox").get_property("value") == "4"


@pytest.mark.vllm
@browser
@pytest.mark.skipif(not HAS_PRESETS, reason="presets (--steer-preset) are not in this tree")
def test_preset_is_listed_and_picked_as_a_column(page, server):
    """The page lists the server's presets; a preset column asks for the preset's model name
    (no steer field) and shows what the API returns for that model."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    info = requests.get(server + "/v1/steer/info").json()
    assert info["presets"] == [{"name": "polite", "steer": {"detox": 4.0, "sentiment": -2.0}}]
    # the page lists the preset cards of /v1/models (the live list), else the info's presets
    cards = [m for m in requests.get(server + "/v1/models").json()["data"] if m.get("steer")]
    assert [(m["id"], m["steer"]) for m in cards] == [("polite", info["presets"][0]["steer"])]
    set_field(page, "prompt", "Once upon a time")
    set_field(page, "max-tokens", MAX_TOKENS)
    set_field(page, "temperature", 0)
    Select(page.find_element(By.ID, "layout")).select_by_value("single")
    sel = Select(page.find_element(By.ID, "preset-select"))
    assert [o.text for o in sel.options][1:] == ["polite (detox +4 \u00b7 sentiment \u22122)"]
    sel.select_by_value("polite")
    page.find_element(By.ID, "add-preset").click()
    page.find_element(By.ID, "generate").click()
    cols = wait(page, settled)
    assert [c["title"] for c in cols] == ["plain", "detox +5",
                                          "preset polite (detox +4 \u00b7 sentiment \u22122)"]
    preset = cols[2]
    assert preset["request"] == {"model": "polite", "prompt": "Once upon a time",
                                 "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0}
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(3) as pool:  # the same batch as the page's three requests
        api = list(pool.map(lambda a: api_completion(server, a[0], model=a[1]),
                            [(None, "tiny"), ({"detox": 5}, "tiny"), (None, "polite")]))
    assert [c["text"] for c in cols] == api
    assert preset["text"] and preset["text"] != cols[0]["text"]  # the preset steers


@pytest.mark.vllm
@browser
def test_highlight_tab_shows_the_routes_spans(page, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    tab = page.find_element(By.ID, "tab-compare")
    tab.send_keys(Keys.ARROW_RIGHT)  # keyboard navigation between tabs
    assert page.find_element(By.ID, "panel-highlight").is_displayed()
    text = "You are a wonderful person and I like the way you talk"
    set_field(page, "hl-text", text)
    Select(page.find_element(By.ID, "hl-steer")).select_by_visible_text("detox")
    set_field(page, "hl-strength", 1)  # random steers: at 5 every token loses probability
    page.find_element(By.ID, "hl-run").click()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#hl-out mark.span, #hl-out .no-spans")
         or d.find_element(By.ID, "hl-error").is_displayed())
    assert not page.find_element(By.ID, "hl-error").is_displayed(), \
        page.find_element(By.ID, "hl-error").text
    marks = page.find_elements(By.CSS_SELECTOR, "#hl-out mark.span")
    want = requests.post(server + "/v1/steer/highlight",
                         json={"text": text, "steer": {"detox": 1}, "k": 3, "max_len": 8}).json()
    assert len(marks) == len(want["spans"]) >= 1
    # a span's text in the page: its tokens (the rank badge is a separate element)
    got = ["".join(t.get_attribute("textContent") for t in m.find_elements(By.CLASS_NAME, "t"))
           for m in marks]
    assert sorted(got) == sorted(s["text"] for s in want["spans"])
    coloured = page.find_elements(By.CSS_SELECTOR, "#hl-out .t[data-score]")
    assert len(coloured) == sum(s is not None for s in want["scores"])


@pytest.mark.vllm
@browser
def test_strength_over_the_limit_shows_the_servers_error(page, server):
    from selenium.webdriver.common.by import By

    set_field(page, "prompt", "Once upon a time")
    set_field(page, "max-tokens", MAX_TOKENS)
    # greedy: a sampled token of a random model can flip with the batch's float rounding
    set_field(page, "temperature", 0)
    set_field(page, "num-detox", 0)
    set_field(page, "num-sentiment", 25)
    page.find_element(By.ID, "generate").click()
    cols = wait(page, settled)
    by_steer = {json.dumps(c["steer"]): c for c in cols}
    for strength in (25, -25):
        col = by_steer[json.dumps({"sentiment": strength})]
        # the same request straight to the API: the page shows the server's status and words
        r = requests.post(server + "/v1/completions", json={**col["request"], "stream": True})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert f"strength {strength} of steer 'sentiment' exceeds the server's maximum " \
            "|strength| 20" in message
        assert col["error"].startswith("HTTP 400") and col["error"].endswith(message)
        assert "failed" in col["classes"] and not col["text"]
    plain = by_steer["null"]
    assert not plain["error"] and plain["text"] == api_completion(server)


# The page's fetch, wrapped: GET /v1/steer/info and GET /v1/steers answer as the server does but
# with detox's recommended strength set to arguments[0] (a steer file may recommend more than
# this server's --steer-max-strength allows), and every POST body the page sends is recorded.
FAKE_RECOMMENDED_JS = """
const rec = arguments[0], orig = window.fetch;
window.sentBodies = [];
window.fetch = async (url, opts) => {
  const u = String(url);
  if (opts && opts.method === 'POST') window.sentBodies.push({url: u, body: JSON.parse(opts.body)});
  const r = await orig(url, opts);
  if (!r.ok || (u !== '/v1/steer/info' && u !== '/v1/steers')) return r;
  const j = await r.json();
  const walk = (o, detox) => {
    if (!o || typeof o !== 'object') return;
    detox = detox || o.name === 'detox';
    if (detox && 'recommended_strength' in o) o.recommended_strength = rec;
    for (const v of Object.values(o)) walk(v, detox);
  };
  walk(j, false);
  return new Response(JSON.stringify(j), {status: r.status, headers: r.headers});
};
"""


@pytest.mark.vllm
@browser
def test_recommended_strength_over_the_servers_maximum_starts_capped(page, server):
    """A steer file recommending 30 on a server capped at 20: the page starts the compare
    sliders and the highlight box at ±20 (keeping the sign), says so where the recommended
    strength is shown, and the first Generate and Highlight go through (at 30: HTTP 400)."""
    from selenium.webdriver.common.by import By

    page.execute_script(FAKE_RECOMMENDED_JS, 30)
    # the page's own loader, now reading the wrapped answers (WebDriver awaits its promise)
    page.execute_script("return loadInfo();")
    wait(page, lambda d: any(m.get_attribute("title").startswith("recommended +30")
                             for m in d.find_elements(By.CSS_SELECTOR, ".mark.rec")))
    info = requests.get(server + "/v1/steer/info").json()
    assert info["max_strength"] == 20  # the real server's limit; the file says 30
    assert page.find_element(By.ID, "sl-detox").get_property("value") == "20"
    assert page.find_element(By.ID, "num-detox").get_property("value") == "20"
    assert page.find_element(By.ID, "num-sentiment").get_property("value") == "0"
    # the recommended mark keeps the file's value; the row says the server caps it
    marks = page.find_elements(By.CSS_SELECTOR, ".mark.rec")
    assert sorted(m.get_attribute("title") for m in marks) == [
        "recommended +30 (over the server's maximum |strength| 20)",
        "recommended \u221230 (over the server's maximum |strength| 20)"]
    head = page.find_element(By.ID, "desc-detox").text
    assert "recommended \u00b130" in head and "capped at \u00b120" in head \
        and "--steer-max-strength" in head, head
    buttons = page.find_elements(By.CSS_SELECTOR, ".steer-row button.small")
    assert [b.text for b in buttons] == ["\u221220", "+20"]
    assert "recommended +30, capped" in buttons[1].get_attribute("aria-label")

    set_field(page, "prompt", "Once upon a time")
    set_field(page, "max-tokens", MAX_TOKENS)
    set_field(page, "temperature", 0)
    page.find_element(By.ID, "show-harmful").click()  # the -20 column too (detox's toxic side)
    page.find_element(By.ID, "generate").click()
    cols = wait(page, settled)
    assert [c["steer"] for c in cols] == [{"detox": -20}, None, {"detox": 20}]
    assert [c["error"] for c in cols] == ["", "", ""]
    assert all("finished" in c["classes"] and c["text"] for c in cols), cols
    sent = page.execute_script("return window.sentBodies")
    assert [b["body"].get("steer") for b in sent] == [{"detox": -20}, None, {"detox": 20}]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(3) as pool:  # the same batch as the page's three requests
        api = list(pool.map(lambda st: api_completion(server, st),
                            [{"detox": -20}, None, {"detox": 20}]))
    assert [c["text"] for c in cols] == api
    # what the file's value would have given: the server's refusal the clamp avoids
    r = requests.post(server + "/v1/completions", json={**cols[2]["request"],
                                                         "steer": {"detox": 30}})
    assert r.status_code == 400 and "|strength| 20" in r.json()["error"]["message"]

    # the highlight tab starts at the capped strength too, with a note under the box
    page.find_element(By.ID, "tab-highlight").click()
    assert page.find_element(By.ID, "hl-strength").get_property("value") == "20"
    note = page.find_element(By.ID, "hl-cap")
    assert note.is_displayed() and "recommended +30, capped at \u00b120" in note.text
    page.execute_script("window.sentBodies = [];")
    page.find_element(By.ID, "hl-run").click()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#hl-out mark.span, #hl-out .no-spans")
         or d.find_element(By.ID, "hl-error").is_displayed())
    assert not page.find_element(By.ID, "hl-error").is_displayed(), \
        page.find_element(By.ID, "hl-error").text
    sent = page.execute_script("return window.sentBodies")
    assert [(b["url"], b["body"]["steer"]) for b in sent] == \
        [("/v1/steer/highlight", {"detox": 20})]


def test_info_lists_a_control_vector_with_its_kind_blocks_and_strength(tmp_path):
    """A llama.cpp control vector on the page: its kind, its blocks and its recommended
    strength (the sliders' scale), read from the GGUF."""
    import torch

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.server.playground import info_dict
    from vllm_steer.vectors import make_vector_steer, save_gguf

    vs = make_vector_steer({2: torch.ones(64), 3: torch.ones(64)}, "calm",
                           recommended_strength=0.5, labels={"positive": "calm"})
    save_gguf(tmp_path / "calm.gguf", vs)
    cfg = SteerServerConfig(steers={"c": str(tmp_path / "calm.gguf")}, max_strength=20)
    (c,) = info_dict(cfg, "tiny")["steers"]
    assert (c["name"], c["name_in_file"], c["file"], c["kind"]) == \
        ("c", "calm", "calm.gguf", "vector")
    assert (c["layers"], c["recommended_strength"], c["hidden_size"]) == ([2, 3], 0.5, 64)
