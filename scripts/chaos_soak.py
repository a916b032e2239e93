#!/usr/bin/env python
"""Chaos soak: one `vllm serve` with steers under random valid and invalid traffic while steers,
presets and files change underneath it.

    python scripts/chaos_soak.py --duration 900 --clients 8 --seed 0 --report soak.json

The server is the embedded SmolLM2-135M-Instruct in float32 with two API servers, prefix
caching, a bank of 6 steers (``--steer sentiment=...`` LM-Steer, ``--steer calm=calm.gguf`` a
vector steer, and four slots), ``--steer-vectors``, a ``--steer-dir`` of 6 LM-Steer files and 4
vector steers (safetensors and llama.cpp GGUF, made for the model's hidden size and block
count) plus two vector files made for another model, ``--enable-steer-updates``, a presets
file and a ``--steer-preset``, both mixing the kinds. ``--clients`` threads send completions,
chat and responses requests, streamed or not, with ``n > 1``, logprobs, windows, presets as
model names, ``vllm_xargs``, mixes of both kinds with negative strengths, and invalid ones
(unknown steers, bad strengths and windows, oversized and malformed fields, vector files for
another model). One operator thread meanwhile loads and unloads steers of both kinds over
HTTP (a vector file for another model too: a 400 naming the block counts, and no loaded steer
lost), puts and deletes presets, rewrites the presets file (a bad version too) and replaces,
corrupts and removes steer files of both kinds in the folder.

A fixed set of greedy requests (temperature 0, steered only by the ``--steer`` steers, which
no operation touches: LM-Steer, the vector steer, both) runs among the traffic; every text
seen under load must be the first one seen for that request, and at the end each runs alone
on the same server and every text must be the solo one (float32: the plain model does not
depend on the batch on a CPU; in bf16 it does).

The report (``--report``, JSON; a summary on stdout) gives requests by kind and status, every
5xx and connection error with its request, whether the engine is alive at the end (``/health``
and a plain request), the greedy mismatches, and the RSS of the server's processes after
warm-up and at the end. The exit status is 1 when there was a 5xx, a connection error, a
mismatch or a dead engine.

``--restart-check`` then kills the engine core (SIGKILL) under traffic, records what clients
see and the server's exit status, starts the server again with the same flags and checks what
came back (the presets file, the folder, ``--steer``) and what did not (run-time loads and
presets, counters): docs/deploy.md "What a restart loses".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vllm_steer.server.launch import _tail, free_port, vllm_executable  # noqa: E402

MODEL_NAME = "smollm2"
SHIPPED = {"detox": ROOT / "steers" / "smollm2-detox.safetensors",
           "sentiment": ROOT / "steers" / "smollm2-sentiment.safetensors"}
MAX_STEERS = 6
MAX_STRENGTH = 50
DIR_NAMES = [f"d{i}" for i in range(1, 7)]  # --steer-dir LM-Steer files: over the bank
# --steer-dir vector steers: NAME.safetensors (ours) or NAME.gguf (llama.cpp); the operator
# replaces, corrupts and removes all but g1 (which a run-time preset always names)
VEC_SAFETENSORS = ["v1", "v2"]
VEC_GGUF = ["g1", "g2"]
VEC_NAMES = VEC_SAFETENSORS + VEC_GGUF
VEC_TOUCHED = ["v1", "v2", "g2"]
BAD_VEC_DIR = ["vbad", "gbad"]  # vector files of the folder made for another model
FLAG_VECTOR = "calm"  # --steer calm=calm.gguf (never unloaded)
API_NAMES = ["api1", "api2", "api3"]  # loaded by POST with a path (api3: vector files)
RT_PRESETS = ["rp1", "rp2", "rp3"]  # run-time presets
FILE_PRESETS = ["fp1", "fp2", "fp3"]
FLAG_PRESET = "fixed"  # --steer-preset fixed=sentiment:3,calm:0.5
# the soak model's shape (SmolLM2-135M: config.json hidden_size, num_hidden_layers); main()
# reads them from the served model's config
MODEL_SHAPE = {"hidden_size": 576, "num_layers": 30, "model_type": "llama"}
OTHER_LAYERS = 24  # the bad vector files: made for a model of 24 blocks

PROMPTS = ["The weather today is", "My neighbour's dog", "I went to the restaurant and",
           "The movie was", "Tell me about your day", "Our team meeting"]
CHECK_PROMPTS = PROMPTS[:3]
# the greedy check: steered only by --steer sentiment (never unloaded, never replaced)
CHECK_STEERS = {
    "plain": {},
    "sent+5": {"steer": {"sentiment": 5}},
    "sent-6": {"steer": {"sentiment": -6}},
    "window": {"steer": {"sentiment": {"strength": 8, "start": 2, "end": 9, "ramp": 3}}},
    "xargs": {"vllm_xargs": {"steer": "sentiment:4"}},
    "preset": {"model": FLAG_PRESET},
    # the vector steer given by --steer (a GGUF): alone, negative, windowed, with LM-Steer
    "calm+0.8": {"steer": {FLAG_VECTOR: 0.8}},
    "calm-0.7": {"steer": {FLAG_VECTOR: -0.7}},
    "calm-window": {"steer": {FLAG_VECTOR: {"strength": 1, "start": 1, "end": 8, "ramp": 2}}},
    "calm+sent": {"steer": {FLAG_VECTOR: 0.6, "sentiment": -4}},
}
CHECK_TOKENS = 16
TIMEOUT = 300


# ---------------------------------------------------------------------------- the server
def server_args(model: str, work: Path, dtype: str) -> list[str]:
    return [model, "--served-model-name", MODEL_NAME, "--dtype", dtype,
            "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", str(1 << 28), "--enforce-eager",
            "--api-server-count", "2", "--max-steers", str(MAX_STEERS),
            "--enable-prefix-caching", "--steer-vectors",
            "--steer", f"sentiment={SHIPPED['sentiment']}",
            "--steer", f"{FLAG_VECTOR}={work / 'calm.gguf'}",
            "--steer-dir", str(work / "steers"), "--enable-steer-updates",
            "--steer-presets-file", str(work / "presets.json"),
            "--steer-preset", f"{FLAG_PRESET}=sentiment:3,{FLAG_VECTOR}:0.5",
            "--steer-max-strength", str(MAX_STRENGTH)]


class Server:
    """`vllm serve ARGS` on loopback; unlike vllm_steer.server.launch.serve it keeps the
    process, so that its exit status can be read after an engine core is killed."""

    def __init__(self, args: list[str], log: Path, timeout: float = 900.0, attempts: int = 3):
        self.log = log
        t0 = time.time()
        self._start(args)
        while True:
            if self.proc.poll() is not None:
                attempts -= 1  # another process bound the port first: another port
                if attempts and "Address already in use" in _tail(log):
                    self.f.close()
                    self._start(args)
                    continue
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{_tail(log)}")
            if time.time() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"vllm serve did not come up in {timeout:.0f} s:\n"
                                   f"{_tail(log)}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        self.start_s = time.time() - t0

    def _start(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [vllm_executable(), "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.f = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.f, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def processes(self):
        import psutil

        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_mb(self) -> dict:
        import psutil

        out = {}
        for p in self.processes():
            try:
                out[f"{p.pid} {p.name()}"] = round(p.memory_info().rss / 2**20, 1)
            except psutil.NoSuchProcess:
                pass
        return out

    def engine_cores(self):
        """The engine-core processes: vLLM's log names each process and its pid
        ("(EngineCore_DP0 pid=123) INFO ..."); the process titles need setproctitle."""
        import re

        pids = {int(p) for p in re.findall(r"\(EngineCore\w* pid=(\d+)\)",
                                           self.log.read_text(errors="replace"))}
        out = []
        for p in self.processes():
            try:
                if p.pid in pids or "EngineCore" in p.name() or \
                        any("EngineCore" in a for a in p.cmdline()):
                    out.append(p)
            except Exception:
                pass
        return out

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.f.close()


class Attached:
    """A server this script did not start (``--url``)."""

    def __init__(self, url):
        self.url, self.start_s = url.rstrip("/"), 0.0
        self.proc = argparse.Namespace(returncode=None)

    def rss_mb(self):
        return {}

    def stop(self):
        pass


# ---------------------------------------------------------------------------- files
def atomic_write(path: Path, data: bytes):
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def good_presets(rng: random.Random) -> dict:
    mixes = [{"sentiment": 3}, {"d1": 2, "sentiment": -1}, {"d2": -3}, {"sentiment": -5},
             {"d3": 4}, "sentiment:2,d4:1", {FLAG_VECTOR: 0.6}, {"v1": -0.8, "sentiment": 2},
             f"{FLAG_VECTOR}:-0.5,d5:3", {"v2": 0.5, FLAG_VECTOR: 0.4}]
    return {"presets": {name: rng.choice(mixes) for name in FILE_PRESETS}}


def vector_bytes(seed: int, blocks, gguf: bool, num_layers: int | None = None) -> bytes:
    """A vector steer's file: a random unit-scale vector (N(0, 1) entries) for each of
    ``blocks``, made for the soak model (or, with ``num_layers``, for a model of that many
    blocks)."""
    import torch

    from vllm_steer.vectors import make_vector_steer, save_gguf, save_vector

    g = torch.Generator().manual_seed(seed)
    vs = make_vector_steer(
        {k: torch.randn(MODEL_SHAPE["hidden_size"], generator=g) for k in blocks},
        f"soak{seed}", model_type=MODEL_SHAPE["model_type"],
        model_layers=num_layers or MODEL_SHAPE["num_layers"])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("v.gguf" if gguf else "v.safetensors")
        (save_gguf if gguf else save_vector)(path, vs)
        return path.read_bytes()


def vector_files() -> dict:
    """Every vector file of the soak, by role, as bytes (made once, seeded)."""
    n = MODEL_SHAPE["num_layers"]
    mid = list(range(n // 3, 2 * n // 3))
    out = {FLAG_VECTOR: vector_bytes(1, mid, gguf=True)}
    for i, name in enumerate(VEC_NAMES):
        out[name] = vector_bytes(10 + i, mid[i::2], gguf=name in VEC_GGUF)
    # replacements the operator writes over v*/g2 (other vectors, the same kind of file)
    out["alt.safetensors"] = [vector_bytes(20 + i, mid[:3 + i], gguf=False) for i in range(2)]
    out["alt.gguf"] = [vector_bytes(30 + i, mid[i:4 + i], gguf=True) for i in range(2)]
    # made for a model of OTHER_LAYERS blocks: refused with a 400 naming both block counts
    out["vbad"] = vector_bytes(40, [1, 2], gguf=False, num_layers=OTHER_LAYERS)
    out["gbad"] = vector_bytes(41, [1, 2], gguf=True, num_layers=OTHER_LAYERS)
    return out


VECTOR_FILES: dict = {}


def vec_file(name: str) -> str:
    return f"{name}.gguf" if name in VEC_GGUF or name == "gbad" else f"{name}.safetensors"


def setup_work(work: Path, rng: random.Random):
    (work / "steers").mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(DIR_NAMES):
        src = SHIPPED["detox" if i % 2 == 0 else "sentiment"]
        shutil.copyfile(src, work / "steers" / f"{name}.safetensors")
    if not VECTOR_FILES:
        VECTOR_FILES.update(vector_files())
    atomic_write(work / "calm.gguf", VECTOR_FILES[FLAG_VECTOR])
    for name in VEC_NAMES + BAD_VEC_DIR:
        atomic_write(work / "steers" / vec_file(name), VECTOR_FILES[name])
    # the presets file names both kinds (but no GGUF-only steer of the folder: see Operator)
    doc = {"presets": {"fp1": {"sentiment": 3}, "fp2": {"d1": 2, "v1": -0.5},
                       "fp3": f"d2:-3,{FLAG_VECTOR}:0.7"}}
    atomic_write(work / "presets.json", json.dumps(doc).encode())


def restore_work(work: Path):
    setup_work(work, random.Random(0))
    keep = {f"{n}.safetensors" for n in DIR_NAMES} | {vec_file(n) for n in
                                                        VEC_NAMES + BAD_VEC_DIR}
    for p in (work / "steers").iterdir():
        if p.name not in keep:
            p.unlink()


# ---------------------------------------------------------------------------- requests
def vllm_logprobs_key_error(message: str, desc: str) -> bool:
    """Whether a 500 in a completion stream is vLLM's own ``KeyError`` in
    ``_create_completion_logprobs`` (the error's message is the token id alone), which stock
    vLLM 0.32 raises when a step's top-logprobs dict lacks the sampled token (an upstream bug:
    vllm-project/vllm pull request 53722, open). Counted apart from the plugin's 5xx, and
    reported; the plugin's own 500s name vllm-steer."""
    import re

    return bool(re.search(r'"message":\s*"\d+"', message)) and '"logprobs"' in desc \
        and '"stream": true' in desc


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_status = collections.Counter()  # status (int or "conn_error")
        self.by_kind = collections.defaultdict(collections.Counter)
        self.unexpected = collections.Counter()  # kind -> count of statuses outside its set
        self.examples = collections.defaultdict(list)  # "5xx"/"conn"/"unexpected" -> few
        self.ops = collections.defaultdict(collections.Counter)
        self.greedy = collections.defaultdict(list)  # key -> texts seen under load
        self.stream_errors = collections.Counter()  # error events in 200 streams, by code
        self.bad_vector = collections.Counter()  # "ok"/"failed": Operator.bad_vector checks

    def record(self, kind, status, allowed, desc, body_text="", code=None):
        code = status if code is None else code
        with self.lock:
            self.by_status[status] += 1
            self.by_kind[kind][status] += 1
            bad = None
            if status == "conn_error":
                bad = "conn_error"
            elif isinstance(code, int) and code >= 500:
                bad = "5xx"
            elif status == "stream_error":  # a stream cut without an error code
                bad = "conn_error"
            elif status == "stream vllm #53722":  # vLLM's own KeyError (see that function)
                bad = "vllm_known"
            elif str(status).startswith("stream "):  # a refusal inside a 200 stream
                bad = "stream_refusal"
                if status not in allowed:
                    self.unexpected[kind] += 1
            elif status not in allowed:
                self.unexpected[kind] += 1
                bad = "unexpected"
            if bad and len(self.examples[bad]) < (5 if bad == "stream_refusal" else 20):
                self.examples[bad].append({"kind": kind, "status": status, "request": desc,
                                           "response": body_text[:400]})

    def op(self, kind, status):
        with self.lock:
            self.ops[kind][status] += 1
            # 507: the documented refusal of a load into a full bank (names --max-steers)
            if status == "conn_error" or (isinstance(status, int) and status >= 500
                                          and status != 507):
                self.by_status[f"op {status}"] += 1
                if len(self.examples["op_error"]) < 20:
                    self.examples["op_error"].append({"op": kind, "status": status})


def steer_value(rng: random.Random, vector: bool = False):
    """A valid strength: a number, a numeric string or a window; for a vector steer (its
    strength is the raw coefficient of unit-scale vectors) within [-1.2, 1.2]."""
    s = rng.choice([rng.randint(-1, 1), round(rng.uniform(-1.2, 1.2), 2)]) if vector else \
        rng.choice([rng.randint(-8, 8), round(rng.uniform(-10, 10), 2)])
    r = rng.random()
    if r < 0.6:
        return s
    if r < 0.7:
        return str(s)
    w = {"strength": s}
    if rng.random() < 0.5:
        w["start"] = rng.randint(0, 6)
    if rng.random() < 0.5:
        w["end"] = w.get("start", 0) + rng.randint(1, 10)
    if rng.random() < 0.5:
        w["ramp"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        w["base"] = rng.randint(-2, 2)
    return w


def valid_steer(rng: random.Random, k_max: int = 2) -> dict:
    """1 to ``k_max`` steers of any kind: LM-Steer, vector or both (api3 holds a vector)."""
    lm = ["sentiment"] + DIR_NAMES + API_NAMES[:2]
    vec = [FLAG_VECTOR] + VEC_NAMES + API_NAMES[2:]
    names = rng.choice([lm, vec, lm + vec, lm + vec])
    k = rng.randint(1, k_max)
    return {n: steer_value(rng, n in vec) for n in rng.sample(names, k)}


# Invalid steer fields: each a 400 naming the problem (a few depend on the state: 404 for a
# model, 400 for all steer fields).
INVALID_STEERS = [
    {"steer": {"nothere": 1}},
    {"steer": {"sentiment": True}},
    {"steer": {"sentiment": [1]}},
    {"steer": {"sentiment": "nan"}},
    {"steer": {"sentiment": "0x10"}},
    {"steer": {"sentiment": "1e400"}},
    {"steer": {"sentiment": MAX_STRENGTH + 1}},
    {"steer": {"sentiment": 3.5e9}},
    {"steer": {"sentiment": {"strength": 3, "start": 5, "end": 5}}},
    {"steer": {"sentiment": {"strength": 3, "start": 1.5}}},
    {"steer": {"sentiment": {"strength": 3, "start": 2000000}}},
    {"steer": {"sentiment": {"strength": 3, "speed": 2}}},
    {"steer": {"sentiment": {"start": 2}}},
    {"steer": {"../d1": 1}},
    {"steer": {"a/b": 1}},
    {"steer": {"..": 1}},
    {"steer": {"x" * 5000: 1}},
    {"steer": {f"s{i}": 1 for i in range(600)}},
    {"steer": "sentiment"},
    {"steer": 5},
    {"steer": [["sentiment", 1]]},
    {"vllm_xargs": {"steer": "sentiment:"}},
    {"vllm_xargs": {"steer": "sentiment:1,sentiment:2"}},
    {"vllm_xargs": {"steer": ":::"}},
    {"vllm_xargs": {"steer": "sentiment:1"}, "steer": {"sentiment": 1}},
    # more steers than the bank holds
    {"steer": {"d1": 1, "d2": 1, "d3": 1, "d4": 1, "d5": 1, "v1": 1, "g1": 0.5}},
    {"steer": {FLAG_VECTOR: 51}},
    {"steer": {FLAG_VECTOR: {"strength": 0.5, "start": 4, "end": 2}}},
    # vector files of the folder made for another model (OTHER_LAYERS blocks)
    {"steer": {"vbad": 0.5}},
    {"steer": {"gbad": -0.5, FLAG_VECTOR: 0.3}},
    {"steer": {"vbad": 0.5, "sentiment": 2}},
    {"steer": {"d1": 1, "d2": 1, "d3": 1, "d4": 1, "d5": 1, "d6": 1, "v2": 1}},
    {"steer": {"sentiment": 2}, "use_beam_search": True, "n": 2},
]


class Client(threading.Thread):
    def __init__(self, i, base, stats, rng, stop):
        super().__init__(daemon=True, name=f"client-{i}")
        self.base, self.stats, self.rng, self.stop = base, stats, rng, stop
        self.s = requests.Session()
        # the first request of the first clients: greedy checks of the vector steer, of both
        # kinds and plain, and an invalid request, so that a short soak on a busy machine
        # checks each (the others start at random)
        self.first_key = ["calm+0.8", "calm+sent", "plain", None][i] if i < 4 else None
        self.first_r = 0.8 if i == 3 else None

    def run(self):
        while not self.stop.is_set():
            try:
                self.one()
            except Exception as e:  # a bug in this script: count it, keep going
                self.stats.record("script_error", "script_error", set(), repr(e))

    # -- building blocks
    def send(self, kind, path, body, allowed, stream=False, raw=None):
        desc = raw.decode(errors="replace")[:300] if raw is not None else \
            json.dumps(body)[:300]
        try:
            if raw is not None:
                r = self.s.post(self.base + path, data=raw, timeout=TIMEOUT,
                                headers={"Content-Type": "application/json"})
            else:
                r = self.s.post(self.base + path, json=body, stream=stream, timeout=TIMEOUT)
        except requests.RequestException as e:
            self.stats.record(kind, "conn_error", allowed, desc, repr(e))
            return None, None
        text = None
        if stream and r.status_code == 200:
            try:
                text = read_stream(r, path)
            except StreamError as e:
                # an error event after the 200 headers: a refusal (400) or a failure (500)
                code = e.code if isinstance(e.code, int) else "stream_error"
                if code == 500 and vllm_logprobs_key_error(str(e), desc):
                    code = "vllm #53722"  # vLLM's own failure, counted apart (see there)
                with self.stats.lock:
                    self.stats.stream_errors[code] += 1
                status = code if code == "stream_error" else f"stream {code}"
                self.stats.record(kind, status, {f"stream {a}" for a in allowed}, desc,
                                  str(e), code=code)
                return None, None
            except requests.RequestException as e:
                self.stats.record(kind, "conn_error", allowed, desc, repr(e))
                return None, None
        body_text = r.text if not stream or r.status_code != 200 else ""
        self.stats.record(kind, r.status_code, allowed, desc, body_text)
        if r.status_code != 200:
            return r.status_code, None
        if text is None:
            text = response_text(r.json(), path)
        return 200, text

    def body(self, path, prompt, extra=None, max_tokens=None):
        rng = self.rng
        mt = max_tokens or rng.randint(1, 24)
        if path == "/v1/completions":
            b = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": mt}
        elif path == "/v1/chat/completions":
            b = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
                 "max_tokens": mt}
        else:
            b = {"model": MODEL_NAME, "input": prompt, "max_output_tokens": mt}
        b.update(extra or {})
        return b

    def n_logprobs(self, prompt):
        rng = self.rng
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        extra = {"n": rng.randint(2, 4), "temperature": 0.9, "seed": rng.randint(0, 99),
                 "steer": {"sentiment": steer_value(rng)}}
        if rng.random() < 0.5:
            extra["steer"][FLAG_VECTOR] = steer_value(rng, vector=True)
        if path == "/v1/completions":
            extra["logprobs"] = rng.randint(0, 5)
            if rng.random() < 0.3:
                extra["echo"] = True
        else:
            extra.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        stream = rng.random() < 0.3
        b = self.body(path, prompt, extra)
        b["stream"] = stream
        self.send("n_logprobs", path, b, {200}, stream=stream)

    def one(self):
        rng = self.rng
        r = rng.random() if self.first_r is None else self.first_r
        self.first_r = None
        path = rng.choice(["/v1/completions", "/v1/completions", "/v1/chat/completions",
                           "/v1/responses"])
        prompt = rng.choice(PROMPTS)
        if r < 0.25 or self.first_key:  # the greedy check
            key_prompt = rng.randrange(len(CHECK_PROMPTS))
            key_steer = self.first_key or rng.choice(list(CHECK_STEERS))
            self.first_key = None
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            extra = dict(CHECK_STEERS[key_steer], temperature=0)
            if rng.random() < 0.3:
                extra.update({"logprobs": 2} if path == "/v1/completions"
                             else {"logprobs": True, "top_logprobs": 2})
            stream = rng.random() < 0.4
            b = self.body(path, CHECK_PROMPTS[key_prompt], extra, CHECK_TOKENS)
            b["stream"] = stream
            status, text = self.send("greedy_check", path, b, {200}, stream=stream)
            if status == 200:
                with self.stats.lock:
                    self.stats.greedy[f"{path} {key_prompt} {key_steer}"].append(text)
        elif r < 0.55:  # steered with any steer: the folder's may be gone, full or corrupt
            extra = {"steer": valid_steer(rng, 3), "temperature": rng.choice([0, 0.7, 1.0])}
            if rng.random() < 0.2:
                extra["model"] = rng.choice(FILE_PRESETS + RT_PRESETS + [FLAG_PRESET])
            stream = path != "/v1/responses" and rng.random() < 0.4
            b = self.body(path, prompt, extra)
            b["stream"] = stream
            # 429: first-use steers that fit, but every slot holds a steer running requests use
            self.send("steered", path, b, {200, 400, 404, 429, 507}, stream=stream)
        elif r < 0.65:  # n > 1, logprobs, seeds
            self.n_logprobs(prompt)
        elif r < 0.72:  # presets as model names
            extra = {"model": rng.choice(FILE_PRESETS + RT_PRESETS + [FLAG_PRESET]),
                     "temperature": 0}
            if rng.random() < 0.3:
                extra["steer"] = rng.choice([{"sentiment": steer_value(rng)},
                                             {FLAG_VECTOR: steer_value(rng, vector=True)}])
            self.send("preset_model", path, self.body(path, prompt, extra),
                      {200, 400, 404, 429})
        elif r < 0.92:  # invalid steer fields
            # beam search exists on completions and chat only: the Responses API has no such
            # field, and a steered request with one is served (200) as if it were not there
            extra = dict(rng.choice(INVALID_STEERS if path != "/v1/responses" else
                                    [e for e in INVALID_STEERS if "use_beam_search" not in e]))
            stream = path != "/v1/responses" and rng.random() < 0.3
            b = self.body(path, prompt, extra)
            b["stream"] = stream
            # a bad file of the folder is read once a slot is free: a full bank is a 429 first
            steer = extra.get("steer")
            bad_file = isinstance(steer, dict) and set(steer) & set(BAD_VEC_DIR)
            self.send("invalid_steer", path, b, {400, 429} if bad_file else {400},
                      stream=stream)
        else:  # malformed requests
            choice = rng.randrange(7)
            if choice == 0:
                self.send("malformed", path, None, {400, 422}, raw=b'{"model": "smollm2", "pro')
            elif choice == 1:
                b = self.body(path, "word " * 2000)  # over --max-model-len
                self.send("malformed", path, b, {400})
            elif choice == 2:
                b = self.body(path, prompt, {"max_tokens": 100000, "max_output_tokens": 100000})
                self.send("malformed", path, b, {400})
            elif choice == 3:
                b = self.body(path, prompt, {"model": "no-such-model"})
                self.send("malformed", path, b, {404})
            elif choice == 4:
                b = self.body(path, prompt, {"max_tokens": "many", "max_output_tokens": "x"})
                self.send("malformed", path, b, {400, 422})
            elif choice == 5:
                b = self.body(path, prompt, {"temperature": -1})
                self.send("malformed", path, b, {400, 422})
            else:
                self.send("malformed", path, None, {400, 422}, raw=b"\xff\xfe not json")


class StreamError(Exception):
    def __init__(self, msg, code=None):
        super().__init__(msg)
        self.code = code


def read_stream(r, path) -> str:
    """The text of a streamed response (the first choice); an error event is a StreamError."""
    parts, done = [], False
    for line in r.iter_lines():
        if not line:
            continue
        if line.startswith(b"event:"):
            continue
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            done = True
            break
        ev = json.loads(data)
        if "error" in ev and "choices" not in ev:
            err = ev["error"] if isinstance(ev["error"], dict) else {}
            raise StreamError(json.dumps(ev)[:400], err.get("code"))
        if ev.get("type") in ("error", "response.failed"):
            raise StreamError(json.dumps(ev)[:400], ev.get("code") or 500)
        if path == "/v1/responses":
            if ev.get("type") == "response.output_text.delta":
                parts.append(ev.get("delta", ""))
            if ev.get("type") == "response.completed":
                done = True
            continue
        for c in ev.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            if "text" in c:
                parts.append(c["text"] or "")
            else:
                parts.append((c.get("delta") or {}).get("content") or "")
    if not done:
        raise StreamError("stream ended without [DONE]")
    return "".join(parts)


def response_text(j, path) -> str:
    if path == "/v1/completions":
        return j["choices"][0]["text"]
    if path == "/v1/chat/completions":
        return j["choices"][0]["message"]["content"] or ""
    return "".join(c.get("text", "") for o in j.get("output", [])
                   for c in o.get("content", []) or [])


class Operator(threading.Thread):
    """Management calls and file changes, one every 0.2-1.5 s."""

    def __init__(self, base, stats, rng, stop, work: Path):
        super().__init__(daemon=True, name="operator")
        self.base, self.stats, self.rng, self.stop, self.work = base, stats, rng, stop, work
        self.s = requests.Session()
        self.SWEEP = list(self.SWEEP)

    def call(self, kind, method, path, body=None):
        try:
            r = self.s.request(method, self.base + path, json=body, timeout=TIMEOUT)
            self.stats.op(kind, r.status_code)
        except requests.RequestException:
            self.stats.op(kind, "conn_error")

    def run(self):
        while not self.stop.is_set():
            try:
                self.one()
            except Exception as e:
                self.stats.op(f"script_error {e!r}"[:80], "script_error")
            self.stop.wait(self.rng.uniform(0.2, 1.5))

    # the first operations: one of each kind (presets file and steer files first), so that a
    # short soak on a slow machine has them all; then at random
    SWEEP = [0.7, 0.8, 0.05, 0.24, 0.5, 0.44, 0.3, 0.18, 0.57, 0.62, 0.23, 0.7, 0.8, 0.95]

    def one(self):
        rng, steers = self.rng, self.work / "steers"
        r = self.SWEEP.pop(0) if self.SWEEP else rng.random()
        if r < 0.15:
            self.call("load_dir", "POST", "/v1/steers",
                      {"name": rng.choice(DIR_NAMES + VEC_NAMES)})
        elif r < 0.22:
            if rng.random() < 0.5:  # an LM-Steer steer by path
                self.call("load_path", "POST", "/v1/steers",
                          {"name": rng.choice(API_NAMES[:2]),
                           "path": str(steers / f"{rng.choice(DIR_NAMES)}.safetensors")})
            else:  # a vector steer by path: safetensors or GGUF
                self.call("load_path_vector", "POST", "/v1/steers",
                          {"name": API_NAMES[2],
                           "path": str(steers / vec_file(rng.choice(VEC_NAMES)))})
        elif r < 0.25:
            if r < 0.235:
                self.call("load_bad", "POST", "/v1/steers",
                          rng.choice([{"name": "../x"}, {"name": "x", "path": "/etc/passwd"},
                                      {"name": "nothere"}, {"name": 5}, {}]))
            else:
                self.bad_vector()
        elif r < 0.42:
            self.call("unload", "DELETE",
                      f"/v1/steers/{rng.choice(DIR_NAMES + VEC_NAMES + API_NAMES)}")
        elif r < 0.46:  # a run-time preset naming a GGUF-only vector steer of the folder
            self.call("preset_put_gguf", "PUT", f"/v1/steer-presets/{rng.choice(RT_PRESETS)}",
                      {"steer": {"g1": round(rng.uniform(-1, 1), 2), "sentiment": 2}})
        elif r < 0.55:
            mix = valid_steer(rng, 2)
            mix = {k: (v["strength"] if isinstance(v, dict) else float(v))
                   for k, v in mix.items()}
            if rng.random() < 0.2:
                mix = rng.choice([{"nothere": 1}, {"sentiment": 99}, {}, "x"])
            self.call("preset_put", "PUT", f"/v1/steer-presets/{rng.choice(RT_PRESETS)}",
                      {"steer": mix})
        elif r < 0.6:
            self.call("preset_post", "POST", "/v1/steer-presets",
                      {"name": rng.choice(RT_PRESETS + FILE_PRESETS + [MODEL_NAME]),
                       "steer": {"sentiment": rng.randint(-5, 5)}})
        elif r < 0.68:
            self.call("preset_delete", "DELETE",
                      f"/v1/steer-presets/{rng.choice(RT_PRESETS + FILE_PRESETS)}")
        elif r < 0.78:
            kind = rng.choice(["good", "good", "bad_json", "bad_steer", "bad_strength"])
            doc = {"good": lambda: json.dumps(good_presets(rng)),
                   "bad_json": lambda: '{"presets": {"fp1": ',
                   "bad_steer": lambda: json.dumps({"presets": {"fp1": {"nothere": 1}}}),
                   "bad_strength": lambda: json.dumps({"presets": {"fp1": {"sentiment": 99}}}),
                   }[kind]()
            atomic_write(self.work / "presets.json", doc.encode())
            self.stats.op("presets_file", kind)
        elif r < 0.88:
            name = rng.choice(DIR_NAMES + VEC_TOUCHED)
            kind = rng.choice(["replace", "replace", "remove", "corrupt"])
            path = steers / (f"{name}.safetensors" if name in DIR_NAMES else vec_file(name))
            if kind == "replace" and name in DIR_NAMES:
                atomic_write(path, SHIPPED[rng.choice(["detox", "sentiment"])].read_bytes())
            elif kind == "replace":  # another vector, in the same format
                atomic_write(path, rng.choice(VECTOR_FILES["alt" + path.suffix]))
            elif kind == "remove":
                path.unlink(missing_ok=True)
            else:
                atomic_write(path, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
            self.stats.op("steer_file", kind)
        else:
            self.call("get", "GET", rng.choice(["/v1/steers", "/v1/steer-presets",
                                                "/v1/models", "/metrics", "/health"]))

    def listing(self) -> set | None:
        try:
            r = self.s.get(self.base + "/v1/steers", timeout=TIMEOUT)
            return {s["name"] for s in r.json()["data"]} if r.ok else None
        except (requests.RequestException, ValueError, KeyError):
            return None

    def bad_vector(self):
        """POST a vector file made for a model of OTHER_LAYERS blocks: a 400 that names both
        block counts, and no steer loaded before it lost (the steers no request loads or
        evicts: the --steer ones and those this thread loaded by path)."""
        before = self.listing()
        kept = (before or set()) & ({"sentiment", FLAG_VECTOR} | set(API_NAMES))
        # inside --steer-dir (a path outside it is a 403 without --steer-updates-any-path)
        path = self.work / "steers" / vec_file(self.rng.choice(BAD_VEC_DIR))
        try:
            r = self.s.post(self.base + "/v1/steers", timeout=TIMEOUT,
                            json={"name": self.rng.choice(["badv", API_NAMES[2]]),
                                  "path": str(path)})
        except requests.RequestException:
            self.stats.op("load_bad_vector", "conn_error")
            return
        self.stats.op("load_bad_vector", r.status_code)
        after = self.listing()
        if r.status_code == 507:  # the bank is full of steers never evicted: no file read
            with self.stats.lock:
                self.stats.bad_vector["bank full (507)"] += 1
            return
        problems = []
        if r.status_code != 400:
            problems.append(f"HTTP {r.status_code}, not 400")
        want = [f"{OTHER_LAYERS} decoder blocks", str(MODEL_SHAPE["num_layers"])]
        if not all(w in r.text for w in want):
            problems.append(f"the message does not name {want}")
        if after is None or kept - after:
            problems.append(f"loaded steers lost: {sorted(kept - (after or set()))}")
        with self.stats.lock:
            self.stats.bad_vector["ok" if not problems else "failed"] += 1
            if problems and len(self.stats.examples["bad_vector"]) < 10:
                self.stats.examples["bad_vector"].append(
                    {"path": str(path), "status": r.status_code, "response": r.text[:400],
                     "problems": problems, "before": sorted(before or []),
                     "after": sorted(after or [])})


# ---------------------------------------------------------------------------- phases
def plain_ok(base) -> tuple[bool, str]:
    try:
        h = requests.get(base + "/health", timeout=30).status_code
        r = requests.post(base + "/v1/completions", timeout=120,
                          json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
        return h == 200 and r.status_code == 200, f"/health {h}, plain request {r.status_code}"
    except requests.RequestException as e:
        return False, repr(e)


def solo_texts(base, keys) -> dict:
    out = {}
    for key in sorted(keys):
        path, p, steer = key.split(" ")
        b = {"model": MODEL_NAME, "max_tokens": CHECK_TOKENS, "temperature": 0,
             **CHECK_STEERS[steer]}
        if path == "/v1/completions":
            b["prompt"] = CHECK_PROMPTS[int(p)]
        else:
            b["messages"] = [{"role": "user", "content": CHECK_PROMPTS[int(p)]}]
        r = requests.post(base + path, json=b, timeout=TIMEOUT)
        print(f"[solo] {key}: {r.status_code}", flush=True)
        out[key] = response_text(r.json(), path) if r.status_code == 200 else \
            f"HTTP {r.status_code}: {r.text[:200]}"
    return out


def soak(base, work, args, server) -> dict:
    stats, stop = Stats(), threading.Event()
    seed = random.Random(args.seed)
    clients = [Client(i, base, stats, random.Random(seed.random()), stop)
               for i in range(args.clients)]
    op = Operator(base, stats, random.Random(seed.random()), stop, work)
    for t in clients:
        t.start()
    op.start()
    t0 = last = time.time()
    try:
        while time.time() - t0 < args.duration:
            time.sleep(1)
            if time.time() - last >= 10:
                last = time.time()
                with stats.lock:
                    n = sum(v for k, v in stats.by_status.items() if not str(k).startswith("op"))
                    s5 = sum(v for k, v in stats.by_status.items()
                             if isinstance(k, int) and k >= 500) + sum(
                        v for k, v in stats.stream_errors.items()
                        if isinstance(k, int) and k >= 500)
                    ce = stats.by_status.get("conn_error", 0) + \
                        stats.by_status.get("stream_error", 0)
                    st = dict(sorted((str(k), v) for k, v in stats.by_status.items()))
                    nops = sum(sum(c.values()) for c in stats.ops.values())
                print(f"[soak {time.time() - t0:6.0f}s] requests {n} ({n / (last - t0):.1f}/s) "
                      f"5xx {s5} conn_errors {ce} ops {nops} by status {st}", flush=True)
    finally:
        stop.set()
        for t in clients + [op]:
            t.join(TIMEOUT + 10)
    elapsed = time.time() - t0
    return {"stats": stats, "elapsed_s": elapsed}


def wait_idle(base: str, timeout: float) -> float | None:
    """Seconds until vLLM reports no request running or waiting (``/metrics``), None if it
    never did within ``timeout``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            text = requests.get(base + "/metrics", timeout=10).text
            busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(("vllm:num_requests_running{",
                                           "vllm:num_requests_waiting{")))
            if busy == 0:
                return round(time.time() - t0, 1)
        except (requests.RequestException, ValueError, IndexError):
            pass
        time.sleep(1.0)
    return None


def restart_check(args_list, work, log_dir, server) -> dict:
    """Kill the engine core under traffic; what clients see; the exit status; a restart."""
    base = server.url
    out: dict = {}
    if server.proc.poll() is not None or not plain_ok(base)[0]:
        out["error"] = f"the server had died before the kill (exit {server.proc.poll()})"
        server.stop()
        return out
    # run-time state to lose: a steer loaded over HTTP, a run-time preset, counters
    # a file of its own (the soak's operator may have corrupted or removed any d*.safetensors)
    own = work / "steers" / "restart-check.safetensors"
    atomic_write(own, SHIPPED["detox"].read_bytes())
    out["engine_idle_after_s"] = wait_idle(base, 180)  # the soak's last requests finish
    deadline = time.time() + 180  # a loaded machine's last soak requests may still run
    while True:  # 507: every slot holds a steer that requests still in the engine use
        loaded = requests.post(base + "/v1/steers", json={"name": "api1", "path": str(own)},
                               timeout=120)
        if loaded.status_code != 507 or time.time() > deadline:
            break
        time.sleep(1.0)
    out["api1_load_status"] = loaded.status_code
    if loaded.status_code != 200:  # what the operator would read: the answer and the listing
        out["api1_load_error"] = loaded.text[:600]
        listing = requests.get(base + "/v1/steers", timeout=60)
        out["api1_load_listing"] = listing.json() if listing.ok else listing.text[:600]
    requests.put(base + "/v1/steer-presets/rp1", json={"steer": {"sentiment": 2}}, timeout=120)
    before = state(base)
    out["before_kill"] = before
    cores = server.engine_cores()
    out["engine_cores"] = [f"{p.pid} {p.name()}" for p in cores]
    if not cores or server.proc.poll() is not None:
        out["error"] = (f"the server had exited ({server.proc.returncode}) before the kill"
                        if server.proc.poll() is not None else "no engine core process found")
        server.stop()
        return out
    seen = collections.Counter()
    stop = threading.Event()

    def traffic():
        s = requests.Session()
        while not stop.is_set():
            try:
                r = s.post(base + "/v1/completions", timeout=30,
                           json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 8,
                                 "steer": {"sentiment": 3}})
                seen[r.status_code] += 1
            except requests.RequestException as e:
                seen[type(e).__name__] += 1
                time.sleep(0.2)

    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    t_kill = time.time()
    cores[0].send_signal(signal.SIGKILL)
    try:
        code = server.proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None
    out["server_exit_s"] = round(time.time() - t_kill, 1)
    out["server_exit_code"] = code
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join(40)
    out["clients_saw"] = {str(k): v for k, v in seen.items()}
    server.stop()
    # the restart: the same flags
    s2 = Server(args_list, log_dir / "server-restart.log")
    try:
        b2 = s2.url
        out["restart_start_s"] = round(s2.start_s, 1)
        after = {}
        # the presets file and the folder serve again; --steer too
        for name, body in [("file_preset", {"model": "fp1"}),
                           ("steer_dir", {"steer": {"d3": 4}}),
                           ("flag_steer", {"steer": {"sentiment": 4}}),
                           ("flag_preset", {"model": FLAG_PRESET}),
                           ("flag_vector", {"steer": {FLAG_VECTOR: 0.5}}),
                           ("steer_dir_vector", {"steer": {"g2": -0.5, "v1": 0.5}}),
                           ("runtime_preset", {"model": "rp1"}),
                           ("runtime_loaded_name", {"steer": {"api1": 4}})]:
            r = requests.post(b2 + "/v1/completions", timeout=120,
                              json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4,
                                    **body})
            after[name] = r.status_code
        out["after_restart_status"] = after
        out["after_restart"] = state(b2)
    finally:
        s2.stop()
    out["restart_exit_code"] = s2.proc.returncode
    return out


def quiet_vector_check(base, work) -> dict:
    """With no traffic: room in the bank, then both bad vector files (made for another model)
    by POST: each a 400 naming both block counts, the listing the same after as before, and
    the --steer vector steer's greedy text the same after as before."""
    out: dict = {"ok": True, "posts": []}
    for name in API_NAMES + DIR_NAMES + VEC_NAMES:  # all but the --steer ones
        requests.delete(base + f"/v1/steers/{name}", timeout=120)
    body = {"model": MODEL_NAME, "prompt": CHECK_PROMPTS[0], "max_tokens": CHECK_TOKENS,
            "temperature": 0, "steer": {FLAG_VECTOR: 0.8}}

    def snapshot():
        ls = requests.get(base + "/v1/steers", timeout=120).json()["data"]
        g = requests.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
        return sorted(s["name"] for s in ls), (g.json()["choices"][0]["text"] if g.ok
                                               else f"HTTP {g.status_code}")
    before = snapshot()
    for f in map(vec_file, BAD_VEC_DIR):
        r = requests.post(base + "/v1/steers", timeout=120,
                          json={"name": "badv", "path": str(work / "steers" / f)})
        named = f"{OTHER_LAYERS} decoder blocks" in r.text and \
            str(MODEL_SHAPE["num_layers"]) in r.text
        out["posts"].append({"file": f, "status": r.status_code, "names_both": named,
                             "response": r.text[:400]})
        out["ok"] &= r.status_code == 400 and named
    after = snapshot()
    out.update(listing_before=before[0], listing_after=after[0],
               greedy_same=before[1] == after[1])
    out["ok"] &= before == after
    return out


def state(base) -> dict:
    import re

    st = requests.get(base + "/v1/steers", timeout=60).json()
    pr = requests.get(base + "/v1/steer-presets", timeout=60).json()
    metrics = requests.get(base + "/metrics", timeout=60).text
    steered = sum(float(m) for m in re.findall(
        r"^vllm_steer:requests_steered_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M))
    return {"steers": sorted(s["name"] for s in st["data"]), "presets": pr,
            "requests_steered_total": steered}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=900, help="seconds of traffic (900)")
    ap.add_argument("--clients", type=int, default=8, help="client threads (8)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the traffic (0)")
    ap.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    ap.add_argument("--model", default=None,
                    help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32",
                    help="float32 (default): the greedy check needs batch-invariant output")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder for the steer dir, presets file and logs (default: a temp one)")
    ap.add_argument("--url", default=None,
                    help="soak a server already running with server_args(MODEL, --work) "
                         "instead of starting one (no RSS, no --restart-check)")
    ap.add_argument("--restart-check", action="store_true",
                    help="after the soak, kill the engine core and restart the server")
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        from vllm_steer.models import prepare_embedded

        model = str(prepare_embedded("smollm2"))
    cfg = json.loads((Path(model) / "config.json").read_text())
    MODEL_SHAPE.update(hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
                       model_type=cfg["model_type"])
    work = args.work or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    setup_work(work, random.Random(args.seed))
    sargs = server_args(model, work, args.dtype)
    if args.url:
        server = Attached(args.url)
    else:
        print(f"[soak] work folder {work}; starting vllm serve {' '.join(sargs)}", flush=True)
        server = Server(sargs, work / "server.log")
    report: dict = {"command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                    "duration_s": args.duration, "clients": args.clients, "seed": args.seed,
                    "dtype": args.dtype, "server_args": sargs,
                    "server_start_s": round(server.start_s, 1)}
    try:
        base = server.url
        ok, why = plain_ok(base)  # warm-up
        rss_start = server.rss_mb()
        print(f"[soak] server up in {server.start_s:.0f} s ({why}); RSS MB {rss_start}",
              flush=True)
        res = soak(base, work, args, server)
        stats = res["stats"]
        restore_work(work)  # the folder and the file as at start (for the restart)
        alive, why = plain_ok(base)
        rss_end = server.rss_mb()
        if args.report:  # the traffic's figures, before the solo runs
            args.report.write_text(json.dumps(dict(
                report, partial=True, elapsed_s=round(res["elapsed_s"], 1),
                requests_by_status={str(k): v for k, v in stats.by_status.items()},
                engine_alive=alive, rss_mb_start=rss_start, rss_mb_end=rss_end),
                indent=1, default=str))
        print(f"[soak] traffic stopped; engine alive: {why}; {len(stats.greedy)} greedy "
              f"requests to run alone", flush=True)
        solo = solo_texts(base, stats.greedy) if alive else {}
        mismatches, first_mismatches = [], []
        for key, texts in stats.greedy.items():
            for t in texts:
                if t != solo.get(key):
                    mismatches.append({"key": key, "under_load": t, "solo": solo.get(key)})
                if t != texts[0]:
                    first_mismatches.append({"key": key, "text": t, "first": texts[0]})
        vec_greedy = sum(len(v) for k, v in stats.greedy.items()
                         if k.split(" ")[2].startswith(FLAG_VECTOR))
        quiet = quiet_vector_check(base, work) if alive else {"ok": False,
                                                             "error": "engine not alive"}
        n_req = sum(v for k, v in stats.by_status.items() if not str(k).startswith("op"))
        s5 = sum(v for k, v in stats.by_status.items() if isinstance(k, int) and k >= 500) + \
            sum(v for k, v in stats.stream_errors.items() if isinstance(k, int) and k >= 500)
        op5 = sum(v for k, v in stats.by_status.items() if str(k).startswith("op"))
        start_total = sum(rss_start.values())
        end_total = sum(rss_end.values())
        report.update({
            "elapsed_s": round(res["elapsed_s"], 1),
            "requests": n_req,
            "requests_by_status": {str(k): v for k, v in sorted(stats.by_status.items(),
                                                                key=lambda kv: str(kv[0]))},
            "requests_by_kind": {k: {str(s): n for s, n in c.items()}
                                 for k, c in sorted(stats.by_kind.items())},
            "status_5xx": s5,
            "connection_errors": stats.by_status.get("conn_error", 0) +
            stats.by_status.get("stream_error", 0),
            "stream_error_events": {str(k): v for k, v in stats.stream_errors.items()},
            "ops_5xx_or_conn_errors": op5,
            "unexpected_status": dict(stats.unexpected),
            "operations": {k: {str(s): n for s, n in c.items()}
                           for k, c in sorted(stats.ops.items())},
            "examples": dict(stats.examples),
            "engine_alive": alive, "engine_alive_detail": why,
            "greedy_checked": sum(len(v) for v in stats.greedy.values()),
            "greedy_keys": len(stats.greedy),
            "mismatches": len(mismatches), "mismatch_examples": mismatches[:10],
            "greedy_checked_vector": vec_greedy,
            "first_answer_mismatches": len(first_mismatches),
            "first_answer_mismatch_examples": first_mismatches[:10],
            "bad_vector_checks": dict(stats.bad_vector),
            "bad_vector_quiet_check": quiet,
            "rss_mb_start": rss_start, "rss_mb_end": rss_end,
            "rss_mb_start_total": round(start_total, 1), "rss_mb_end_total": round(end_total, 1),
            "rss_growth_mb": round(end_total - start_total, 1),
            "rss_growth_pct": round(100 * (end_total - start_total) / max(start_total, 1), 1),
        })
        if args.restart_check and not args.url:
            report["restart"] = restart_check(sargs, work, work, server)
    finally:
        server.stop()
        report["server_exit_code"] = server.proc.returncode
        report["server_log"] = str(work / "server.log")
        if args.report:
            args.report.write_text(json.dumps(report, indent=1, default=str))
    failed = [why for why, bad in [
        ("5xx responses", report.get("status_5xx", 1)),
        ("connection errors", report.get("connection_errors", 1)),
        ("5xx or connection errors on management calls", report.get("ops_5xx_or_conn_errors", 1)),
        ("engine not alive", not report.get("engine_alive")),
        ("greedy mismatches", report.get("mismatches", 1)),
        ("greedy texts unlike the first answer", report.get("first_answer_mismatches", 1)),
        ("bad vector file: not a 400 naming the block counts, or a loaded steer lost",
         report.get("bad_vector_checks", {}).get("failed", 0)
         or not report.get("bad_vector_quiet_check", {}).get("ok")),
    ] if bad]
    summary = {k: report.get(k) for k in (
        "elapsed_s", "clients", "requests", "requests_by_status", "status_5xx",
        "connection_errors", "stream_error_events", "unexpected_status", "engine_alive",
        "greedy_checked", "greedy_checked_vector", "mismatches", "first_answer_mismatches",
        "bad_vector_checks", "rss_mb_start_total", "rss_mb_end_total", "rss_growth_mb")}
    summary["bad_vector_quiet_ok"] = report.get("bad_vector_quiet_check", {}).get("ok")
    print("[soak] " + json.dumps(summary), flush=True)
    if "restart" in report:
        print("[soak] restart: " + json.dumps(report["restart"], default=str)[:3000], flush=True)
    if failed:
        print(f"[soak] FAILED: {', '.join(failed)}", flush=True)
        return 1
    print("[soak] passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
