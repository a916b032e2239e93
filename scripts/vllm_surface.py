"""Write the surface manifest of a vLLM version: every name the plugin's hooks patch (each
alternative target too), read (the hooks' and the accesses' of
``vllm_steer/integrations/vllm_access.py``), bind by name or need called through a patched
name, as vLLM's source defines it.

    python scripts/vllm_surface.py                      # the installed vLLM
    python scripts/vllm_surface.py --wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl

A wheel is read, not imported (``ast`` on its sources), so a CUDA wheel works on a host
without a GPU: ``pip download vllm==X --no-deps -d DIR`` fetches one. The manifest goes to
``vllm_steer/integrations/surfaces/vllm-<version>.json``; ``make test`` checks the plugin's
hooks against every committed manifest (tests/integrations/test_surface.py), so supporting a
new vLLM starts here: write its manifest, run the tests, read what moved.

Format (``format``: :data:`vllm_steer.integrations.manifest.SURFACE_FORMAT`): ``vllm`` (the
version), ``source``, ``names`` (each name: its kind, where it is defined, its parameters
as one string; null when this vLLM does not have it) and ``calls`` (``"caller -> patched name"``:
how the caller reaches it, null when it no longer does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_steer.integrations.manifest import SURFACES_DIR, write  # noqa: E402
from vllm_steer.integrations.surface import Sources, Surface  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", help="a vLLM wheel file (default: the installed vLLM)")
    p.add_argument("--out", default=SURFACES_DIR, help="directory of the manifests")
    args = p.parse_args(argv)
    from vllm_steer.integrations.plugin import HOOKS
    from vllm_steer.integrations.vllm_access import ACCESSES

    sources = Sources(wheel=args.wheel) if args.wheel else Sources()
    try:
        m = write(Surface(sources), os.path.basename(args.wheel) if args.wheel else "installed",
                  (*HOOKS, *ACCESSES))
    except ValueError as e:
        raise SystemExit(f"vllm_surface: {e}") from e
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
