"""Random steers for tests, and saving them as steer files."""

from __future__ import annotations

from pathlib import Path


def save_steers(directory: Path, steers: dict) -> dict[str, str]:
    """Save ``{name: Steer}`` as ``directory/NAME.safetensors``; returns ``{name: path}``."""
    from vllm_steer.format import save_steer

    paths = {}
    for name, steer in steers.items():
        paths[name] = str(Path(directory) / f"{name}.safetensors")
        save_steer(paths[name], steer)
    return paths


def random_steer(hidden: int, rank: int, name: str, seed: int = 0, scale: float = 1.0,
                 base_model: str | None = None):
    """A random steer whose effect at strength ~5 is visible on the tiny models."""
    import torch

    from vllm_steer.format import make_steer

    g = torch.Generator().manual_seed(seed)
    p1 = torch.randn(hidden, rank, generator=g) * scale
    p2 = torch.randn(hidden, rank, generator=g) * scale
    return make_steer(p1, p2, name, base_model=base_model, labels={"positive": name})


def random_vectors(hidden: int, blocks, seed: int, scale: float = 1.0) -> dict:
    """``{block: [hidden] float32}``: a random vector per decoder block (a vector steer's
    content; strengths near 1 change the tiny models' greedy tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(hidden, generator=g) * scale for k in blocks}


def save_vector_steer(path, vectors: dict, name: str) -> str:
    """Write ``vectors`` as a vector steer: llama.cpp's GGUF when ``path`` ends in ``.gguf``,
    else the project's safetensors kind. Returns the path."""
    from vllm_steer.vectors import make_vector_steer, save_gguf, save_vector

    steer = make_vector_steer(vectors, name)
    (save_gguf if str(path).endswith(".gguf") else save_vector)(path, steer)
    return str(path)
