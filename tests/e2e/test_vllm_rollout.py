"""Rolling out a new steer version across replicas, as docs/deploy.md tells it, on two real
`vllm serve` replicas of the embedded SmolLM2-135M-Instruct behind a round-robin proxy.

Both replicas read one presets file (``--steer-presets-file``) and one steer directory
(``--steer-dir``; replica B's is a link to it, so that one variant can give B a view of its
own that shows a new file late, as network storage can). The presets file is the shipped
ConfigMap's, in a folder laid out and updated as the kubelet updates a mounted ConfigMap
(``presets.yaml -> ..data/presets.yaml``, each update a new timestamped folder and one rename
of ``..data``: :mod:`helpers.kubelet`), and ``kubectl`` is a stand-in that applies a ConfigMap
manifest to that folder at once (the kubelet's 1-2 minutes of sync skipped). The test runs
the commands of the roll-out section of docs/deploy.md for the shipped Deployment as a user
types them (a steer file written then renamed into the directory; the ConfigMap edited and
applied), while client threads call the
stable preset name through the proxy, and asserts what the docs promise: no client call fails,
every response's ``x-vllm-steer-applied`` names the old or the new version, and each replica
serves the new version at its next look at the file. A roll-back runs the same way. In the
last variant replica B's volume shows the new steer file several seconds after the presets
file: B refuses the version (``GET /v1/steer-presets``, ``/metrics`` say so), keeps serving
the old one, and serves the new one once the file is there.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import http.server
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from helpers.kubelet import DATA_DIR, MOUNTS_ENV, apply, configmaps
from helpers.rollout_doc import rollout_blocks
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
POLL = 1.0  # VLLM_STEER_PRESETS_FILE_POLL_SECONDS: the replicas' look at the presets file
# What "at its next look" may take beyond the poll: the read and the steer directory's
# listing (SLACK), and the look's two calls into an engine core that is decoding for the
# clients plus the test's own call that sees the result: three control calls, each as slow as
# this replica answered one then (the slowest of the test's own calls just before the swap and
# while it waited; on a 2-core CPU shared with other work one call can take seconds).
SLACK = 2.0
CLIENTS = 4
LATE = 6.0  # seconds between the presets file and the new steer file on replica B's volume
PRESET = "detox-stable"
HIDDEN = 576  # SmolLM2-135M's hidden size


# ---- the doc's commands ------------------------------------------------------------------
CONFIGMAP = Path("deploy") / "kubernetes" / "presets-configmap.yaml"


class Docs:
    """Runs the doc's commands with its paths (``/steers``, ``/etc/vllm-steer``) at the test's
    folders, in a work folder holding the user's copy of ``deploy/kubernetes/``, with
    ``kubectl`` the kubelet's stand-in (``mounts``: ConfigMap name -> mounted folder);
    ``versions``: the doc's version names mapped to the ones a variant rolls."""

    def __init__(self, steers: Path, etc: Path, work: Path, mounts: dict[str, str]):
        self.steers, self.etc, self.work = steers, etc, work
        blocks = rollout_blocks()
        self.copy, self.swap, self.rollback = (blocks["copy"], blocks["swap_configmap"],
                                               blocks["rollback_configmap"])
        bin_dir = work / "bin"
        bin_dir.mkdir()
        (bin_dir / "kubectl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m '
                                         'helpers.kubelet "$@"\n')
        (bin_dir / "kubectl").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONPATH": str(ROOT / "tests"), MOUNTS_ENV: json.dumps(mounts)}

    def run(self, block: str, **versions: str) -> None:
        for old, new in versions.items():  # e.g. detox_v2="detox-v3"
            block = block.replace(old.replace("_", "-"), new)
        block = block.replace("/etc/vllm-steer/", f"{self.etc}/").replace("/steers/",
                                                                           f"{self.steers}/")
        subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=self.work, check=True,
                       env=self.env)


# ---- a round-robin proxy ----------------------------------------------------------------
class Proxy:
    """A load balancer in front of the replicas: each POST goes to the next one in turn; the
    answer comes back with its status, body and ``x-vllm-steer-*`` headers, and
    ``x-replica`` (which one answered)."""

    def __init__(self, upstreams: list[str]):
        order = itertools.cycle(range(len(upstreams)))
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    i = next(order)
                try:
                    r = requests.post(upstreams[i] + self.path, data=body, timeout=120,
                                      headers={"Content-Type": "application/json"})
                    status, data, headers = r.status_code, r.content, r.headers
                except requests.RequestException as e:
                    status, data, headers = 502, str(e).encode(), {}
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower().startswith("x-vllm-steer"):
                        self.send_header(k, v)
                self.send_header("x-replica", str(i))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Clients:
    """``CLIENTS`` threads calling the stable preset name through the proxy until stopped;
    ``calls``: (start, end, status, replica, x-vllm-steer-applied) of each."""

    def __init__(self, url: str):
        self.url, self.calls, self.stop = url, [], threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        s = requests.Session()
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r = s.post(self.url + "/v1/completions", timeout=120, json={
                    "model": PRESET, "prompt": f"Client {k} says the weather is",
                    "max_tokens": 2, "temperature": 0})
                rec = (t0, time.monotonic(), r.status_code, r.headers.get("x-replica"),
                       r.headers.get("x-vllm-steer-applied"))
            except requests.RequestException as e:
                rec = (t0, time.monotonic(), repr(e), None, None)
            with self.lock:
                self.calls.append(rec)

    def until_new(self, new: str, served: dict[str, float], timeout: float = 120.0) -> None:
        """Keep the traffic on until every replica answered a call started after it served
        ``new`` (``served``: replica -> monotonic time), and 2 seconds more."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                seen = {c[3] for c in self.calls if c[3] in served and c[0] > served[c[3]]}
            if seen == set(served):
                break
            time.sleep(0.2)
        time.sleep(2.0)

    def finish(self) -> list[tuple]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)
        return list(self.calls)


# ---- the fleet ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    steers, etc, work = root / "steers", root / "etc", root / "work"
    for d in (steers, etc, work):
        d.mkdir()
    # the versions a user has built: v1 deployed, v2 and v3 to roll out (random steers of
    # SmolLM2's hidden size: the test is about which one serves, not what they do)
    for k, name in enumerate(("detox-v1", "detox-v2", "detox-v3")):
        save_steer(work / f"{name}.safetensors", random_steer(HIDDEN, 4, name, seed=k))
    os.link(work / "detox-v1.safetensors", steers / "detox-v1.safetensors")
    # the user's copy of the shipped ConfigMap, its alias on v1 (step 1 of the doc), mounted
    # where the Deployment mounts it, as the kubelet lays it out
    shipped = (ROOT / CONFIGMAP).read_text()
    assert "detox-stable: {detox: 4}" in shipped
    (work / CONFIGMAP).parent.mkdir(parents=True)
    (work / CONFIGMAP).write_text(shipped.replace("detox-stable: {detox: 4}",
                                                  'detox-stable: "detox-v1:4"'))
    (name,) = configmaps(work / CONFIGMAP)
    mount = etc / "presets"
    assert apply(work / CONFIGMAP, {name: str(mount)}) == [name]
    presets_file = mount / "presets.yaml"
    assert os.readlink(presets_file) == "..data/presets.yaml"
    view_b = root / "b-steers"  # replica B's --steer-dir: a link to the shared folder
    view_b.symlink_to(steers, target_is_directory=True)
    common = ["--steer-presets-file", presets_file, "--dtype", "float32",
              "--max-model-len", "256", "--max-num-seqs", "8",
              "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    env = {"VLLM_STEER_PRESETS_FILE_POLL_SECONDS": str(POLL)}
    with contextlib.ExitStack() as stack:
        # both replicas start at once (an engine start is about a minute on this CPU)
        with cf.ThreadPoolExecutor(2) as pool:
            urls = list(pool.map(lambda a: stack.enter_context(
                serve([smollm2_dir, "--served-model-name", "smollm2", "--steer-dir", a[1],
                       *common], root / f"{a[0]}.log", env=env, timeout=900)),
                [("a", steers), ("b", view_b)]))
        proxy = Proxy(urls)
        stack.callback(proxy.close)
        yield {"urls": urls, "proxy": proxy, "root": root, "steers": steers,
               "docs": Docs(steers, etc, work, {name: str(mount)}), "view_b": view_b,
               "mount": mount, "presets_file": presets_file}


def presets_state(url: str) -> dict:
    r = requests.get(url + "/v1/steer-presets", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    mix = next(p["steer"] for p in body["data"] if p["name"] == PRESET)
    return {"mix": mix, **body["presets_file_state"]}


def refused_metric(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("vllm_steer:presets_file_refused", "vllm_steer:presets_file_reloads_total",
                 "vllm_steer:presets_file_refusals_total"):
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m[1]) if m else None
    return out


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def control_latency(url: str) -> float:
    """Median seconds of 3 ``GET /v1/steer-presets`` (one call into the engine core each)."""
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        presets_state(url)
        times.append(time.monotonic() - t0)
    return sorted(times)[1]


def promise(rt: float) -> float:
    """Seconds the docs' "at its next look" allows a replica answering a control call in
    ``rt`` seconds."""
    return POLL + SLACK + 3 * rt


def wait_serving(url: str, version: str, since: float, rt: float,
                 timeout: float = 120.0) -> tuple[float, float]:
    """Seconds from ``since`` until the replica's table serves ``version`` for the preset, and
    what the docs allow: :func:`promise` of the slowest control call (``rt``, measured before,
    or one of the calls made while waiting)."""
    while True:
        t0 = time.monotonic()
        st = presets_state(url)
        rt = max(rt, time.monotonic() - t0)
        if st["mix"] == {version: 4.0}:
            return time.monotonic() - since, promise(rt)
        assert time.monotonic() - since < timeout, st
        time.sleep(0.1)


def check_calls(calls: list[tuple], allowed: set[str], served: dict[str, float],
                new: str, label: str) -> dict:
    """The figures of one phase: calls that were not 200 (0), every header naming an allowed
    version, and after each replica serves ``new`` (``served``: replica -> monotonic time)
    every call it answered naming ``new``."""
    failed = [c for c in calls if c[2] != 200]
    headers = {}
    for c in calls:
        name, _, value = (c[4] or "").partition("=")
        headers[name] = headers.get(name, 0) + 1
        assert c[4] is None or float(value) == 4.0, c
    late_old = [c for c in calls if c[2] == 200 and c[3] is not None
                and c[0] > served[c[3]] + 0.5 and not (c[4] or "").startswith(new + "=")]
    per_replica = {r: sum(1 for c in calls if c[3] == r and (c[4] or "").startswith(new + "="))
                   for r in served}
    figures = {"calls": len(calls), "not_200": len(failed), "headers": headers,
               "old_after_served": len(late_old), "new_per_replica": per_replica}
    print(f"\n[rollout] {label}: {json.dumps(figures)}")
    assert not failed, failed[:5]
    assert set(headers) <= allowed, headers
    assert not late_old, late_old[:5]
    assert all(n > 0 for n in per_replica.values()), per_replica
    return figures


# ---- the roll-out, the roll-back, and a replica that sees the steer file late ---------------
def test_rollout_and_rollback_by_the_docs_under_traffic(fleet):
    urls, docs = fleet["urls"], fleet["docs"]
    for u in urls:  # the file's first version serves everywhere
        st = presets_state(u)
        assert st["mix"] == {"detox-v1": 4.0} and st["refused"] is None, st
        assert st["serving"]["sha256"] == file_sha(fleet["presets_file"])

    for label, steps, old, new in (
            ("roll-out v1 -> v2", [docs.copy, docs.swap], "detox-v1", "detox-v2"),
            ("roll-back v2 -> v1", [docs.rollback], "detox-v2", "detox-v1")):
        clients = Clients(fleet["proxy"].url)
        time.sleep(2.0)  # traffic on the old version first
        for block in steps[:-1]:
            docs.run(block)  # step 2: the steer file, written then renamed
        rt = {str(i): control_latency(u) for i, u in enumerate(urls)}
        before = os.readlink(fleet["mount"] / DATA_DIR)
        t_swap = time.monotonic()
        docs.run(steps[-1])  # step 3 (or 5): the ConfigMap edited and applied
        # the kubelet's one step: ..data renamed to a new folder, the file's link unchanged
        assert os.readlink(fleet["mount"] / DATA_DIR) != before
        assert not (fleet["mount"] / before).exists()
        assert os.readlink(fleet["presets_file"]) == "..data/presets.yaml"
        # each replica watched by its own thread: one replica's wait must not delay the look
        # that times the other
        with cf.ThreadPoolExecutor(len(urls)) as pool:
            waited = dict(zip(rt, pool.map(
                lambda r, u, new=new, t_swap=t_swap, rt=rt: wait_serving(u, new, t_swap, rt[r]),
                rt, urls), strict=True))
        took = {r: w[0] for r, w in waited.items()}
        allowed = {r: w[1] for r, w in waited.items()}
        served = {r: t_swap + s for r, s in took.items()}
        clients.until_new(new, served)  # traffic on the new version
        calls = clients.finish()
        print(f"\n[rollout] {label}: seconds until each replica served {new}: "
              f"{ {r: round(t, 2) for r, t in took.items()} }; allowed (the next look, every "
              f"{POLL:g} s, + {SLACK:g} s + 3 control calls as slow as the slowest seen): "
              f"{ {r: round(t, 2) for r, t in allowed.items()} }")
        check_calls(calls, {f"{old}", f"{new}"}, served, new, label)
        assert all(took[r] <= allowed[r] for r in took), (took, allowed)
        sha = file_sha(fleet["presets_file"])
        for u in urls:
            st = presets_state(u)
            assert st["serving"]["sha256"] == sha and st["refused"] is None, st
            assert refused_metric(u)["vllm_steer:presets_file_refused"] == 0.0


def test_a_replica_that_sees_the_steer_file_late_converges_once_it_is_there(fleet):
    urls, docs = fleet["urls"], fleet["docs"]
    a, b = urls
    assert presets_state(a)["mix"] == presets_state(b)["mix"] == {"detox-v1": 4.0}
    # replica B's volume gets a view of its own: the files it shows now, not the next one
    own = fleet["root"] / "b-own"
    own.mkdir()
    for f in fleet["steers"].glob("*.safetensors"):
        os.link(f, own / f.name)
    link = fleet["root"] / "b-steers.new"
    link.symlink_to(own, target_is_directory=True)
    os.replace(link, fleet["view_b"])
    before_b = refused_metric(b)

    clients = Clients(fleet["proxy"].url)
    time.sleep(2.0)
    docs.run(docs.copy, detox_v2="detox-v3")  # step 2 for v3: only A's volume shows it
    rt_a, rt_b = control_latency(a), control_latency(b)
    before = os.readlink(fleet["mount"] / DATA_DIR)
    t_swap = time.monotonic()
    docs.run(docs.swap, detox_v2="detox-v3")  # step 3: v1 -> v3
    assert os.readlink(fleet["mount"] / DATA_DIR) != before
    took_a, allowed_a = wait_serving(a, "detox-v3", t_swap, rt_a)
    # B refuses the new version, says why, and keeps serving v1 while it reads it again
    deadline = time.monotonic() + 120
    while True:
        t0 = time.monotonic()
        st = presets_state(b)
        rt_b = max(rt_b, time.monotonic() - t0)
        if (st["refused"] or {}).get("reads", 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert st["mix"] == {"detox-v1": 4.0}, st
    assert "unknown steer 'detox-v3'" in st["refused"]["reason"], st
    assert st["refused"]["sha256"] == file_sha(fleet["presets_file"])
    assert st["refused"]["reads"] >= 2, st  # read again at every look
    during_b = refused_metric(b)
    assert during_b["vllm_steer:presets_file_refused"] == 1.0, during_b
    assert refused_metric(a)["vllm_steer:presets_file_refused"] == 0.0
    while time.monotonic() - t_swap < LATE:
        time.sleep(0.2)
    # the file reaches B's volume, written then renamed like the doc's step 2
    subprocess.run(["bash", "-euo", "pipefail", "-c",
                    f"cp detox-v3.safetensors {own}/.detox-v3.safetensors.tmp && "
                    f"mv {own}/.detox-v3.safetensors.tmp {own}/detox-v3.safetensors"],
                   cwd=fleet["docs"].work, check=True)
    t_file = time.monotonic()
    took_b, allowed_b = wait_serving(b, "detox-v3", t_file, rt_b)
    served = {"0": t_swap + took_a, "1": t_file + took_b}
    clients.until_new("detox-v3", served)
    calls = clients.finish()
    print(f"\n[rollout] late steer file: A served detox-v3 {took_a:.2f} s after the swap "
          f"(allowed {allowed_a:.2f} s); B refused it for {t_file - t_swap:.1f} s "
          f"({st['refused']['reads']} reads when looked at) and served it {took_b:.2f} s after "
          f"the file reached its volume (allowed {allowed_b:.2f} s)")
    check_calls(calls, {"detox-v1", "detox-v3"}, served, "detox-v3", "late steer file")
    assert took_a <= allowed_a and took_b <= allowed_b, (took_a, allowed_a, took_b, allowed_b)
    after_b = refused_metric(b)
    st = presets_state(b)
    assert st["refused"] is None and st["serving"]["sha256"] == file_sha(
        fleet["presets_file"]), st
    assert after_b["vllm_steer:presets_file_refused"] == 0.0
    # one refusal counted however many reads it took, one more version loaded
    assert after_b["vllm_steer:presets_file_refusals_total"] == \
        before_b["vllm_steer:presets_file_refusals_total"] + 1, (before_b, after_b)
    assert after_b["vllm_steer:presets_file_reloads_total"] == \
        before_b["vllm_steer:presets_file_reloads_total"] + 1, (before_b, after_b)
