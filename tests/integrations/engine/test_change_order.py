"""Two changes of one name sent at once by two API servers (data parallelism with
``--api-server-count 2``): every API server has its own connection to each engine core, so
the two engine cores may get the changes in different orders. Whatever the order, the engine
cores must end serving the same thing, and what the two calls answered must be true.

The real code runs on both sides (the API server's management client, the engine cores'
management hook, registry and preset table); the network between them is a model that holds
every message until the test delivers it, in an order Hypothesis chooses (each engine core
handles one message at a time, as its one thread does).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.engine_cores import HIDDEN, management_core, op
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.engine import core as hooks


class Network:
    """The connections of every API server to every engine core: a utility call sends one
    message to each engine core and waits for their answers; :meth:`deliver` hands one held
    message to its engine core, which answers it at once."""

    def __init__(self, cores):
        self.cores = cores
        self.held: list[tuple[int, tuple, asyncio.Future]] = []

    def client(self):
        net = self

        class Client:  # vLLM's load-balancing data-parallel client, as the plugin uses it
            core_engines = self.cores

            async def call_utility_all_async(self, method, *args):
                assert method == "collective_rpc"
                loop = asyncio.get_running_loop()
                futures = []
                for i in range(len(net.cores)):
                    futures.append(loop.create_future())
                    net.held.append((i, args, futures[-1]))
                return [await f for f in futures]

        return SimpleNamespace(engine_core=Client())

    def deliver(self, k: int) -> None:
        i, args, future = self.held.pop(k)
        future.set_result(hooks.collective_rpc(None, self.cores[i], *args))


def race(cores, calls, choose) -> list[dict]:
    """``calls`` (``(op, kwargs)`` each) sent at once from one API server each; the held
    messages delivered one at a time, ``choose(n)`` picking which of the ``n`` held; the
    calls' answers."""
    from vllm_steer.integrations.frontend.engine_client import manage
    from vllm_steer.integrations.frontend.state import frontend_state

    net = Network(cores)

    async def run():
        tasks = [asyncio.ensure_future(manage(net.client(), name, **kw)) for name, kw in calls]
        while not all(t.done() for t in tasks):
            for _ in range(20):  # let every call run up to its next message
                await asyncio.sleep(0)
            if net.held:
                net.deliver(choose(len(net.held)))
        return [t.result() for t in tasks]

    try:
        return asyncio.run(run())
    finally:
        frontend_state().reset(None)


def serves(core, name: str):
    """What an engine core serves under the steer ``name``: its file, or None."""
    return next((s["file"] for s in op(core, "list")["steers"]
                 if s["name"] == name and s["state"] == "loaded"), None)


def preset(core, name: str):
    """An engine core's run-time preset ``name``: its mix, or None."""
    return op(core, "presets")["presets"].get(name)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("steers")
    for i, n in enumerate(("a", "b", "c")):
        save_steer(root / f"{n}.safetensors", random_steer(HIDDEN, 2, n, seed=i))
    return lambda n: str(root / f"{n}.safetensors")


#: Two changes of the steer ``s`` (loaded from ``a`` before): each call's ``(op, kwargs)``
#: and what it leaves served when it is the last change applied (a file, or None).
STEER_RACES = {
    "two replacements": ((("load", {"name": "s", "path": "b"}), "b"),
                         (("load", {"name": "s", "path": "c"}), "c")),
    "a replacement and an unload": ((("load", {"name": "s", "path": "b"}), "b"),
                                    (("unload", {"name": "s"}), None)),
}


@pytest.mark.parametrize("race_name", sorted(STEER_RACES))
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_two_api_servers_changing_one_steer_at_once_leave_the_engine_cores_agreeing(
        files, race_name, data):
    cores = [management_core(0, capacity=3), management_core(1, capacity=3)]
    for c in cores:
        assert op(c, "load", name="s", path=files("a"))["ok"]
    (call1, effect1), (call2, effect2) = STEER_RACES[race_name]
    calls = [(name, {**kw, **({"path": files(kw["path"])} if "path" in kw else {})})
             for name, kw in (call1, call2)]
    answers = race(cores, calls, lambda n: data.draw(st.integers(0, n - 1)))
    served = [serves(c, "s") for c in cores]
    assert served[0] == served[1], (served, answers)
    effects = [None if e is None else files(e) for e in (effect1, effect2)]
    ok = [e for a, e in zip(answers, effects, strict=True) if a["ok"]]
    assert ok, answers  # the newer change is refused nowhere
    assert served[0] in ok, (served, answers)
    for a in answers:
        if not a["ok"]:
            assert a["status"] == 409 and "changed at the same time" in a["error"], a
    for c in cores:  # the bank's slots hold what the registry binds, and nothing else
        listing = {s["bank_slot"]: (s["load_id"], s["name"]) for s in op(c, "list")["steers"]}
        for bank in c.model_executor.banks:
            assert {s: bank.get(s) for s in listing} == listing


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), delete=st.booleans())
def test_two_api_servers_changing_one_preset_at_once_leave_the_engine_cores_agreeing(
        files, data, delete):
    """A ``PUT`` of the preset ``p`` racing another ``PUT`` of it (or its ``DELETE``)."""
    cores = [management_core(0, capacity=3), management_core(1, capacity=3)]
    for c in cores:
        assert op(c, "load", name="s", path=files("a"))["ok"]
        assert op(c, "preset_add", name="p", steer={"s": 1.0}, token="t0")["ok"]
    first = ("preset_add", {"name": "p", "steer": {"s": 2.0}, "token": "t1", "replace": True})
    second = (("preset_delete", {"name": "p"}) if delete else
              ("preset_add", {"name": "p", "steer": {"s": 3.0}, "token": "t2",
                              "replace": True}))
    answers = race(cores, [first, second], lambda n: data.draw(st.integers(0, n - 1)))
    mixes = [preset(c, "p") for c in cores]
    assert mixes[0] == mixes[1], (mixes, answers)
    effects = [{"s": 2.0}, None if delete else {"s": 3.0}]
    ok = [e for a, e in zip(answers, effects, strict=True) if a["ok"]]
    assert ok and mixes[0] in ok, (mixes, answers)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), preset_race=st.booleans())
def test_a_change_every_engine_core_refuses_holds_back_no_older_change(files, data, preset_race):
    """A ``POST /v1/steers`` of a file that does not exist (HTTP 400 on every engine core)
    racing a ``DELETE`` of the name, or a preset ``PUT`` with a strength that is no number
    racing the preset's ``DELETE``: the refused change changed nothing, so the ``DELETE`` applies on
    every engine core (it was refused as superseded where the refused change came first)."""
    cores = [management_core(0, capacity=3), management_core(1, capacity=3)]
    for c in cores:
        assert op(c, "load", name="s", path=files("a"))["ok"]
        if preset_race:
            assert op(c, "preset_add", name="p", steer={"s": 1.0}, token="t0")["ok"]
    if preset_race:
        calls = [("preset_add", {"name": "p", "steer": {"s": "x"}, "token": "t1",
                                 "replace": True}), ("preset_delete", {"name": "p"})]
    else:
        calls = [("load", {"name": "s", "path": files("a") + ".missing", "source": "api"}),
                 ("unload", {"name": "s"})]
    answers = race(cores, calls, lambda n: data.draw(st.integers(0, n - 1)))
    assert answers[1]["ok"] is True, answers
    assert not answers[0]["ok"] and answers[0]["status"] in (400, 409), answers
    left = [preset(c, "p") if preset_race else serves(c, "s") for c in cores]
    assert left == [None, None], (left, answers)
