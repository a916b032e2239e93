"""Load and unload steers between ``generate`` calls of a ``vllm.LLM`` (offline).

    from vllm import LLM, SamplingParams
    from vllm_steer import offline

    llm = LLM(MODEL, additional_config={"vllm_steer": {"steers": {}, "max_steers": 16}})
    offline.load_steer(llm, "detox", "steers/smollm2-detox.safetensors")
    llm.generate(prompts, SamplingParams(extra_args={"steer": {"detox": 5}}))
    offline.unload_steer(llm, "detox")
    offline.list_steers(llm)   # [{"name": ..., "file": ..., "load_id": ..., ...}]

The same engine-core operations as ``POST`` / ``DELETE /v1/steers`` (through
``LLM.collective_rpc``, reaching every worker); the same guarantees (see
``docs/serving.md``). Steering must be enabled on the engine: give steers, or a capacity
(``"max_steers"``) to start with none.
"""

from __future__ import annotations

from vllm_steer.integrations.frontend.engine_client import manage_sync


class SteerLoadError(ValueError):
    """The engine refused a load or unload; ``status`` is the HTTP status the server uses."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _manage(llm, op: str, **kwargs) -> dict:
    res = manage_sync(llm, op, **kwargs)
    if res.get("ok") is False:
        raise SteerLoadError(res["error"], res["status"])
    return res


def load_steer(llm, name: str, path: str) -> dict:
    """Load ``path`` as steer ``name`` (a new load id if the name is loaded: requests
    already admitted keep the old file). Returns the steer's entry (as ``GET /v1/steers``).
    Raises :class:`SteerLoadError` with every reason when the file or capacity refuses."""
    import os

    return _manage(llm, "load", name=name, path=os.path.abspath(path), source="offline")["steer"]


def unload_steer(llm, name: str) -> dict:
    """Unload steer ``name`` (requests already admitted with it finish with it)."""
    return _manage(llm, "unload", name=name)["steer"]


def list_steers(llm) -> list[dict]:
    """The loaded steers (as ``GET /v1/steers`` ``data``)."""
    return [s for s in _manage(llm, "list")["steers"] if s["state"] == "loaded"]
