"""Kinds of steer: what each kind owns, in one registration.

A *kind* of steer says, for its files and its loaded steers:

- **its file** (:attr:`SteerKind.claims`, :attr:`SteerKind.read_metadata`,
  :attr:`SteerKind.load`): which files are of the kind, their metadata without tensors, the
  loaded steer;
- **where it is applied** (:attr:`SteerKind.applied_at`): :data:`AT_HEAD` (the final hidden
  state, before the unchanged LM head: LM-Steer's ``c' = c + eps W c``) or
  :data:`AT_DECODER_LAYERS` (added to the residual stream after decoder blocks, inside the
  model's compiled forward: ``h_k += a v_k``);
- **its layout in the bank and its op**: a head kind's factors go into the bank's
  fixed-layout factor columns (:class:`vllm_steer.bank.SlotBank`) read by the head's op; a
  decoder-layer kind gives one vector per decoder block (:attr:`SteerKind.layer_vectors`),
  written into the vector bank (``[blocks, bank slots, hidden]``) read by the layers' op;
- **its memory reservation** (:attr:`SteerKind.reserve_bytes`): the device bytes one bank
  slot of the kind takes, reserved at start-up, in the dtype of the store it goes to
  (:mod:`vllm_steer.sizing` computes them).

Every bank slot holds a steer of one kind; a request mixes kinds freely
(``{"calm": 0.8, "detox": 4}``): each kind's op reads only its own columns of the request's
coefficients. Semantics: see :mod:`vllm_steer.reference`.

Two kinds ship: :data:`LM_STEER` and :data:`VECTOR`. :func:`register_kind` adds one (a test
registers a minimal kind to show that nothing else changes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

#: Applied to the final hidden state, before the LM head (the head's op).
AT_HEAD = "head"
#: Added to the output of decoder blocks, inside the model's forward (the layers' op).
AT_DECODER_LAYERS = "decoder_layers"


@dataclass(frozen=True)
class SteerKind:
    """One kind of steer (see the module doc)."""

    name: str
    """The kind's name: the ``kind`` of its metadata (``lm-steer``, ``vector``)."""
    applied_at: str
    """:data:`AT_HEAD` or :data:`AT_DECODER_LAYERS`."""
    claims: Callable[[str], bool]
    """Whether a file is of this kind (cheap: reads at most the file's header)."""
    read_metadata: Callable[[str], Any]
    """The file's metadata, checked, without its tensors (raises the kind's file error, which
    lists every reason)."""
    load: Callable[[str], Any]
    """The loaded steer (raises the kind's file error)."""
    steer_type: type
    """The type of its loaded steers."""
    layer_vectors: Callable[[Any, int], Any] | None = None
    """A decoder-layer kind: ``[num_blocks, hidden]`` float32, block ``k``'s vector in row ``k``
    (zeros where it has none)."""
    reserve_bytes: Callable[[int, int, int, Any], int] | None = None
    """Device bytes one bank slot of the kind reserves: ``(hidden, num_blocks, rank, dtype)``,
    ``dtype`` (a torch dtype or its name) that of the store its steers go to: the bank's
    (the LM head's dtype) for a head kind, the vector bank's (the model's 16-bit dtype on CUDA,
    float32 elsewhere) for a decoder-layer kind."""


_KINDS: list[SteerKind] = []


def register_kind(kind: SteerKind) -> SteerKind:
    """Add a kind (checked before the ones registered earlier: the most specific claim first);
    the same name again replaces it."""
    global _KINDS
    _KINDS = [kind] + [k for k in _KINDS if k.name != kind.name]
    return kind


def unregister_kind(name: str) -> None:
    """Remove a kind (tests)."""
    global _KINDS
    _KINDS = [k for k in _KINDS if k.name != name]


def kinds() -> list[SteerKind]:
    """The registered kinds, most specific claim first."""
    return list(_KINDS)


def kind_of_file(path: str | os.PathLike) -> SteerKind:
    """The kind of the file at ``path``: the first that claims it, else LM-Steer (whose reader
    then says what is wrong with it)."""
    path = os.fspath(path)
    for k in _KINDS:
        if k.name != LM_STEER.name and k.claims(path):
            return k
    return LM_STEER


def kind_of(steer: Any) -> SteerKind:
    """The kind of a loaded steer."""
    for k in _KINDS:
        if isinstance(steer, k.steer_type):
            return k
    raise TypeError(f"{type(steer).__name__} is no registered kind of steer")


def kind_named(name: str) -> SteerKind | None:
    for k in _KINDS:
        if k.name == name:
            return k
    return None


def read_any_metadata(path: str | os.PathLike) -> Any:
    """The metadata of a steer file of any kind (raises that kind's file error)."""
    return kind_of_file(path).read_metadata(os.fspath(path))


def load_any(path: str | os.PathLike) -> Any:
    """A steer file of any kind, loaded (raises that kind's file error)."""
    return kind_of_file(path).load(os.fspath(path))


def content_digest(steer: Any, num_blocks: int) -> str | None:
    """What a steer applied in the decoder layers adds to a model of ``num_blocks`` blocks,
    as a SHA-256 hex digest of its kind's name and ``layer_vectors(steer, num_blocks)`` in
    float32: equal for two loads of the same vectors, in any process and whatever their file's
    format (the prefix cache's salt names a steer by it). None for a head kind: it changes no
    key or value."""
    import hashlib

    kind = kind_of(steer)
    if kind.applied_at != AT_DECODER_LAYERS or kind.layer_vectors is None:
        return None
    vectors = kind.layer_vectors(steer, num_blocks).detach().float().cpu().contiguous()
    h = hashlib.sha256(f"{kind.name}:{tuple(vectors.shape)}:".encode())
    h.update(vectors.numpy().tobytes())
    return h.hexdigest()


def applied_in_layers(steer_or_meta: Any) -> bool:
    """Whether a steer (or its metadata) is applied inside the decoder layers."""
    name = getattr(steer_or_meta, "kind", None)
    if name is None and hasattr(steer_or_meta, "metadata"):
        name = steer_or_meta.metadata.kind
    k = kind_named(name) if isinstance(name, str) else None
    return k is not None and k.applied_at == AT_DECODER_LAYERS


# ---- the two kinds that ship ------------------------------------------------------------

def _lm_claims(path: str) -> bool:
    from vllm_steer.format import KIND_LM_STEER, file_kind, read_document

    try:
        _, d, _ = read_document(path)
    except OSError:
        return False
    return file_kind(d) == KIND_LM_STEER


def _lm_read(path: str):
    from vllm_steer.format import read_metadata

    return read_metadata(path)


def _lm_load(path: str):
    from vllm_steer.format import load_steer

    return load_steer(path)


def _vector_claims(path: str) -> bool:
    from vllm_steer.format import KIND_VECTOR, file_kind, read_document
    from vllm_steer.vectors import is_gguf

    try:
        if is_gguf(path):
            return True
        _, d, _ = read_document(path)
    except OSError:
        return False
    return file_kind(d) == KIND_VECTOR


def _vector_read(path: str):
    from vllm_steer.vectors import read_vector_metadata

    return read_vector_metadata(path)


def _vector_load(path: str):
    from vllm_steer.vectors import load_vector

    return load_vector(path)


def _vector_layers(steer, num_blocks: int):
    return steer.stacked(num_blocks)


def _sizing():
    from vllm_steer import sizing

    return sizing


def _lm_type():
    from vllm_steer.format import Steer

    return Steer


def _vector_type():
    from vllm_steer.vectors import VectorSteer

    return VectorSteer


LM_STEER = SteerKind(
    name="lm-steer", applied_at=AT_HEAD, claims=_lm_claims, read_metadata=_lm_read,
    load=_lm_load, steer_type=_lm_type(),
    # both factors of the steer and of its domain component, at the reserved rank
    reserve_bytes=lambda hidden, blocks, rank, dtype: _sizing().bank_bytes(1, rank, hidden,
                                                                           dtype))
VECTOR = SteerKind(
    name="vector", applied_at=AT_DECODER_LAYERS, claims=_vector_claims,
    read_metadata=_vector_read, load=_vector_load, steer_type=_vector_type(),
    layer_vectors=_vector_layers,
    # one vector per decoder block of the worker (the step mapping's per-token strengths, a
    # column per bank slot, come on top: vllm_steer.sizing.vector_bank_bytes)
    reserve_bytes=lambda hidden, blocks, rank, dtype: _sizing().vector_bank_bytes(
        1, blocks, hidden, 0, dtype))
register_kind(LM_STEER)
register_kind(VECTOR)


__all__ = ["SteerKind", "AT_HEAD", "AT_DECODER_LAYERS", "LM_STEER", "VECTOR", "register_kind",
           "unregister_kind", "kinds", "kind_of_file", "kind_of", "kind_named", "content_digest",
           "read_any_metadata", "load_any", "applied_in_layers"]
