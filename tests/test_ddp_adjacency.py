"""Which adjacency a distributed-discrete-Gaussian event of one device may claim.

:func:`edge_sdk.ddp.event` refuses device-level add/remove: an absent device takes its noise
share with it, so the neighbouring sums carry n and n - 1 shares, while KLS 2021 Theorem 1
compares x + Z with x' + Z for the same Z. The attacker-style test computes, for a small
case, the exact Renyi divergence and a lower bound on the hockey-stick delta of

* add/remove: S_n + v (device present) against S_{n-1} (absent), and
* zero-out: S_n + v against S_n (device present with a null update),

with S_n the sum of n discrete Gaussian shares (pmf by convolution, as in the privacy
review's ``ddg_exact.py``), and checks that the add/remove pair breaks what an add/remove
label on the code's numbers would claim while the zero-out claim dominates the exact value.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from scipy.special import logsumexp

from edge_sdk import ddp
from edge_sdk.ddp import DEVICE_ADD_REMOVE_REFUSAL, DistributedDP, padded_dim
from edge_sdk.privacy import DistributedDiscreteGaussian, DistributedSkellam, discrete_epsilon
from edge_sdk.privacy.rdp import rdp_of

# Orders where the truncated grids below lose nothing visible: the zero-out integrand
# P^a Q^(1-a) is centred a * v_max <= 8 * 3 = 24 integer steps from 0, far inside the grid.
ORDERS = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)

CONFIGS = (
    DistributedDP(clip=1.0, gamma=0.5, noise="discrete_gaussian", sigma=1.0, bits=20),
    DistributedDP(clip=1.0, gamma=0.5, noise="skellam", mu=0.5, bits=20),
)


# --------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("cfg", CONFIGS, ids=["ddg", "skellam"])
def test_device_level_add_remove_is_refused_with_the_reason(cfg: DistributedDP) -> None:
    with pytest.raises(ValueError) as err:
        ddp.event(cfg, 10, 8, adjacency="add_remove")
    msg = str(err.value)
    assert msg.startswith("adjacency='add_remove': ")
    for why in ("takes its noise share with it", "n and n-1 shares", "KLS 2021 Theorem 1",
                "true delta >= 1.2e-2", "adjacency='zero_out'", "'substitution'",
                "sensitivities doubled"):
        assert why in msg
    assert msg.endswith(DEVICE_ADD_REMOVE_REFUSAL)
    with pytest.raises(TypeError, match="adjacency"):
        ddp.event(cfg, 10, 8)  # type: ignore[call-arg]  # no default: the caller must say
    with pytest.raises(ValueError, match="must be 'zero_out' or 'substitution'.*'zero-out'"):
        ddp.event(cfg, 10, 8, adjacency="zero-out")
    for adjacency in ("zero_out", "substitution"):
        ev = ddp.event(cfg, 10, 8, adjacency=adjacency)
        assert isinstance(ev, DistributedDiscreteGaussian | DistributedSkellam)
        assert ev.adjacency == adjacency


# ------------------------------------------------------------------- exact divergences


def _sum_pmf(sigma: float, n: int, half: int) -> np.ndarray:
    """pmf of the sum of n N_Z(0, sigma^2) shares on [-half, half] (direct convolution of
    shares truncated at 40 sigma, whose dropped mass is below 1e-300)."""
    t = int(math.ceil(40 * sigma)) + 1
    y = np.arange(-t, t + 1, dtype=np.float64)
    lw = -y * y / (2 * sigma * sigma)
    one = np.exp(lw - logsumexp(lw))
    out = np.array([1.0])
    for _ in range(n):
        out = np.convolve(out, one)
    c = len(out) // 2
    out = out[c - half: c + half + 1]
    return out / out.sum()


def _shift(p: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(p)
    out[k:] = p[: len(p) - k]
    return out


def _renyi(p: np.ndarray, q: np.ndarray, a: float) -> float:
    """D_a(P || Q) in nats over the grid. Points where either pmf underflowed to 0 (beyond
    ~38 std) are left out: that only lowers the value (every term is >= 0), and at these
    orders their terms are below e^-200, invisible next to the sum (~1)."""
    m = (p > 0) & (q > 0)
    return float(logsumexp(a * np.log(p[m]) + (1 - a) * np.log(q[m]))) / (a - 1)


def _pld(p: np.ndarray, q: np.ndarray) -> dp_pld.PrivacyLossDistribution:
    """The PLD of P against Q, optimistic: its delta is a LOWER bound on the true delta."""
    lp = {i: math.log(x) for i, x in enumerate(p) if x > 0}
    lq = {i: math.log(x) for i, x in enumerate(q) if x > 0}
    return dp_pld.from_two_probability_mass_functions(
        lq, lp, pessimistic_estimate=False, value_discretization_interval=1e-4)


def test_device_add_remove_exceeds_the_claim_zero_out_does_not() -> None:
    # One device's event as the code builds it: d' = 8, D2 = the rounded bound at
    # clip/gamma = 2, n = 3 honest shares of sigma = 1 (tau > 0: the sums are not Gaussian).
    cfg, n, dim = CONFIGS[0], 3, 8
    zero_out = ddp.event(cfg, n, dim, adjacency="zero_out")
    assert isinstance(zero_out, DistributedDiscreteGaussian)
    d = padded_dim(dim)
    # What the code emitted before the refusal: the same numbers labelled add/remove.
    add_remove = dataclasses.replace(zero_out, adjacency="add_remove")
    claim = rdp_of(add_remove, ORDERS)
    np.testing.assert_array_equal(claim, rdp_of(zero_out, ORDERS))
    k = math.floor(zero_out.l2_sensitivity)  # the attacker's shift: v = k e_1, ||v|| <= D2
    assert k >= 3

    half = int(math.ceil(40 * math.sqrt(n) * cfg.sigma)) + k
    s_n, s_n1 = _sum_pmf(cfg.sigma, n, half), _sum_pmf(cfg.sigma, n - 1, half)
    moved = _shift(s_n, k)
    # Coordinates are independent: the divergence of the vectors is the sum over them.
    exact_zero_out = np.array([_renyi(moved, s_n, a) for a in ORDERS])
    exact_add_remove = np.array(
        [_renyi(moved, s_n1, a) + (d - 1) * _renyi(s_n, s_n1, a) for a in ORDERS])
    print(f"\nd'={d}, n={n}, sigma={cfg.sigma}, D2={zero_out.l2_sensitivity:.4f}, shift {k}:"
          f"\n claim   {np.round(claim, 3)}\n zeroout {np.round(exact_zero_out, 3)}"
          f"\n add/rem {np.round(exact_add_remove, 3)}")
    # Zero-out: KLS Theorem 1 holds (the target's share is in both sums).
    assert np.all(exact_zero_out <= claim)
    assert np.all(exact_zero_out >= 0.5 * claim)  # and is no vacuous bound here
    # Add/remove: the exact divergence is far above the claim at every order.
    assert np.all(exact_add_remove > 1.5 * claim)

    # The same in (eps, delta): at the claimed eps for delta = 1e-5, the add/remove pair's
    # true delta (an optimistic PLD: a lower bound) is far above 1e-5; the zero-out
    # pair's delta (pessimistic PLD: an upper bound) is below it.
    eps = discrete_epsilon(zero_out, 1e-5)
    absent = _pld(moved, s_n1).compose(_pld(s_n, s_n1).self_compose(d - 1))
    delta_add_remove = absent.get_delta_for_epsilon(eps)
    lp = {i: math.log(x) for i, x in enumerate(moved) if x > 0}
    lq = {i: math.log(x) for i, x in enumerate(s_n) if x > 0}
    present = dp_pld.from_two_probability_mass_functions(lq, lp, pessimistic_estimate=True)
    delta_zero_out = present.get_delta_for_epsilon(eps)
    print(f" claimed eps {eps:.3f} at 1e-5: add/remove delta >= {delta_add_remove:.3g}, "
          f"zero-out delta <= {delta_zero_out:.3g}")
    assert delta_add_remove > 5e-3  # 500 times the claimed delta (it is 1.05e-2)
    assert delta_zero_out <= 1e-5
