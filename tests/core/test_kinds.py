"""Kinds of steer: a file is read by its kind, a loaded steer goes where its kind says, and a
new kind needs only its own module and one registration (a test-only kind shows it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import bias_kind
from helpers.steers import random_steer
from vllm_steer import kinds
from vllm_steer.bank import SlotBank
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker.request_slots import RequestSlots
from vllm_steer.integrations.worker.step_mapping import LayerVectors, TokenCoefs
from vllm_steer.kernels.layer_vectors import add_to_block_output, add_vectors
from vllm_steer.vectors import make_vector_steer, save_gguf, save_vector


@pytest.fixture
def bias():
    k = bias_kind.register()
    yield k
    kinds.unregister_kind(k.name)


def test_each_file_is_read_by_its_own_kind(tmp_path):
    lm = tmp_path / "lm.safetensors"
    save_steer(lm, random_steer(16, 2, "lm", seed=0))
    vec = tmp_path / "v.safetensors"
    save_vector(vec, make_vector_steer({1: torch.ones(16)}, "v"))
    gg = tmp_path / "g.gguf"
    save_gguf(gg, make_vector_steer({1: torch.ones(16)}, "g"))
    assert [kinds.kind_of_file(p).name for p in (lm, vec, gg)] == ["lm-steer", "vector", "vector"]
    assert kinds.read_any_metadata(gg).layers == [1]
    assert kinds.load_any(lm).p1.shape == (16, 2)
    assert kinds.applied_in_layers(kinds.read_any_metadata(vec))
    assert not kinds.applied_in_layers(kinds.read_any_metadata(lm))


def test_a_test_only_kind_is_served_by_the_bank_the_mapping_and_the_blocks_op(tmp_path, bias):
    """Registered from its own module only: its file is claimed, its steer goes to the vector
    bank (no factor columns), the step mapping gives its tokens their strengths, and the
    blocks' op adds ``a * v`` at its block only; plain torch says what each token must get."""
    path = tmp_path / f"b{bias_kind.SUFFIX}"
    v = torch.randn(16, generator=torch.Generator().manual_seed(3))
    bias_kind.save(path, "b", 1, v)
    assert kinds.kind_of_file(path) is bias
    steer = kinds.load_any(path)

    bank = SlotBank(4, 16, reserve_rank=2)
    layers = LayerVectors([0, 1], 2, 4, 16, max_tokens=8, device=torch.device("cpu"))
    bank.layers = layers
    bank.put(2, 7, "b", steer)
    assert bank.layer_slots() == [2] and int(bank.widths[2]) == 0  # no factor columns
    assert torch.equal(bank.p1, torch.zeros_like(bank.p1))

    slots = RequestSlots(4)
    slots.ensure(3, torch.device("cpu"))
    row, problems = bank.coef_row({"b": (2, 7)}, {"b": -1.5})
    assert not problems
    slots.set(1, np.asarray(row, dtype=np.float32), None, bank)  # request slot 1: steered
    slots.flush()
    mapping = TokenCoefs(layers, slots)
    # three requests (slots 0, 1, 2) with 2, 3 and 1 tokens: only slot 1's tokens steered
    mapping.build(np.array([0, 1, 2]), np.array([2, 3, 1]), None)
    h = torch.randn(6, 16)
    res = torch.randn(6, 16)
    out1 = add_to_block_output((h, res), layers.token_coefs, layers.block_vectors(1))
    out0 = add_to_block_output((h, res), layers.token_coefs, layers.block_vectors(0))
    want = res.clone()
    want[2:5] += -1.5 * v  # plain torch: the steered request's tokens, at its block
    assert torch.allclose(out1[1], want, atol=1e-6) and torch.equal(out1[0], h)
    assert torch.equal(out1[1][[0, 1, 5]], res[[0, 1, 5]])  # other tokens: the same bits
    assert torch.equal(out0[1], res)  # another block: nothing
    # the same step again writes nothing; a changed strength is written
    mapping.build(np.array([0, 1, 2]), np.array([2, 3, 1]), None)
    assert mapping.unchanged_steps == 1
    row2, _ = bank.coef_row({"b": (2, 7)}, {"b": 2.0})
    slots.set(1, np.asarray(row2, dtype=np.float32), None, bank)
    mapping.build(np.array([0, 1, 2]), np.array([2, 3, 1]), None)
    assert mapping.unchanged_steps == 1
    assert torch.equal(layers.token_coefs[2:5, 2], torch.full((3,), 2.0))
    # a shorter step with no steered token zeroes what the last one left
    mapping.build(np.array([0]), np.array([1]), None)
    assert not layers.token_coefs.any()



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_layers_op_keeps_unsteered_tokens_bit_for_bit_negative_zeros_too(dtype):
    """Against plain torch: steered tokens get ``h + sum a_i v_i`` (fp32 math), the others
    keep their bits, ``-0.0`` included (``-0.0 + 0.0`` would be ``+0.0``)."""
    g = torch.Generator().manual_seed(0)
    vecs = torch.randn(3, 16, generator=g)
    coefs = torch.zeros(8, 3)
    coefs[1, 0], coefs[3] = 2.0, torch.tensor([0.5, -1.0, 0.25])
    h = torch.randn(5, 16, generator=g).to(dtype)
    h[0, :4] = -0.0
    h[2] = -0.0
    out = add_vectors(h, coefs, vecs)
    want = h.clone()
    for t in (1, 3):
        want[t] = (h[t].float() + coefs[t] @ vecs).to(dtype)
    assert out.dtype == dtype and torch.equal(out[[1, 3]], want[[1, 3]])
    for t in (0, 2, 4):  # the same bits
        assert torch.equal(out[t].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           h[t].view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("keeps_factors", [True, False])
def test_a_slot_reused_by_another_kind_keeps_nothing_of_the_old_steer(keeps_factors):
    """A slot that held a vector steer takes an LM-Steer without being emptied first (a name
    loaded again into its own slot, an eviction, a draining slot reaped): a request on the new
    steer gets nothing added in the decoder blocks, where the old vector was; the other way
    round, the new vector's slot has no factors. ``keeps_factors=False``: a pipeline stage
    with decoder blocks and no LM head."""
    bank = SlotBank(2, 16, reserve_rank=2)
    bank.keeps_factors = keeps_factors
    layers = LayerVectors([0], 1, 2, 16, max_tokens=4, device=torch.device("cpu"))
    bank.layers = layers
    bank.put(1, 3, "x", make_vector_steer({0: torch.linspace(-1, 1, 16)}, "x"))
    lm = random_steer(16, 2, "x", seed=0)
    bank.put(1, 4, "x", lm)  # the same slot, another kind, never dropped
    assert bank.layer_slots() == []
    slots = RequestSlots(2)
    slots.ensure(2, torch.device("cpu"))
    row, problems = bank.coef_row({"x": (1, 4)}, {"x": 3.0})
    assert not problems
    slots.set(0, np.asarray(row, dtype=np.float32), None, bank)
    slots.flush()
    TokenCoefs(layers, slots).build(np.array([0, 1]), np.array([2, 1]), None)
    h = torch.randn(3, 16)
    assert torch.equal(add_to_block_output(h, layers.token_coefs, layers.block_vectors(0)), h)
    assert not layers.vectors.any()
    if keeps_factors:
        assert int(bank.widths[1]) == 2
        bank.put(1, 5, "y", make_vector_steer({0: torch.ones(16)}, "y"))  # and back
        assert int(bank.widths[1]) == 0 and not bank.p1.any() and bank.layer_slots() == [1]


def test_unregistered_kinds_fall_back_to_lm_steer_s_reader(tmp_path):
    path = tmp_path / f"b{bias_kind.SUFFIX}"
    bias_kind.save(path, "b", 1, [1.0, 2.0])
    assert kinds.kind_of_file(path).name == "lm-steer"  # whose reader refuses it, with reasons
    with pytest.raises(Exception, match="refused"):
        kinds.read_any_metadata(path)


def test_the_op_in_a_16_bit_dtype_writes_the_strengths_and_keeps_plain_rows_bit_for_bit():
    """On CUDA the op runs in the model's 16-bit dtype: the step mapping writes the strengths
    as that dtype's bytes (here on the host, the same code path), unsteered tokens keep their
    bits, a steered token gets ``a * v`` within the dtype's rounding."""
    from vllm_steer.integrations.worker.step_mapping import op_dtype

    assert op_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32
    assert op_dtype(torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    assert op_dtype(torch.device("cuda"), torch.float32) == torch.float32
    steer = make_vector_steer({0: torch.linspace(-1, 1, 16)}, "v")
    bank = SlotBank(2, 16, reserve_rank=2)
    layers = LayerVectors([0], 1, 2, 16, max_tokens=4, device=torch.device("cpu"),
                          dtype=torch.bfloat16)
    bank.layers = layers
    bank.put(1, 3, "v", steer)
    slots = RequestSlots(2)
    slots.ensure(2, torch.device("cpu"))
    row, _ = bank.coef_row({"v": (1, 3)}, {"v": 0.75})
    slots.set(0, np.asarray(row, dtype=np.float32), None, bank)
    slots.flush()
    TokenCoefs(layers, slots).build(np.array([0, 1]), np.array([2, 1]), None)
    assert layers.token_coefs.dtype == torch.bfloat16
    assert layers.token_coefs[:3, 1].tolist() == [0.75, 0.75, 0.0]
    h = torch.randn(3, 16).to(torch.bfloat16)
    out = add_to_block_output(h, layers.token_coefs, layers.block_vectors(0))
    assert torch.equal(out[2], h[2])
    want = h[:2].float() + 0.75 * torch.linspace(-1, 1, 16)
    assert torch.allclose(out[:2].float(), want, atol=2e-2)


def test_a_window_on_an_lm_steer_maps_no_token_rows_and_one_on_a_vector_does(monkeypatch):
    """The decoder blocks' token rows are computed per token only when a window is on a vector
    steer: a step whose only window is an LM-Steer's (at the head) writes nothing here and
    computes no per-token row; a vector's window whose strength is 0 but whose base is not
    still gives the prompt tokens its base."""
    from vllm_steer.request import Window

    bank = SlotBank(2, 16, reserve_rank=2)
    layers = LayerVectors([0], 1, 2, 16, max_tokens=8, device=torch.device("cpu"))
    bank.layers = layers
    bank.put(0, 1, "lm", random_steer(16, 2, "lm", seed=0))
    v = torch.linspace(-1, 1, 16)
    bank.put(1, 2, "v", make_vector_steer({0: v}, "v"))
    slots = RequestSlots(2)
    slots.ensure(2, torch.device("cpu"))
    row, problems = bank.coef_row({"lm": (0, 1)}, {"lm": 3.0})
    assert not problems
    slots.set(0, np.asarray(row, dtype=np.float32), {0: Window(3.0, start=1)}, bank)
    slots.flush()
    mapping = TokenCoefs(layers, slots)
    computed = []
    real = mapping._windowed_rows
    monkeypatch.setattr(mapping, "_windowed_rows", lambda *a: computed.append(1) or real(*a))
    mapping.build(np.array([0, 1]), np.array([3, 1]), np.array([-2, 0]))
    assert computed == [] and mapping.steered_steps == 0 and not layers.token_coefs.any()
    # a vector window: strength 0 inside, base 2 outside it (the prompt tokens among them)
    vrow, problems = bank.coef_row({"v": (1, 2)}, {"v": 0.0})
    assert not problems
    slots.set(1, np.asarray(vrow, dtype=np.float32), {1: Window(0.0, start=0, base=2.0)}, bank)
    slots.flush()
    mapping.build(np.array([1]), np.array([3]), np.array([-2]))  # 2 prompt tokens, then t=0
    assert computed == [1] and mapping.steered_steps == 1
    h = torch.zeros(3, 16)
    out = add_to_block_output(h, layers.token_coefs, layers.block_vectors(0))
    torch.testing.assert_close(out, torch.stack([2 * v, 2 * v, 0 * v]))


def test_a_refused_load_into_a_vector_steers_slot_leaves_the_vector_steering():
    """An LM-Steer refused by the bank (its hidden size, its rank over the reservation) in a
    slot that holds a vector steer changes nothing: the vector steer, still bound there,
    keeps steering its requests."""
    bank = SlotBank(2, 16, reserve_rank=2)
    bank.max_rank = 2
    layers = LayerVectors([0], 1, 2, 16, max_tokens=4, device=torch.device("cpu"))
    bank.layers = layers
    v = torch.linspace(-1, 1, 16)
    bank.put(1, 3, "x", make_vector_steer({0: v}, "x"))
    for bad, fragment in ((random_steer(32, 2, "y"), "hidden size 32"),
                          (random_steer(16, 4, "y"), "rank 4 over --max-steer-rank=2")):
        with pytest.raises(ValueError, match=fragment):
            bank.put(1, 4, "y", bad)
        assert bank.layer_slots() == [1] and bank.load_ids[1] == 3
        assert torch.equal(layers.block_vectors(0)[1], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_kinds_reservation_is_what_its_store_allocates_per_slot(dtype):
    """:attr:`SteerKind.reserve_bytes` of the shipped kinds, per bank slot and dtype, is what
    the bank (an LM-Steer slot: both factors of the steer and of its domain component) and
    the vector bank (a vector slot: a vector per block of the worker) allocate."""
    cap, rank, hidden, blocks = 5, 8, 48, [1, 2, 3]
    bank = SlotBank(cap, hidden, dtype=dtype, reserve_rank=rank)
    factors = sum(t.numel() * t.element_size() for t in (bank.p1, bank.p2))
    assert cap * kinds.LM_STEER.reserve_bytes(hidden, 4, rank, dtype) == factors
    layers = LayerVectors(blocks, 4, cap, hidden, max_tokens=16, device=torch.device("cpu"),
                          dtype=dtype)
    assert cap * kinds.VECTOR.reserve_bytes(hidden, len(blocks), rank, str(dtype)) == \
        layers.vectors.numel() * layers.vectors.element_size()
