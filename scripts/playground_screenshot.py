"""Screenshots of the playground (docs/playground.png, docs/playground-highlight.png) with real
output: the embedded SmolLM2 served with the shipped steers, driven in headless chromium.

    .venv/bin/python scripts/playground_screenshot.py            # starts the demo's server
    .venv/bin/python scripts/playground_screenshot.py --url http://127.0.0.1:8000   # or uses one

Needs Debian's chromium and chromedriver (scripts/install.sh) and selenium (the test extra).
It waits for every column of the playground to settle (generated, failed, or withheld: a side
a steer file marks harmful, which the page does not generate unless asked), at most
``--timeout`` seconds per step, and otherwise exits 1 naming the columns still running.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A column's classes once it has settled: its stream ended (``finished``), it failed or was
#: refused (``failed``), or the page withheld it (``withheld``: never generated unless asked).
SETTLED = ("finished", "failed", "withheld")
#: Every column of the page, in one script (one snapshot: no event lands between two reads).
COLUMNS_JS = """
return Array.from(document.querySelectorAll('#columns .column'), (col) => ({
  title: (col.querySelector('h2') || {}).textContent || '', classes: col.className}));
"""


class ScreenshotTimeout(RuntimeError):
    """The page did not reach the state a screenshot needs in time."""


def unsettled(driver) -> list[str] | None:
    """The titles of the columns still running (an empty list: every column settled); None
    while the page shows no column yet."""
    cols = driver.execute_script(COLUMNS_JS) or []
    if not cols:
        return None
    return [c["title"].strip() or "(untitled)" for c in cols
            if not set(SETTLED) & set(c["classes"].split())]


def wait_for_columns(driver, timeout: float, poll: float = 0.2) -> None:
    """Wait until every column has settled (:data:`SETTLED`); raise
    :class:`ScreenshotTimeout` naming the columns still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = unsettled(driver)
        if left == []:
            return
        if time.monotonic() >= deadline:
            raise ScreenshotTimeout(
                f"the playground's columns did not settle in {timeout:g} s: "
                + (f"still running: {', '.join(left)}" if left else "no column appeared")
                + "; is the server generating? (raise --timeout on a slow machine)")
        time.sleep(poll)


def wait_until(driver, cond, timeout: float, what: str):
    """``WebDriverWait(driver, timeout).until(cond)``, raising :class:`ScreenshotTimeout`
    naming ``what`` instead of selenium's bare timeout."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout).until(cond)
    except TimeoutException:
        raise ScreenshotTimeout(f"{what} did not happen in {timeout:g} s") from None


def chromium(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--hide-scrollbars", f"--window-size={width},{height}",
              "--force-prefers-reduced-motion", "--force-color-profile=srgb"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))


def full_page(driver, path: Path, width: int) -> None:
    """Save the whole page (not only the window) as a PNG, through the DevTools protocol."""
    import base64

    height = driver.execute_script("return document.documentElement.scrollHeight")
    time.sleep(0.3)
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"wrote {path} ({width}x{height})")


def shoot(base: str, out: Path, args) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    d = chromium(args.width, 900)
    try:
        d.get(base + "/steer/")
        wait_until(d, lambda d: d.find_elements(By.ID, f"sl-{args.steer}"), args.timeout,
                   f"the playground listing steer {args.steer!r}")

        def field(id_, value):
            e = d.find_element(By.ID, id_)
            e.clear()
            e.send_keys(str(value))

        field("prompt", args.prompt)
        field("max-tokens", args.max_tokens)
        field("temperature", args.temperature)
        field("seed", args.seed)
        field(f"num-{args.steer}", args.strength)
        d.find_element(By.ID, "generate").click()
        wait_for_columns(d, args.timeout)
        d.execute_script("document.activeElement.blur()")
        full_page(d, out / "playground.png", args.width)

        d.find_element(By.ID, "tab-highlight").click()
        field("hl-text", args.highlight_text)
        Select(d.find_element(By.ID, "hl-steer")).select_by_visible_text(args.highlight_steer)
        field("hl-strength", args.highlight_strength)
        d.find_element(By.ID, "hl-run").click()
        wait_until(d, lambda d: d.find_elements(
            By.CSS_SELECTOR, "#hl-out mark.span, #hl-out .no-spans, #hl-error:not([hidden])"),
            args.timeout, "the highlight's answer")
        d.execute_script("document.activeElement.blur()")
        full_page(d, out / "playground-highlight.png", args.width)
    finally:
        d.quit()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="use this running server (else start the demo's server)")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--width", type=int, default=1360)
    p.add_argument("--prompt", default="My review of the new pizza place downtown:")
    p.add_argument("--steer", default="sentiment")
    p.add_argument("--strength", type=float, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--highlight-text", default="The food was cold and the waiter was rude, "
                   "but the dessert was wonderful and the view was lovely.")
    p.add_argument("--highlight-steer", default="sentiment")
    p.add_argument("--highlight-strength", type=float, default=3)
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds each step of the page may take (default 600)")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except ScreenshotTimeout as e:
        print(f"playground_screenshot: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    if args.url:
        shoot(args.url.rstrip("/"), args.out, args)
        return 0
    sys.path.insert(0, str(ROOT / "scripts"))
    from demo import PLUGINS_ENV, server_args

    from vllm_steer.server.launch import serve

    with contextlib.ExitStack() as stack:
        base = stack.enter_context(serve(server_args(quiet=True), ROOT / ".cache" /
                                         "screenshot-server.log", env=PLUGINS_ENV))
        shoot(base, args.out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
