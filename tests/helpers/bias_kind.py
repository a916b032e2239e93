"""A minimal kind of steer that exists only for tests: one vector added at one decoder block,
read from a small JSON file. Everything about it is in this module and its one
``register_kind`` call (what the seam of :mod:`vllm_steer.kinds` promises)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from vllm_steer.kinds import AT_DECODER_LAYERS, SteerKind, register_kind

SUFFIX = ".bias.json"


@dataclass
class BiasMetadata:
    name: str
    hidden_size: int
    block: int
    kind: str = "bias-test"
    labels: dict = field(default_factory=dict)
    recommended_strength: float | None = None
    base_model: str | None = None
    rank: int = 0
    epsilon: float = 1.0
    domain: str = "none"
    domain_strength: float = 0.0

    @property
    def layers(self) -> list[int]:
        return [self.block]


@dataclass
class BiasSteer:
    vector: torch.Tensor
    metadata: BiasMetadata

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def hidden_size(self) -> int:
        return self.metadata.hidden_size


def _read(path: str) -> BiasMetadata:
    d = json.loads(open(path).read())
    return BiasMetadata(d["name"], len(d["vector"]), int(d["block"]))


def _load(path: str) -> BiasSteer:
    d = json.loads(open(path).read())
    return BiasSteer(torch.tensor(d["vector"], dtype=torch.float32), _read(path))


def _stack(steer: BiasSteer, num_blocks: int) -> torch.Tensor:
    out = torch.zeros(num_blocks, steer.hidden_size)
    out[steer.metadata.block] = steer.vector
    return out


def save(path, name: str, block: int, vector) -> None:
    with open(path, "w") as f:
        json.dump({"name": name, "block": block, "vector": [float(x) for x in vector]}, f)


BIAS = SteerKind(name="bias-test", applied_at=AT_DECODER_LAYERS,
                 claims=lambda p: str(p).endswith(SUFFIX), read_metadata=_read, load=_load,
                 steer_type=BiasSteer, layer_vectors=_stack,
                 reserve_bytes=lambda hidden, blocks, rank, dtype: hidden * 4)


def register() -> SteerKind:
    return register_kind(BIAS)
