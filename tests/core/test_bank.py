"""The steer bank: request strengths to coefficient rows, domain columns, apply."""

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.bank import SteerBank
from vllm_steer.format import make_steer
from vllm_steer.reference import steer_dense_reference


def test_coef_rows_use_each_steers_epsilon_and_names():
    a = random_steer(32, 4, "a")
    b = random_steer(32, 6, "b", seed=1)
    b.metadata.epsilon = 2e-3
    bank = SteerBank({"a": a, "b": b})
    assert bank.rank_offsets == [0, 4, 10]
    assert bank.coef_row({"b": 5}) == [0.0, 5 * 2e-3]
    assert bank.coef_row({}) == [0.0, 0.0]


def test_domain_column_only_when_steer_is_used():
    g = torch.Generator().manual_seed(0)
    s = make_steer(torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g), "s",
                   domain_p1=torch.randn(32, 2, generator=g),
                   domain_p2=torch.randn(32, 2, generator=g), domain="with_steer",
                   domain_strength=1.0)
    bank = SteerBank({"s": s})
    assert bank.num_columns == 2
    assert bank.coef_row({"s": 5}) == [5e-3, 1e-3] and bank.coef_row({"s": 0}) == [0.0, 0.0]


def test_apply_matches_dense_formula():
    a, b = random_steer(32, 4, "a"), random_steer(32, 32, "b", seed=2)
    bank = SteerBank({"a": a, "b": b}, dtype=torch.float64)
    h = torch.randn(3, 32, dtype=torch.float64)
    coefs = torch.tensor([bank.coef_row({"a": 5}), bank.coef_row({"a": 2, "b": -3}),
                          bank.coef_row({})], dtype=torch.float32)
    out = bank.apply(h, coefs, backend="reference")
    dense = steer_dense_reference(h, [a.matrix().double(), b.matrix().double()], coefs)
    torch.testing.assert_close(out, dense)


def test_plan_key_reuses_the_plan_until_the_key_changes():
    bank = SteerBank({"a": random_steer(32, 4, "a"), "b": random_steer(32, 8, "b", seed=1)})
    h = torch.randn(4, 32)
    c1 = torch.tensor([bank.coef_row({"a": 5})] * 2 + [bank.coef_row({"b": -3})] * 2)
    c2 = torch.tensor([bank.coef_row({"b": 5})] * 4)
    want1 = bank.apply(h, c1, backend="torch")
    want2 = bank.apply(h, c2, backend="torch")
    assert not torch.equal(want1, want2)
    assert torch.equal(bank.apply(h, c1, backend="torch", plan_key=1), want1)
    plan = bank._plan
    assert torch.equal(bank.apply(h * 2, c1, backend="torch", plan_key=1),
                       bank.apply(h * 2, c1, backend="torch"))
    assert bank._plan is plan  # same key: not re-planned
    # a new key (the runtime bumps its version when the slots' coefficients change)
    assert torch.equal(bank.apply(h, c2, backend="torch", plan_key=2), want2)


def test_slot_bank_keeps_columns_fixed_while_steers_come_and_go():
    from vllm_steer.bank import SlotBank

    a, b = random_steer(32, 4, "a"), random_steer(32, 6, "b", seed=1)
    bank = SlotBank(3, 32)
    bank.put(1, 7, "a", a)
    row_a, problems = bank.coef_row({"a": (1, 7)}, {"a": 5})
    assert problems == [] and row_a == [0.0, 5e-3, 0.0, 0.0, 0.0, 0.0]
    h = torch.randn(2, 32)
    coefs = torch.tensor([row_a, [0.0] * 6])
    out1 = bank.apply(h, coefs, backend="torch", plan_key=1)
    bank.put(0, 8, "b", b)  # loading another steer: a's column and result do not move
    out2 = bank.apply(h, coefs, backend="torch", plan_key=1)  # same key, new bank version
    want = steer_dense_reference(h, [a.matrix()], torch.tensor([[5e-3], [0.0]]))
    torch.testing.assert_close(out1, want)
    torch.testing.assert_close(out2, want)
    assert torch.equal(out2[1], h[1])
    # a request bound to an older generation of slot 1 is never steered by what is there now
    bank.put(1, 9, "a", b)
    row, problems = bank.coef_row({"a": (1, 7)}, {"a": 5})
    assert row == [0.0] * 6 and "load 7" in problems[0]
    bank.drop(1)
    assert bank.rank_offsets == [0, 6, 12, 18, 24, 30, 36]  # grew to rank 6 per column; kept
    assert torch.equal(bank.p1[:, 6:12], torch.zeros(32, 6))  # slot 1 emptied in place
    assert bank.widths.tolist() == [6, 0, 0, 0, 0, 0]  # each column's steer rank, in place


# ---- the slot bank against an independent model, over generated sequences ------------------
_H, _CAP, _RESERVE, _BLOCKS = 8, 3, 3, 3


def _slot_bank_ops():
    from hypothesis import strategies as st

    lm = st.tuples(st.just("lm"), st.integers(0, _CAP - 1), st.integers(1, _RESERVE),
                   st.sampled_from(["none", "with_steer"]), st.integers(0, 10**6))
    vec = st.tuples(st.just("vector"), st.integers(0, _CAP - 1),
                    st.sets(st.integers(0, _BLOCKS - 1), min_size=1), st.integers(0, 10**6))
    drop = st.tuples(st.just("drop"), st.integers(0, _CAP - 1))
    return st.lists(st.one_of(lm, vec, drop), min_size=1, max_size=12)


def _expected_columns(steer, keeps_factors):
    """Plain torch: the ``[hidden, reserve]`` blocks of a slot's steer and domain columns."""
    z = torch.zeros(_H, _RESERVE)
    if steer is None or not hasattr(steer, "p1") or not keeps_factors:
        return (z, z), (z, z)
    def pad(t):
        out = z.clone()
        out[:, :t.shape[1]] = t
        return out
    dom = steer.metadata.domain == "with_steer"
    return ((pad(steer.p1), pad(steer.p2)),
            (pad(steer.domain_p1), pad(steer.domain_p2)) if dom else (z, z))


@pytest.mark.parametrize("keeps_factors", [True, False])
def test_every_slot_holds_exactly_what_its_last_put_left(keeps_factors):
    """Generated sequences of puts (LM-Steer, with or without a domain component, and vector
    steers, into any slot, whatever it held: a name loaded again, an eviction, a reaped slot)
    and drops: after each, every slot's factor columns, domain columns, vectors in the decoder
    layers' bank and kind are those of the last steer put there (zeros for an emptied slot),
    by an independent model in plain torch. ``keeps_factors=False``: a pipeline stage with
    decoder blocks and no LM head."""
    from hypothesis import HealthCheck, given, settings

    from vllm_steer.bank import SlotBank
    from vllm_steer.integrations.worker.step_mapping import LayerVectors
    from vllm_steer.vectors import make_vector_steer

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_slot_bank_ops())
    def run(ops):
        bank = SlotBank(_CAP, _H, reserve_rank=_RESERVE, max_rank=_RESERVE)
        bank.keeps_factors = keeps_factors
        bank.layers = LayerVectors(list(range(_BLOCKS)), _BLOCKS, _CAP, _H, max_tokens=4,
                                   device=torch.device("cpu"))
        model: dict[int, object] = {}
        for n, op in enumerate(ops):
            g = torch.Generator().manual_seed(op[-1] if op[0] != "drop" else 0)
            if op[0] == "lm":
                _, slot, rank, domain, _ = op
                extra = {}
                if domain == "with_steer":
                    extra = dict(domain_p1=torch.randn(_H, 1, generator=g),
                                 domain_p2=torch.randn(_H, 1, generator=g), domain=domain)
                steer = make_steer(torch.randn(_H, rank, generator=g),
                                   torch.randn(_H, rank, generator=g), f"s{n}", **extra)
                bank.put(slot, n + 1, f"s{n}", steer)
                model[slot] = steer
            elif op[0] == "vector":
                _, slot, blocks, _ = op
                steer = make_vector_steer({k: torch.randn(_H, generator=g) for k in blocks},
                                          f"s{n}")
                bank.put(slot, n + 1, f"s{n}", steer)
                model[slot] = steer
            else:
                bank.drop(op[1])
                model.pop(op[1], None)
            r = bank.rank
            for j in range(_CAP):
                steer = model.get(j)
                (p1, p2), (d1, d2) = _expected_columns(steer, keeps_factors)
                if r:
                    assert torch.equal(bank.p1[:, j * r:(j + 1) * r], p1[:, :r]), (ops, n, j)
                    assert torch.equal(bank.p2[:, j * r:(j + 1) * r], p2[:, :r]), (ops, n, j)
                    k = _CAP + j
                    assert torch.equal(bank.p1[:, k * r:(k + 1) * r], d1[:, :r]), (ops, n, j)
                    assert torch.equal(bank.p2[:, k * r:(k + 1) * r], d2[:, :r]), (ops, n, j)
                want = torch.zeros(_BLOCKS, _H)
                if steer is not None and hasattr(steer, "directions"):
                    for b, v in steer.directions.items():
                        want[b] = v
                assert torch.equal(bank.layers.vectors[:, j, :], want), (ops, n, j)
            assert bank.layer_slots() == sorted(j for j, s in model.items()
                                                if hasattr(s, "directions")), (ops, n)

    run()
