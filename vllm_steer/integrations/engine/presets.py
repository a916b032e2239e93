"""Presets that change while the server runs: added, replaced and deleted over HTTP (``POST``,
``PUT`` and ``DELETE /v1/steer-presets``, with ``--enable-steer-updates``) and read from a
presets file (``--steer-presets-file``): where the table lives and how every API server sees
it.

Design (docs/internals.md, "Run-time steers and presets: the engine core decides"):

- **One table, in the engine core.** :class:`PresetTable` lives next to the steer registry
  in each engine core (``management.py`` ops ``presets``, ``preset_add`` (``replace``: the PUT),
  ``preset_delete``, ``preset_rollback``, ``preset_file``; with data parallelism every engine
  core holds a copy, changed by the same calls, and engine core 0's answer is the one read).
  It has two layers: the presets of the file (replaced as a whole each time an API server
  reads a new version of it) and the presets added over HTTP. A name is in one layer only:
  the file takes a name over from HTTP, HTTP may not take a name of the file.
  ``--steer-preset`` presets stay in the configuration (every process has them, they never
  change, neither the file nor HTTP may take their names).
- **A replacement is one op.** ``preset_add`` with ``replace`` swaps the mix of a run-time
  preset in one step on the engine core's thread: a request reads the old mix or the new
  one, never no preset.
- **Each API server keeps a view**
  (:meth:`vllm_steer.integrations.frontend.state.FrontendState.presets_view`, both layers
  merged), replaced only by a newer table ``version``: from its own answers and from the steers
  poll (the ``list`` op carries the table).
- **A name that is not static is read at the request.** When a request's ``model`` is not
  the served model, a ``--steer-preset`` preset or a LoRA adapter, the API server reads the
  table from the engine core before vLLM's model check (one utility call,
  :func:`vllm_steer.integrations.frontend.engine_client.refresh_presets`;
  :func:`vllm_steer.integrations.frontend.preset_models.check_model`), and the mix it read is
  the one the request gets (pinned for ``to_sampling_params``). So from the moment a change
  returns on any API server, a request to any API server sees it; requests naming the base
  model or a ``--steer-preset`` preset never make that call. ``/v1/models`` and ``GET
  /v1/steer-presets`` read the table too.

The API server's half: :mod:`vllm_steer.integrations.frontend.preset_models`, and the file's
reader :mod:`vllm_steer.server.presets_file`. Light: no torch, no vLLM imports at import time.
"""

from __future__ import annotations

from typing import Any, Mapping

#: Why a name of the presets file cannot be taken, replaced or deleted over HTTP.
FILE_TAKES = "a preset of the presets file (--steer-presets-file; edit the file to change it)"


# ---- engine core ---------------------------------------------------------------------------
class PresetTable:
    """The presets of one engine core that may change while it runs: the presets file's
    (``file``) and the ones added over HTTP (``presets``). Every change bumps ``version``."""

    def __init__(self):
        self.presets: dict[str, dict[str, float]] = {}
        self.tokens: dict[str, str] = {}  # name -> the token of the POST / PUT that set it
        self.previous: dict[str, dict[str, float] | None] = {}  # name -> mix before that
        self.file: dict[str, dict[str, float]] = {}
        self.file_stamp: tuple[int, str] | None = None  # (mtime_ns, sha256) of the file read
        self.file_order = 0  # when its read began (read_ns): what orders the versions
        self.version = 0

    def snapshot(self) -> dict:
        """``{"version", "presets"}`` (both layers, as model names serve them), and once a
        file was read ``"from_file"`` (the names of the file's presets) and ``"file_stamp"``
        (``[mtime_ns, sha256]`` of the version served)."""
        out = {"version": self.version,
               "presets": {n: dict(m) for n, m in {**self.presets, **self.file}.items()}}
        if self.file_stamp is not None:
            out["from_file"] = sorted(self.file)
            out["file_stamp"] = list(self.file_stamp)
        return out

    def add(self, name: str, mix: Mapping[str, float], token: str = "",
            reserved: Mapping[str, str] | None = None, replace: bool = False) -> dict:
        """Add a preset; refused (``ok: False``, status 400) if the name is taken. With
        ``replace`` (``PUT``) a run-time preset of that name gets the new mix in one step
        (``"replaced"``: its old mix)."""
        taken = (reserved or {}).get(name)
        if taken is None and name in self.file:
            taken = FILE_TAKES
        if taken is None and name in self.presets and not replace:
            taken = (f"a preset added at run time (PUT /v1/steer-presets/{name} replaces "
                     "it)")
        if taken is not None:
            return {"ok": False, "status": 400,
                    "error": f"preset name {name!r} is already {taken}; give the preset "
                             "another name", **self.snapshot()}
        before = self.presets.get(name)
        self.presets[name] = {k: float(v) for k, v in mix.items()}
        self.tokens[name] = token
        self.previous[name] = before
        self.version += 1
        return {"ok": True, "preset": {"name": name, "steer": dict(self.presets[name])},
                "replaced": before, **self.snapshot()}

    def delete(self, name: str, static: Mapping[str, Any] | None = None) -> dict:
        """Delete a run-time preset: 404 if there is none of that name; 400 for a
        ``--steer-preset`` one (``static``) or one of the presets file."""
        if name not in self.presets:
            if static and name in static:
                return {"ok": False, "status": 400,
                        "error": f"preset {name!r} is set by --steer-preset at start-up and "
                                 "cannot be deleted at run time; restart the server without "
                                 "it", **self.snapshot()}
            if name in self.file:
                return {"ok": False, "status": 400,
                        "error": f"preset {name!r} is set by the presets file "
                                 "(--steer-presets-file) and cannot be deleted over HTTP; "
                                 "remove it from the file (every API server re-reads it)",
                        **self.snapshot()}
            known = sorted(self.presets)
            return {"ok": False, "status": 404,
                    "error": f"preset {name!r} does not exist; presets added at run time: "
                             f"{', '.join(known) or 'none'}", **self.snapshot()}
        mix = self.presets.pop(name)
        self.tokens.pop(name, None)
        self.previous.pop(name, None)
        self.version += 1
        return {"ok": True, "preset": {"name": name, "steer": mix}, **self.snapshot()}

    def rollback(self, name: str, token: str) -> dict:
        """Undo the add or replacement of ``token`` (it failed on another data-parallel engine
        core): the mix before it comes back, or the preset goes if it was new."""
        if self.tokens.get(name) == token and token:
            before = self.previous.get(name)
            if before is None:
                self.delete(name)
            else:
                self.presets[name] = before
                self.tokens[name], self.previous[name] = "", None
                self.version += 1
        return {"ok": True, **self.snapshot()}

    def set_file(self, presets: Mapping[str, Mapping[str, float]], stamp,
                 reserved: Mapping[str, str] | None = None) -> dict:
        """The presets file's presets, replacing the last version read as a whole (checked by
        the API server that read it; here only the names). ``stamp``: ``(mtime_ns, sha256,
        read_ns)`` of what was read (:func:`vllm_steer.presets_file.read_file`): a version
        read before the one loaded (another API server read it earlier and sent it later) is
        ignored, by when its read began (the modification time when a stamp has none), the
        same content changes nothing. A name added over HTTP that the file now sets is the file's
        from then on (``"took_over"``)."""
        mtime, digest = int(stamp[0]), str(stamp[1])
        order = int(stamp[2]) if len(stamp) > 2 else mtime
        for name in presets:
            taken = (reserved or {}).get(name)
            if taken is not None:
                return {"ok": False, "status": 400,
                        "error": f"presets file: preset name {name!r} is already {taken}; "
                                 "give the preset another name in the file", **self.snapshot()}
        if self.file_stamp is not None and (order < self.file_order
                                            or digest == self.file_stamp[1]):
            return {"ok": True, "changed": False, **self.snapshot()}
        new = {n: {k: float(v) for k, v in m.items()} for n, m in presets.items()}
        took = sorted(n for n in new if n in self.presets)  # nothing changed before here
        for name in took:
            self.presets.pop(name)
            self.tokens.pop(name, None)
            self.previous.pop(name, None)
        old = self.file
        self.file = new
        self.file_stamp, self.file_order = (mtime, digest), order
        self.version += 1
        return {"ok": True, "changed": True, "took_over": took,
                "added": sorted(set(self.file) - set(old)),
                "removed": sorted(set(old) - set(self.file)),
                "updated": sorted(n for n in self.file if n in old and old[n] != self.file[n]),
                **self.snapshot()}


def file_op(table: PresetTable, kwargs: Mapping[str, Any],
            reserved: Mapping[str, str] | None = None) -> dict:
    """The ``preset_file`` op: :meth:`PresetTable.set_file`, and one log line when the
    presets change (each API server sends every new version it reads; only the first
    changes anything)."""
    res = table.set_file(kwargs["presets"], kwargs["stamp"], reserved)
    if res.get("changed"):
        from vllm_steer.logs import get_logger

        parts = [f"{label} {', '.join(res[k])}" for k, label in (
            ("added", "added"), ("updated", "changed"), ("removed", "removed"),
            ("took_over", "taken over from the run-time presets")) if res.get(k)]
        get_logger().info("vllm-steer: presets file %s loaded: %d preset(s)%s",
                          kwargs.get("path", ""), len(table.file),
                          f" ({'; '.join(parts)})" if parts else "")
    return res
