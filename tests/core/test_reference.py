"""The reference math: factor form equals the paper's formula; linear and composable."""

import torch

from vllm_steer.reference import steer_dense_reference, steer_reference, steered_logits_reference


def _bank(d=48, ranks=(4, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    p1 = [torch.randn(d, r, generator=g, dtype=torch.float64) for r in ranks]
    p2 = [torch.randn(d, r, generator=g, dtype=torch.float64) for r in ranks]
    offs = [0]
    for r in ranks:
        offs.append(offs[-1] + r)
    return torch.cat(p1, 1), torch.cat(p2, 1), offs, [b @ a.T for a, b in zip(p1, p2, strict=True)]


def test_factor_form_equals_dense_paper_formula():
    p1, p2, offs, mats = _bank()
    h = torch.randn(5, 48, dtype=torch.float64)
    coefs = torch.tensor([[5e-3, 0], [0, -3e-3], [1e-3, 2e-3], [0, 0], [4e-2, -1e-2]])
    out = steer_reference(h, p1.double(), p2.double(), offs, coefs)
    dense = steer_dense_reference(h, [m.double() for m in mats], coefs)
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10)


def test_zero_rows_are_bit_identical_and_dtype_kept():
    p1, p2, offs, _ = _bank()
    p1, p2 = p1.bfloat16(), p2.bfloat16()
    h = torch.randn(3, 48, dtype=torch.bfloat16)
    coefs = torch.tensor([[0.0, 0.0], [1e-2, 0.0], [0.0, 0.0]])
    out = steer_reference(h, p1, p2, offs, coefs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], h[0]) and torch.equal(out[2], h[2]) and not torch.equal(out[1], h[1])


def test_linearity_and_composition():
    p1, p2, offs, _ = _bank()
    h = torch.randn(4, 48, dtype=torch.float64)
    a = steer_reference(h, p1.double(), p2.double(), offs, torch.tensor([[5e-3, 0.0]] * 4))
    # strength 5 on W == strength 1 on 5W
    p2_scaled = p2.double().clone()
    p2_scaled[:, :4] *= 5
    b = steer_reference(h, p1.double(), p2_scaled, offs, torch.tensor([[1e-3, 0.0]] * 4))
    torch.testing.assert_close(a, b)
    # {a: 2, b: 3} == one steer 2Wa + 3Wb (dense)
    both = steer_reference(h, p1.double(), p2.double(), offs, torch.tensor([[2e-3, 3e-3]] * 4))
    _, _, _, mats = _bank()
    merged = steer_dense_reference(h, [2 * mats[0].double() + 3 * mats[1].double()],
                                   torch.tensor([[1e-3]] * 4))
    torch.testing.assert_close(both, merged)


def test_steered_logits_shift_towards_the_steer():
    p1, p2, offs, _ = _bank(d=16, ranks=(16,))
    p1, p2 = p1.float(), p2.float()
    h = torch.randn(2, 16)
    E = torch.randn(100, 16)
    plain = steered_logits_reference(h, E, p1, p2, offs, torch.zeros(2, 1))
    torch.testing.assert_close(plain, h @ E.T)
    steered = steered_logits_reference(h, E, p1, p2, offs, torch.full((2, 1), 5e-3))
    assert (steered - plain).abs().max() > 1e-3


def test_steer_coefficients_follow_the_paper_and_the_domain_rule():
    from vllm_steer.reference import steer_coefficients

    # strength s of a steer with epsilon eps is s * eps (the paper's 5 eps0 is strength 5)
    assert steer_coefficients(5, 1e-3) == (5 * 1e-3, 0.0)
    assert steer_coefficients(-2.5, 2e-3) == (-2.5 * 2e-3, 0.0)
    # a served domain component comes with the steer at domain_strength * eps, sign-free
    assert steer_coefficients(-3, 1e-3, 1.0) == (-3 * 1e-3, 1e-3)
    # an unsteered request pays nothing, not even the domain component
    assert steer_coefficients(0, 1e-3, 1.0) == (0.0, 0.0)


def test_steer_coefficient_arrays_equal_the_scalar_rule_element_by_element():
    import numpy as np

    from vllm_steer.reference import steer_coefficient_arrays, steer_coefficients

    strengths = np.array([[5.0, 0.0, -2.5], [0.0, 1.0, -3.0]])
    eps = np.array([1e-3, 2e-3, 1e-3])
    domain_strength = [1.0, None, 0.5]  # None: served without the domain component
    dom = np.array([0.0 if d is None else d * e for d, e in zip(domain_strength, eps,
                                                                      strict=True)])
    steer, domain = steer_coefficient_arrays(strengths, eps, dom)
    for (r, j), s in np.ndenumerate(strengths):
        assert (steer[r, j], domain[r, j]) == steer_coefficients(s, eps[j], domain_strength[j])


def test_window_strengths_vectorised_equal_the_window_rule_token_by_token():
    """The vectorised schedule (runtime side) against the scalar rule written out here."""
    import numpy as np

    from vllm_steer.request import Window
    from vllm_steer.reference import window_strengths

    def by_hand(w, t):
        if t < 0 or t < w.start or (w.end is not None and t >= w.end):
            return w.base
        frac = 1.0 if w.ramp == 0 else min(1.0, (t - w.start + 1) / w.ramp)
        return w.base + frac * (w.strength - w.base)

    windows = [Window(5), Window(5, start=3, end=7), Window(-4, ramp=4), Window(6, 2, 10, 3, 2),
               Window(2, end=0)]
    ts = np.arange(-1, 12)
    for w in windows:
        got = window_strengths(w.strength, w.base, w.start, -1 if w.end is None else w.end,
                               w.ramp, ts)
        assert got.tolist() == [by_hand(w, int(t)) for t in ts], w
        assert [w.at(int(t)) for t in ts if t >= 0] == [by_hand(w, int(t)) for t in ts if t >= 0]
    assert window_strengths(5, 0, 0, -1, 4, [0, 1, 2, 3, 9]).tolist() == [1.25, 2.5, 3.75, 5, 5]
