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
from typing import TYPE_CHECKING, Any, Literal

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
#: The paper's unit of strength.
DEFAULT_EPSILON = 1e-3
FILE_SUFFIX = ".safetensors"

DomainMode = Literal["none", "with_steer"]
_SAFETENSORS_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_MAX_HEADER = 100 * 1024 * 1024


class SteerFileError(ValueError):
    """A steer file was refused; the message names the file and every reason."""

    def __init__(self, path: str, reasons: list[str]):
        self.path = str(path)
        self.reasons = list(reasons)
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"steer file {self.path!r} refused:\n{lines}")


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
    """What positive and negative strengths move towards, e.g. ``{"positive": "non-toxic"}``."""
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
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Unknown keys read from a newer file (kept, written back, warned about)."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
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


def _read_header(path: str) -> tuple[dict[str, Any] | None, list[str]]:
    """Parse the safetensors header by hand (no torch). Returns (header, reasons)."""
    reasons: list[str] = []
    if not os.path.exists(path):
        return None, [f"no such file: {path}"]
    if os.path.isdir(path):
        return None, ["is a directory, expected a .safetensors file"]
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, [f"file is {size} bytes, too short to be safetensors (truncated or empty)"]
        if head[:1] == b"\x80" or head[:2] == b"PK":
            return None, [
                "this is a pickle / torch.save file, not safetensors; vllm-steer never unpickles "
                "at load time. If it is a checkpoint of the paper's code, convert it with "
                "`vllm-steer convert FILE --unsafe-allow-pickle --out steer.safetensors`"
            ]
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or n + 8 > size:
            return None, [
                f"header length {n} does not fit in the file ({size} bytes): not safetensors, "
                "or truncated"
            ]
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [f"safetensors header is not valid JSON ({e})"]
    data_len = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            reasons.append(f"tensor {key!r}: malformed header entry")
            continue
        if end > data_len:
            reasons.append(
                f"tensor {key!r} ends at byte {end} of the data section but the file holds "
                f"{data_len} bytes (truncated file)"
            )
    return header, reasons


def read_metadata(path: str | os.PathLike) -> SteerMetadata:
    """Read and check a steer file's metadata and tensor shapes without loading tensors.

    Light: needs neither torch nor safetensors. Raises :class:`SteerFileError` listing every
    reason the file is refused.
    """
    path = os.fspath(path)
    header, reasons = _read_header(path)
    if header is None:
        raise SteerFileError(path, reasons)
    meta_raw = (header.get("__metadata__") or {}).get(METADATA_KEY)
    meta: SteerMetadata | None = None
    if meta_raw is None:
        reasons.append(
            f"no {METADATA_KEY!r} entry in the safetensors metadata (not a vllm-steer file; "
            "raw factors can be wrapped with vllm_steer.format.save_steer)"
        )
    else:
        try:
            d = json.loads(meta_raw)
            if d.get("format", FORMAT_NAME) != FORMAT_NAME:
                reasons.append(f"metadata format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
            if int(d.get("format_version", 0)) > FORMAT_VERSION:
                reasons.append(
                    f"format_version {d.get('format_version')} is newer than this vllm-steer "
                    f"supports ({FORMAT_VERSION}); upgrade vllm-steer"
                )
            missing = [k for k in ("name", "hidden_size", "rank") if k not in d]
            if missing:
                reasons.append(f"metadata lacks required keys {missing}")
            else:
                meta = SteerMetadata.from_dict(d, path)
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            reasons.append(f"metadata is not valid JSON ({e})")
    for t in (TENSOR_P1, TENSOR_P2):
        if t not in header:
            reasons.append(f"missing tensor {t!r}")
    for key, info in header.items():
        if key == "__metadata__" or not isinstance(info, dict):
            continue
        if key not in KNOWN_TENSORS:
            warnings.warn(f"steer file {path!r}: unknown tensor {key!r} is ignored", stacklevel=2)
        if info.get("dtype") not in _SAFETENSORS_DTYPES:
            reasons.append(f"tensor {key!r} has dtype {info.get('dtype')!r}, expected a float type")
        if len(info.get("shape", [])) != 2:
            reasons.append(f"tensor {key!r} has shape {info.get('shape')}, expected [hidden, rank]")
    if meta is not None:
        for a, b in ((TENSOR_P1, TENSOR_P2), (TENSOR_DOMAIN_P1, TENSOR_DOMAIN_P2)):
            if a in header and b in header:
                sa, sb = header[a].get("shape"), header[b].get("shape")
                if sa != sb:
                    reasons.append(f"{a} shape {sa} differs from {b} shape {sb}")
                elif sa and sa[0] != meta.hidden_size:
                    reasons.append(
                        f"{a} has hidden size {sa[0]} but the metadata says {meta.hidden_size}"
                    )
            elif (a in header) != (b in header):
                reasons.append(f"{a} and {b} must both be present or both absent")
        if TENSOR_P1 in header and header[TENSOR_P1].get("shape", [0, 0])[1:] != [meta.rank]:
            reasons.append(
                f"{TENSOR_P1} has rank {header[TENSOR_P1].get('shape')[1:]} but metadata says "
                f"{meta.rank}"
            )
        if meta.domain == "with_steer" and TENSOR_DOMAIN_P1 not in header:
            reasons.append("metadata domain='with_steer' but the file has no domain tensors")
        if meta.domain not in ("none", "with_steer"):
            reasons.append(f"metadata domain={meta.domain!r}, expected 'none' or 'with_steer'")
        if not (isinstance(meta.epsilon, (int, float)) and math.isfinite(meta.epsilon)
                and meta.epsilon > 0):
            reasons.append(f"metadata epsilon={meta.epsilon!r}, expected a positive number")
    if reasons:
        raise SteerFileError(path, reasons)
    assert meta is not None
    return meta


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

    def effective_factors(self, strength: float = 1.0):
        """``[(p1, p2, coef)]`` the server applies at this strength (domain included if so set)."""
        eps = self.metadata.epsilon
        out = [(self.p1, self.p2, strength * eps)]
        if self.metadata.domain == "with_steer" and strength != 0 and self.domain_p1 is not None:
            out.append((self.domain_p1, self.domain_p2, self.metadata.domain_strength * eps))
        return out


def save_steer(path: str | os.PathLike, steer: Steer) -> None:
    """Write ``steer`` to ``path`` (safetensors + JSON metadata), refusing non-finite values."""
    import torch
    from safetensors.torch import save_file

    path = os.fspath(path)
    meta = steer.metadata
    if steer.p1.shape != steer.p2.shape or steer.p1.dim() != 2:
        raise ValueError(f"P1 {tuple(steer.p1.shape)} and P2 {tuple(steer.p2.shape)} must be "
                         "equal [hidden, rank] shapes")
    meta = dataclasses.replace(meta, hidden_size=int(steer.p1.shape[0]),
                               rank=int(steer.p1.shape[1]))
    tensors = {TENSOR_P1: steer.p1, TENSOR_P2: steer.p2}
    if steer.domain_p1 is not None:
        tensors[TENSOR_DOMAIN_P1] = steer.domain_p1
        tensors[TENSOR_DOMAIN_P2] = steer.domain_p2
    for k, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"refusing to save steer {meta.name!r}: tensor {k} holds NaN or inf")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={METADATA_KEY: meta.to_json(), "format": "pt"})
    os.replace(tmp, path)


def load_steer(path: str | os.PathLike, device=None, dtype=None) -> Steer:
    """Load a steer file (safetensors only, never pickle), check it, and move it.

    Raises :class:`SteerFileError` naming the file and every reason it is refused
    (missing, truncated, pickle, wrong shapes, NaN/inf values, bad metadata).
    """
    from safetensors import safe_open
    import torch

    path = os.fspath(path)
    meta = read_metadata(path)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                if k in KNOWN_TENSORS:
                    tensors[k] = f.get_tensor(k)
    except Exception as e:  # safetensors raises its own error types
        raise SteerFileError(path, [f"safetensors could not read the file: {e}"]) from e
    reasons = [f"tensor {k!r} holds NaN or inf values"
               for k, t in tensors.items() if not torch.isfinite(t).all()]
    if reasons:
        raise SteerFileError(path, reasons)
    steer = Steer(tensors[TENSOR_P1], tensors[TENSOR_P2], meta,
                  tensors.get(TENSOR_DOMAIN_P1), tensors.get(TENSOR_DOMAIN_P2))
    if device is not None or dtype is not None:
        steer = steer.to(device=device, dtype=dtype)
    return steer


def make_steer(p1, p2, name: str, *, base_model: str | None = None,
               epsilon: float = DEFAULT_EPSILON, domain_p1=None, domain_p2=None,
               **meta_kwargs) -> Steer:
    """Build a :class:`Steer` from factors ``[hidden, rank]``, filling the shape metadata."""
    meta = SteerMetadata(name=name, hidden_size=int(p1.shape[0]), rank=int(p1.shape[1]),
                         base_model=base_model, epsilon=epsilon, **meta_kwargs)
    return Steer(p1, p2, meta, domain_p1, domain_p2)
