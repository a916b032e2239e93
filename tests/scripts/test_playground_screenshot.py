"""scripts/playground_screenshot.py's wait for the playground's columns, on the column states
the page shows (the same snapshot script, answered by a stand-in page): a withheld column (a
side marked harmful, the page's default) counts as settled, and a column that never settles
ends the wait with a message naming it, not a hang. The same wait against the real page, in
chromium: tests/server/test_playground.py."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "playground_screenshot.py"


def _script():
    spec = importlib.util.spec_from_file_location("playground_screenshot", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Page:
    """The page's columns over time: each ``execute_script`` answers the next state (the last
    one repeats), as the page's own snapshot script would."""

    def __init__(self, *states):
        self.states, self.calls = list(states), 0

    def execute_script(self, js):
        assert "#columns .column" in js
        self.calls += 1
        state = self.states[min(self.calls, len(self.states)) - 1]
        return [{"title": t, "classes": c} for t, c in state]


PLAIN_DONE = ("plain", "column finished")
STEERED_DONE = ("detox +5", "column finished")
WITHHELD = ("detox \u22125 (not generated)", "column withheld")


def test_a_withheld_column_counts_as_settled():
    shot = _script()
    page = Page([("plain", "column"), ("detox +5", "column")],  # streaming
                [PLAIN_DONE, ("detox +5", "column")],
                [WITHHELD, PLAIN_DONE, STEERED_DONE])
    t0 = time.monotonic()
    shot.wait_for_columns(page, timeout=5, poll=0.01)
    assert page.calls == 3 and time.monotonic() - t0 < 5
    # failed and refused columns settle too
    shot.wait_for_columns(Page([WITHHELD, ("plain", "column failed"), STEERED_DONE]), 5, 0.01)


def test_a_column_that_never_settles_times_out_naming_it():
    shot = _script()
    page = Page([WITHHELD, PLAIN_DONE, ("detox +5", "column")])
    t0 = time.monotonic()
    with pytest.raises(shot.ScreenshotTimeout) as e:
        shot.wait_for_columns(page, timeout=0.3, poll=0.01)
    assert 0.3 <= time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "did not settle in 0.3 s" in msg and "still running: detox +5" in msg, msg
    assert "plain" not in msg.split("still running:")[1] and "--timeout" in msg, msg
    with pytest.raises(shot.ScreenshotTimeout, match="no column appeared"):
        shot.wait_for_columns(Page([]), timeout=0.05, poll=0.01)


def test_main_exits_1_with_the_message_on_a_timeout(monkeypatch, capsys):
    shot = _script()

    def shoot(base, out, args):
        assert args.timeout == 2.5
        raise shot.ScreenshotTimeout("the highlight's answer did not happen in 2.5 s")

    monkeypatch.setattr(shot, "shoot", shoot)
    assert shot.main(["--url", "http://127.0.0.1:1", "--timeout", "2.5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("playground_screenshot: the highlight's answer did not happen"), err
