"""The frontend process (vLLM's API server, or the process of an offline ``LLM``): the
``--steer`` flags, start-up checks, the ``steer`` request field parsed once and the operator's
policy applied once (admission), presets as model names, the management client. It speaks to
the engine core only through :mod:`vllm_steer.integrations.protocol`. Light: no torch at
import time."""
