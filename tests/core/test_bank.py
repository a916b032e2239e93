"""The steer bank: request strengths to coefficient rows, domain columns, apply."""

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
