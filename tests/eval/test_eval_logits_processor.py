"""The soft blacklist's V1 logits processor, driven by hand-made batch updates (no engine)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_steer.eval.logits_processor import (CONFIG_KEY, SoftBlacklistLogitsProcessor,
                                              engine_config, request_strengths)
from vllm_steer.eval.soft_blacklist import SoftBlacklist, save_soft_blacklist

V = 6


@pytest.fixture
def proc(tmp_path):
    a = SoftBlacklist(torch.tensor([1000.0, 0, 0, 0, 0, -1000.0]), "a")  # eps 1e-3
    b = SoftBlacklist(torch.tensor([0.0, 500.0, 0, 0, 0, 0]), "b")
    paths = {}
    for sb in (a, b):
        paths[sb.name] = str(tmp_path / f"{sb.name}.safetensors")
        save_soft_blacklist(paths[sb.name], sb)
    cfg = SimpleNamespace(additional_config=engine_config(paths),
                          scheduler_config=SimpleNamespace(max_num_seqs=4))
    return SoftBlacklistLogitsProcessor(cfg, torch.device("cpu"), False)


def params(**strengths):
    return SimpleNamespace(extra_args={"soft_blacklist": strengths} if strengths else None)


def update(batch_size, added=(), removed=(), moved=()):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=batch_size, removed=list(removed),
                       added=[(i, p, None, []) for i, p in added], moved=list(moved))


def test_rows_get_their_own_offsets_and_unsteered_rows_are_untouched(proc):
    assert not proc.is_argmax_invariant()
    proc.update_state(update(3, added=[(0, params(a=2)), (1, params()), (2, params(a=1, b=2))]))
    out = proc.apply(torch.zeros(3, V))
    assert out[0].tolist() == [2.0, 0, 0, 0, 0, -2.0]
    assert out[1].tolist() == [0.0] * V
    assert out[2].tolist() == [1.0, 1.0, 0, 0, 0, -1.0]


def test_moves_swaps_and_removals_carry_the_state(proc):
    from vllm.v1.sample.logits_processor import MoveDirectionality as M

    proc.update_state(update(2, added=[(0, params(a=1)), (1, params(b=2))]))
    proc.update_state(update(2, moved=[(0, 1, M.SWAP)]))
    out = proc.apply(torch.zeros(2, V))
    assert out[0, 1] == 1.0 and out[1, 0] == 1.0
    proc.update_state(update(1, removed=[0], moved=[(1, 0, M.UNIDIRECTIONAL)]))
    out = proc.apply(torch.zeros(1, V))
    assert out[0].tolist() == [1.0, 0, 0, 0, 0, -1.0]
    proc.update_state(update(0, removed=[0]))
    assert proc.slots == set()
    x = torch.randn(2, V)
    assert proc.apply(x) is x  # nothing active: no work at all


def test_a_reused_slot_is_reset(proc):
    proc.update_state(update(1, added=[(0, params(a=3))]))
    proc.update_state(update(1, added=[(0, params())]))  # slot reused by an unsteered request
    assert proc.apply(torch.zeros(1, V)).abs().sum() == 0


def test_request_parsing_errors_name_the_field():
    assert request_strengths({"soft_blacklist": {"a": 2, "b": 0}}) == {"a": 2.0}
    assert request_strengths(None) == {}
    with pytest.raises(ValueError, match=r"soft_blacklist.*expected \{name: strength\}"):
        SoftBlacklistLogitsProcessor.validate_params(SimpleNamespace(
            extra_args={"soft_blacklist": 3}))
    with pytest.raises(ValueError, match="finite number, got 'x'"):
        request_strengths({"soft_blacklist": {"a": "x"}})


def test_engine_config_entry():
    assert engine_config({"a": "a.safetensors"}) == {
        CONFIG_KEY: {"soft_blacklists": {"a": "a.safetensors"}}}
