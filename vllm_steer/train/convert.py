"""Import steers trained with the paper's original code (github.com/Glaciohound/LM-Steer).

Its checkpoints are ``torch.save([args, {"projector1": P1, "projector2": P2}, step])`` with
P1, P2 of shape ``(num_steers, hidden, rank)``, applied as::

    h' = h + eps * sum_i v_i * (h @ P1[i]) @ P2[i].T

Steer ``steer_index`` (the paper's ``training_steer``, 0) becomes ``steer.P1/P2`` and the
dummy steer (``dummy_index``: the paper's ``dummy_steer``, else 1 when there are several)
becomes ``domain.P1/P2`` -- the same row convention, so the factors are copied unchanged.
The paper generates with ``--steer_values S 1`` (style at S, dummy at 1): the default
``domain="with_steer"`` reproduces exactly that for any S != 0; ``domain="none"`` gives
``--steer_values S 0``.

A checkpoint is a pickle, which can run code when loaded: it is read only when the caller
passes ``allow_pickle=True`` (``--unsafe-allow-pickle``), and then only with the restricted
loader ``torch.load(weights_only=True)`` (``argparse.Namespace`` allowed), which is enough for
genuine checkpoints of the paper's code. A file the restricted loader refuses is refused with
its reason; full unpickling happens only with the separate ``full_unpickle=True``
(``--unsafe-full-unpickle``). Every unreadable input (empty, truncated, random bytes, not
a paper checkpoint) raises :class:`CheckpointError` with a one-line message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import warnings
from typing import Any

import torch

from vllm_steer.format import DEFAULT_EPSILON, MAX_EPSILON, MIN_EPSILON, Steer, make_steer
from vllm_steer.vectors import GGUF_MAGIC


class PickleRefused(ValueError):
    """Loading a pickle was not explicitly allowed."""


class CheckpointError(ValueError):
    """The checkpoint cannot be converted; the message is one line naming the file."""


def _reason(e: BaseException) -> str:
    """One line from a ``torch.load`` error (whose messages run to paragraphs)."""
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text[text.index(marker) + len(marker):]
        for stop in ("Check the documentation", "Please use `torch.serialization"):
            text = text.split(stop)[0]
    text = " ".join(text.split()).rstrip(". ")
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _default_name(path: str) -> str:
    """A valid steer name from the file name (see :mod:`vllm_steer.names`)."""
    from vllm_steer.names import safe_steer_name

    return safe_steer_name(os.path.basename(path).split(".")[0], "converted")


def _json_safe(v: Any, depth: int = 0) -> Any:
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if depth > 16:  # a crafted checkpoint may nest (or loop) without end
        return repr(type(v).__name__)
    if isinstance(v, (list, tuple)):
        return [_json_safe(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k)[:200]: _json_safe(x, depth + 1) for k, x in v.items()}
    return repr(v)[:200]


def load_paper_checkpoint(path: str, allow_pickle: bool = False, full_unpickle: bool = False
                          ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, int | None]:
    """``(args, P1 [K, d, r], P2 [K, d, r], step)`` from a checkpoint of the paper's code.

    ``args`` is ``{}`` when the checkpoint carries none.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory, expected a checkpoint file")
    problem = content_problem(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    if not (allow_pickle or full_unpickle):
        raise PickleRefused(
            f"{path} is a torch.save pickle; unpickling can run arbitrary code, so it is read "
            "only with --unsafe-allow-pickle (use it only for files you trust): "
            f"vllm-steer convert {path} --unsafe-allow-pickle --out steer.safetensors")
    try:
        if full_unpickle:
            warnings.warn(f"{path}: unpickling fully (--unsafe-full-unpickle): this runs any "
                          "code the file holds", stacklevel=2)
            obj = torch.load(path, map_location="cpu", weights_only=False)
        else:
            with torch.serialization.safe_globals([argparse.Namespace]):
                obj = torch.load(path, map_location="cpu", weights_only=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 -- corrupt files raise anything
        if full_unpickle:
            raise CheckpointError(f"{path}: not a readable checkpoint ({_reason(e)})") from None
        raise CheckpointError(
            f"{path}: the restricted loader (torch.load weights_only=True) refused it "
            f"({_reason(e)}); a genuine checkpoint of the paper's code loads this way, so the "
            "file is corrupt, truncated, not a checkpoint, or holds other objects. Only for a "
            "file you trust: --unsafe-full-unpickle (runs any code it holds)") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2:
        raise CheckpointError(f"{path}: expected [args, state_dict, step] as saved by the "
                              f"paper's train.py, got {type(obj).__name__}")
    args, state = obj[0], obj[1]
    step = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    args = vars(args) if isinstance(args, argparse.Namespace) else (
        dict(args) if isinstance(args, dict) else {})
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the second element should be the steer's state dict, "
                              f"got {type(state).__name__}")
    if "projector1" not in state or "projector2" not in state:
        kind = args.get("adaptor_class", "?")
        keys = [repr(k)[:40] for k in list(state)[:8]]
        raise CheckpointError(f"{path}: no projector1/projector2 in the state dict (keys "
                              f"{keys}{' ...' if len(state) > 8 else ''}; adaptor_class="
                              f"{kind!r:.40}); only the 'multiply' adaptor (LM-Steer proper) "
                              "can be converted")
    p1, p2 = state["projector1"], state["projector2"]
    if not (torch.is_tensor(p1) and torch.is_tensor(p2)) or p1.dim() != 3 or p1.shape != p2.shape \
            or not (p1.is_floating_point() and p2.is_floating_point()):
        raise CheckpointError(f"{path}: projector1 {getattr(p1, 'shape', None)} and projector2 "
                              f"{getattr(p2, 'shape', None)} must be equal (num_steers, hidden, "
                              "rank) float tensors")
    if not (torch.isfinite(p1).all() and torch.isfinite(p2).all()):
        raise CheckpointError(f"{path}: projector1/projector2 hold NaN or inf values")
    return args, p1.detach().float(), p2.detach().float(), step


#: What the paper's checkpoints are, for the messages of :func:`content_problem`.
_CHECKPOINT = "a checkpoint of the paper's code (a torch.save file)"


def content_problem(path: str) -> str | None:
    """Why the file at ``path``, by its first bytes, is not a checkpoint of the paper's code
    (None: it starts as ``torch.save`` writes, a zip archive or a pickle). Nothing is
    unpickled: an empty or short file, one of this project's steer files, a GGUF and any
    other content are named for what they are."""
    from vllm_steer.format import KIND_LM_STEER, _looks_like_pickle, file_kind, read_document

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    if size == 0:
        return f"the file is empty: not {_CHECKPOINT}, a control-vector GGUF or a steer file"
    if len(head) >= 2 and _looks_like_pickle(head):
        return None
    if head[:4] == GGUF_MAGIC:
        return f"a GGUF file, not {_CHECKPOINT}"
    if size < 8:
        return (f"the file is {size} bytes, too short to be {_CHECKPOINT}, a control-vector "
                "GGUF or a steer file (truncated?)")
    header, d, _ = read_document(path)
    if header is not None and file_kind(d) == KIND_LM_STEER:
        return ("already an LM-Steer file in this project's format (safetensors): there is "
                "nothing to convert (`vllm-steer info FILE` prints its metadata)")
    if header is not None:
        return (f"a safetensors file, but not a steer file of this project nor {_CHECKPOINT} "
                "(`vllm-steer info FILE` says why it is not a steer file)")
    return (f"not {_CHECKPOINT}, a control-vector GGUF or a steer file: those start with a "
            f"zip or pickle header, 'GGUF' or a safetensors header; this one starts with "
            f"{head!r}")


def convert_checkpoint(path: str, *, allow_pickle: bool = False, full_unpickle: bool = False,
                       steer_index: int | None = None,
                       dummy_index: int | None = None, no_dummy: bool = False,
                       domain: str = "with_steer", name: str | None = None,
                       base_model: str | None = None, epsilon: float | None = None) -> Steer:
    """A :class:`~vllm_steer.format.Steer` from a checkpoint of the paper's code."""
    args, p1, p2, step = load_paper_checkpoint(path, allow_pickle, full_unpickle)
    K = int(p1.shape[0])
    if steer_index is None:
        steer_index = _index_arg(path, args, "training_steer", 0)
    if dummy_index is None and not no_dummy:
        if args:  # the paper's args record the dummy (None: trained without one)
            dummy_index = _index_arg(path, args, "dummy_steer", None)
        else:
            dummy_index = 1 if K > 1 else None
    if no_dummy:
        dummy_index = None
    for what, i in (("--steer-index", steer_index), ("--dummy-index", dummy_index)):
        if i is not None and not 0 <= i < K:
            raise ValueError(f"{what} {i} is out of range: the checkpoint holds {K} steers "
                             f"(0..{K - 1})")
    if dummy_index is not None and dummy_index == steer_index:
        raise ValueError(f"the dummy steer (index {dummy_index}) is the steer itself (index "
                         f"{steer_index}); pass --no-dummy to convert without a dummy steer, or "
                         "pick another --dummy-index")
    if domain not in ("none", "with_steer"):
        raise ValueError(f"--domain {domain!r}: choose none or with_steer")
    if dummy_index is None and domain == "with_steer":
        domain = "none"
    recorded = args.get("epsilon")
    eps = epsilon if epsilon is not None else (DEFAULT_EPSILON if recorded is None else recorded)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise CheckpointError(f"{path}: args.epsilon={eps!r:.40} is not a number; give --epsilon")
    eps = float(eps)
    if not MIN_EPSILON <= eps <= MAX_EPSILON:  # (0 would be no steer at all)
        what = "--epsilon" if epsilon is not None else "the checkpoint's args.epsilon"
        raise CheckpointError(f"{path}: {what}={eps!r} is outside {MIN_EPSILON:g} to "
                              f"{MAX_EPSILON:g}, the range a steer file holds; give --epsilon "
                              f"(the paper's unit is {DEFAULT_EPSILON:g})")
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    source = {"kind": "LM-Steer checkpoint (github.com/Glaciohound/LM-Steer)",
              "file": os.path.basename(path), "sha256": sha, "step": step,
              "num_steers": K, "steer_index": steer_index, "dummy_index": dummy_index,
              "args": _json_safe(args)}
    dp1 = p1[dummy_index].contiguous() if dummy_index is not None else None
    dp2 = p2[dummy_index].contiguous() if dummy_index is not None else None
    name = name or _default_name(path)
    return make_steer(p1[steer_index].contiguous(), p2[steer_index].contiguous(), name,
                      base_model=base_model or args.get("model_name"), epsilon=eps,
                      domain_p1=dp1, domain_p2=dp2, domain=domain, domain_strength=1.0,
                      recommended_strength=5.0, source=source,
                      recipe={k: _json_safe(args[k]) for k in
                              ("lr", "n_steps", "batch_size", "rank", "init_var",
                               "regularization", "max_length", "dataset_name", "seed")
                              if k in args})


def _index_arg(path: str, args: dict[str, Any], key: str, default: int | None) -> int | None:
    v = args.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"{path}: args.{key}={v!r:.40} is not a steer index; give "
                              f"--{'steer' if key == 'training_steer' else 'dummy'}-index")
    return v


def describe(steer: Steer) -> str:
    m = steer.metadata
    return json.dumps({"name": m.name, "hidden_size": m.hidden_size, "rank": m.rank,
                       "epsilon": m.epsilon, "domain": m.domain,
                       "base_model": m.base_model, "source_step": m.source.get("step")})
