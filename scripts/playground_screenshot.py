"""Screenshots of the playground (docs/playground.png, docs/playground-highlight.png) with real
output: the embedded SmolLM2 served with the shipped steers, driven in headless chromium.

    .venv/bin/python scripts/playground_screenshot.py            # starts the demo's server
    .venv/bin/python scripts/playground_screenshot.py --url http://127.0.0.1:8000   # or uses one

Needs Debian's chromium and chromedriver (scripts/install.sh) and selenium (the test extra).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    from selenium.webdriver.support.ui import Select, WebDriverWait

    d = chromium(args.width, 900)
    try:
        d.get(base + "/steer/")
        WebDriverWait(d, 60).until(lambda d: d.find_elements(By.ID, f"sl-{args.steer}"))

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
        WebDriverWait(d, 600).until(lambda d: (cols := d.find_elements(
            By.CSS_SELECTOR, "#columns .column")) and all(
            "finished" in c.get_attribute("class") or "failed" in c.get_attribute("class")
            for c in cols))
        d.execute_script("document.activeElement.blur()")
        full_page(d, out / "playground.png", args.width)

        d.find_element(By.ID, "tab-highlight").click()
        field("hl-text", args.highlight_text)
        Select(d.find_element(By.ID, "hl-steer")).select_by_visible_text(args.highlight_steer)
        field("hl-strength", args.highlight_strength)
        d.find_element(By.ID, "hl-run").click()
        WebDriverWait(d, 300).until(lambda d: d.find_elements(
            By.CSS_SELECTOR, "#hl-out mark.span, #hl-out .no-spans, #hl-error:not([hidden])"))
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
    args = p.parse_args(argv)
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
