"""scripts/chaos_soak.py for 20 seconds, then its engine core killed and the server restarted.

One run of the script (two engine starts: the soak's server and the restarted one): 8 clients of
random valid and invalid completions, chat and responses requests mixing LM-Steer and vector
steers (safetensors and GGUF) while steers, presets and files of both kinds change; then
SIGKILL to the engine core under traffic, the server's exit, and a restart with the same flags
(docs/deploy.md "What a restart loses").
Twenty seconds of traffic hold every kind of operation (the operator's first dozen go through
each kind, the presets file and the steer files first; the first requests of clients 0-3 are
the fixed greedy and invalid checks); the long soak is the script itself (``--duration 900``,
benchmarks/RESULTS.md). The servers start as on a host: ``vllm serve`` spawns its engine
core (the suite's other servers fork theirs: ``helpers.engines.fork_engine_processes``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.engines import serve_spawns_engines

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
#: seconds of traffic in the suite
DURATION_S = 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("chaos")
    report = work / "report.json"
    with pytest.MonkeyPatch.context() as mp:  # as deployed: the engine core spawned
        serve_spawns_engines(mp)
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "chaos_soak.py"), "--duration",
             str(DURATION_S), "--clients", "8", "--seed", "0", "--report", str(report),
             "--work", str(work), "--restart-check"],
            cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(report.read_text())


def test_a_chaos_soak_leaves_no_5xx_no_dropped_connection_and_the_same_greedy_text(run):
    proc, r = run
    detail = json.dumps({k: r.get(k) for k in ("requests_by_status", "examples",
                                                "mismatch_examples", "engine_alive_detail")})
    assert r["status_5xx"] == 0, detail
    assert r["connection_errors"] == 0, detail
    assert r["ops_5xx_or_conn_errors"] == 0, detail
    assert r["engine_alive"], detail
    # every answer had a status its kind of request may get (a refusal: the right one)
    assert not r["unexpected_status"], json.dumps(r["examples"].get("unexpected"))
    assert r["mismatches"] == 0, detail
    assert r["first_answer_mismatches"] == 0, json.dumps(r["first_answer_mismatch_examples"])
    # the traffic was real: answers and refusals, greedy texts compared, files changed
    assert r["requests_by_status"].get("200", 0) > 0, detail
    assert r["requests_by_status"].get("400", 0) > 0, detail
    assert r["greedy_checked"] >= 3, detail
    # vector steers were served and refused: the --steer vector's greedy texts compared, a
    # vector file for another model a 400 naming both block counts, nothing loaded lost
    assert r["greedy_checked_vector"] >= 1, detail
    assert not r["bad_vector_checks"].get("failed"), json.dumps(r["examples"].get("bad_vector"))
    quiet = r["bad_vector_quiet_check"]
    assert quiet["ok"], json.dumps(quiet)
    assert [p["status"] for p in quiet["posts"]] == [400, 400], json.dumps(quiet)
    assert "calm" in quiet["listing_after"] and quiet["greedy_same"], json.dumps(quiet)
    assert r["operations"]["presets_file"] and r["operations"]["steer_file"], detail
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_killed_engine_core_stops_the_server_and_a_restart_serves_the_files_again(run):
    _, r = run
    k = r["restart"]
    assert k["engine_cores"], k
    # the server exits, non-zero, so that a supervisor restarts it
    assert k["server_exit_code"] not in (None, 0), k
    # clients see refusals or dropped connections, never a hang: every request came back
    assert sum(k["clients_saw"].values()) > 0, k
    after = k["after_restart_status"]
    # what comes back: the presets file, the steer folder on first use, the flags
    assert after["file_preset"] == after["steer_dir"] == after["flag_steer"] == 200, k
    assert after["flag_preset"] == 200, k
    assert after["flag_vector"] == after["steer_dir_vector"] == 200, k
    # what is lost: the run-time preset, the steer loaded over HTTP, the counters
    assert after["runtime_preset"] == 404, k
    assert after["runtime_loaded_name"] == 400, k
    assert "api1" in k["before_kill"]["steers"] and "api1" not in k["after_restart"]["steers"]
    assert k["before_kill"]["requests_steered_total"] > k["after_restart"][
        "requests_steered_total"], k
