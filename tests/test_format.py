"""The steer file: round trip, metadata without torch, and every reason a file is refused."""

import json
import pickle
import struct

import pytest
import torch

from conftest import random_steer
from vllm_steer.format import (
    METADATA_KEY, TENSOR_P1, TENSOR_P2, SteerFileError, load_steer, make_steer, read_metadata,
    save_steer,
)


def test_round_trip_keeps_factors_and_metadata(tmp_path):
    s = random_steer(64, 8, "detox", seed=3)
    s.metadata.recipe = {"lr": 0.01, "steps": 10}
    save_steer(tmp_path / "d.safetensors", s)
    back = load_steer(tmp_path / "d.safetensors")
    assert torch.equal(back.p1, s.p1) and torch.equal(back.p2, s.p2)
    assert back.metadata.name == "detox" and back.metadata.rank == 8
    assert back.metadata.hidden_size == 64 and back.metadata.recipe == {"lr": 0.01, "steps": 10}
    assert back.domain_p1 is None


def test_metadata_is_readable_json_and_needs_no_tensor_load(tmp_path):
    path = tmp_path / "d.safetensors"
    save_steer(path, random_steer(64, 4, "x"))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = json.loads(header["__metadata__"][METADATA_KEY])
    assert meta["format"] == "vllm-steer" and meta["format_version"] == 1
    assert header[TENSOR_P1]["shape"] == [64, 4]
    assert read_metadata(path).epsilon == 1e-3


def test_domain_component_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    s = make_steer(torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g), "s",
                   domain_p1=torch.randn(32, 2, generator=g),
                   domain_p2=torch.randn(32, 2, generator=g), domain="with_steer")
    save_steer(tmp_path / "s.safetensors", s)
    back = load_steer(tmp_path / "s.safetensors")
    assert back.domain_p1.shape == (32, 2) and back.metadata.domain == "with_steer"
    # the domain part is served with the steer, at domain_strength, only when strength != 0
    assert len(back.effective_factors(5.0)) == 2 and len(back.effective_factors(0.0)) == 1


def _refusal(path) -> str:
    with pytest.raises(SteerFileError) as e:
        load_steer(path)
    assert str(path) in str(e.value)
    return str(e.value)


def test_missing_file_is_refused_by_name(tmp_path):
    assert "no such file" in _refusal(tmp_path / "nope.safetensors")


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    save_steer(path, random_steer(64, 8, "t"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert "truncated" in _refusal(path)


def test_pickle_file_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "ref.pt"
    torch.save([{"lr": 1}, {"projector1": torch.zeros(2, 4, 2)}, 3], path)
    msg = _refusal(path)
    assert "pickle" in msg and "vllm-steer convert" in msg
    path2 = tmp_path / "plain.pkl"
    path2.write_bytes(pickle.dumps({"a": 1}))
    assert "pickle" in _refusal(path2)


def test_nan_values_are_refused(tmp_path):
    s = random_steer(16, 2, "n")
    s.p1[3, 1] = float("nan")
    from safetensors.torch import save_file

    path = tmp_path / "n.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: s.p2}, path,
              metadata={METADATA_KEY: s.metadata.to_json()})
    assert "NaN" in _refusal(path)
    with pytest.raises(ValueError, match="NaN"):
        save_steer(tmp_path / "n2.safetensors", s)


def test_wrong_shapes_and_every_reason_listed(tmp_path):
    from safetensors.torch import save_file

    s = random_steer(16, 2, "w")
    s.metadata.hidden_size = 32  # lies about the hidden size
    path = tmp_path / "w.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: torch.zeros(16, 3)}, path,
              metadata={METADATA_KEY: s.metadata.to_json()})
    msg = _refusal(path)
    assert "differs" in msg  # P1 vs P2 shape
    path2 = tmp_path / "w2.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: s.p2}, path2,
              metadata={METADATA_KEY: s.metadata.to_json()})
    assert "hidden size 16 but the metadata says 32" in _refusal(path2)
    path3 = tmp_path / "w3.safetensors"
    save_file({"other": s.p1}, path3)
    msg = _refusal(path3)
    assert "no 'vllm_steer' entry" in msg and "missing tensor 'steer.P1'" in msg \
        and "missing tensor 'steer.P2'" in msg


def test_unknown_metadata_keys_warn_but_load(tmp_path):
    from safetensors.torch import save_file

    s = random_steer(16, 2, "u")
    meta = json.loads(s.metadata.to_json())
    meta["from_the_future"] = 1
    path = tmp_path / "u.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: s.p2}, path, metadata={METADATA_KEY: json.dumps(meta)})
    with pytest.warns(UserWarning, match="from_the_future"):
        back = load_steer(path)
    assert back.metadata.extra == {"from_the_future": 1}


def test_newer_format_version_is_refused(tmp_path):
    from safetensors.torch import save_file

    s = random_steer(16, 2, "v")
    meta = json.loads(s.metadata.to_json())
    meta["format_version"] = 99
    path = tmp_path / "v.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: s.p2}, path, metadata={METADATA_KEY: json.dumps(meta)})
    assert "upgrade vllm-steer" in _refusal(path)


def test_read_metadata_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "d.safetensors"
    save_steer(path, random_steer(16, 2, "light"))
    code = ("import sys; from vllm_steer.format import read_metadata; "
            f"m = read_metadata({str(path)!r}); print(m.name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["light", "False"]
