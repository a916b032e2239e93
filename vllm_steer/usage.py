"""Command-line usage errors: flags that do not go together, or a value out of range.

``vllm-steer`` answers a :class:`UsageError` as argparse answers its own: the command's usage
line, ``vllm-steer COMMAND: error: ...`` and exit status 2, before any model or file is read.
Other errors (a file that cannot be read, a steer for another model) exit with status 1.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


class UsageError(ValueError):
    """The command line is wrong (the flags, not the files or the model): exit status 2. A
    ``ValueError``, so that code calling the commands as functions may catch either."""


def int_at_least(minimum: int, example: int) -> Callable[[str], int]:
    """A count flag's ``type``: an integer >= ``minimum``, refused at parse time (exit 2,
    before any model is loaded) with the value, the limit and an example."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < minimum:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer >= {minimum}: give e.g. {example}")
        return n
    return parse


def checked(validate: Callable[[], None]) -> None:
    """Run a configuration's ``validate`` built from the command's flags: its refusal (every
    field and value wrong, in one message) is a usage error."""
    try:
        validate()
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None
