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
passes ``allow_pickle=True`` (``--unsafe-allow-pickle``), and even then first with
``torch.load(weights_only=True)`` (argparse.Namespace allowed), falling back to full
unpickling only if that fails.
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

from vllm_steer.format import DEFAULT_EPSILON, Steer, make_steer


class PickleRefused(ValueError):
    """Loading a pickle was not explicitly allowed."""


def _json_safe(v: Any) -> Any:
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    return repr(v)


def load_paper_checkpoint(path: str, allow_pickle: bool = False
                          ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, int | None]:
    """``(args, P1 [K, d, r], P2 [K, d, r], step)`` from a checkpoint of the paper's code."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if not allow_pickle:
        raise PickleRefused(
            f"{path} is a torch.save pickle; unpickling can run arbitrary code, so it is read "
            "only with --unsafe-allow-pickle (use it only for files you trust): "
            f"vllm-steer convert {path} --unsafe-allow-pickle --out steer.safetensors")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any refusal of the restricted loader
        warnings.warn(f"{path}: the restricted loader refused it ({type(e).__name__}); "
                      "unpickling fully as allowed by --unsafe-allow-pickle", stacklevel=2)
        obj = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(obj, (list, tuple)) or len(obj) < 2:
        raise ValueError(f"{path}: expected [args, state_dict, step] as saved by the paper's "
                         f"train.py, got {type(obj).__name__}")
    args, state = obj[0], obj[1]
    step = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    args = vars(args) if isinstance(args, argparse.Namespace) else (
        dict(args) if isinstance(args, dict) else {})
    if not isinstance(state, dict):
        raise ValueError(f"{path}: the second element should be the steer's state dict, got "
                         f"{type(state).__name__}")
    if "projector1" not in state or "projector2" not in state:
        kind = args.get("adaptor_class", "?")
        raise ValueError(f"{path}: no projector1/projector2 in the state dict (keys "
                         f"{sorted(state)}; adaptor_class={kind!r}); only the 'multiply' "
                         "adaptor (LM-Steer proper) can be converted")
    p1, p2 = state["projector1"], state["projector2"]
    if not (torch.is_tensor(p1) and torch.is_tensor(p2)) or p1.dim() != 3 or p1.shape != p2.shape:
        raise ValueError(f"{path}: projector1 {getattr(p1, 'shape', None)} and projector2 "
                         f"{getattr(p2, 'shape', None)} must be equal (num_steers, hidden, rank)")
    return args, p1.detach().float(), p2.detach().float(), step


def convert_checkpoint(path: str, *, allow_pickle: bool = False, steer_index: int | None = None,
                       dummy_index: int | None = None, no_dummy: bool = False,
                       domain: str = "with_steer", name: str | None = None,
                       base_model: str | None = None, epsilon: float | None = None) -> Steer:
    """A :class:`~vllm_steer.format.Steer` from a checkpoint of the paper's code."""
    args, p1, p2, step = load_paper_checkpoint(path, allow_pickle)
    K = int(p1.shape[0])
    if steer_index is None:
        steer_index = int(args.get("training_steer", 0) or 0)
    if dummy_index is None and not no_dummy:
        d_arg = args.get("dummy_steer")
        dummy_index = int(d_arg) if d_arg is not None else (1 if K > 1 else None)
    if no_dummy:
        dummy_index = None
    for what, i in (("--steer-index", steer_index), ("--dummy-index", dummy_index)):
        if i is not None and not 0 <= i < K:
            raise ValueError(f"{what} {i} is out of range: the checkpoint holds {K} steers "
                             f"(0..{K - 1})")
    if dummy_index is not None and dummy_index == steer_index:
        raise ValueError(f"--dummy-index {dummy_index} equals --steer-index; pick another")
    if domain not in ("none", "with_steer"):
        raise ValueError(f"--domain {domain!r}: choose none or with_steer")
    if dummy_index is None and domain == "with_steer":
        domain = "none"
    eps = float(epsilon if epsilon is not None else args.get("epsilon") or DEFAULT_EPSILON)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    source = {"kind": "LM-Steer checkpoint (github.com/Glaciohound/LM-Steer)",
              "file": os.path.basename(path), "sha256": sha, "step": step,
              "num_steers": K, "steer_index": steer_index, "dummy_index": dummy_index,
              "args": _json_safe(args)}
    dp1 = p1[dummy_index].contiguous() if dummy_index is not None else None
    dp2 = p2[dummy_index].contiguous() if dummy_index is not None else None
    name = name or os.path.basename(path).split(".")[0]
    return make_steer(p1[steer_index].contiguous(), p2[steer_index].contiguous(), name,
                      base_model=base_model or args.get("model_name"), epsilon=eps,
                      domain_p1=dp1, domain_p2=dp2, domain=domain, domain_strength=1.0,
                      recommended_strength=5.0, source=source,
                      recipe={k: _json_safe(args[k]) for k in
                              ("lr", "n_steps", "batch_size", "rank", "init_var",
                               "regularization", "max_length", "dataset_name", "seed")
                              if k in args})


def describe(steer: Steer) -> str:
    m = steer.metadata
    return json.dumps({"name": m.name, "hidden_size": m.hidden_size, "rank": m.rank,
                       "epsilon": m.epsilon, "domain": m.domain,
                       "base_model": m.base_model, "source_step": m.source.get("step")})
