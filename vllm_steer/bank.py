"""A bank of loaded steers on one device: the factors of all steers concatenated along the
rank axis, as :mod:`vllm_steer.reference` defines, plus the mapping from a request's
``{name: strength}`` to a row of coefficients.

Semantics: see :mod:`vllm_steer.reference`.
"""

from __future__ import annotations

from typing import Mapping

import torch

from vllm_steer.format import Steer, load_steer
from vllm_steer.ops import apply_steers, prepare_steers


class SteerBank:
    """K loaded steers (a steer whose domain component is served counts as two columns)."""

    def __init__(self, steers: Mapping[str, Steer], device=None, dtype=None):
        self.names: list[str] = list(steers)
        self.steers = {n: s.to(device=device, dtype=dtype) for n, s in steers.items()}
        hidden = {s.hidden_size for s in self.steers.values()}
        if len(hidden) > 1:
            raise ValueError(f"steers have different hidden sizes: "
                             f"{ {n: s.hidden_size for n, s in self.steers.items()} }")
        self.hidden_size = hidden.pop() if hidden else 0
        p1s, p2s, offs = [], [], [0]
        # column k of the coefficient matrix -> (steer index, multiplier kind)
        self._columns: list[tuple[str, str]] = []
        for n in self.names:
            s = self.steers[n]
            p1s.append(s.p1), p2s.append(s.p2), offs.append(offs[-1] + s.p1.shape[1])
            self._columns.append((n, "steer"))
            if s.metadata.domain == "with_steer" and s.domain_p1 is not None:
                p1s.append(s.domain_p1), p2s.append(s.domain_p2)
                offs.append(offs[-1] + s.domain_p1.shape[1])
                self._columns.append((n, "domain"))
        if p1s:
            self.p1 = torch.cat(p1s, dim=1).contiguous()  # [hidden, total_rank]
            self.p2 = torch.cat(p2s, dim=1).contiguous()  # [hidden, total_rank]
        else:
            self.p1 = self.p2 = torch.zeros(0, 0, device=device, dtype=dtype)
        self.rank_offsets: list[int] = offs
        self.index = {n: i for i, n in enumerate(self.names)}
        self._plan_key: object = None
        self._plan = None

    @classmethod
    def from_files(cls, paths: Mapping[str, str], device=None, dtype=None) -> "SteerBank":
        return cls({n: load_steer(p) for n, p in paths.items()}, device=device, dtype=dtype)

    @property
    def num_columns(self) -> int:
        return len(self._columns)

    def coef_row(self, strengths: Mapping[str, float]) -> list[float]:
        """Coefficients (strength * epsilon, domain included) for one request."""
        row = [0.0] * self.num_columns
        for k, (n, kind) in enumerate(self._columns):
            s = float(strengths.get(n, 0.0))
            if s == 0.0:
                continue
            meta = self.steers[n].metadata
            row[k] = s * meta.epsilon if kind == "steer" else meta.domain_strength * meta.epsilon
        return row

    def coefs(self, strengths: Mapping[str, float], num_rows: int, device=None) -> torch.Tensor:
        row = torch.tensor(self.coef_row(strengths), dtype=torch.float32, device=device)
        return row.expand(num_rows, -1).contiguous()

    def apply(self, hidden: torch.Tensor, coefs: torch.Tensor, backend: str | None = None,
              plan_key: object = None) -> torch.Tensor:
        """Steer ``hidden`` ([rows, hidden]) with per-row ``coefs`` ([rows, K]).

        ``plan_key``: a value that changes whenever ``coefs`` may have changed (the serving
        runtime passes its coefficient version and the row count). Calls with the key of the
        previous call reuse its plan (no re-planning: see :func:`vllm_steer.ops.prepare_steers`).
        """
        if self.num_columns == 0:
            return hidden
        prepared = None
        if plan_key is not None:
            key = (plan_key, backend)
            if key != self._plan_key:
                self._plan_key, self._plan = None, None  # never keep a stale plan on error
                self._plan = prepare_steers(self.p1, self.p2, self.rank_offsets, coefs, backend)
                self._plan_key = key
            prepared = self._plan
        return apply_steers(hidden, self.p1, self.p2, self.rank_offsets, coefs, backend=backend,
                            prepared=prepared)
