"""vllm-steer: make, check and manage steers for vLLM.

A steer is an LM-Steer (a small learned matrix on a model's final hidden state) or a control
vector (one vector per decoder layer added to the residual stream, llama.cpp's and repeng's
GGUF files read as they are); requests choose which steers to apply and how strongly.
Serving is vLLM's own command, with the flags this package adds to it:

    vllm serve MODEL --steer NAME=PATH [NAME=PATH ...]

then send "steer": {"NAME": strength} in the request body (the openai client's extra_body).
`vllm serve --help=vllm-steer` lists the serving flags; README.md and docs/ explain the rest.

This command makes and inspects steers and manages a running server's:

    vllm-steer model smollm2                      prepare the embedded model, print its folder
    vllm-steer train --model M --data F ...       train a steer on labelled texts
    vllm-steer tune STEER --task T --prompts F    choose its served strength by generation
    vllm-steer info STEER                         print a steer file's metadata
    vllm-steer eval toxicity|sentiment|grid ...   evaluate like the paper
    vllm-steer transfer|highlight|explain|score   the lens: move, read and explain steers
    vllm-steer convert CHECKPOINT ...             import a steer trained with the paper's code
    vllm-steer convert X.gguf --out X.safetensors a control vector, GGUF <-> ours
    vllm-steer steers list|load|unload --url URL  a running server's steers (HTTP)
    vllm-steer presets list|add|delete --url URL  a running server's presets (HTTP)

`vllm-steer COMMAND --help` documents each command and every flag, with its default.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import sys

from vllm_steer.usage import UsageError

#: Modules that contribute sub-commands: each has ``add_commands(subparsers)``; a parser's
#: ``func`` default receives the parsed args. Imported lazily so ``--help`` stays fast.
COMMAND_MODULES = ("vllm_steer.train.cli", "vllm_steer.eval.cli", "vllm_steer.lens.cli",
                   "vllm_steer.manage")


def _cmd_model(args) -> int:
    from vllm_steer.models import prepare_embedded

    print(prepare_embedded(args.name, quiet=False))
    return 0


def _cmd_info(args) -> int:
    from vllm_steer.kinds import load_any

    # the check serving runs on the file (every tensor read, every value finite), not only
    # its header: what `info` passes, `vllm serve --steer` loads
    steer = load_any(args.file)
    print(json.dumps(json.loads(steer.metadata.to_json()), indent=2, sort_keys=True))
    return 0


#: A help text that says its flag's default: the word "default", but not someone else's
#: ("repeng's default", "the paper's default" say where a value comes from).
STATES_DEFAULT = r"(?<!'s )\bdefault\b"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions of several lines as written (one-line ones wrapped); every option's help
    ends with its default, once: appended unless the help already says it (or there is no
    default worth saying: None, False, an empty list; a default of 0 is said)."""

    def _format_args(self, action, default_metavar):
        if getattr(action, "comma_list", False):  # shown in its one documented form
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or re.search(STATES_DEFAULT, text, re.I)
                or default is None or default is False or default == argparse.SUPPRESS
                or default == []
                or not action.option_strings):
            return text
        shown = (",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
                 if isinstance(default, (list, tuple)) else
                 f"{default:g}" if isinstance(default, float) else str(default))
        return f"{text} (default: {shown.replace('%', '%%')})"


def os_error_text(e: OSError) -> str:
    """An ``OSError`` as one line: ``FILE: reason`` (``[Errno 21] Is a directory: 'x'`` reads
    ``x: Is a directory``), or its own message when it names no file."""
    if e.strerror and e.filename is not None:
        names = [os.fsdecode(e.filename)] + ([os.fsdecode(e.filename2)]
                                             if e.filename2 is not None else [])
        return f"{' -> '.join(names)}: {e.strerror}"
    return e.strerror or str(e)


def walk_parsers(parser: argparse.ArgumentParser):
    """``parser`` and every sub-command parser below it."""
    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in dict.fromkeys(a.choices.values()):
                yield from walk_parsers(sub)


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-command parser of ``command`` (``parser`` itself if there is none)."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) and command in a.choices:
            return a.choices[command]
    return parser


SERVE_HINT = """serving is vLLM's own command, with the flags this package adds to it:

    vllm serve MODEL --steer NAME=PATH [NAME=PATH ...]

`vllm serve --help=vllm-steer` lists them (README.md, docs/serving.md)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-steer", description=__doc__,
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    m = sub.add_parser("model", help="prepare an embedded model and print its folder")
    m.add_argument("name", choices=["smollm2"],
                   help="embedded model (smollm2: SmolLM2-135M-Instruct)")
    m.set_defaults(func=_cmd_model)
    i = sub.add_parser("info", help="print a steer file's metadata")
    i.add_argument("file", help="steer file (.safetensors), or a control vector (.gguf)")
    i.set_defaults(func=_cmd_info)
    for mod in COMMAND_MODULES:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("vllm_steer"):
                continue  # sub-package without commands yet
            raise
        module.add_commands(sub)
    for q in walk_parsers(p):
        q.formatter_class = HelpFormatter
    return p


def quiet_libraries() -> None:
    """``--quiet``: no progress bar of Hugging Face's libraries either (transformers loading
    and writing a model's weights, the hub's downloads), as of now."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when transformers is imported
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        rest = " ".join(shlex.quote(a) for a in argv[1:]) or "MODEL --steer NAME=PATH"
        print(f"vllm-steer serve: {SERVE_HINT}\n\nWith your arguments:\n\n    vllm serve {rest}",
              file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "quiet", False):
        quiet_libraries()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: said in one line, exit status 130 as a shell's
        hint = ("; --resume continues from its last checkpoint (docs/training.md)"
                if args.command == "train" else "")
        print(f"\nvllm-steer {args.command}: interrupted{hint}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `vllm-steer info FILE | head`: the reader stopped, as for `cat`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 1
    except UsageError as e:  # flags that do not go together: as argparse's own errors
        command_parser(parser, args.command).print_usage(sys.stderr)
        print(f"vllm-steer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as e:
        print(f"vllm-steer {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file that cannot be read or written: which one, and why
        print(f"vllm-steer {args.command}: error: {os_error_text(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
