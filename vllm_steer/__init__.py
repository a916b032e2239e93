"""vllm-steer: LM-Steer steering for stock vLLM, per request, from the OpenAI API.

This module stays light (no torch import): vLLM's frontend imports it through the
``vllm.general_plugins`` entry point.
"""

__version__ = "0.1.0"

#: Key of the request field (top-level ``steer`` in the OpenAI body, ``extra_args["steer"]``
#: in ``SamplingParams``, ``vllm_xargs={"steer": "name:strength,..."}``).
REQUEST_FIELD = "steer"

#: Key under vLLM's ``additional_config`` that carries the server's steer configuration.
ADDITIONAL_CONFIG_KEY = "vllm_steer"

__all__ = ["__version__", "REQUEST_FIELD", "ADDITIONAL_CONFIG_KEY"]
