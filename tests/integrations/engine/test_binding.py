"""Admission end to end without an engine: a request's steers as the frontend admits them
(:func:`vllm_steer.integrations.frontend.admission.validate`: the one parse, presets,
defaults, floors), sent to the engine core as vLLM sends them (msgpack), and bound there
(:func:`vllm_steer.integrations.engine.binding.bind_request`). What a user would see: the
strengths each steer is served with (the bound form the workers read) or the refusal
message, which is the same whichever process refuses."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from helpers.steers import random_steer  # noqa: E402
from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.format import read_metadata, save_steer  # noqa: E402
from vllm_steer.integrations.engine.binding import SteerAdmissionError, bind_request  # noqa: E402
from vllm_steer.integrations.engine.registry import SteerEntry, SteerRegistry  # noqa: E402
from vllm_steer.integrations.engine.state import EngineSteerState  # noqa: E402
from vllm_steer.integrations.frontend import admission  # noqa: E402
from vllm_steer.integrations.frontend.state import frontend_state  # noqa: E402
from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest, Window  # noqa: E402
from helpers.fakes import engine_core  # noqa: E402
from vllm_steer.integrations.engine.state import engine_state  # noqa: E402

HIDDEN = 64
LOADED = ("detox", "formal", "sentiment")


@pytest.fixture
def files(tmp_path):
    """``--steer`` files, and a ``--steer-dir`` with ``extra`` and a steer of the wrong size."""
    steer_dir = tmp_path / "dir"
    steer_dir.mkdir()
    paths = {}
    for i, name in enumerate(LOADED):
        paths[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(paths[name], random_steer(HIDDEN, 4, name, seed=i))
    save_steer(steer_dir / "extra.safetensors", random_steer(HIDDEN, 4, "extra", seed=7))
    save_steer(steer_dir / "narrow.safetensors", random_steer(HIDDEN // 2, 4, "narrow", seed=8))
    return paths, str(steer_dir)


def _server(paths, steer_dir=None, **policy):
    """The frontend's state and an engine core (its registry, workers that take every op)
    for one configuration, as at start-up."""
    cfg = SteerServerConfig(steers=paths, max_strength=10.0, steer_dir=steer_dir,
                            max_steers=4, **policy)
    st = frontend_state()
    st.reset(cfg)
    st.hidden_size = HIDDEN
    reg = SteerRegistry(cfg.capacity)
    for slot, (name, path) in enumerate(cfg.steers.items()):
        reg.commit(SteerEntry.from_metadata(name, path, read_metadata(path),
                                            reg.new_load_id(), slot, "--steer"))
    reg.counters["loads"] = 0
    puts = []
    core = engine_core(
        engine_index=0, steer_state=EngineSteerState(cfg, reg, HIDDEN),
        scheduler=SimpleNamespace(requests={}),
        model_executor=SimpleNamespace(
            collective_rpc=lambda fn, args=(): puts.append(args) or [True]),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="tiny")))
    return core, puts


@pytest.fixture(autouse=True)
def _restore_frontend_state():
    old = frontend_state().config
    yield
    frontend_state().reset(old)


def _sent(params):
    """``params`` as the engine-core process receives them (vLLM's msgpack)."""
    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))


def _admit(core, steer=..., across_processes=True):
    """One request through the frontend's admission and the engine core's binding: the
    bound steers ``{name: (bank_slot, load_id, value)}``."""
    from vllm import SamplingParams

    params = SamplingParams(extra_args=None if steer is ... else {"steer": steer})
    admission.validate(params)
    sp = _sent(params) if across_processes else params
    request = SimpleNamespace(request_id="r", sampling_params=sp)
    bind_request(core, request)
    return {b.name: (b.bank_slot, b.load_id, b.value)
            for b in BoundSteer.from_wire((sp.extra_args or {}).get(BOUND_KEY))}


def _slot(core, name):
    e = engine_state(core).registry.get(name)
    return e.bank_slot, e.load_id


def _refusal(exc_info) -> str:
    """The refusal's message (HTTP 400's ``message``; vLLM's ``str`` of its validation error
    adds the parameter, which the response carries as ``param``)."""
    return str(exc_info.value.args[0])


def test_a_request_is_bound_with_its_own_strengths(files):
    core, _ = _server(files[0])
    got = _admit(core, {"detox": 5, "sentiment": "-2.5"})
    assert got == {"detox": (*_slot(core, "detox"), 5.0),
                   "sentiment": (*_slot(core, "sentiment"), -2.5)}
    got = _admit(core, "detox:3")  # the vllm_xargs string form
    assert got == {"detox": (*_slot(core, "detox"), 3.0)}
    assert _admit(core, {"detox": 0}) == {} and _admit(core) == {}  # unsteered
    window = {"strength": 4, "start": 2, "end": 8, "ramp": 2}
    assert _admit(core, {"formal": window})["formal"][2] == Window(4.0, 2, 8, 2, 0.0)


def test_defaults_apply_unless_the_request_names_the_steer(files):
    core, _ = _server(files[0], defaults={"formal": 2.0})
    assert _admit(core) == {"formal": (*_slot(core, "formal"), 2.0)}
    assert _admit(core, {"detox": 5}) == {"detox": (*_slot(core, "detox"), 5.0),
                                          "formal": (*_slot(core, "formal"), 2.0)}
    assert _admit(core, {"formal": -1}) == {"formal": (*_slot(core, "formal"), -1.0)}
    assert _admit(core, {"formal": 0}) == {}  # named with 0: the default is overridden


def test_floors_raise_a_strength_below_them_and_leave_the_others(files):
    core, _ = _server(files[0], floors={"sentiment": -1.0, "detox": 2.0})
    got = _admit(core, {"sentiment": -3})
    assert got["sentiment"][2] == -1.0  # -3 < -1: served at the floor
    assert got["detox"][2] == 2.0  # not named: 0 < 2, raised to the floor
    got = _admit(core, {"sentiment": 4, "detox": 6})
    assert (got["sentiment"][2], got["detox"][2]) == (4.0, 6.0)  # above: as asked
    got = _admit(core, {"detox": {"strength": 1, "start": 3}})
    assert got["detox"][2] == Window(2.0, 3, None, 0, 2.0)  # strength and base raised


def test_sampling_params_reused_across_calls_are_served_at_their_values_now(files):
    """vLLM admits the caller's own ``SamplingParams`` (then copies them): one object reused for
    a strength sweep, with the caller's dict changed between calls, is served at each new
    strength (it was served at the first one every time); a steer unloaded since is refused;
    an edit of the form admission wrote is refused by name."""
    from vllm import SamplingParams

    from vllm_steer.integrations.frontend.admission import CHANGED_FORM

    core, _ = _server(files[0], enable_updates=True)
    mix = {"detox": 0.0}
    sp = SamplingParams(max_tokens=4, extra_args={"steer": mix})

    def served():
        admission.validate(sp)  # what LLM.generate runs on the caller's params (``sp`` now)
        sent = _sent(sp)
        bind_request(core, SimpleNamespace(request_id="r", sampling_params=sent))
        return {b.name: b.value for b in BoundSteer.from_wire(sent.extra_args.get(BOUND_KEY))}

    for s in (2.0, 5.0, -3.0):
        mix["detox"] = s
        assert served() == {"detox": s}
    mix["formal"] = 1.0
    assert served() == {"detox": -3.0, "formal": 1.0}
    # the caller's own extra_args dict, its key given a new value between calls
    xa = {"steer": {"detox": 1.0}}
    sp = SamplingParams(max_tokens=4, extra_args=xa)
    for s in (1.0, 4.0, -2.0):
        xa["steer"] = {"detox": s}
        assert served() == {"detox": s}
    assert sp.extra_args is xa
    from vllm_steer.integrations.engine.management import run_op

    assert run_op(core, "unload", {"name": "detox"})["ok"]  # detox unloaded since
    frontend_state().set_loaded(["formal", "sentiment"])
    with pytest.raises(SteerAdmissionError) as e:
        served()
    assert "unknown steer 'detox'" in _refusal(e)
    sp.extra_args["steer"] = {"formal": 2}
    assert served() == {"formal": 2.0}
    sp.extra_args["steer"]["steers"] = [["formal", 9.0]]  # the form admission wrote, edited
    with pytest.raises(Exception) as e:
        admission.validate(sp)
    assert CHANGED_FORM in str(e.value)


@pytest.mark.parametrize("floor", [-1.0, 0.0])
def test_a_floor_that_raises_nothing_names_no_steer_so_its_steer_may_be_unloaded(files, floor):
    """A floor at or below 0 changes only the requests that name its steer: the others are
    sent without it, so unloading it (allowed: no request needs it) refuses nothing after."""
    from vllm_steer.integrations.engine.management import run_op

    core, _ = _server(files[0], floors={"sentiment": floor}, enable_updates=True)
    assert _admit(core, {"detox": 2}) == {"detox": (*_slot(core, "detox"), 2.0)}
    assert run_op(core, "unload", {"name": "sentiment"})["ok"] is True
    frontend_state().set_loaded(["detox", "formal"])  # the API server's view after it
    assert _admit(core) == {}  # a plain request: served plain
    assert _admit(core, {"formal": 3}) == {"formal": (*_slot(core, "formal"), 3.0)}
    with pytest.raises(SteerAdmissionError) as e:  # naming it is refused, as for any name
        _admit(core, {"sentiment": -3})
    assert "unknown steer 'sentiment'" in _refusal(e)


def test_a_steer_dir_steer_is_loaded_on_first_use_and_bound_to_its_new_slot(files):
    paths, steer_dir = files
    core, puts = _server(paths, steer_dir)
    got = _admit(core, {"extra": 3, "detox": 1})
    reg = engine_state(core).registry
    entry = reg.get("extra")
    assert entry is not None and entry.source == "steer-dir"
    assert entry.file == os.path.realpath(os.path.join(steer_dir, "extra.safetensors"))
    assert got == {"extra": (entry.bank_slot, entry.load_id, 3.0),
                   "detox": (*_slot(core, "detox"), 1.0)}
    assert [a[:3] for a in puts if a[0] == "put"] == [("put", entry.bank_slot, entry.load_id)]
    assert _admit(core, {"extra": -2}) == {"extra": (entry.bank_slot, entry.load_id, -2.0)}
    assert reg.counters["loads"] == 1  # the second request found it loaded


def test_the_engine_core_binds_a_request_the_frontend_of_the_same_process_admitted(files):
    """Offline with the engine core in the frontend's process: the serialised form still holds
    the typed request, which the engine core binds as it is."""
    core, _ = _server(files[0], defaults={"formal": 2.0})
    got = _admit(core, {"detox": 5}, across_processes=False)
    assert got == {"detox": (*_slot(core, "detox"), 5.0), "formal": (*_slot(core, "formal"),
                                                                      2.0)}


@pytest.mark.parametrize("steer, message", [
    ({"nope": 1}, "steer: unknown steer 'nope'; loaded steers: detox, formal, sentiment"),
    ({"detox": 11}, "steer: strength 11 of steer 'detox' exceeds the server's maximum "
                    "|strength| 10 (--steer-max-strength)"),
    ("detox:1e3", "steer: strength 1000 of steer 'detox' exceeds the server's maximum "
                  "|strength| 10 (--steer-max-strength)"),
    ({"detox": "x"}, "steer: strength of steer 'detox' must be a number, got 'x'"),
    ({"@vllm_steer": 2, "steers": [["detox", 50.0]]},
     "steer: '@vllm_steer' marks the serialised form vllm-steer writes itself"),
])
def test_the_frontend_refuses_a_bad_value_with_http_400_naming_it(files, steer, message):
    from vllm.exceptions import VLLMValidationError

    core, _ = _server(files[0])
    with pytest.raises(VLLMValidationError) as e:
        _admit(core, steer)
    assert _refusal(e).startswith(message), _refusal(e)
    assert e.value.parameter == "steer"


def test_an_unknown_steer_is_refused_with_one_message_by_the_frontend_and_the_engine(files):
    """With --steer-dir, a name with no file there: the same message from the frontend's check
    and from the engine core's (a request the frontend let through: its view of the names a
    poll old, under --enable-steer-updates)."""
    from vllm.exceptions import VLLMValidationError

    paths, steer_dir = files
    expected = (f"steer: unknown steer 'nope': not loaded (loaded: detox, formal, sentiment) "
                f"and no file nope.safetensors or nope.gguf in --steer-dir {steer_dir}")
    core, _ = _server(paths, steer_dir)
    with pytest.raises(VLLMValidationError) as e:
        _admit(core, {"nope": 1})
    assert _refusal(e) == expected
    core, _ = _server(paths, steer_dir, enable_updates=True)  # the engine core decides
    with pytest.raises(SteerAdmissionError) as e:
        _admit(core, {"nope": 1})
    assert _refusal(e) == expected


def test_the_engine_refuses_a_steer_unloaded_after_the_frontend_admitted_it(files):
    core, _ = _server(files[0])
    engine_state(core).registry.unload("detox", set())
    with pytest.raises(SteerAdmissionError) as e:
        _admit(core, {"detox": 2})
    assert _refusal(e) == "steer: unknown steer 'detox'; loaded steers: formal, sentiment"


def test_a_steer_dir_file_of_the_wrong_size_is_refused_naming_both_sizes(files):
    from vllm.exceptions import VLLMValidationError

    paths, steer_dir = files
    core, _ = _server(paths, steer_dir)
    with pytest.raises(VLLMValidationError) as e:  # the frontend reads the header
        _admit(core, {"narrow": 1})
    path = os.path.realpath(os.path.join(steer_dir, "narrow.safetensors"))
    assert _refusal(e) == (f"steer: steer 'narrow' ({path}) has hidden size 32 but the model "
                           "has 64")
    sp = SimpleNamespace(extra_args={"steer": dict(SteerRequest((("narrow", 1.0),)).to_wire())})
    with pytest.raises(SteerAdmissionError) as e:  # the engine core loads it: refused too
        bind_request(core, SimpleNamespace(request_id="r", sampling_params=sp))
    assert _refusal(e) == (f"steer: steer file '{path}' refused:\n  - steer 'narrow' has "
                           "hidden size 32 but the model tiny has 64; train or transfer the "
                           "steer for this model (vllm-steer train / transfer)")
    assert engine_state(core).registry.get("narrow") is None


def test_the_engine_refuses_a_serialised_form_of_another_version(files):
    core, _ = _server(files[0])
    sp = SimpleNamespace(extra_args={"steer": {"@vllm_steer": 1, "steers": [["detox", 1.0]]}})
    with pytest.raises(SteerAdmissionError) as e:
        bind_request(core, SimpleNamespace(request_id="r", sampling_params=sp))
    assert _refusal(e) == ("steer: serialised steer request of version 1; this vllm-steer "
                           "reads version 2 (frontend and engine run different vllm-steer "
                           "versions: install the same one everywhere)")


def test_binding_adds_only_the_bound_form_and_drops_one_a_client_sent(files):
    """Nothing downstream reads ``extra_args["steer"]`` in the engine core: binding leaves it
    as it came and writes the bound form, replacing any the request carried in."""
    core, _ = _server(files[0])
    wire = dict(SteerRequest((("detox", 2.0),)).to_wire())
    forged = BoundSteer.to_wire([BoundSteer("detox", 3, 99, 50.0)])
    sp = SimpleNamespace(extra_args={"steer": wire, BOUND_KEY: forged, "other": 1})
    bind_request(core, SimpleNamespace(request_id="r", sampling_params=sp))
    assert sp.extra_args["steer"] is wire and sp.extra_args["other"] == 1
    assert BoundSteer.from_wire(sp.extra_args[BOUND_KEY]) == \
        [BoundSteer("detox", *_slot(core, "detox"), 2.0)]


def test_the_engine_refuses_a_value_that_skipped_the_frontends_admission(files):
    core, _ = _server(files[0])
    sp = SimpleNamespace(extra_args={"steer": {"detox": 1}})
    with pytest.raises(SteerAdmissionError) as e:
        bind_request(core, SimpleNamespace(request_id="r", sampling_params=sp))
    assert _refusal(e) == ("steer: {'detox': 1} is not the serialised form vllm-steer's "
                           "frontend writes: the request did not pass its admission (send it "
                           "through vLLM's LLM, AsyncLLM or API server, with the plugin "
                           "installed)")


def test_an_unsteered_request_needs_nothing_of_the_steer_state_and_a_steered_one_names_why(
        files, tmp_path):
    """The engine core reads its steer state (the ``--steer`` files' headers) at its first use:
    if that fails (a file moved away since the workers loaded it), a steered request gets the
    error, and an unsteered one is served as by vLLM alone."""
    from vllm.sampling_params import SamplingParams

    from vllm_steer.integrations.engine.state import STATES

    paths, _ = files
    moved = dict(paths, detox=str(tmp_path / "moved-away.safetensors"))
    cfg = SteerServerConfig(steers=moved, max_strength=10.0, max_steers=4)
    core = engine_core(engine_index=0, scheduler=SimpleNamespace(requests={}),
                       vllm_config=SimpleNamespace(
                           additional_config=cfg.to_additional_config(),
                           model_config=SimpleNamespace(model="tiny")))
    plain = SimpleNamespace(sampling_params=SamplingParams(max_tokens=4))
    bind_request(core, plain)  # served: no error, nothing bound
    assert BOUND_KEY not in (plain.sampling_params.extra_args or {})
    assert STATES.get(core) is None  # nothing of the steer state was read for it
    steered = SimpleNamespace(sampling_params=SamplingParams(
        max_tokens=4, extra_args={"steer": SteerRequest.parse({"formal": 2}).to_wire()}))
    with pytest.raises(Exception, match="moved-away"):
        bind_request(core, steered)


def test_the_engine_core_reads_its_steers_as_it_starts(files, tmp_path):
    """The hook on the engine core's start (``EngineCore._initialize_kv_caches``, once its
    workers read the ``--steer`` files to reserve the bank) makes the steer state: a file
    replaced on disk afterwards changes nothing the engine core lists or binds, and a file
    that cannot be read fails the start, naming it (not the first request, hours later)."""
    from helpers.engine_cores import Workers
    from vllm_steer.integrations.engine import core as hooks
    from vllm_steer.integrations.engine.management import run_op

    paths, _ = files
    cfg = SteerServerConfig(steers=paths, max_strength=10.0, max_steers=4)
    vllm_config = SimpleNamespace(additional_config=cfg.to_additional_config(),
                                  model_config=SimpleNamespace(
                                      model="tiny", architectures=["LlamaForCausalLM"],
                                      get_hidden_size=lambda: HIDDEN))
    started = []
    core = engine_core(engine_index=0, scheduler=SimpleNamespace(requests={}),
                       model_executor=Workers())
    hooks.start(lambda self, cfg: (started.append(cfg), setattr(self, "vllm_config", cfg)),
                core, vllm_config)
    assert started == [vllm_config]
    ranks = {s["name"]: s["rank"] for s in run_op(core, "list")["steers"]}
    save_steer(paths["formal"], random_steer(HIDDEN, 8, "formal", seed=9))  # replaced on disk
    assert {s["name"]: s["rank"] for s in run_op(core, "list")["steers"]} == ranks
    assert ranks["formal"] == 4
    moved = dict(paths, detox=str(tmp_path / "moved-away.safetensors"))
    bad = SimpleNamespace(**{**vars(vllm_config), "additional_config": SteerServerConfig(
        steers=moved, max_strength=10.0, max_steers=4).to_additional_config()})
    with pytest.raises(Exception, match="moved-away"):
        hooks.start(lambda self, cfg: setattr(self, "vllm_config", cfg),
                    engine_core(engine_index=0), bad)


def _vector_replica(paths: dict, steer_dir: str | None = None):
    """An engine core started (as vLLM starts it) with the vector steers ``paths`` on a
    two-block model of hidden size :data:`HIDDEN`, its workers taking every op: one replica
    or one run of a server."""
    from helpers.engine_cores import Workers, start_vector_core

    cfg = SteerServerConfig(steers=paths, max_strength=10.0, max_steers=4, steer_dir=steer_dir,
                            enable_updates=True)
    return start_vector_core(cfg, HIDDEN, scheduler=SimpleNamespace(requests={}),
                             model_executor=Workers())


def _block_hashes(core, steer) -> list:
    """The prefix-cache block hashes (what vLLM's prefix cache and a KV connector's store are
    keyed by) of a three-block prompt admitted with ``steer``, computed by vLLM's own
    hasher."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    params = SamplingParams(max_tokens=4, extra_args={"steer": steer})
    admission.validate(params)
    request = Request("r", list(range(3 * 16)), _sent(params), None,
                      block_hasher=get_request_block_hasher(16, sha256_cbor))
    bind_request(core, request)
    return list(request.block_hashes)


def test_the_prefix_cache_names_a_vector_steer_by_its_vectors_not_its_load(tmp_path):
    """A KV store that outlives the process or is shared by replicas (a KV connector) is
    keyed by vLLM's block hashes. A server restarted with a changed ``calm`` file (the same
    name, the same load id) must not find the old file's blocks; the same vectors find the
    same blocks in another replica, in llama.cpp's GGUF, and loaded again at run time."""
    from vllm_steer.integrations.engine.management import run_op
    from vllm_steer.vectors import make_vector_steer, save_gguf, save_vector

    torch = pytest.importorskip("torch")

    def vec(seed):
        g = torch.Generator().manual_seed(seed)
        return make_vector_steer({1: torch.randn(HIDDEN, generator=g)}, "calm")

    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    save_vector(tmp_path / "v1/calm.safetensors", vec(1))
    save_vector(tmp_path / "v2/calm.safetensors", vec(2))  # the file changed
    save_gguf(tmp_path / "v1/calm.gguf", vec(1))  # the same vectors as llama.cpp writes them
    before = _vector_replica({"calm": str(tmp_path / "v1/calm.safetensors")})
    after = _vector_replica({"calm": str(tmp_path / "v2/calm.safetensors")})
    other = _vector_replica({"calm": str(tmp_path / "v1/calm.gguf")})
    assert _slot(before, "calm") == _slot(after, "calm")  # the same name and load id
    plain = _block_hashes(before, {"calm": 0})
    steered = _block_hashes(before, {"calm": 0.5})
    assert len(steered) == 3 and not set(steered) & set(plain)
    assert not set(_block_hashes(after, {"calm": 0.5})) & set(steered)  # other vectors
    assert _block_hashes(other, {"calm": 0.5}) == steered  # the same vectors elsewhere
    assert not set(_block_hashes(before, {"calm": -0.5})) & set(steered)  # another strength
    for op, kw in (("unload", {"name": "calm"}),
                   ("load", {"name": "calm", "path": str(tmp_path / "v1/calm.gguf")})):
        assert run_op(before, op, kw)["ok"]
    assert _slot(before, "calm")[1] != _slot(other, "calm")[1]  # a new load id
    assert _block_hashes(before, {"calm": 0.5}) == steered


def test_vllms_kv_cache_error_says_what_the_steer_bank_took(files):
    """A bank that fits on the device but leaves the KV cache too little: vLLM's error names
    only its own flags (``gpu_memory_utilization``, ``max_model_len``); raised again with the
    bank's figure and the flags that size it. Any other error is raised as it is."""
    from vllm_steer.integrations.engine import core as hooks
    from vllm_steer.sizing import bank_bytes

    paths, _ = files
    cfg = SteerServerConfig(steers=paths, max_strength=10.0, max_steers=1024,
                            max_steer_rank=256)
    vllm_config = SimpleNamespace(additional_config=cfg.to_additional_config(),
                                  model_config=SimpleNamespace(
                                      model="tiny", architectures=["LlamaForCausalLM"],
                                      get_hidden_size=lambda: HIDDEN, dtype="torch.bfloat16",
                                      head_dtype="torch.bfloat16"))
    short = ("No available memory for the cache blocks. Try increasing "
             "`gpu_memory_utilization` when initializing the engine.")

    def no_room(self, cfg):
        raise ValueError(short)

    with pytest.raises(ValueError) as e:
        hooks.start(no_room, engine_core(engine_index=0), vllm_config)
    msg = str(e.value)
    mib = bank_bytes(1024, 256, HIDDEN, "bfloat16") / 2**20
    assert msg.startswith(short) and f"the steer bank, {mib:,.1f} MiB" in msg
    assert f"1024 max steers x rank 256 x hidden {HIDDEN} x bfloat16" in msg
    assert "--max-steers (now 1024)" in msg and "--max-steer-rank (now 256)" in msg

    def other(self, cfg):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="^something else$"):
        hooks.start(other, engine_core(engine_index=0), vllm_config)
