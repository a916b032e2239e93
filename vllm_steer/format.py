"""The steer file: one safetensors file per steer, with readable JSON metadata.

Layout (see ``docs/format.md``)::

    steer.P1      [hidden, rank]   down-projection  (the paper's projector1)
    steer.P2      [hidden, rank]   up-projection    (the paper's projector2)
    domain.P1     [hidden, rank_d] optional domain ("dummy") steer, same convention
    domain.P2     [hidden, rank_d]
    __metadata__  {"vllm_steer": "<JSON>", "format": "pt"}

A steer at strength ``s`` (in units of ``epsilon``) maps a final hidden state row ``c`` to::

    c' = c + s * epsilon * (c @ P1) @ P2.T          (row-vector form)

i.e. ``W = P2 @ P1.T`` in the paper's column form ``c' = c + eps W c``.

Names are defined once here. Loading never unpickles: only safetensors is read, and a
file that is not one (a ``torch.save`` pickle, a truncated file, ...) is refused with every
reason listed in one error. Reading the metadata (:func:`read_metadata`) needs neither
torch nor safetensors, so vLLM's frontend can call it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

FORMAT_NAME = "vllm-steer"
FORMAT_VERSION = 1
#: Key in the safetensors ``__metadata__`` whose value is our JSON document.
METADATA_KEY = "vllm_steer"
TENSOR_P1 = "steer.P1"
TENSOR_P2 = "steer.P2"
TENSOR_DOMAIN_P1 = "domain.P1"
TENSOR_DOMAIN_P2 = "domain.P2"
KNOWN_TENSORS = (TENSOR_P1, TENSOR_P2, TENSOR_DOMAIN_P1, TENSOR_DOMAIN_P2)
#: Metadata key naming a steer file's kind; absent means :data:`KIND_LM_STEER`.
KIND_KEY = "kind"
#: An LM-Steer file (``steer.P1``/``steer.P2`` on the final hidden state): every file written
#: before kinds existed.
KIND_LM_STEER = "lm-steer"
#: A control-vector file (``direction.K`` added to decoder block K's output): see
#: :mod:`vllm_steer.vectors`.
KIND_VECTOR = "vector"
KINDS = (KIND_LM_STEER, KIND_VECTOR)
#: Name prefix of a vector file's tensors: ``direction.K`` is the vector of decoder block K
#: (0-based), one dimension ``[hidden]``, as llama.cpp's control-vector GGUF names them.
TENSOR_DIRECTION_PREFIX = "direction."
#: The paper's unit of strength.
DEFAULT_EPSILON = 1e-3
FILE_SUFFIX = ".safetensors"

DomainMode = Literal["none", "with_steer"]
_SAFETENSORS_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
#: Bytes per element of the safetensors dtypes an unknown tensor may have: it is ignored, so
#: it is only checked to lie where the header says (a step counter, a bias, a newer writer's).
_ANY_SAFETENSORS_DTYPES = {**_SAFETENSORS_DTYPES, "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1,
                           "F8_E4M3": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8,
                           "U64": 8}

#: ``labels`` key naming the side of a steer that moves towards harmful text: ``"negative"``
#: (a detox steer: negative strengths make text toxic) or ``"positive"``. Pages that show a
#: steer to people (the playground) keep that side out of view until the user asks for it.
LABEL_HARMFUL = "harmful"
#: The values ``labels["harmful"]`` may take.
HARMFUL_SIDES = ("negative", "positive")

# ---- limits (documented in docs/format.md) -------------------------------------------------
#: Largest safetensors header (JSON) a steer file may have, in bytes.
MAX_HEADER_BYTES = 1 << 20
#: Largest ``vllm_steer`` metadata JSON document, in bytes.
MAX_METADATA_BYTES = 256 << 10
#: Largest hidden size and rank a steer file may declare.
MAX_HIDDEN_SIZE = 1 << 17
MAX_RANK = 1 << 13
#: ``epsilon`` must lie in ``[MIN_EPSILON, MAX_EPSILON]`` (the paper's unit is 1e-3).
MIN_EPSILON = 1e-9
MAX_EPSILON = 1.0
#: ``|domain_strength|`` and ``|recommended_strength|`` at most this (units of epsilon).
MAX_META_STRENGTH = 1e4
#: Longest ``base_model`` string.
MAX_BASE_MODEL_LENGTH = 1024


class RefusedFileError(ValueError):
    """A file was refused; the message names the file (a ``KIND`` file) and every reason."""

    KIND = "file"

    def __init__(self, path: str, reasons: list[str]):
        self.path = str(path)
        self.reasons = list(reasons)
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"{self.KIND} file {self.path!r} refused:\n{lines}")


class SteerFileError(RefusedFileError):
    """A steer file was refused; the message names the file and every reason."""

    KIND = "steer"


@dataclass
class SteerMetadata:
    """Metadata stored as JSON in the steer file. Unknown keys are kept and warned about."""

    name: str
    """Short name of the steer (what requests use when the server gives no other name)."""
    hidden_size: int
    """Size of the final hidden state the steer acts on (the model's ``hidden_size``)."""
    rank: int
    """Rank of ``W = P2 P1^T`` (columns of P1 and P2)."""
    base_model: str | None = None
    """Identity of the model the steer was trained on (HF id, path or ``smollm2``)."""
    epsilon: float = DEFAULT_EPSILON
    """Unit of strength: a request strength ``s`` applies ``s * epsilon``."""
    labels: dict[str, str] = field(default_factory=dict)
    """What positive and negative strengths move towards, e.g. ``{"positive": "non-toxic",
    "negative": "toxic"}``; ``"harmful"`` (:data:`LABEL_HARMFUL`) names the side that moves
    towards harmful text, e.g. ``"negative"`` for a detox steer."""
    domain: DomainMode = "none"
    """How the domain ("dummy") component is applied when serving: ``none`` keeps it for
    reference only; ``with_steer`` adds it at ``domain_strength`` whenever the steer is used
    with a non-zero strength."""
    domain_strength: float = 1.0
    """Strength (units of ``epsilon``) of the domain component when ``domain == "with_steer"``."""
    recommended_strength: float | None = None
    """Strength the steer's author recommends (the paper generates at 5)."""
    recipe: dict[str, Any] = field(default_factory=dict)
    """Training recipe: steps, lr, batch size, seed, data, ... (free form)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Training data description: files and their sha256."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Final train/dev losses and other measurements."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where the steer came from when not trained here (converted, transferred)."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    kind: str = KIND_LM_STEER
    """The file's kind, always :data:`KIND_LM_STEER` here (not written: the default when
    absent, so files stay readable by releases before kinds)."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Unknown keys read from a newer file (kept, written back, warned about)."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        if d[KIND_KEY] == KIND_LM_STEER:
            del d[KIND_KEY]
        d.update(extra)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "<memory>") -> "SteerMetadata":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        unknown = {k: v for k, v in d.items() if k not in names}
        if unknown:
            warnings.warn(
                f"steer file {path!r}: unknown metadata keys {sorted(unknown)} "
                f"(written by a newer vllm-steer?); they are kept but not used",
                stacklevel=3,
            )
        return cls(**known, extra=unknown)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def metadata_problems(d: Any) -> list[str]:
    """Every reason the metadata document ``d`` (the parsed ``vllm_steer`` JSON) of an
    LM-Steer file is refused.

    The one check of steer metadata, used when a file is read and when one is saved. A
    vector file (``kind`` ``"vector"``) is refused here with the reader to use instead.
    """
    if not isinstance(d, dict):
        return [f"metadata must be a JSON object, got {type(d).__name__}"]
    kind = d.get(KIND_KEY, KIND_LM_STEER)
    if kind == KIND_VECTOR:
        return [f"this is a vector steer (metadata {KIND_KEY}={KIND_VECTOR!r}), not an LM-Steer "
                "file: read it with vllm_steer.vectors.load_vector (`vllm-steer info FILE` "
                "shows either kind)"]
    reasons = common_metadata_problems(d, ("name", "hidden_size", "rank"))
    if "rank" in d and not (_is_int(d["rank"]) and 1 <= d["rank"] <= MAX_RANK):
        reasons.append(f"metadata rank={_echo(d['rank'])}, expected an integer from 1 to "
                       f"{MAX_RANK}")
    eps = d.get("epsilon", DEFAULT_EPSILON)
    if not (_is_number(eps) and _finite(eps) and MIN_EPSILON <= eps <= MAX_EPSILON):
        reasons.append(f"metadata epsilon={_echo(eps)}, expected a number from {MIN_EPSILON:g} "
                       f"to {MAX_EPSILON:g} (the paper's unit is {DEFAULT_EPSILON:g})")
    dom = d.get("domain", "none")
    if dom not in ("none", "with_steer"):
        reasons.append(f"metadata domain={_echo(dom)}, expected 'none' or 'with_steer'")
    v = d.get("domain_strength", 1.0)
    if not (_is_number(v) and _finite(v) and abs(v) <= MAX_META_STRENGTH):
        reasons.append(f"metadata domain_strength={_echo(v)}, expected a finite number with "
                       f"|domain_strength| <= {MAX_META_STRENGTH:g}")
    return reasons


def common_metadata_problems(d: dict[str, Any], required: tuple[str, ...]) -> list[str]:
    """The checks every kind of steer file shares: format and version, ``kind``, the
    ``required`` keys, ``name``, ``hidden_size``, ``base_model``, ``recommended_strength``,
    ``labels`` and the free-form objects."""
    from vllm_steer.names import steer_name_problem

    reasons: list[str] = []
    fmt = d.get("format", FORMAT_NAME)
    if fmt != FORMAT_NAME:
        reasons.append(f"metadata format is {_echo(fmt)}, expected {FORMAT_NAME!r}")
    ver = d.get("format_version", FORMAT_VERSION)
    if not _is_int(ver) or ver < 1:
        reasons.append(f"metadata format_version={_echo(ver)}, expected a positive integer")
    elif ver > FORMAT_VERSION:
        reasons.append(f"format_version {ver} is newer than this vllm-steer supports "
                       f"({FORMAT_VERSION}); upgrade vllm-steer")
    kind = d.get(KIND_KEY, KIND_LM_STEER)
    if kind not in KINDS:
        reasons.append(f"metadata {KIND_KEY}={_echo(kind)}, expected one of "
                       f"{', '.join(map(repr, KINDS))} (a newer vllm-steer may know it)")
    missing = [k for k in required if k not in d]
    if missing:
        reasons.append(f"metadata lacks required keys {missing}")
    if "name" in d:
        problem = steer_name_problem(d["name"])
        if problem:
            reasons.append(f"metadata name: {problem}")
    if "hidden_size" in d and not (_is_int(d["hidden_size"])
                                   and 1 <= d["hidden_size"] <= MAX_HIDDEN_SIZE):
        reasons.append(f"metadata hidden_size={_echo(d['hidden_size'])}, expected an integer "
                       f"from 1 to {MAX_HIDDEN_SIZE}")
    bm = d.get("base_model")
    if bm is not None and not (isinstance(bm, str) and len(bm) <= MAX_BASE_MODEL_LENGTH):
        reasons.append(f"metadata base_model={_echo(bm)}, expected a string of at most "
                       f"{MAX_BASE_MODEL_LENGTH} characters or null")
    v = d.get("recommended_strength")
    if v is not None and not (_is_number(v) and _finite(v) and abs(v) <= MAX_META_STRENGTH):
        reasons.append(f"metadata recommended_strength={_echo(v)}, expected a finite number "
                       f"with |recommended_strength| <= {MAX_META_STRENGTH:g} or null")
    labels = d.get("labels", {})
    if not (isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())):
        reasons.append(f"metadata labels={_echo(labels)}, expected an object of strings")
    elif labels.get(LABEL_HARMFUL, HARMFUL_SIDES[0]) not in HARMFUL_SIDES:
        reasons.append(f"metadata labels.{LABEL_HARMFUL}={_echo(labels[LABEL_HARMFUL])}, "
                       f"expected {' or '.join(map(repr, HARMFUL_SIDES))} (the side that "
                       "moves towards harmful text)")
    for key in ("recipe", "data", "metrics", "source"):
        if not isinstance(d.get(key, {}), dict):
            reasons.append(f"metadata {key}={_echo(d[key])}, expected a JSON object")
    return reasons


def _echo(v: Any) -> str:
    from vllm_steer.names import echo

    return echo(v)


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"key {_echo(k)} appears twice")
        d[k] = v
    return d


def _strict_json(raw: bytes | str, constants: bool = False) -> Any:
    """JSON as safetensors (serde) reads it: no duplicate keys, and no NaN/Infinity unless
    ``constants`` (our metadata document: the value is then refused by name)."""
    return json.loads(raw, object_pairs_hook=_unique_keys,
                      **({} if constants else {"parse_constant": _no_constants}))


def _looks_like_pickle(head: bytes) -> bool:
    # pickle protocol 2+ starts with PROTO (0x80) and the protocol number; torch.save's
    # default is a zip file. Asked only after the bytes failed to read as safetensors.
    return (head[:1] == b"\x80" and 2 <= head[1] <= 5) or head[:4] == b"PK\x03\x04"


_PICKLE_REASON = (
    "this is a pickle / torch.save file, not safetensors; vllm-steer never unpickles "
    "at load time. If it is a checkpoint of the paper's code, convert it with "
    "`vllm-steer convert FILE --unsafe-allow-pickle --out steer.safetensors`")


class _NotSafetensors(Exception):
    """Raised with the reason when a file cannot be read as safetensors at all."""


def _check_path(path: str) -> None:
    """Refuse a path that is missing or a directory."""
    if not os.path.exists(path):
        raise _NotSafetensors(f"no such file: {path}")
    if os.path.isdir(path):
        raise _NotSafetensors("is a directory, expected a .safetensors file")


def _read_header_bytes(path: str) -> tuple[int, bytes, int, bytes | None]:
    """``(file size, first 8 bytes, declared header length, header bytes)``; the header bytes
    are None when the declared length is out of bounds or does not fit in the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _NotSafetensors(f"file is {size} bytes, too short to be safetensors "
                                      "(truncated or empty)")
            (n,) = struct.unpack("<Q", head)
            raw = f.read(n) if 2 <= n <= MAX_HEADER_BYTES and n + 8 <= size else None
    except OSError as e:
        raise _NotSafetensors(f"cannot read the file ({e.strerror or e})") from None
    return size, head, n, raw


def _check_header_length(head: bytes, n: int, size: int, raw: bytes | None) -> None:
    """Refuse a GGUF file, and a header length that was not read: a pickle, a header over
    :data:`MAX_HEADER_BYTES`, or one longer than the file."""
    if head[:4] == b"GGUF":
        raise _NotSafetensors("this is a GGUF file (a llama.cpp control vector is a vector "
                              "steer, not an LM-Steer file): read it with "
                              "vllm_steer.vectors.load_vector, or "
                              "`vllm-steer convert FILE --out x.safetensors`")
    if raw is not None:
        return
    if _looks_like_pickle(head):
        raise _NotSafetensors(_PICKLE_REASON)
    if n > MAX_HEADER_BYTES and n + 8 <= size:
        raise _NotSafetensors(f"safetensors header is {n} bytes; a steer file's header may "
                              f"have at most {MAX_HEADER_BYTES}")
    raise _NotSafetensors(f"header length {n} does not fit in the file ({size} bytes): not "
                          "safetensors, or truncated")


def _parse_header_json(raw: bytes, head: bytes) -> dict[str, Any]:
    """The header as a JSON object; refuse a pickle, invalid JSON or another JSON value."""
    try:
        header = _strict_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if _looks_like_pickle(head):
            raise _NotSafetensors(_PICKLE_REASON) from None
        raise _NotSafetensors(f"safetensors header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise _NotSafetensors("safetensors header must be a JSON object, got "
                              f"{type(header).__name__}")
    return header


def _entry_spans(header: dict[str, Any], data_len: int
                 ) -> tuple[list[tuple[int, int, str]], list[str]]:
    """``(spans, reasons)``: the data span ``(start, end, key)`` of each well-formed tensor
    entry that fits in the data section, and what is wrong with the other entries and with
    ``__metadata__``."""
    reasons: list[str] = []
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                reasons.append("safetensors __metadata__ must be a JSON object of strings")
            continue
        problems = _tensor_entry_problems(key, info)
        if problems:
            reasons.extend(problems)
            continue
        start, end = info["data_offsets"]
        if end > data_len:
            reasons.append(f"tensor {_echo(key)} ends at byte {end} of the data section but the "
                           f"file holds {data_len} bytes (truncated file)")
            continue
        spans.append((start, end, key))
    return spans, reasons


def _layout_problems(spans: list[tuple[int, int, str]], data_len: int) -> list[str]:
    """The first gap or overlap between the tensors' spans, or trailing bytes after them."""
    pos = 0
    for start, end, key in sorted(spans):
        if start != pos:
            return [f"tensor {_echo(key)} starts at byte {start} of the data section, "
                    f"expected {pos} (overlapping or gapped tensors)"]
        pos = end
    if pos != data_len:
        return [f"the tensors cover {pos} bytes but the data section holds "
                f"{data_len} (trailing bytes)"]
    return []


def _read_header(path: str) -> tuple[dict[str, Any] | None, list[str], int]:
    """Parse the safetensors header by hand (no torch). Returns (header, reasons, data_len).

    ``header`` is None when the bytes are not a safetensors file at all; otherwise it is a
    JSON object whose tensor entries and data offsets have been checked (``reasons`` lists
    what is wrong with them).
    """
    try:
        _check_path(path)
        size, head, n, raw = _read_header_bytes(path)
        _check_header_length(head, n, size, raw)
        header = _parse_header_json(raw, head)
    except _NotSafetensors as e:
        return None, [str(e)], 0
    data_len = size - 8 - n
    spans, reasons = _entry_spans(header, data_len)
    if not reasons:
        reasons = _layout_problems(spans, data_len)
    return header, reasons, data_len


def _tensor_entry_problems(key: str, info: Any) -> list[str]:
    k = _echo(key)
    if not isinstance(info, dict):
        return [f"tensor {k}: header entry must be a JSON object, got {type(info).__name__}"]
    out = []
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    # a vector file's direction.K is one row [hidden]; the LM-Steer factors are [hidden, rank];
    # any other tensor is ignored (with a warning), so it only has to be well-formed
    vector = isinstance(key, str) and key.startswith(TENSOR_DIRECTION_PREFIX)
    known = vector or key in KNOWN_TENSORS
    sizes = _SAFETENSORS_DTYPES if known else _ANY_SAFETENSORS_DTYPES
    if not (isinstance(dtype, str) and dtype in sizes):
        out.append(f"tensor {k} has dtype {_echo(dtype)}, expected one of {sorted(sizes)}")
    ndim, form = (1, "[hidden]") if vector else (2, "[hidden, rank]")
    if not known:
        if not (isinstance(shape, list) and all(_is_int(x) and x >= 0 for x in shape)):
            out.append(f"tensor {k} has shape {_echo(shape)}, expected a list of sizes")
    elif not (isinstance(shape, list) and len(shape) == ndim
              and all(_is_int(x) and 1 <= x <= MAX_HIDDEN_SIZE for x in shape)):
        out.append(f"tensor {k} has shape {_echo(shape)}, expected {form} with each "
                   f"size from 1 to {MAX_HIDDEN_SIZE}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(x) for x in offs)
            and 0 <= offs[0] <= offs[1]):
        out.append(f"tensor {k}: malformed data_offsets {_echo(offs)}, expected [start, end]")
    elif not out and offs[1] - offs[0] != math.prod(shape) * sizes[dtype]:
        out.append(f"tensor {k}: data_offsets {offs} span {offs[1] - offs[0]} bytes but a "
                   f"{dtype} {shape} tensor takes {math.prod(shape) * sizes[dtype]}")
    return out


def read_document(path: str) -> tuple[dict[str, Any] | None, Any, list[str]]:
    """``(header, metadata document, reasons)`` of a safetensors steer file of any kind,
    without checking the document's values: ``header`` is None when the file is not
    safetensors, ``document`` None when it has no readable ``vllm_steer`` JSON."""
    header, reasons, _ = _read_header(path)
    if header is None:
        return None, None, reasons
    smeta = header.get("__metadata__")
    meta_raw = smeta.get(METADATA_KEY) if isinstance(smeta, dict) else None
    d: Any = None
    if not isinstance(meta_raw, str):
        reasons.append(
            f"no {METADATA_KEY!r} entry in the safetensors metadata (not a vllm-steer file; "
            "raw factors can be wrapped with vllm_steer.format.save_steer)")
    elif len(meta_raw.encode("utf-8", "surrogatepass")) > MAX_METADATA_BYTES:
        reasons.append(f"the {METADATA_KEY!r} metadata is {len(meta_raw)} characters; at most "
                       f"{MAX_METADATA_BYTES} bytes are allowed")
    else:
        try:
            d = _strict_json(meta_raw, constants=True)
        except (ValueError, RecursionError) as e:
            reasons.append(f"metadata is not valid JSON ({str(e)[:200]})")
    return header, d, reasons


def file_kind(d: Any) -> str | None:
    """The kind a parsed metadata document declares (:data:`KIND_LM_STEER` when absent), or
    None when ``d`` is not a JSON object."""
    return d.get(KIND_KEY, KIND_LM_STEER) if isinstance(d, dict) else None


def _check_file(path: str) -> tuple[dict[str, Any], SteerMetadata]:
    """The one check of an LM-Steer file without loading tensors: (header, metadata), or
    :class:`SteerFileError` listing every reason."""
    header, d, reasons = read_document(path)
    if header is None:
        raise SteerFileError(path, reasons)
    if d is not None:
        reasons.extend(metadata_problems(d))
        if file_kind(d) == KIND_VECTOR:  # its tensors are another kind's: nothing more to say
            raise SteerFileError(path, reasons)
    missing = [t for t in (TENSOR_P1, TENSOR_P2) if t not in header]
    reasons.extend(f"missing tensor {t!r}" for t in missing)
    unknown = [k for k in header if k != "__metadata__" and k not in KNOWN_TENSORS]
    others = ", ".join(_echo(k) for k in unknown[:5]) + (" and more" if len(unknown) > 5 else "")
    if missing and unknown:  # what the file holds instead (a file of another kind, or renamed)
        reasons.append(f"the file's other tensors: {others}")
    if not reasons:  # entries are well-formed: compare shapes with each other and the metadata
        shape = {k: header[k]["shape"] for k in KNOWN_TENSORS if k in header}
        for a, b in ((TENSOR_P1, TENSOR_P2), (TENSOR_DOMAIN_P1, TENSOR_DOMAIN_P2)):
            if a in shape and b in shape:
                if shape[a] != shape[b]:
                    reasons.append(f"{a} shape {shape[a]} differs from {b} shape {shape[b]}")
                elif shape[a][0] != d["hidden_size"]:
                    reasons.append(f"{a} has hidden size {shape[a][0]} but the metadata says "
                                   f"{d['hidden_size']}")
            elif (a in shape) != (b in shape):
                reasons.append(f"{a} and {b} must both be present or both absent")
        if shape[TENSOR_P1][1] != d["rank"]:
            reasons.append(f"{TENSOR_P1} has rank {shape[TENSOR_P1][1]} but the metadata says "
                           f"{d['rank']}")
        if d.get("domain") == "with_steer" and TENSOR_DOMAIN_P1 not in shape:
            reasons.append("metadata domain='with_steer' but the file has no domain tensors")
    if reasons:
        raise SteerFileError(path, reasons)
    if unknown:  # a file that is served: only then are they ignored
        warnings.warn(f"steer file {path!r}: unknown tensors {others} are ignored", stacklevel=3)
    return header, SteerMetadata.from_dict(d, path)


def read_metadata(path: str | os.PathLike) -> SteerMetadata:
    """Read and check a steer file's metadata and tensor shapes without loading tensors.

    Light: needs neither torch nor safetensors. Raises :class:`SteerFileError` listing every
    reason the file is refused.
    """
    path = os.fspath(path)
    return _check_file(path)[1]


def factor_ranks(path: str | os.PathLike) -> tuple[int, ...]:
    """The ranks of an LM-Steer file's factors, the steer's and its domain component's if it
    has one, from the header (no tensors loaded): what a bank slot must reserve for it, as
    the loaded steer's ``p1`` and ``domain_p1`` say. Raises :class:`SteerFileError`."""
    header = _check_file(os.fspath(path))[0]
    return tuple(int(header[t]["shape"][1]) for t in (TENSOR_P1, TENSOR_DOMAIN_P1)
                 if t in header)


@dataclass
class Steer:
    """A loaded steer: factors (row-vector convention) and metadata."""

    p1: "torch.Tensor"  # [hidden, rank]
    p2: "torch.Tensor"  # [hidden, rank]
    metadata: SteerMetadata
    domain_p1: "torch.Tensor | None" = None  # [hidden, rank_d]
    domain_p2: "torch.Tensor | None" = None  # [hidden, rank_d]

    @property
    def hidden_size(self) -> int:
        return int(self.p1.shape[0])

    @property
    def name(self) -> str:
        return self.metadata.name

    def to(self, device=None, dtype=None) -> "Steer":
        f = lambda t: None if t is None else t.to(device=device, dtype=dtype).contiguous()  # noqa
        return Steer(f(self.p1), f(self.p2), self.metadata, f(self.domain_p1), f(self.domain_p2))

    def matrix(self) -> "torch.Tensor":
        """The dense ``W = P2 P1^T`` ([hidden, hidden], column form). For small models/tests."""
        return self.p2 @ self.p1.T

    def scaled(self, factor: float) -> "Steer":
        """The same steer with ``W`` multiplied by ``factor``."""
        return dataclasses.replace(self, p2=self.p2 * factor)


def check_steer(steer: Steer, path: str = "<memory>") -> None:
    """The checks :func:`load_steer` makes, on a steer in memory (used before saving):
    raises :class:`SteerFileError` listing every reason."""
    import torch

    reasons: list[str] = []
    meta = steer.metadata
    try:
        doc = meta.to_json()
    except (TypeError, ValueError) as e:
        raise SteerFileError(path, [f"metadata is not JSON-serialisable ({e})"]) from None
    reasons += metadata_size_problems(doc)
    reasons += metadata_problems(json.loads(doc))
    pairs = [(TENSOR_P1, steer.p1, TENSOR_P2, steer.p2)]
    if (steer.domain_p1 is None) != (steer.domain_p2 is None):
        reasons.append("domain P1 and P2 must both be given or both be None")
    elif steer.domain_p1 is not None:
        pairs.append((TENSOR_DOMAIN_P1, steer.domain_p1, TENSOR_DOMAIN_P2, steer.domain_p2))
    elif meta.domain == "with_steer":
        reasons.append("metadata domain='with_steer' but the steer has no domain tensors")
    for ka, a, kb, b in pairs:
        if a.dim() != 2 or a.shape != b.shape:
            reasons.append(f"{ka} {tuple(a.shape)} and {kb} {tuple(b.shape)} must be equal "
                           "[hidden, rank] shapes")
        elif a.shape[0] != steer.p1.shape[0]:
            reasons.append(f"{ka} has hidden size {a.shape[0]}, {TENSOR_P1} {steer.p1.shape[0]}")
        for k, t in ((ka, a), (kb, b)):
            if not t.is_floating_point() or str(t.dtype).split(".")[-1] not in _TORCH_DTYPES:
                reasons.append(f"tensor {k} has dtype {t.dtype}, expected one of "
                               f"{sorted(_TORCH_DTYPES)}")
            elif not torch.isfinite(t).all():
                reasons.append(f"tensor {k} holds NaN or inf")
            else:
                reasons += beyond_range({k: t}, torch.float32)
    if reasons:
        raise SteerFileError(path, reasons)


class OutputPathError(ValueError):
    """A file cannot be written at the path given; the message names the path, why, and
    what to give instead."""


def output_path_problem(path: str, suffix: str = FILE_SUFFIX) -> str | None:
    """Why no file can be written at ``path`` (None: nothing against it before writing): an
    empty path, a directory (or a path ending in ``/``), or a path below a file."""
    if not path:
        return f"no file name given: give one, e.g. NAME{suffix}"
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return (f"{path!r} is a directory, not a file: give a file name in it, e.g. "
                f"{os.path.join(path, 'NAME' + suffix)}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):  # the nearest folder above that exists
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return (f"cannot write {path!r}: {parent} is not a directory, so no file can be "
                "written below it; give a path in a directory")
    return None


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux's
    ``/proc/self/status``: another thread creating a file meanwhile keeps its mode)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str, write: Callable[[str], None], suffix: str = FILE_SUFFIX
                     ) -> None:
    """Write ``path`` whole or not at all: ``write(tmp)`` writes ``path + ".tmp"``, which is
    then renamed onto ``path``, with the mode ``open()`` gives a new file (0644 under umask
    022: a server running as another user reads it). A path that cannot be a file is refused
    first (:class:`OutputPathError`, naming it); on any failure the temporary file is removed
    and an ``OSError`` says which file could not be written and why."""
    problem = output_path_problem(path, suffix)
    if problem:
        raise OutputPathError(problem)
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() makes a file: safetensors makes it 0600
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise type(e)(e.errno, f"cannot write {path!r} ({e.strerror})") from e
        raise


_TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64")


def save_steer(path: str | os.PathLike, steer: Steer) -> None:
    """Write ``steer`` to ``path`` (safetensors + JSON metadata) after the checks a reader
    makes (:func:`check_steer`): a file this writes is one every reader accepts."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    meta = steer.metadata
    if steer.p1.dim() == 2:
        meta = dataclasses.replace(meta, hidden_size=int(steer.p1.shape[0]),
                                   rank=int(steer.p1.shape[1]))
    steer = dataclasses.replace(steer, metadata=meta)
    check_steer(steer, path)
    tensors = {TENSOR_P1: steer.p1, TENSOR_P2: steer.p2}
    if steer.domain_p1 is not None:
        tensors[TENSOR_DOMAIN_P1] = steer.domain_p1
        tensors[TENSOR_DOMAIN_P2] = steer.domain_p2
    tensors = own_storage({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
    write_atomically(path, lambda tmp: save_file(
        tensors, tmp, metadata={METADATA_KEY: meta.to_json(), "format": "pt"}))


def own_storage(tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """``tensors`` with each one that shares its storage with an earlier one copied:
    safetensors' ``save_file`` refuses tensors that share memory (``P1 is P2``, a symmetric
    steer; one vector given for several blocks), which are valid steers all the same."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def load_steer(path: str | os.PathLike, device=None, dtype=None) -> Steer:
    """Load a steer file (safetensors only, never pickle), check it, and move it.

    Raises :class:`SteerFileError` naming the file and every reason it is refused
    (missing, truncated, pickle, wrong shapes, NaN/inf values, bad metadata).
    """
    from safetensors import safe_open
    import torch

    path = os.fspath(path)
    _, meta = _check_file(path)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                if k in KNOWN_TENSORS:
                    tensors[k] = f.get_tensor(k)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # safetensors' own errors, and a Rust panic (BaseException)
        raise SteerFileError(path, [f"safetensors could not read the file: "
                                    f"{str(e)[:300]}"]) from e
    reasons = [f"tensor {k!r} holds NaN or inf values"
               for k, t in tensors.items() if not torch.isfinite(t).all()]
    reasons += beyond_range(tensors, torch.float32) if not reasons else []
    if reasons:
        raise SteerFileError(path, reasons)
    steer = Steer(tensors[TENSOR_P1], tensors[TENSOR_P2], meta,
                  tensors.get(TENSOR_DOMAIN_P1), tensors.get(TENSOR_DOMAIN_P2))
    if device is not None or dtype is not None:
        steer = steer.to(device=device, dtype=dtype)
    return steer


def metadata_size_problems(doc: str) -> list[str]:
    """The writers' check of a metadata document (JSON text) against the readers' limit,
    :data:`MAX_METADATA_BYTES`: a file written is a file read."""
    if len(doc.encode("utf-8", "surrogatepass")) > MAX_METADATA_BYTES:
        return [f"the metadata JSON is {len(doc)} characters; at most {MAX_METADATA_BYTES} "
                "bytes are allowed"]
    return []


def beyond_range(tensors: Mapping[str, "torch.Tensor"], dtype: "torch.dtype") -> list[str]:
    """Each tensor (finite as stored) with values that ``dtype`` cannot hold (an F64 tensor
    beyond float32's range; an F32 one beyond float16's when the model is served in fp16):
    they would be infinite once cast."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return []  # (a dtype not known yet)
    top = torch.finfo(dtype).max
    return [f"tensor {k!r} holds values up to {t.abs().max().item():.4g}, beyond {dtype}'s "
            f"range (±{top:.4g}); they would be infinite in {dtype}"
            for k, t in tensors.items() if t.is_floating_point() and t.numel()
            and t.abs().max().item() > top]


def served_range_problems(steer: Steer, dtype: "torch.dtype") -> list[str]:
    """:func:`beyond_range` for a loaded steer's factors against the dtype the bank holds
    them in (the model's)."""
    tensors = {TENSOR_P1: steer.p1, TENSOR_P2: steer.p2}
    if steer.domain_p1 is not None:
        tensors.update({TENSOR_DOMAIN_P1: steer.domain_p1, TENSOR_DOMAIN_P2: steer.domain_p2})
    return beyond_range(tensors, dtype)


def harmful_side(meta: SteerMetadata) -> str | None:
    """The side of the steer its file marks harmful (``labels["harmful"]``), or None."""
    side = (meta.labels or {}).get(LABEL_HARMFUL)
    return side if side in HARMFUL_SIDES else None


def make_steer(p1, p2, name: str, *, base_model: str | None = None,
               epsilon: float = DEFAULT_EPSILON, domain_p1=None, domain_p2=None,
               **meta_kwargs) -> Steer:
    """Build a :class:`Steer` from factors ``[hidden, rank]``, filling the shape metadata."""
    meta = SteerMetadata(name=name, hidden_size=int(p1.shape[0]), rank=int(p1.shape[1]),
                         base_model=base_model, epsilon=epsilon, **meta_kwargs)
    return Steer(p1, p2, meta, domain_p1, domain_p2)
