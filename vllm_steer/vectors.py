"""Vector steers (control vectors): one vector per decoder block, added to that block's output.

A vector steer holds ``v_k`` ([hidden]) for some decoder blocks ``k`` (0-based). At strength
``a`` it adds ``a * v_k`` to the output of block ``k`` at every position of a row; several
vector steers add up. Semantics: see :func:`vllm_steer.reference.vector_steer_reference`.

The same content is read from two kinds of file:

- **llama.cpp's control-vector GGUF** (also written by repeng and EasySteer): architecture
  ``controlvector``; F32 tensors ``direction.K`` of one dimension ``[hidden]``, where
  ``direction.K`` is added to the output of decoder block K (0-based), as llama.cpp applies it
  (``build_cvec(cur, il)`` after block ``il``'s last residual add); llama.cpp refuses
  ``direction.0`` (block 0 is never steered there), so a file written for it starts at 1. Keys
  ``controlvector.model_hint`` (the model's architecture, e.g. ``llama``) and
  ``controlvector.layer_count`` (the number of directions). Read and written with the ``gguf``
  package; no parser of ours.
- **this project's safetensors steer file** of kind ``vector``: the same ``direction.K``
  tensors and JSON metadata (:class:`VectorMetadata`: layers, model, provenance, recommended
  strength, the harmful side), under the conventions of :mod:`vllm_steer.format`.

Every reason a file is refused is listed in one :class:`VectorFileError`.
:func:`model_fit_problems` checks a vector steer against a model's hidden size, layer count
and name, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_steer.format import (FORMAT_NAME, FORMAT_VERSION, KIND_KEY, KIND_VECTOR,
                               MAX_HIDDEN_SIZE, METADATA_KEY, SteerFileError,
                               TENSOR_DIRECTION_PREFIX, _echo, _is_int, beyond_range,
                               common_metadata_problems, file_kind, metadata_size_problems,
                               own_storage, read_document, write_atomically)

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Suffix of llama.cpp's control-vector files.
GGUF_SUFFIX = ".gguf"
#: ``general.architecture`` of a control-vector GGUF.
GGUF_ARCH = "controlvector"
GGUF_KEY_ARCH = "general.architecture"
GGUF_KEY_MODEL_HINT = f"{GGUF_ARCH}.model_hint"
GGUF_KEY_LAYER_COUNT = f"{GGUF_ARCH}.layer_count"
#: GGUF key (a string: our JSON metadata document) that carries a vector steer's metadata
#: through a GGUF file; llama.cpp ignores keys it does not know.
GGUF_KEY_METADATA = f"{GGUF_ARCH}.vllm_steer_metadata"
#: The first 4 bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: Largest decoder-block index + 1 a vector steer may name.
MAX_LAYERS = 4096
#: Longest ``model_type`` string.
MAX_MODEL_TYPE_LENGTH = 128


class VectorFileError(SteerFileError):
    """A vector steer file was refused; the message names the file and every reason."""

    KIND = "vector steer"


def direction_name(layer: int) -> str:
    """The tensor name of block ``layer``'s vector: ``direction.K``."""
    return f"{TENSOR_DIRECTION_PREFIX}{layer}"


def direction_layer(name: str) -> int | None:
    """The block index of a ``direction.K`` tensor name (K a plain non-negative decimal), or
    None for any other name."""
    if not isinstance(name, str) or not name.startswith(TENSOR_DIRECTION_PREFIX):
        return None
    tail = name[len(TENSOR_DIRECTION_PREFIX):]
    if not (tail.isascii() and tail.isdigit()) or (len(tail) > 1 and tail[0] == "0"):
        return None
    return int(tail)


@dataclass
class VectorMetadata:
    """Metadata of a vector steer, stored as JSON in its safetensors file (and in a GGUF
    written here, under :data:`GGUF_KEY_METADATA`). Unknown keys are kept and warned about."""

    name: str
    """Short name of the steer (what requests use when the server gives no other name)."""
    hidden_size: int
    """Size of each vector: the model's ``hidden_size``."""
    layers: list[int]
    """The decoder blocks (0-based) that have a vector, ascending: ``direction.K`` for each."""
    base_model: str | None = None
    """Identity of the model the vectors were made for (HF id, path or ``smollm2``)."""
    model_type: str | None = None
    """The model's architecture (its config's ``model_type``; a GGUF's
    ``controlvector.model_hint``), e.g. ``llama``."""
    model_layers: int | None = None
    """How many decoder blocks the model has (every ``layers`` entry is below it)."""
    labels: dict[str, str] = field(default_factory=dict)
    """What positive and negative strengths move towards, and ``"harmful"``: the side that
    moves towards harmful text (as in LM-Steer files)."""
    recommended_strength: float | None = None
    """Strength the author recommends (a strength ``a`` adds ``a * v_k``)."""
    recipe: dict[str, Any] = field(default_factory=dict)
    """How the vectors were made: method, layers, data size, seed, ... (free form)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Training data description: files and their sha256."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Measurements made when training (per layer: held-out separation, scale, ...)."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where the vectors came from when not trained here (a converted GGUF: its file, sha256
    and keys)."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    kind: str = KIND_VECTOR
    """Always :data:`vllm_steer.format.KIND_VECTOR`."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Unknown keys read from a newer file (kept, written back, warned about)."""

    # What every steer's metadata answers (the bank, the registry and ``/v1/steers`` read
    # these of any kind): a vector has no rank and no domain component, and its strength is
    # its coefficient (``a * v_k``: epsilon 1).
    @property
    def rank(self) -> int:
        """0: a vector steer has no low-rank factors."""
        return 0

    @property
    def epsilon(self) -> float:
        """1.0: strength ``a`` adds ``a * v_k`` (no unit to scale by)."""
        return 1.0

    @property
    def domain(self) -> str:
        """``"none"``: no domain component."""
        return "none"

    @property
    def domain_strength(self) -> float:
        return 0.0

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.update(d.pop("extra"))
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "<memory>") -> "VectorMetadata":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        unknown = {k: v for k, v in d.items() if k not in names}
        if unknown:
            warnings.warn(f"vector steer file {path!r}: unknown metadata keys {sorted(unknown)} "
                          "(written by a newer vllm-steer?); they are kept but not used",
                          stacklevel=3)
        return cls(**known, extra=unknown)


def vector_metadata_problems(d: Any) -> list[str]:
    """Every reason the metadata document ``d`` of a vector steer is refused."""
    if not isinstance(d, dict):
        return [f"metadata must be a JSON object, got {type(d).__name__}"]
    reasons = common_metadata_problems(d, ("name", "hidden_size", "layers"))
    if file_kind(d) != KIND_VECTOR:
        reasons.append(f"metadata {KIND_KEY}={_echo(file_kind(d))}, expected {KIND_VECTOR!r} "
                       "(an LM-Steer file is read with vllm_steer.format.load_steer)")
    layers = d.get("layers", [])
    if "layers" not in d:
        pass  # named among the required keys
    elif not (isinstance(layers, list) and layers
            and all(_is_int(k) and 0 <= k < MAX_LAYERS for k in layers)):
        reasons.append(f"metadata layers={_echo(layers)}, expected a non-empty list of block "
                       f"indices from 0 to {MAX_LAYERS - 1}")
    elif len(set(layers)) != len(layers) or layers != sorted(layers):
        reasons.append(f"metadata layers={_echo(layers)}, expected ascending indices, each once")
    ml = d.get("model_layers")
    if ml is not None and not (_is_int(ml) and 1 <= ml <= MAX_LAYERS):
        reasons.append(f"metadata model_layers={_echo(ml)}, expected an integer from 1 to "
                       f"{MAX_LAYERS} or null")
    elif _is_int(ml) and isinstance(layers, list) and all(_is_int(k) for k in layers) \
            and layers and max(layers) >= ml:
        reasons.append(f"metadata layers include block {max(layers)} but model_layers={ml} "
                       f"(blocks 0 to {ml - 1})")
    mt = d.get("model_type")
    if mt is not None and not (isinstance(mt, str) and len(mt) <= MAX_MODEL_TYPE_LENGTH):
        reasons.append(f"metadata model_type={_echo(mt)}, expected a string of at most "
                       f"{MAX_MODEL_TYPE_LENGTH} characters or null")
    return reasons


@dataclass
class VectorSteer:
    """A loaded vector steer: ``directions[k]`` ([hidden], float32) for each block ``k``."""

    directions: dict[int, "torch.Tensor"]
    metadata: VectorMetadata

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def hidden_size(self) -> int:
        return self.metadata.hidden_size

    @property
    def layers(self) -> list[int]:
        return sorted(self.directions)

    def to(self, device=None, dtype=None) -> "VectorSteer":
        """The same steer; its vectors stay float32 on the host (the bank copies them)."""
        return self

    def stacked(self, num_layers: int) -> "torch.Tensor":
        """``[num_layers, hidden]``: block ``k``'s vector in row ``k``, zeros elsewhere."""
        import torch

        out = torch.zeros(num_layers, self.hidden_size, dtype=torch.float32)
        for k, v in self.directions.items():
            out[k] = v.float()
        return out

    def select(self, layers: list[int]) -> "VectorSteer":
        """The same steer on ``layers`` only (each must have a vector)."""
        missing = sorted(set(layers) - set(self.directions))
        if missing:
            raise ValueError(f"layers {missing} have no vector in {self.name!r} (it has "
                             f"{_ranges(self.layers)})")
        keep = sorted(set(layers))
        meta = dataclasses.replace(self.metadata, layers=keep)
        return VectorSteer({k: self.directions[k] for k in keep}, meta)


def _ranges(xs: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3,7``."""
    out, xs = [], sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def parse_layers(spec: str, num_layers: int | None = None) -> list[int]:
    """Block indices from ``"1-29"``, ``"5,10,12-14"`` or ``"all"`` (needs ``num_layers``)."""
    text = str(spec).strip().lower()
    if text == "all":
        if num_layers is None:
            raise ValueError("layers 'all' needs the model's layer count")
        return list(range(num_layers))
    spans: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            a, dash, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if dash else int(a)  # "5-" has no end: refused
            if lo < 0 or hi < lo:
                raise ValueError
            spans.append((lo, hi))
    except ValueError:
        raise ValueError(f"layers {_echo(spec)}: give block indices (0-based) like 1-29, "
                         "5,10,12-14 or all") from None
    top = max(hi for _, hi in spans)  # checked before any range is built
    limit = MAX_LAYERS if num_layers is None else num_layers
    if top >= limit:
        raise ValueError(f"layers {_echo(spec)}: block {_echo(top)} does not exist; "
                         + (f"the model has {num_layers} decoder blocks (0 to {num_layers - 1})"
                            if num_layers is not None
                            else f"a vector steer names blocks 0 to {MAX_LAYERS - 1}"))
    return sorted({k for lo, hi in spans for k in range(lo, hi + 1)})


def make_vector_steer(directions: dict[int, Any], name: str, **meta_kwargs) -> VectorSteer:
    """A :class:`VectorSteer` from ``{block: vector}`` (tensors or arrays), float32, with the
    shape metadata filled in."""
    import torch

    dirs = {int(k): torch.as_tensor(v).detach().to("cpu", torch.float32).reshape(-1).contiguous()
            for k, v in directions.items()}
    hidden = next(iter(dirs.values())).numel() if dirs else 0
    meta = VectorMetadata(name=name, hidden_size=hidden, layers=sorted(dirs), **meta_kwargs)
    return VectorSteer(dirs, meta)


def check_vector_steer(vs: VectorSteer, path: str = "<memory>") -> None:
    """The checks a reader makes, on a vector steer in memory (used before saving)."""
    import torch

    meta = vs.metadata
    try:
        text = meta.to_json()
        doc = json.loads(text)
    except (TypeError, ValueError) as e:
        raise VectorFileError(path, [f"metadata is not JSON-serialisable ({e})"]) from None
    reasons = vector_metadata_problems(doc) + metadata_size_problems(text)
    if sorted(vs.directions) != list(meta.layers):
        reasons.append(f"the vectors are for blocks {_ranges(sorted(vs.directions))} but the "
                       f"metadata lists {_ranges(list(meta.layers))}")
    for k, v in sorted(vs.directions.items()):
        if v.dim() != 1 or v.numel() != meta.hidden_size:
            reasons.append(f"{direction_name(k)} has shape {tuple(v.shape)}, expected "
                           f"[{meta.hidden_size}] (the hidden size)")
        elif not torch.isfinite(v).all():
            reasons.append(f"{direction_name(k)} holds NaN or inf")
        else:  # written as float32
            reasons += beyond_range({direction_name(k): v}, torch.float32)
    if reasons:
        raise VectorFileError(path, reasons)


def save_vector(path: str | os.PathLike, vs: VectorSteer) -> None:
    """Write ``vs`` as this project's safetensors file (kind ``vector``, float32)."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    check_vector_steer(vs, path)
    tensors = own_storage({direction_name(k): v.detach().to("cpu").float().contiguous()
                           for k, v in sorted(vs.directions.items())})
    write_atomically(path, lambda tmp: save_file(
        tensors, tmp, metadata={METADATA_KEY: vs.metadata.to_json(), "format": "pt"}))


def _check_vector_file(path: str) -> tuple[dict[str, Any], VectorMetadata]:
    header, d, reasons = read_document(path)
    if header is None:
        raise VectorFileError(path, reasons)
    if d is not None:
        reasons.extend(vector_metadata_problems(d))
    names = [k for k in header if k != "__metadata__"]
    found = {direction_layer(k): k for k in names if direction_layer(k) is not None}
    unknown = [k for k in names if direction_layer(k) is None]
    # the tensors against what of the metadata can be read, whatever else is wrong with it
    want = d.get("layers") if isinstance(d, dict) else None
    if isinstance(want, list) and all(_is_int(k) for k in want) \
            and sorted(found) != sorted(set(want)):
        reasons.append(f"the file's direction tensors are for blocks "
                       f"{_ranges(sorted(found)) or 'none'} but the metadata lists "
                       f"{_ranges(sorted(set(want))) or 'none'}")
    hidden = d.get("hidden_size") if isinstance(d, dict) else None
    for _k, name in sorted(found.items()):
        shape = header[name].get("shape")
        if _is_int(hidden) and shape != [hidden]:
            reasons.append(f"{name} has shape {shape} but the metadata's hidden size is "
                           f"{hidden}")
        elif not _is_int(hidden) and not (isinstance(shape, list) and len(shape) == 1):
            reasons.append(f"{name} has shape {shape}, expected one dimension [hidden]")
    if reasons:
        raise VectorFileError(path, reasons)
    if unknown:
        warnings.warn(f"vector steer file {path!r}: unknown tensors "
                      f"{', '.join(_echo(k) for k in unknown[:5])} are ignored", stacklevel=3)
    return header, VectorMetadata.from_dict(d, path)


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether the file is read as a GGUF: it starts with the GGUF magic, or it is named
    ``.gguf`` and does not start as a safetensors file does (an 8-byte header length, then
    ``{``), so that an empty or truncated ``.gguf`` is refused as a GGUF."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if head[:4] == GGUF_MAGIC:
        return True
    return is_gguf_name(path) and head[8:9] != b"{"


def read_vector_metadata(path: str | os.PathLike) -> VectorMetadata:
    """Read and check a vector steer's metadata (either kind of file). Raises
    :class:`VectorFileError` listing every reason."""
    path = os.fspath(path)
    if is_gguf(path):
        return load_gguf(path).metadata
    return _check_vector_file(path)[1]


def load_vector(path: str | os.PathLike) -> VectorSteer:
    """Load a vector steer from this project's safetensors file or from a llama.cpp control
    vector GGUF (told apart by the file's first bytes). Raises :class:`VectorFileError` naming
    the file and every reason it is refused."""
    from safetensors import safe_open
    import torch

    path = os.fspath(path)
    if is_gguf(path):
        return load_gguf(path)
    _, meta = _check_vector_file(path)
    dirs: dict[int, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for k in meta.layers:
                dirs[k] = f.get_tensor(direction_name(k))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # safetensors' own errors, and a Rust panic
        raise VectorFileError(path, [f"safetensors could not read the file: "
                                     f"{str(e)[:300]}"]) from e
    reasons = [f"{direction_name(k)} holds NaN or inf values"
               for k, t in dirs.items() if not torch.isfinite(t).all()]
    if not reasons:  # read as float32: an F64 file's values must fit it
        reasons = beyond_range({direction_name(k): t for k, t in dirs.items()}, torch.float32)
    if reasons:
        raise VectorFileError(path, reasons)
    return VectorSteer({k: t.float() for k, t in dirs.items()}, meta)


# ---- llama.cpp's GGUF ---------------------------------------------------------------------

def _gguf_value(reader, key: str) -> Any:
    f = reader.get_field(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 -- a field of an odd type: treated as absent
        return None


def load_gguf(path: str | os.PathLike, name: str | None = None) -> VectorSteer:
    """A vector steer from llama.cpp's control-vector GGUF (what repeng, EasySteer and
    llama.cpp's generator write). Read with the ``gguf`` package. The file's tensors are kept
    bit for bit; ``direction.K`` is block K's vector (0-based)."""
    path = os.fspath(path)
    reader = _open_gguf(path)
    reasons: list[str] = []
    arch = _gguf_value(reader, GGUF_KEY_ARCH)
    if arch is not None and arch != GGUF_ARCH:  # absent: llama.cpp does not read it either
        reasons.append(f"{GGUF_KEY_ARCH} is {_echo(arch)}, expected {GGUF_ARCH!r} (a control "
                       "vector; this looks like another kind of GGUF, e.g. a model)")
    dirs = _gguf_directions(reader, reasons)
    if reasons:
        raise VectorFileError(path, reasons)
    meta_kwargs = _gguf_metadata(reader, path, dirs, name)
    known = {f.name for f in dataclasses.fields(VectorMetadata)}
    extra = {k: v for k, v in meta_kwargs.items() if k not in known}
    if extra:
        warnings.warn(f"vector steer file {path!r}: unknown metadata keys {sorted(extra)} in "
                      f"{GGUF_KEY_METADATA} (written by a newer vllm-steer?); they are kept "
                      "but not used", stacklevel=2)
    meta_kwargs = {k: v for k, v in meta_kwargs.items() if k in known and k != "extra"}
    vs = make_vector_steer(dirs, **meta_kwargs)
    vs.metadata.extra = extra
    check_vector_steer(vs, path)
    return vs


def _open_gguf(path: str):
    """``gguf.GGUFReader`` of ``path``, or the refusal naming why it cannot be read."""
    if not os.path.isfile(path):
        raise VectorFileError(path, ["no such file" if not os.path.exists(path)
                                     else "is not a file, expected a .gguf file"])
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        size = os.path.getsize(path)
        raise VectorFileError(path, [f"file is {size} bytes and does not start with GGUF's "
                                     f"magic {GGUF_MAGIC.decode()!r}: empty, truncated or not "
                                     "a GGUF file"])
    try:
        import gguf
        return gguf.GGUFReader(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 -- corrupt files raise anything
        raise VectorFileError(path, [f"not a readable GGUF file: truncated or corrupt "
                                     f"({type(e).__name__}: {str(e)[:200]})"]) from None


def _gguf_directions(reader, reasons: list[str]) -> dict:
    """Block index -> fp32 vector of every ``direction.K`` tensor of ``reader``; what is
    wrong with a tensor is added to ``reasons``."""
    import gguf
    import numpy as np
    import torch

    dirs: dict[int, torch.Tensor] = {}
    hidden = None
    others = [t.name for t in reader.tensors if direction_layer(t.name) is None]
    if others:  # one reason for them all: a model's GGUF has hundreds
        names = ", ".join(_echo(n) for n in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        reasons.append(f"tensor {names} is not named direction.K (K a block index), as "
                       "llama.cpp requires" if len(others) == 1 else
                       f"{len(others)} tensors ({names}{more}) are not named direction.K (K a "
                       "block index), as llama.cpp requires")
    for t in reader.tensors:
        k = direction_layer(t.name)
        if k is None:
            continue
        n = int(t.n_elements)
        problem = _gguf_tensor_problem(t, k, n, hidden, gguf)
        if problem is None:
            hidden = n
            arr = np.array(t.data, dtype=np.float32, copy=True).reshape(-1)
            if np.isfinite(arr).all():
                dirs[k] = torch.from_numpy(arr)
                continue
            problem = f"{t.name} holds NaN or inf values"
        reasons.append(problem)
    if not reader.tensors:
        reasons.append("the file has no direction tensors")
    return dirs


def _gguf_tensor_problem(t, k: int, n: int, hidden: int | None, gguf) -> str | None:
    """Why the GGUF tensor ``t`` (block ``k``, ``n`` values) is not a direction (None: it is);
    ``hidden``: the values of the directions before it."""
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
        return f"{t.name} has type {t.tensor_type.name}, expected F32 (as llama.cpp requires)"
    ne = [int(s) for s in t.shape]  # ggml's order; trailing 1s are no dimension to ggml
    n_dims = max([i + 1 for i, x in enumerate(ne) if x != 1] or [1])
    if n_dims != 1 or not 1 <= n <= MAX_HIDDEN_SIZE:
        return (f"{t.name} has shape {ne} (ggml's order), expected one dimension [hidden] of "
                f"1 to {MAX_HIDDEN_SIZE}, as llama.cpp requires")
    if k >= MAX_LAYERS:
        return f"{t.name}: block {k} is beyond the {MAX_LAYERS} blocks a vector steer may have"
    if hidden is not None and n != hidden:
        return (f"{t.name} has {n} values but the first direction has {hidden}: every "
                "direction must have the model's hidden size")
    return None


def _gguf_metadata(reader, path: str, dirs: dict, name: str | None) -> dict:
    """The vector steer's metadata fields from the GGUF's keys: our own metadata where the file
    was written here, else the name, the model hint and where the file came from."""
    import hashlib

    from vllm_steer.names import safe_steer_name

    hint = _gguf_value(reader, GGUF_KEY_MODEL_HINT)
    count = _gguf_value(reader, GGUF_KEY_LAYER_COUNT)
    doc_raw = _gguf_value(reader, GGUF_KEY_METADATA)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    keys = _gguf_provenance_keys(reader)
    source = {"kind": "llama.cpp control-vector GGUF", "file": os.path.basename(path),
              "sha256": sha, "keys": keys}
    meta_kwargs: dict[str, Any] = {}
    if doc_raw is not None:  # written here: our metadata travelled with the vectors
        d = _gguf_own_metadata(doc_raw, path)
        meta_kwargs = {k: v for k, v in d.items() if k not in ("hidden_size", "layers")}
    else:
        if isinstance(hint, str) and len(hint) > MAX_MODEL_TYPE_LENGTH:
            raise VectorFileError(path, [f"{GGUF_KEY_MODEL_HINT} is {len(hint)} characters "
                                         f"({_echo(hint)}), expected an architecture name of "
                                         f"at most {MAX_MODEL_TYPE_LENGTH}"])
        stem = os.path.splitext(os.path.basename(path))[0]  # detox.v2.gguf -> detox.v2
        meta_kwargs = {"name": name or safe_steer_name(stem, "vector"),
                       "model_type": hint if isinstance(hint, str) and hint else None,
                       "source": source}
        if isinstance(count, int) and count != len(dirs):
            source["note"] = (f"{GGUF_KEY_LAYER_COUNT}={count} but the file holds {len(dirs)} "
                              "directions (the directions are what is applied)")
    if name and doc_raw is not None:
        meta_kwargs["name"] = name
    return meta_kwargs


def _gguf_own_metadata(raw: Any, path: str) -> dict:
    """Our metadata document from a GGUF's :data:`GGUF_KEY_METADATA`, checked as a vector
    file's is: a file that carries it but whose document is refused is refused (its name,
    labels and strength would be lost unseen), every reason named."""
    if not isinstance(raw, str):
        raise VectorFileError(path, [f"{GGUF_KEY_METADATA} is not a string (our JSON "
                                     "metadata document)"])
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise VectorFileError(path, [f"{GGUF_KEY_METADATA} is not valid JSON ({e})"]) from None
    reasons = vector_metadata_problems(d)
    if reasons:
        raise VectorFileError(path, [f"{GGUF_KEY_METADATA}: {r}" for r in reasons])
    return d


#: The most keys, and the longest text value, kept from a GGUF's keys as provenance.
MAX_SOURCE_KEYS = 64
MAX_SOURCE_TEXT = 1000
#: The longest key name kept (longer ones are no writer's provenance).
MAX_SOURCE_KEY_NAME = 200


def _gguf_provenance_keys(reader) -> dict[str, Any]:
    """The GGUF's own keys, kept under ``source["keys"]`` when the vectors are converted (the
    model hint, the layer count, and what other writers add: EasySteer's method, ...): every
    key (a name of at most :data:`MAX_SOURCE_KEY_NAME` characters) with a number, a boolean
    or a text of at most :data:`MAX_SOURCE_TEXT` characters, but
    the reader's ``GGUF.*`` entries, the architecture and our own metadata; at most
    :data:`MAX_SOURCE_KEYS`."""
    keys: dict[str, Any] = {}
    for key in reader.fields:
        if key.startswith("GGUF.") or key in (GGUF_KEY_ARCH, GGUF_KEY_METADATA) \
                or len(key) > MAX_SOURCE_KEY_NAME:
            continue
        v = _gguf_value(reader, key)
        if isinstance(v, float) and not math.isfinite(v):
            continue
        if isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= MAX_SOURCE_TEXT):
            keys[key] = v
            if len(keys) == MAX_SOURCE_KEYS:
                break
    return keys


def save_gguf(path: str | os.PathLike, vs: VectorSteer) -> None:
    """Write ``vs`` as llama.cpp's control-vector GGUF (F32 ``direction.K``, the
    ``controlvector.*`` keys, and our metadata under :data:`GGUF_KEY_METADATA`), with the
    ``gguf`` package. llama.cpp refuses ``direction.0``, so a steer with a vector for block 0
    is refused: drop that block first (:meth:`VectorSteer.select`, ``--layers``)."""
    import gguf
    import numpy as np

    path = os.fspath(path)
    check_vector_steer(vs, path)
    if 0 in vs.directions:
        raise VectorFileError(path, [
            "the steer has a vector for block 0, which llama.cpp refuses (direction.0 is "
            "invalid there: it never steers block 0's output); keep blocks from 1 on "
            f"(--layers {_ranges([k for k in vs.layers if k > 0])})" if max(vs.layers) > 0 else
            "the steer's only vector is for block 0, which llama.cpp refuses"])
    meta = vs.metadata

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, GGUF_ARCH)
        try:
            # always written: repeng's and EasySteer's readers refuse a file without it (an
            # empty hint when the architecture is unknown, read back here as none; the gguf
            # package's add_string would drop an empty text)
            w.add_key_value(GGUF_KEY_MODEL_HINT, meta.model_type or "", gguf.GGUFValueType.STRING)
            w.add_uint32(GGUF_KEY_LAYER_COUNT, len(vs.directions))
            w.add_string(GGUF_KEY_METADATA, meta.to_json())
            for k in vs.layers:
                w.add_tensor(direction_name(k), vs.directions[k].detach().cpu().float().numpy()
                             .astype(np.float32, copy=False))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()

    write_atomically(path, write, GGUF_SUFFIX)


def is_gguf_name(path: str | os.PathLike) -> bool:
    """Whether a file name asks for llama.cpp's GGUF: it ends in ``.gguf``, in any case."""
    return os.fspath(path).lower().endswith(GGUF_SUFFIX)


def save_any(path: str | os.PathLike, vs: VectorSteer) -> None:
    """Write ``vs`` as GGUF (``.gguf``, in any case) or as our safetensors file (any other
    suffix)."""
    if is_gguf_name(path):
        save_gguf(path, vs)
    else:
        save_vector(path, vs)


# ---- the served model ---------------------------------------------------------------------

def _norm_name(s: str) -> str:
    return s.rstrip("/").split("/")[-1].lower().replace("_", "-")


#: A Hugging Face hub cache folder: ``.../models--ORG--NAME/snapshots/REVISION``.
_HF_CACHE_PATH = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def _hub_id(s: str) -> str:
    """``ORG/NAME`` for a path into the Hugging Face hub cache (what ``vllm serve`` is given
    offline), else ``s``."""
    m = _HF_CACHE_PATH.search(s.replace(os.sep, "/"))
    return f"{m.group(1)}/{m.group(2)}" if m else s


def same_model(a: str, b: str) -> bool:
    """Whether two model names (HF ids, paths, ``smollm2``) name the same model: equal last
    path parts, or one contains the other (case, ``_``/``-`` ignored: ``smollm2`` names
    ``HuggingFaceTB/SmolLM2-135M-Instruct``); a hub cache snapshot folder is its model's id."""
    a, b = _hub_id(a), _hub_id(b)
    la, lb = (s.lower().replace("_", "-") for s in (a, b))
    return _norm_name(a) == _norm_name(b) or la in lb or lb in la


#: llama.cpp's architecture names (what its ``cvector-generator`` writes as
#: ``controlvector.model_hint``) that differ from the ``model_type`` of the Hugging Face models
#: it converts to them (its ``convert_hf_to_gguf.py``): Mistral, Mixtral and InternLM3 become
#: ``llama``.
LLAMA_CPP_ARCH_MODEL_TYPES = {
    "llama": ("mistral", "mixtral", "internlm3"),
    "qwen2vl": ("qwen2_5_vl",),  # Qwen2.5-VL converts to llama.cpp's Qwen2-VL
    "command-r": ("cohere",),
    "phi2": ("phi",),
    "starcoder": ("gpt_bigcode",),
    "deepseek2": ("deepseek_v2", "deepseek_v3"),
    "granitehybrid": ("granitemoehybrid",),
    "hunyuan-moe": ("hunyuan_v1_moe",),
    "hunyuan-dense": ("hunyuan_v1_dense",),
    "nemotron_h_moe": ("nemotron_h",),
    "deci": ("nemotron-nas",),  # Nemotron-51B's remote-code config (DeciLM's is "deci")
}


def _norm_type(s: str) -> str:
    """A ``model_type`` compared: case, ``_`` and ``-`` ignored, and a text-only config's
    ``_text`` suffix (Gemma 3's ``gemma3_text`` is a ``gemma3`` model's language model)."""
    s = s.lower().replace("_", "").replace("-", "")
    return s[:-4] if s.endswith("text") and len(s) > 4 else s


def same_model_type(made_for: str, served: str) -> bool:
    """Whether a steer made for architecture ``made_for`` (a config's ``model_type``, or
    llama.cpp's name in a GGUF's model hint) fits a model whose config says ``served``: equal
    once normalised (:func:`_norm_type`), or ``made_for`` is llama.cpp's name for ``served``
    (:data:`LLAMA_CPP_ARCH_MODEL_TYPES`; one way: the served name is always the config's)."""
    a, b = _norm_type(made_for), _norm_type(served)
    return a == b or any(_norm_type(k) == a and b in {_norm_type(t) for t in v}
                         for k, v in LLAMA_CPP_ARCH_MODEL_TYPES.items())


def model_fit_problems(meta: VectorMetadata, *, hidden_size: int, num_layers: int,
                       model_name: str | None = None, model_type: str | None = None,
                       served_names: tuple[str, ...] = ()) -> list[str]:
    """Every reason the vector steer ``meta`` does not fit a model with ``hidden_size``,
    ``num_layers`` decoder blocks, name ``model_name`` (or any of ``served_names``, its
    ``--served-model-name``) and architecture ``model_type`` (its config's ``model_type``);
    each names both sides. Empty when it fits. Pure: reads only the metadata."""
    model = repr(model_name) if model_name else "the model"
    reasons = []
    if meta.hidden_size != hidden_size:
        reasons.append(f"the vectors have hidden size {meta.hidden_size} but {model} has "
                       f"hidden size {hidden_size}: make the vectors for this model "
                       "(vllm-steer train --kind vector)")
    beyond = [k for k in meta.layers if k >= num_layers]
    if beyond:
        reasons.append(f"the steer has vectors for blocks {_ranges(beyond)} but {model} has "
                       f"{num_layers} decoder blocks (0 to {num_layers - 1})")
    if meta.model_layers is not None and meta.model_layers != num_layers:
        reasons.append(f"the steer was made for a model of {meta.model_layers} decoder blocks "
                       f"but {model} has {num_layers}")
    if meta.model_type and model_type and not same_model_type(meta.model_type, model_type):
        reasons.append(f"the steer was made for a {meta.model_type!r} model but {model} is a "
                       f"{model_type!r} model")
    if meta.base_model and model_name and not any(
            same_model(meta.base_model, n) for n in (model_name, *served_names)):
        served = f" (served as {', '.join(map(repr, served_names))})" if served_names else ""
        reasons.append(f"the steer was made for {meta.base_model!r} but the model is "
                       f"{model_name!r}{served}")
    return reasons


def check_fits_model(meta: VectorMetadata, path: str, **model) -> None:
    """:func:`model_fit_problems`, raised as one :class:`VectorFileError` naming ``path``."""
    reasons = model_fit_problems(meta, **model)
    if reasons:
        raise VectorFileError(path, reasons)
