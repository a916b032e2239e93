"""The engine-core process: the registry of loaded steers (``registry``), run-time management
(``management``), admission (``binding``: each request's steers bound to their bank slots)
and the hooks on ``EngineCore`` (``core``). It speaks to the frontend only through
:mod:`vllm_steer.integrations.protocol`. Light: no torch at import time."""
