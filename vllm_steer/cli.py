"""``vllm-steer``: the command line. Each concept's module adds its own sub-commands.

    vllm-steer model smollm2                  prepare the embedded model, print its path
    vllm-steer train ...                      train a steer (vllm_steer.train.cli)
    vllm-steer convert ...                    import a checkpoint of the paper's code
    vllm-steer eval toxicity|sentiment ...    evaluate like the paper (vllm_steer.eval.cli)
    vllm-steer tune STEER --task T --prompts F   choose the recommended strength by generation
    vllm-steer transfer|highlight|explain|score ...   the lens (vllm_steer.lens.cli)
    vllm-steer info FILE                      show a steer file's metadata
    vllm-steer steers list|load|unload --url URL   manage a server's steers (HTTP)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

#: Modules that contribute sub-commands: each has ``add_commands(subparsers)``; a parser's
#: ``func`` default receives the parsed args. Imported lazily so ``--help`` stays fast.
COMMAND_MODULES = ("vllm_steer.train.cli", "vllm_steer.eval.cli", "vllm_steer.lens.cli",
                   "vllm_steer.manage")


def _cmd_model(args) -> int:
    from vllm_steer.models import prepare_embedded

    print(prepare_embedded(args.name, quiet=False))
    return 0


def _cmd_info(args) -> int:
    from vllm_steer.format import read_metadata

    meta = read_metadata(args.file)
    print(json.dumps(json.loads(meta.to_json()), indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-steer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    m = sub.add_parser("model", help="prepare an embedded model and print its folder")
    m.add_argument("name", choices=["smollm2"], help="embedded model")
    m.set_defaults(func=_cmd_model)
    i = sub.add_parser("info", help="print a steer file's metadata")
    i.add_argument("file")
    i.set_defaults(func=_cmd_info)
    for mod in COMMAND_MODULES:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("vllm_steer"):
                continue  # sub-package without commands yet
            raise
        module.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"vllm-steer {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
