"""scripts/gpu_vllm_carry.py, the parts that run without network or GPU: ``split`` cuts files
into chunk folders with a manifest, ``receive`` / ``assemble`` (what runs on the GPU machine)
put them back together byte for byte and refuse a corrupt, missing or reordered chunk, naming
it; ``plan`` prints one remote call per chunk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_vllm_carry.py"
MiB = 1 << 20


def run(*args, cwd=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


@pytest.fixture()
def wheels(tmp_path):
    """Files of odd sizes (one empty, one exactly a chunk, ones that straddle chunk edges)."""
    src = tmp_path / "whl"
    src.mkdir()
    rng = __import__("random").Random(7)
    sizes = {"a-1.0-py3-none-any.whl": 1_000_003, "b-2.whl": 0, "c.whl": 262_144,
             "d.bin": 777_777, "e.whl": 13, "f.whl": 1_300_001}
    for name, n in sizes.items():
        (src / name).write_bytes(rng.randbytes(n))
    return src, sizes


def split(src, out, mib=0.25):
    r = run("split", "--src", src, "--out", out, "--chunk-mib", mib)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "manifest.json").read_text())


def receive_all(out, area, names=None):
    for d in sorted(out.glob("c*")):
        if names is None or d.name in names:
            r = run("receive", d, "--area", area)
            assert r.returncode == 0, r.stderr


def test_round_trip_is_byte_equal(tmp_path, wheels):
    src, sizes = wheels
    out, area, dest = tmp_path / "carry", tmp_path / "area", tmp_path / "dest"
    man = split(src, out)
    total = sum(sizes.values())
    assert man["total"] == total
    assert [c["size"] for c in man["chunks"]][:-1] == [MiB // 4] * (len(man["chunks"]) - 1)
    assert sum(c["size"] for c in man["chunks"]) == total
    assert len(man["chunks"]) == -(-total // (MiB // 4))
    for c in man["chunks"]:  # each folder travels alone: its chunk and the manifest
        assert sorted(p.name for p in (out / c["name"]).iterdir()) == [f"{c['name']}.bin",
                                                                        "manifest.json"]
        assert (out / c["name"] / f"{c['name']}.bin").stat().st_size < 60 * MiB
    receive_all(out, area)
    r = run("assemble", "--area", area, "--dest", dest)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in dest.iterdir()) == sorted(sizes)
    for name in sizes:
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name
        want = hashlib.sha256((src / name).read_bytes()).hexdigest()
        assert next(e for e in man["files"] if e["name"] == name)["sha256"] == want


def test_chunk_boundary_and_limit(tmp_path):
    src = tmp_path / "whl"
    src.mkdir()
    (src / "x.whl").write_bytes(os.urandom(MiB // 2))  # exactly two chunks of 0.25 MiB
    man = split(src, tmp_path / "carry")
    assert [c["size"] for c in man["chunks"]] == [MiB // 4, MiB // 4]
    r = run("split", "--src", src, "--out", tmp_path / "c2", "--chunk-mib", 61)
    assert r.returncode == 2 and "under 60 MiB" in r.stderr and "61" in r.stderr


def test_corrupt_chunk_refused_naming_it(tmp_path, wheels):
    src, _ = wheels
    out, area = tmp_path / "carry", tmp_path / "area"
    split(src, out)
    receive_all(out, area)
    b = bytearray((area / "c002.bin").read_bytes())
    b[1234] ^= 0xFF
    (area / "c002.bin").write_bytes(bytes(b))
    r = run("assemble", "--area", area, "--dest", tmp_path / "dest")
    assert r.returncode == 2
    assert "chunk c002" in r.stderr and "sha256" in r.stderr and "carry c002 again" in r.stderr
    # receive checks a chunk on arrival too
    b = bytearray((out / "c001" / "c001.bin").read_bytes())
    b[0] ^= 1
    (out / "c001" / "c001.bin").write_bytes(bytes(b))
    r = run("receive", out / "c001", "--area", tmp_path / "area2")
    assert r.returncode == 2 and "chunk c001" in r.stderr


def test_missing_chunk_refused_naming_it(tmp_path, wheels):
    src, _ = wheels
    out, area = tmp_path / "carry", tmp_path / "area"
    man = split(src, out)
    names = [c["name"] for c in man["chunks"]]
    receive_all(out, area, names=set(names) - {"c003"})
    r = run("assemble", "--area", area, "--dest", tmp_path / "dest")
    assert r.returncode == 2 and "c003" in r.stderr and "missing" in r.stderr
    assert "c002" not in r.stderr
    assert not (tmp_path / "dest").exists()


def test_reordered_chunks_refused_naming_them(tmp_path, wheels):
    src, _ = wheels
    out, area = tmp_path / "carry", tmp_path / "area"
    split(src, out)
    receive_all(out, area)
    shutil.move(area / "c001.bin", area / "tmp.bin")
    shutil.move(area / "c004.bin", area / "c001.bin")
    shutil.move(area / "tmp.bin", area / "c004.bin")
    r = run("assemble", "--area", area, "--dest", tmp_path / "dest")
    assert r.returncode == 2 and "chunk c001" in r.stderr and "out of order" in r.stderr


def test_chunks_of_another_split_refused(tmp_path, wheels):
    src, _ = wheels
    split(src, tmp_path / "carry")
    receive_all(tmp_path / "carry", tmp_path / "area", names={"c000"})
    (src / "e.whl").write_bytes(b"changed")
    split(src, tmp_path / "carry2")
    r = run("receive", tmp_path / "carry2" / "c001", "--area", tmp_path / "area")
    assert r.returncode == 2 and "another split" in r.stderr


def test_plan_one_call_per_chunk(tmp_path, wheels):
    src, _ = wheels
    out = ROOT / ".carry-test-plan"
    try:
        man = split(src, out, mib=0.5)
        r = run("plan", "--out", out.name, cwd=ROOT)
        assert r.returncode == 0, r.stdout + r.stderr
        calls = [json.loads(line.split("   #")[0]) for line in r.stdout.splitlines()
                 if line.startswith("{")]
        assert len(calls) == len(man["chunks"])
        for c, call in zip(man["chunks"], calls, strict=True):
            assert call["carry"] == [f"{out.name}/{c['name']}"]
            assert f"receive {out.name}/{c['name']}" in call["command"]
        assert "assemble" in calls[-1]["command"] and "--install" in calls[-1]["command"]
        assert all("assemble" not in c["command"] for c in calls[:-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_help():
    r = run("--help")
    assert r.returncode == 0
    for verb in ("download", "split", "plan", "receive", "assemble"):
        assert verb in r.stdout
