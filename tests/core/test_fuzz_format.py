"""Fuzzing the steer file reader (issue 14): random bytes, random mutations of a valid file
(bit flips, truncations, insertions, header edits) and valid files of every header length.

The outcome is always either a loaded steer that passes every check (and equals what was
saved, when the mutation left the file's meaning intact) or a ``SteerFileError``: never
another exception, never a hang. Reproducible (derandomized) and bounded in time.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:steer file .* unknown:UserWarning")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.steers import random_steer
from vllm_steer.format import (
    MAX_EPSILON, MIN_EPSILON, SteerFileError, load_steer, read_metadata, save_steer,
)
from vllm_steer.names import is_steer_name

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_DIR = Path(tempfile.mkdtemp(prefix="vllm-steer-fuzz-"))


def _valid_bytes(domain: bool = False) -> bytes:
    g = torch.Generator().manual_seed(0)
    s = random_steer(8, 2, "fuzz", seed=1)
    if domain:
        s.domain_p1, s.domain_p2 = torch.randn(8, 1, generator=g), torch.randn(8, 1, generator=g)
        s.metadata.domain = "with_steer"
    path = _DIR / "valid.safetensors"
    save_steer(path, s)
    return path.read_bytes()


VALID = _valid_bytes()
ORIGINAL = load_steer(_DIR / "valid.safetensors")
HEADER_LEN = struct.unpack("<Q", VALID[:8])[0]


def _outcome(raw: bytes, name: str = "f.safetensors"):
    """Load ``raw`` as a file: the Steer, or None when refused with SteerFileError."""
    path = _DIR / name
    path.write_bytes(raw)
    try:
        meta = read_metadata(path)
    except SteerFileError:
        meta = None
    try:
        steer = load_steer(path)
    except SteerFileError:
        return None
    assert meta is not None and meta == steer.metadata  # one check for both readers
    _assert_sound(steer)
    return steer


def _assert_sound(steer) -> None:
    """What every loaded steer satisfies, whatever bytes it came from."""
    m = steer.metadata
    assert is_steer_name(m.name)
    assert isinstance(m.epsilon, (int, float)) and not isinstance(m.epsilon, bool)
    assert MIN_EPSILON <= m.epsilon <= MAX_EPSILON
    assert math.isfinite(m.domain_strength) and m.domain in ("none", "with_steer")
    assert steer.p1.shape == steer.p2.shape == (m.hidden_size, m.rank)
    for t in (steer.p1, steer.p2, steer.domain_p1, steer.domain_p2):
        assert t is None or bool(torch.isfinite(t).all())


def _same(a, b) -> bool:
    return (a.metadata == b.metadata and torch.equal(a.p1, b.p1) and torch.equal(a.p2, b.p2))


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused(raw):
    assert _outcome(raw) is None


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_after_a_plausible_length_are_refused(body):
    # a length that fits the file, so the JSON parser gets the random bytes
    assert _outcome(struct.pack("<Q", len(body)) + body) is None


@FUZZ
@given(st.lists(st.integers(0, len(VALID) * 8 - 1), min_size=1, max_size=4))
def test_bit_flips(bits):
    raw = bytearray(VALID)
    for b in bits:
        raw[b // 8] ^= 1 << (b % 8)
    steer = _outcome(bytes(raw))
    if steer is not None and all(b // 8 >= 8 + HEADER_LEN for b in bits):
        # flips in the tensor data only: the header is intact
        assert steer.metadata == ORIGINAL.metadata


@FUZZ
@given(st.integers(0, len(VALID) - 1))
def test_truncations_are_refused(n):
    assert _outcome(VALID[:n]) is None


@FUZZ
@given(st.integers(0, len(VALID)), st.binary(min_size=1, max_size=16))
def test_insertions(at, junk):
    _outcome(VALID[:at] + junk + VALID[at:])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
META_KEYS = ["name", "hidden_size", "rank", "epsilon", "domain", "domain_strength",
             "recommended_strength", "labels", "format", "format_version", "base_model",
             "recipe", "source"]
ENTRY_KEYS = ["dtype", "shape", "data_offsets"]


def _split(raw: bytes):
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@FUZZ
@given(st.sampled_from(META_KEYS), JSON, st.booleans())
def test_metadata_edits(key, value, drop):
    header, data = _split(VALID)
    meta = json.loads(header["__metadata__"]["vllm_steer"])
    if drop:
        meta.pop(key, None)
    else:
        meta[key] = value
    header["__metadata__"]["vllm_steer"] = json.dumps(meta)
    steer = _outcome(_join(header, data))
    if steer is not None:
        assert torch.equal(steer.p1, ORIGINAL.p1) and torch.equal(steer.p2, ORIGINAL.p2)


@FUZZ
@given(st.sampled_from(["steer.P1", "steer.P2", "__metadata__", "domain.P1", "other"]),
       st.sampled_from(ENTRY_KEYS + ["*"]), JSON)
def test_header_edits(tensor, key, value):
    header, data = _split(VALID)
    if key == "*" or tensor not in header or not isinstance(header[tensor], dict):
        header[tensor] = value
    else:
        header[tensor][key] = value
    _outcome(_join(header, data))


def test_every_header_length_from_8_to_2048():
    """Valid files padded to each header length load equal to what was saved (the first
    bytes then take every value, 0x80 included); shorter ones are refused."""
    header = VALID[8:8 + HEADER_LEN].rstrip(b" ")
    data = VALID[8 + HEADER_LEN:]
    loaded = 0
    for n in range(8, 2049):
        if n >= len(header):
            raw = struct.pack("<Q", n) + header + b" " * (n - len(header)) + data
            steer = _outcome(raw, "len.safetensors")
            assert steer is not None and _same(steer, ORIGINAL), n
            loaded += 1
        else:
            raw = struct.pack("<Q", n) + b"{}" + b" " * (n - 2) + data
            assert _outcome(raw, "len.safetensors") is None, n
    assert loaded > 1000


@pytest.mark.parametrize("domain", [False, True])
def test_round_trip_of_the_fuzz_seed(domain):
    raw = _valid_bytes(domain)
    steer = _outcome(raw)
    assert steer is not None and (steer.domain_p1 is not None) == domain
