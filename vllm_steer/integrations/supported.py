"""The vLLM versions this vllm-steer supports: the one source of the range, read by the
start-up check (:mod:`vllm_steer.integrations.hook_check`) and by ``setup.py`` (its ``cuda``
extra, through ``runpy``: this module imports nothing). Each minor version in the range has a
committed surface manifest (``vllm_steer/integrations/surfaces/vllm-<version>.json``, written
by ``scripts/vllm_surface.py``) that the tests check the hooks against."""

#: pip version specifier of the supported vLLM releases.
SUPPORTED_VLLM = ">=0.32,<0.34"
