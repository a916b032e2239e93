"""The steer file: round trip, metadata without torch, and every reason a file is refused."""

import json
import pickle
import struct
import warnings

import pytest
import torch

from helpers.steers import random_steer
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
    # the domain part is served with the steer, at domain_strength * eps, only when strength != 0
    from vllm_steer.bank import SteerBank

    bank = SteerBank({"s": back})
    eps, dom = back.metadata.epsilon, back.metadata.domain_strength
    assert bank.coef_row({"s": 5.0}) == [5.0 * eps, dom * eps]
    assert bank.coef_row({"s": 0.0}) == [0.0, 0.0]


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


def test_f64_values_beyond_float32_are_refused_not_read_as_inf(tmp_path):
    """An F64 file is read as float32 by the bank's cast: a finite 1e39 would become inf,
    which steers every token to NaN. Refused on load and on save, naming the tensor."""
    from safetensors.torch import save_file

    s = random_steer(16, 2, "big")
    p1 = s.p1.double()
    p1[0, 0] = 1e39
    assert torch.isinf(p1.float()).any() and torch.isfinite(p1).all()  # the premise
    path = tmp_path / "big.safetensors"
    save_file({TENSOR_P1: p1, TENSOR_P2: s.p2.double()}, path,
              metadata={METADATA_KEY: s.metadata.to_json()})
    msg = _refusal(path)
    assert (f"tensor {TENSOR_P1!r} holds values up to 1e+39, beyond torch.float32's range"
            in msg), msg
    s.p1 = p1
    with pytest.raises(SteerFileError, match="beyond torch.float32's range"):
        save_steer(tmp_path / "big2.safetensors", s)
    ok = random_steer(16, 2, "ok")  # F64 within range loads, values kept
    save_file({TENSOR_P1: ok.p1.double() * 1e30, TENSOR_P2: ok.p2.double()}, tmp_path / "ok.st",
              metadata={METADATA_KEY: ok.metadata.to_json()})
    assert torch.equal(load_steer(tmp_path / "ok.st").p1, ok.p1.double() * 1e30)


def test_factors_beyond_the_served_dtype_are_named():
    """The bank holds the factors in the model's dtype: an fp32 factor of 7e4 is inf in fp16
    (largest 65504) but fits bf16."""
    from vllm_steer.format import served_range_problems

    s = random_steer(16, 2, "loud")
    s.p2[1, 1] = 7e4
    assert torch.isinf(s.p2.half()).any() and torch.isfinite(s.p2.bfloat16()).all()
    assert served_range_problems(s, torch.float16) == [
        f"tensor {TENSOR_P2!r} holds values up to 7e+04, beyond torch.float16's range "
        "(±6.55e+04); they would be infinite in torch.float16"]
    assert served_range_problems(s, torch.bfloat16) == []
    assert served_range_problems(s, None) == []


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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused: its tensors are named, not "ignored"
        msg = _refusal(path3)
    assert "no 'vllm_steer' entry" in msg and "missing tensor 'steer.P1'" in msg \
        and "missing tensor 'steer.P2'" in msg and "the file's other tensors: 'other'" in msg


def test_unknown_tensors_of_a_served_file_warn_by_name_and_are_ignored(tmp_path):
    from safetensors.torch import save_file

    s = random_steer(16, 2, "x", seed=3)
    path = tmp_path / "x.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: s.p2, "optimizer.state": torch.zeros(16, 2)}, path,
              metadata={METADATA_KEY: s.metadata.to_json()})
    with pytest.warns(UserWarning, match="unknown tensors 'optimizer.state' are ignored"):
        back = load_steer(path)
    assert torch.equal(back.p1, s.p1) and torch.equal(back.p2, s.p2)


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


# ---- hostile files (issue 14) -------------------------------------------------------------

def _header_len(path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_valid_file_with_header_length_128_mod_256_loads(tmp_path):
    """The first byte of such a file is 0x80, the pickle magic: it used to be refused."""
    path = tmp_path / "h.safetensors"
    for pad in range(300):
        s = random_steer(16, 2, "h", seed=1)
        s.metadata.labels = {"positive": "x" * pad}
        save_steer(path, s)
        if _header_len(path) % 256 == 128:
            break
    assert path.read_bytes()[:1] == b"\x80"
    back = load_steer(path)
    assert torch.equal(back.p1, s.p1) and back.metadata.labels == s.metadata.labels


def _raw_file(path, header, data=b""):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _good_header():
    meta = json.loads(random_steer(4, 1, "g").metadata.to_json())
    meta.update(hidden_size=4, rank=1)
    return {"__metadata__": {METADATA_KEY: json.dumps(meta)},
            TENSOR_P1: {"dtype": "F32", "shape": [4, 1], "data_offsets": [0, 16]},
            TENSOR_P2: {"dtype": "F32", "shape": [4, 1], "data_offsets": [16, 32]}}


def test_hand_made_good_file_loads(tmp_path):
    path = _raw_file(tmp_path / "g.safetensors", _good_header(),
                     struct.pack("<8f", *range(8)))
    s = load_steer(path)
    assert s.p1.flatten().tolist() == [0, 1, 2, 3] and s.p2.flatten().tolist() == [4, 5, 6, 7]


def _edit(edit):
    h = _good_header()
    edit(h)
    return h


def _meta_edit(**kw):
    def f(h):
        m = json.loads(h["__metadata__"][METADATA_KEY])
        m.update(kw)
        h["__metadata__"][METADATA_KEY] = json.dumps(m)
    return f


@pytest.mark.parametrize("header, fragment", [
    ([1, 2, 3], "header must be a JSON object, got list"),
    (_edit(lambda h: h[TENSOR_P1].update(data_offsets="0,16")), "malformed data_offsets"),
    (_edit(lambda h: h.update(__metadata__=[1])), "__metadata__ must be a JSON object"),
    (_edit(lambda h: h["__metadata__"].update({METADATA_KEY: "[1, 2]"})),
     "metadata must be a JSON object, got list"),
    (_edit(lambda h: h[TENSOR_P1].update(shape=16)), "has shape 16, expected [hidden, rank]"),
    (_edit(lambda h: h.update({TENSOR_P1: "steer"})), "header entry must be a JSON object"),
    (_edit(lambda h: h[TENSOR_P1].update(dtype="I64")), "has dtype 'I64'"),
    (_edit(lambda h: h[TENSOR_P1].update(dtype=[])), "has dtype []"),  # found by fuzzing
    (_edit(lambda h: h[TENSOR_P1].update(data_offsets=[0, 12])), "span 12 bytes but"),
    (_edit(lambda h: h[TENSOR_P2].update(data_offsets=[8, 24])), "overlapping or gapped"),
    (_edit(_meta_edit(domain_strength=float("nan"))), "domain_strength=nan"),
    (_edit(_meta_edit(domain_strength=float("inf"))), "domain_strength=inf"),
    (_edit(_meta_edit(epsilon=1e30)), "epsilon=1e+30, expected a number from 1e-09 to 1"),
    (_edit(_meta_edit(epsilon=True)), "epsilon=True"),
    (_edit(_meta_edit(epsilon=0)), "epsilon=0"),
    (_edit(_meta_edit(name="a,b:c d")), "name: steer name 'a,b:c d' may use only ASCII"),
    (_edit(_meta_edit(name=7)), "must be a string, got int"),
    (_edit(_meta_edit(name="n" * 10_000)), "is 10000 characters long; at most 64"),
    (_edit(_meta_edit(hidden_size=True)), "hidden_size=True"),
    (_edit(_meta_edit(labels=[1])), "labels=[1]"),
    (_edit(_meta_edit(labels={"harmful": "toxic"})),
     "labels.harmful='toxic', expected 'negative' or 'positive' (the side that moves"),
    (_edit(_meta_edit(format_version="1")), "format_version='1'"),
    (_edit(_meta_edit(recommended_strength=float("inf"))), "recommended_strength=inf"),
])
def test_malformed_headers_are_refused_with_a_reason(tmp_path, header, fragment):
    path = _raw_file(tmp_path / "m.safetensors", header, bytes(32))
    msg = _refusal(path)
    assert fragment in msg
    assert len(msg) < 2000  # a 10,000-character name is not echoed back whole
    with pytest.raises(SteerFileError):
        read_metadata(path)


def test_every_reason_is_listed_at_once(tmp_path):
    h = _edit(_meta_edit(epsilon=-1, domain_strength=float("nan"), name="a b"))
    msg = _refusal(_raw_file(tmp_path / "e.safetensors", h, bytes(32)))
    assert "epsilon=-1" in msg and "domain_strength=nan" in msg and "'a b'" in msg


def test_oversized_header_and_metadata_are_refused(tmp_path):
    from vllm_steer.format import MAX_HEADER_BYTES, MAX_METADATA_BYTES

    big = tmp_path / "big.safetensors"
    big.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 8) + b"{" + b" " * MAX_HEADER_BYTES
                    + b"}" + bytes(8))
    assert f"at most {MAX_HEADER_BYTES}" in _refusal(big)
    h = _edit(_meta_edit(recipe={"note": "x" * MAX_METADATA_BYTES}))
    assert f"at most {MAX_METADATA_BYTES} bytes" in _refusal(
        _raw_file(tmp_path / "m.safetensors", h, bytes(32)))


def test_duplicate_keys_and_nan_literals_in_the_header_are_refused(tmp_path):
    h = json.dumps(_good_header())
    for text, fragment in ((h[:-1] + ', "steer.P1": {}}', "appears twice"),
                           (h.replace('"F32"', "NaN", 1), "NaN is not valid JSON")):
        raw = text.encode()
        raw += b" " * (-len(raw) % 8)
        path = tmp_path / "d.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(32))
        assert fragment in _refusal(path)


@pytest.mark.parametrize("meta, fragment", [
    (dict(name="a,b"), "may use only ASCII"),
    (dict(epsilon=float("nan")), "epsilon=nan"),
    (dict(domain_strength=float("inf")), "domain_strength=inf"),
])
def test_save_refuses_what_load_would_refuse(tmp_path, meta, fragment):
    s = random_steer(16, 2, "ok")
    for k, v in meta.items():
        setattr(s.metadata, k, v)
    with pytest.raises(SteerFileError, match=fragment):
        save_steer(tmp_path / "x.safetensors", s)
    assert not (tmp_path / "x.safetensors").exists()


def test_the_shipped_detox_steer_marks_its_negative_side_harmful():
    """The playground reads ``labels.harmful`` to keep the toxic side of detox out of view
    until asked (docs/format.md); the other shipped steer marks no side."""
    from pathlib import Path

    from vllm_steer.format import LABEL_HARMFUL, harmful_side

    steers = Path(__file__).resolve().parents[2] / "steers"
    detox = read_metadata(steers / "smollm2-detox.safetensors")
    assert detox.labels == {"positive": "non-toxic", "negative": "toxic",
                            LABEL_HARMFUL: "negative"}
    assert harmful_side(detox) == "negative"
    assert harmful_side(read_metadata(steers / "smollm2-sentiment.safetensors")) is None


@pytest.mark.parametrize("extra", [torch.zeros(16), torch.tensor(1.0), torch.tensor([5]),
                                   torch.zeros(1, 200_000, dtype=torch.float16)],
                         ids=["bias-1d", "scalar", "int64-step", "wide"])
def test_unknown_tensors_of_any_shape_or_dtype_warn_and_are_ignored(tmp_path, extra):
    # docs/format.md: "Unknown tensors and unknown metadata keys only warn" -- whatever their
    # shape or dtype (a step counter, a bias, a newer writer's tensor)
    from safetensors.torch import save_file

    s = random_steer(16, 2, "x", seed=3)
    path = tmp_path / "x.safetensors"
    save_file({TENSOR_P1: s.p1, TENSOR_P2: s.p2, "steer.extra": extra}, path,
              metadata={METADATA_KEY: s.metadata.to_json()})
    with pytest.warns(UserWarning, match="unknown tensors 'steer.extra' are ignored"):
        back = load_steer(path)
        assert read_metadata(path).rank == 2
    assert torch.equal(back.p1, s.p1)


def test_a_model_shard_is_refused_for_what_it_is_not_per_tensor(tmp_path):
    # a model's safetensors given as a steer: the reasons say it is no steer file, not one
    # line per norm weight
    from safetensors.torch import save_file

    tensors = {f"model.layers.{i}.input_layernorm.weight": torch.ones(8) for i in range(40)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SteerFileError) as e:
        load_steer(tmp_path / "model.safetensors")
    assert len(e.value.reasons) <= 4 and "no 'vllm_steer' entry" in str(e.value)


def test_save_accepts_factors_that_share_memory(tmp_path):
    # a symmetric steer (W = P P^T: P1 is P2) is a valid steer; safetensors refuses tensors
    # that share memory, so the writer must not hand it the same storage twice
    p = torch.randn(16, 2)
    save_steer(tmp_path / "sym.safetensors", make_steer(p, p, "sym"))
    back = load_steer(tmp_path / "sym.safetensors")
    assert torch.equal(back.p1, p) and torch.equal(back.p2, p)


def test_a_written_steer_is_readable_as_a_new_file_is(tmp_path):
    """safetensors writes its files 0600: a steer written by `train` or `convert` must take
    the mode open() gives (0644 under umask 022), or a server running as another user (a
    container's) cannot read it."""
    import os

    old = os.umask(0o022)
    try:
        save_steer(tmp_path / "d.safetensors", random_steer(64, 8, "detox"))
    finally:
        os.umask(old)
    assert oct((tmp_path / "d.safetensors").stat().st_mode & 0o777) == "0o644"
