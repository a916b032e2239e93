"""Write the surface manifest of a vLLM version: every name the plugin's hooks patch, read,
bind by name or need called through a patched name, as vLLM's source defines it.

    python scripts/vllm_surface.py                      # the installed vLLM
    python scripts/vllm_surface.py --wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl

A wheel is read, not imported (``ast`` on its sources), so a CUDA wheel works on a host
without a GPU: ``pip download vllm==X --no-deps -d DIR`` fetches one. The manifest goes to
``vllm_steer/integrations/surfaces/vllm-<version>.json``; ``make test`` checks the plugin's
hooks against every committed manifest (tests/integrations/test_surface.py), so supporting a
new vLLM starts here: write its manifest, run the tests, read what moved.

Format (``format``: :data:`vllm_steer.integrations.surface.SURFACE_FORMAT`): ``vllm`` (the
version), ``source``, ``names`` (each name: its kind, where it is defined, its parameters
as one string; null when this vLLM does not have it) and ``calls`` (``"caller -> patched name"``: how the
caller reaches it, null when it no longer does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_steer.integrations.surface import (SURFACE_FORMAT, SURFACES_DIR, Sources,  # noqa: E402
                                             Surface, call_key)


def needed(hooks) -> tuple[list[str], list[tuple[str, str]]]:
    """The names and the (caller, target) pairs ``hooks`` depend on."""
    names = sorted({n for h in hooks for n in (h.target, *h.reads)})
    calls = sorted({(c, h.target) for h in hooks for c in h.called_by})
    return names, calls


def manifest(sources: Sources, source: str, hooks) -> dict:
    """The manifest of ``sources`` for ``hooks``."""
    surface = Surface(sources)
    version = sources.version()
    if version is None:
        raise SystemExit("vllm_surface: no vllm/_version.py in " + source)
    names, calls = needed(hooks)
    entries = {n: surface.lookup(n) for n in names}
    for e in entries.values():
        if e is not None and "params" in e:
            e["params"] = ", ".join(e["params"])  # one line each: the file stays readable
    return {"format": SURFACE_FORMAT, "vllm": version, "source": source, "names": entries,
            "calls": {call_key(c, t): surface.calls_by_name(c, t) for c, t in calls}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", help="a vLLM wheel file (default: the installed vLLM)")
    p.add_argument("--out", default=SURFACES_DIR, help="directory of the manifests")
    args = p.parse_args(argv)
    from vllm_steer.integrations.plugin import HOOKS

    if args.wheel:
        m = manifest(Sources(wheel=args.wheel), os.path.basename(args.wheel), HOOKS)
    else:
        m = manifest(Sources(), "installed", HOOKS)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"vllm-{m['vllm'].split('+')[0]}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(m, f, indent=1, sort_keys=True)
        f.write("\n")
    lost = [n for n, e in m["names"].items() if e is None] + \
        [c for c, how in m["calls"].items() if how is None]
    print(f"{path}: vLLM {m['vllm']}, {len(m['names'])} names, {len(m['calls'])} calls"
          + (f"; missing: {', '.join(lost)}" if lost else "; every name found"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
