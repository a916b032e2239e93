"""The frontend process (vLLM's API server, or the process of an offline ``LLM``): the
``--steer`` flags, start-up checks, the ``steer`` request field parsed once, presets as model
names, the engine-control client. Light: no torch at import time."""
