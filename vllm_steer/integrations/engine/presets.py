"""Presets added and deleted at run time (``POST`` / ``DELETE /v1/steer-presets``, with
``--enable-steer-updates``): where the table lives and how every API server sees it.

Design (docs/internals.md, "Run-time steers and presets: the engine core decides"):

- **One table, in the engine core.** :class:`PresetTable` lives next to the steer registry
  in each engine core (``management.py`` ops ``presets``, ``preset_add``, ``preset_delete``,
  ``preset_rollback``; with data parallelism every engine core holds a copy, changed by the
  same calls, and engine core 0's answer is the one read). ``--steer-preset`` presets stay in
  the configuration (every process has them, they never change).
- **Each API server keeps a view**
  (:meth:`vllm_steer.integrations.frontend.state.FrontendState.presets_view`), replaced only by
  a newer table ``version``: from its own POST / DELETE answers and from the steers poll (the
  ``list`` op carries the table).
- **A name that is not static is read at the request.** When a request's ``model`` is not
  the served model, a ``--steer-preset`` preset or a LoRA adapter, the API server reads the
  table from the engine core before vLLM's model check (one utility call,
  :func:`vllm_steer.integrations.frontend.engine_client.refresh_presets`;
  :func:`vllm_steer.integrations.frontend.preset_models.check_model`), and the mix it read is the one the request gets (pinned
  for ``to_sampling_params``). So from the moment POST / DELETE returns on any API server, a
  request to any API server sees the change; requests naming the base model or a
  ``--steer-preset`` preset never make that call. ``/v1/models`` and ``GET
  /v1/steer-presets`` read the table too.

The API server's half: :mod:`vllm_steer.integrations.frontend.preset_models`. Light: no
torch, no vLLM imports at import time.
"""

from __future__ import annotations

from typing import Any, Mapping



# ---- engine core ---------------------------------------------------------------------------
class PresetTable:
    """The run-time presets of one engine core. Every change bumps ``version``."""

    def __init__(self):
        self.presets: dict[str, dict[str, float]] = {}
        self.tokens: dict[str, str] = {}  # name -> the token of the POST that added it
        self.version = 0

    def snapshot(self) -> dict:
        return {"version": self.version,
                "presets": {n: dict(m) for n, m in self.presets.items()}}

    def add(self, name: str, mix: Mapping[str, float], token: str = "",
            reserved: Mapping[str, str] | None = None) -> dict:
        """Add a preset; refused (``ok: False``, status 400) if the name is taken."""
        taken = (reserved or {}).get(name)
        if taken is None and name in self.presets:
            taken = ("a preset added at run time (DELETE /v1/steer-presets/"
                     f"{name} first to replace it)")
        if taken is not None:
            return {"ok": False, "status": 400,
                    "error": f"preset name {name!r} is already {taken}; give the preset "
                             "another name", **self.snapshot()}
        self.presets[name] = {k: float(v) for k, v in mix.items()}
        self.tokens[name] = token
        self.version += 1
        return {"ok": True, "preset": {"name": name, "steer": dict(self.presets[name])},
                **self.snapshot()}

    def delete(self, name: str, static: Mapping[str, Any] | None = None) -> dict:
        """Delete a run-time preset: 404 if there is none of that name; 400 for a
        ``--steer-preset`` one (``static``)."""
        if name not in self.presets:
            if static and name in static:
                return {"ok": False, "status": 400,
                        "error": f"preset {name!r} is set by --steer-preset at start-up and "
                                 "cannot be deleted at run time; restart the server without "
                                 "it", **self.snapshot()}
            known = sorted(self.presets)
            return {"ok": False, "status": 404,
                    "error": f"preset {name!r} does not exist; presets added at run time: "
                             f"{', '.join(known) or 'none'}", **self.snapshot()}
        mix = self.presets.pop(name)
        self.tokens.pop(name, None)
        self.version += 1
        return {"ok": True, "preset": {"name": name, "steer": mix}, **self.snapshot()}

    def rollback(self, name: str, token: str) -> dict:
        """Undo the add of ``token`` (it failed on another data-parallel engine core)."""
        if self.tokens.get(name) == token and token:
            self.delete(name)
        return {"ok": True, **self.snapshot()}

