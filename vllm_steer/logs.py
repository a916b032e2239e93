"""The plugin's logger.

A child of vLLM's ``vllm`` logger, so that what the plugin logs comes out through vLLM's own
handler and format, at vLLM's level (``VLLM_LOGGING_LEVEL``, INFO by default), in every
process vLLM starts (API servers, engine core, workers), e.g.
``(EngineCore pid=…) INFO … [management.py:180] vllm-steer: loaded steer 'detox' … 4.1 ms``.
A plain ``logging.getLogger("vllm_steer")`` has no handler in those processes, so its INFO
lines were dropped. Outside vLLM (training, the transformers path) nothing configures the
``vllm`` logger and Python's default applies: warnings and errors are shown.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "vllm.vllm_steer"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


_WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    """Log a warning once per process (a condition that repeats at every step)."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        get_logger().warning(msg)
