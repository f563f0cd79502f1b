"""Distributed DP in the integers (edge_sdk.ddp): issue 5, Must-show 3.

The decoded sum of n devices' encodings, summed mod 2^b in numpy uint64 as secure
aggregation delivers it, must carry the noise the accountant assumes: measured over many
trials, the per-coordinate variance of (decoded - true sum) matches
gamma^2 (n Var(noise) + rounding variance) within a chi-square tolerance. Also: the
rounding bias stays within its bound, the exact discrete Gaussian sampler matches its pmf,
rotate/unrotate are inverses, centered decoding is exact without wrap-around, and
choose_bits is monotone and fails cleanly.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import scipy.linalg
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats
from scipy.special import logsumexp

from edge_sdk import ddp
from edge_sdk.ddp import (
    ConditionalRoundingFailed,
    DistributedDP,
    choose_bits,
    conditional_round,
    decode_sum,
    discrete_gaussian_variance,
    encode_device,
    event,
    noise_variance,
    padded_dim,
    rotate,
    rotation_signs,
    rounded_l2_bound,
    rounding_bias_bound,
    sample_discrete_gaussian,
    sample_discrete_laplace,
    sample_skellam,
    unrotate,
    wrap_probability_bound,
)
from edge_sdk.hazmat.ring import Ring
from edge_sdk.privacy import (
    DistributedDiscreteGaussian,
    DistributedSkellam,
    discrete_epsilon,
)

SEED = b"fedge-ddp-test-round-0001"
N_DEV, DIM, TRIALS = 10, 64, 2000
TAIL = 1e-6  # two-sided tail probability of each statistical check


def _clip(x: np.ndarray, c: float) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x * np.minimum(1.0, c / np.maximum(norms, 1e-300))


def _updates(rng: np.random.Generator) -> np.ndarray:
    x = rng.normal(size=(N_DEV, DIM)) * 0.15
    x[0] *= 10.0  # norm ~ 12: clipped
    x[1] = 0.0  # an all-zero update must not divide by zero
    return x


# ---------------------------------------------------------------------- rotation


def test_rotation_signs_golden_vector() -> None:
    signs = rotation_signs(bytes(range(32)), 64)
    packed = np.packbits((signs < 0).astype(np.uint8), bitorder="little").tobytes()
    assert packed.hex() == "118853443b02e920"
    assert rotation_signs(b"fedge-golden-seed-0001", 20).astype(int).tolist() == [
        -1,
        1,
        1,
        -1,
        -1,
        -1,
        -1,
        1,
        -1,
        -1,
        -1,
        1,
        1,
        -1,
        1,
        -1,
        1,
        -1,
        -1,
        1,
    ]


def test_rotation_signs_follow_the_documented_spec() -> None:
    seed = b"\x07" * 17
    key = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedge/ddp/rotation/v1"
    ).derive(seed)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(13))
    want = [-1.0 if (stream[i // 8] >> (i % 8)) & 1 else 1.0 for i in range(100)]
    assert rotation_signs(seed, 100).tolist() == want
    assert not rotation_signs(seed, 100).flags.writeable
    assert rotation_signs(b"\x08" * 17, 100).tolist() != want


def test_fwht_is_the_orthogonal_hadamard_matrix() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 8, 64):
        x = rng.normal(size=(3, n))
        h = scipy.linalg.hadamard(n) / math.sqrt(n)
        np.testing.assert_allclose(ddp._fwht(x), x @ h.T, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(
        np.float64, st.tuples(st.integers(1, 3), st.integers(1, 300)), elements=st.floats(-1e6, 1e6)
    ),
    seed=st.binary(min_size=16, max_size=40),
)
def test_rotate_unrotate_round_trip(x: np.ndarray, seed: bytes) -> None:
    d = x.shape[1]
    y = rotate(x, seed)
    assert y.shape == (x.shape[0], padded_dim(d))
    scale = 1.0 + np.abs(x).max()
    np.testing.assert_allclose(
        np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-12, atol=1e-12 * scale
    )
    np.testing.assert_allclose(unrotate(y, seed, d), x, rtol=0, atol=1e-11 * scale)
    np.testing.assert_allclose(unrotate(y[0], seed, d), x[0], rtol=0, atol=1e-11 * scale)


def test_rotation_flattens_a_spike() -> None:
    e = np.zeros(1000)
    e[3] = 1.0
    y = rotate(e, SEED)
    np.testing.assert_allclose(np.abs(y), 1 / math.sqrt(1024), rtol=1e-12)


def test_padded_dim() -> None:
    assert [padded_dim(d) for d in (1, 2, 3, 64, 65, 21840)] == [1, 2, 4, 64, 128, 32768]
    with pytest.raises(ValueError, match="d must be >= 1, got 0"):
        padded_dim(0)


# ------------------------------------------------------------------------- rounding


def test_rounded_l2_bound_by_hand() -> None:
    c, d, beta = 16.0, 64, math.exp(-0.5)
    assert rounded_l2_bound(c, d, beta) == pytest.approx(math.sqrt(256 + 16 + 1.0 * 20))
    assert rounded_l2_bound(c, d, 0.0) == 24.0
    assert rounded_l2_bound(0.0, 4, 1e-300) == 2.0  # the min picks c + sqrt(d)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\), got 1.0"):
        rounded_l2_bound(c, d, 1.0)


def test_conditional_round_meets_the_bound_and_kls_failure_rate() -> None:
    # All fractional parts 1/2 (the worst case): ||R||^2 ~ Binomial(64, 1/2) for y = 0.5.
    rng = np.random.default_rng(2)
    y = np.full((20_000, 64), 0.5)
    for beta in (0.01, 0.3, 0.9):
        bound = rounded_l2_bound(4.0, 64, beta)
        r = conditional_round(y, bound, rng)
        assert r.dtype == np.int64
        assert np.all(np.einsum("ij,ij->i", r, r) <= bound**2)
        fail = stats.binom.sf(math.floor(bound**2), 64, 0.5)
        assert fail <= beta  # KLS: one try fails with probability <= beta


def test_conditional_rounding_bias_within_its_bound() -> None:
    # beta = 0.9: ||R||^2 <= 35 kept (P ~ 0.82). The exact bias is binomial arithmetic.
    rng = np.random.default_rng(3)
    beta, trials = 0.9, 200_000
    bound = rounded_l2_bound(4.0, 64, beta)
    cut = math.floor(bound**2)
    k = np.arange(cut + 1)
    pmf = stats.binom.pmf(k, 64, 0.5)
    exact = (k * pmf).sum() / pmf.sum() / 64 - 0.5  # per-coordinate bias
    r = conditional_round(np.full((trials, 64), 0.5), bound, rng)
    measured = r.mean(axis=0) - 0.5
    tol = 5.5 * math.sqrt(0.25 / trials)
    np.testing.assert_allclose(measured, exact, atol=tol)
    norm = float(np.linalg.norm(measured))
    print(
        f"\nrounding bias (beta={beta}): measured |bias|={norm:.4f}, exact "
        f"{8 * abs(exact):.4f}, bound {rounding_bias_bound(64, beta):.3f}"
    )
    assert 8 * abs(exact) <= rounding_bias_bound(64, beta)
    assert norm <= rounding_bias_bound(64, beta)
    # Unconditional rounding (beta = 0) is unbiased, and the bound says so.
    assert rounding_bias_bound(64, 0.0) == 0.0
    y = np.linspace(-3.3, 7.9, 64)
    r0 = conditional_round(np.tile(y, (trials // 4, 1)), rounded_l2_bound(30, 64, 0.0), rng)
    np.testing.assert_allclose(r0.mean(axis=0), y, atol=5.5 * math.sqrt(0.25 / (trials // 4)))


def test_conditional_round_gives_up_cleanly() -> None:
    with pytest.raises(ConditionalRoundingFailed, match=r"2 of 3 rows still had L2 norm above"):
        conditional_round(
            np.array([[10.0, 0], [1.0, 0.0], [0, -9.5]]), 3.0, np.random.default_rng(0), max_tries=4
        )
    with pytest.raises(ValueError, match="y must be finite, got nan"):
        conditional_round(np.array([1.0, math.nan]), 3.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="too large for exact integer norms"):
        conditional_round(np.full(4, 2.0**40), 3.0, np.random.default_rng(0))
    assert conditional_round(np.zeros((0, 3)), 3.0, np.random.default_rng(0)).shape == (0, 3)


# ------------------------------------------------------------------------- samplers


def _chi_square_p(samples: np.ndarray, pmf) -> float:  # type: ignore[no-untyped-def]
    """Goodness of fit over the integers, bins with expected count >= 5 plus two tails."""
    n = samples.size
    lo, hi = int(samples.min()), int(samples.max())
    span = np.arange(lo - 200, hi + 201)
    p = pmf(span)
    p = p / p.sum()
    keep = p * n >= 5
    inner = span[keep]
    obs = np.array([np.count_nonzero(samples == v) for v in inner], dtype=np.float64)
    exp = p[keep] * n
    left, right = p[span < inner[0]].sum() * n, p[span > inner[-1]].sum() * n
    obs = np.concatenate(
        (obs, [np.count_nonzero(samples < inner[0]), np.count_nonzero(samples > inner[-1])])
    )
    exp = np.concatenate((exp, [left, right]))
    ok = exp > 0
    return float(stats.chisquare(obs[ok], exp[ok] * obs[ok].sum() / exp[ok].sum()).pvalue)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.7, 12.5])
def test_discrete_gaussian_sampler_matches_the_pmf(sigma: float) -> None:
    rng = np.random.default_rng(int(sigma * 100))
    y = sample_discrete_gaussian(sigma, (400, 500), rng)
    assert y.shape == (400, 500) and y.dtype == np.int64
    p = _chi_square_p(y.ravel(), lambda k: np.exp(-(k.astype(float) ** 2) / (2 * sigma**2)))
    assert p > TAIL
    # Power: the same test rejects the continuous-Gaussian-rounded alternative at sigma 0.3.
    if sigma == 0.3:
        alt = np.rint(rng.normal(0, sigma, 200_000)).astype(np.int64)
        assert _chi_square_p(alt, lambda k: np.exp(-(k.astype(float) ** 2) / 0.18)) < TAIL


@pytest.mark.parametrize("t", [1, 3, 40])
def test_discrete_laplace_sampler_matches_the_pmf(t: int) -> None:
    y = sample_discrete_laplace(t, 200_000, np.random.default_rng(t))
    assert _chi_square_p(y, lambda k: np.exp(-np.abs(k) / t)) > TAIL


@pytest.mark.parametrize("mu", [0.4, 6.0, 150.0])
def test_skellam_sampler_matches_the_pmf(mu: float) -> None:
    y = sample_skellam(mu, 200_000, np.random.default_rng(int(mu * 10)))
    assert _chi_square_p(y, lambda k: stats.skellam.pmf(k, mu, mu)) > TAIL


def test_exact_bernoulli_pieces() -> None:
    rng = np.random.default_rng(4)
    # The 64-bit tie continuation on its own: P(u < 1/3) and a probability below 2^-64.
    hits = sum(ddp._bernoulli_tail(1, 3, rng) for _ in range(20_000))
    assert abs(hits / 20_000 - 1 / 3) < 5.5 * math.sqrt(2 / 9 / 20_000)
    assert not any(ddp._bernoulli_tail(1, 1 << 70, rng) for _ in range(100))
    group = np.repeat(np.arange(4), 50_000)
    out = ddp._bernoulli([0, 1, 2, 3], 3, group, rng)
    rates = [out[group == g].mean() for g in range(4)]
    assert rates[0] == 0.0 and rates[3] == 1.0
    np.testing.assert_allclose(rates[1:3], [1 / 3, 2 / 3], atol=5.5 * math.sqrt(0.25 / 50_000))
    gam = [3, 10, 25]  # /10: exp(-0.3), exp(-1), exp(-2.5)
    out = ddp._bernoulli_exp_neg(gam, 10, np.repeat(np.arange(3), 100_000), rng)
    np.testing.assert_allclose(
        out.reshape(3, -1).mean(axis=1),
        np.exp(-np.array(gam) / 10),
        atol=5.5 * math.sqrt(0.25 / 100_000),
    )


def test_discrete_gaussian_variance_against_mpmath() -> None:
    for sigma in (0.3, 1.0, 5.0):
        two_s2 = 2 * mpmath.mpf(sigma) ** 2
        line = [-mpmath.inf, mpmath.inf]
        num = mpmath.nsum(lambda k, v=two_s2: k**2 * mpmath.exp(-(k**2) / v), line)
        den = mpmath.nsum(lambda k, v=two_s2: mpmath.exp(-(k**2) / v), line)
        assert discrete_gaussian_variance(sigma) == pytest.approx(float(num / den), rel=1e-13)
        assert discrete_gaussian_variance(sigma) <= sigma**2 * (1 + 1e-15)
    assert discrete_gaussian_variance(0.3) < 0.3**2 * 0.9  # visibly below for small sigma


# ------------------------------------------------------------- Must-show 3: variance


def _cfg(noise: str, beta: float, **kw: float) -> DistributedDP:
    gamma, c = 1.0 / 16.0, 1.0
    std = math.sqrt(2 * kw["mu"]) if noise == "skellam" else kw["sigma"]
    bits = choose_bits(N_DEV, DIM, c, gamma, std, 1e-6, noise=noise)  # type: ignore[arg-type]
    return DistributedDP(
        clip=c,
        gamma=gamma,
        noise=noise,
        bits=bits,
        beta=beta,  # type: ignore[arg-type]
        **kw,
    )


def _trials(cfg: DistributedDP, x: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(decoded sums, integer sums) for TRIALS rounds; the uint64 sums wrap like SecAgg's."""
    enc = encode_device(np.tile(x, (TRIALS, 1)), cfg, SEED, np.random.default_rng(seed))
    assert enc.dtype == np.uint64 and int(enc.max()) < cfg.modulus
    sums = enc.reshape(TRIALS, N_DEV, -1).sum(axis=1)
    return decode_sum(sums, cfg, SEED, DIM, N_DEV), Ring(bits=cfg.bits).to_signed(sums)


def _predicted_cov(cfg: DistributedDP, x: np.ndarray) -> np.ndarray:
    """Covariance of one trial's decoded error, model units, for unconditional rounding."""
    y = rotate(_clip(x, cfg.clip), SEED) / cfg.gamma
    f = y - np.floor(y)
    v = N_DEV * noise_variance(cfg) + (f * (1 - f)).sum(axis=0)  # independent coordinates
    u = unrotate(np.eye(y.shape[1]), SEED, DIM)  # row j: where coordinate j lands
    return cfg.gamma**2 * u.T @ (v[:, None] * u)


def _variance_check(err: np.ndarray, cov: np.ndarray, label: str) -> None:
    trials, d = err.shape
    mean_var = np.trace(cov) / d
    dof = trials * np.trace(cov) ** 2 / np.trace(cov @ cov)  # Satterthwaite
    lo, hi = stats.chi2.ppf([TAIL / 2, 1 - TAIL / 2], dof) / dof
    measured = float(np.mean(err**2))
    print(
        f"\n{label}: measured per-coordinate variance {measured:.6g}, predicted "
        f"{mean_var:.6g} (ratio {measured / mean_var:.4f}, chi-square band "
        f"[{lo:.4f}, {hi:.4f}], {dof:.0f} dof)"
    )
    assert lo <= measured / mean_var <= hi
    # Each coordinate on its own (2000 trials), Bonferroni over the d coordinates.
    lo1, hi1 = stats.chi2.ppf([TAIL / (2 * d), 1 - TAIL / (2 * d)], trials) / trials
    ratio = np.mean(err**2, axis=0) / np.diag(cov)
    assert np.all((lo1 <= ratio) & (ratio <= hi1)), (ratio.min(), ratio.max())


@pytest.mark.parametrize(
    ("noise", "kw"), [("discrete_gaussian", {"sigma": 1.5}), ("skellam", {"mu": 1.2})]
)
def test_decoded_sum_carries_the_accounted_noise(noise: str, kw: dict[str, float]) -> None:
    rng = np.random.default_rng(5)
    x = _updates(rng)
    truth = _clip(x, 1.0).sum(axis=0)
    cfg = _cfg(noise, 0.0, **kw)  # unconditional rounding: the prediction is exact
    decoded, ints = _trials(cfg, x, 6)
    err = decoded - truth
    cov = _predicted_cov(cfg, x)
    # Noise dominates, rounding is visible: leaving it out would fail the band.
    noise_part = cfg.gamma**2 * N_DEV * noise_variance(cfg)
    assert 0.05 < 1 - noise_part / (np.trace(cov) / DIM) < 0.2
    _variance_check(err, cov, f"{noise}, beta=0")
    # The same rounds in a 62-bit ring (same randomness) show no wrap happened.
    wide = DistributedDP(clip=cfg.clip, gamma=cfg.gamma, noise=cfg.noise, bits=62, beta=0.0, **kw)
    _, wide_ints = _trials(wide, x, 6)
    np.testing.assert_array_equal(ints, wide_ints)
    # The accountant's event for this configuration carries the same noise parameter.
    ev = event(cfg, N_DEV, DIM, adjacency="zero_out")
    if noise == "skellam":
        assert isinstance(ev, DistributedSkellam) and ev.variance == N_DEV * noise_variance(cfg)
    else:
        assert isinstance(ev, DistributedDiscreteGaussian) and ev.sigma == kw["sigma"]


def test_conditional_rounding_in_the_pipeline_variance_and_bias() -> None:
    rng = np.random.default_rng(7)
    x = _updates(rng)
    truth = _clip(x, 1.0).sum(axis=0)
    cfg = _cfg("discrete_gaussian", math.exp(-0.5), sigma=1.5)
    decoded, _ = _trials(cfg, x, 8)
    err = decoded - truth
    bias = err.mean(axis=0)
    cov = _predicted_cov(cfg, x)
    # Bias: n devices, each within rounding_bias_bound (integer scale) times gamma.
    bound = N_DEV * cfg.gamma * rounding_bias_bound(DIM, cfg.beta)
    slack = 6 * math.sqrt(np.trace(cov) / TRIALS)
    print(
        f"\nconditional rounding (beta=e^-1/2): |mean error| {np.linalg.norm(bias):.4f} "
        f"<= bound {bound:.3f} + sampling slack {slack:.3f}"
    )
    assert np.linalg.norm(bias) <= bound + slack
    _variance_check(err - bias, cov, "discrete_gaussian, beta=e^-1/2 (centered)")


# ------------------------------------------------------------ wrap-around, decoding


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(2, 62), data=st.data())
def test_centered_decode_is_exact_without_wrap(bits: int, data: st.DataObject) -> None:
    half = 1 << (bits - 1)
    total = data.draw(st.integers(-half, half - 1))
    parts = data.draw(st.lists(st.integers(-(1 << 62), 1 << 62), min_size=1, max_size=5))
    parts.append(total - sum(parts))
    residues = np.array([p % (1 << bits) for p in parts], dtype=np.uint64)
    assert int(Ring(bits=bits).to_signed(residues.sum(keepdims=True))[0]) == total
    wrapped = total + data.draw(st.sampled_from([-1, 1])) * (1 << bits)
    wrapped_u64 = np.array([wrapped % (1 << 64)], dtype=np.uint64)
    assert int(Ring(bits=bits).to_signed(wrapped_u64)[0]) == total


def test_too_few_bits_wrap_by_multiples_of_the_modulus() -> None:
    rng = np.random.default_rng(9)
    x = _updates(rng)
    good = _cfg("discrete_gaussian", 0.0, sigma=1.5)
    small = DistributedDP(
        clip=1.0,
        gamma=good.gamma,
        noise="discrete_gaussian",
        bits=good.bits - 4,
        sigma=1.5,
        beta=0.0,
    )
    _, ints_good = _trials(good, x, 10)
    _, ints_small = _trials(small, x, 10)
    diff = ints_good - ints_small
    assert np.any(diff != 0)  # wraps happen when the ring is too small...
    assert np.all(diff % small.modulus == 0)  # ...and only by multiples of 2^b
    assert wrap_probability_bound(N_DEV, DIM, 1.0, good.gamma, 1.5, good.bits) <= 1e-6


def test_encode_decode_single_device_and_zero_noise() -> None:
    rng = np.random.default_rng(11)
    x = rng.normal(size=100)
    cfg = DistributedDP(clip=2.0, gamma=1e-3, noise="discrete_gaussian", sigma=0.0, bits=40)
    enc = encode_device(x, cfg, SEED, rng)
    assert enc.shape == (128,) and enc.dtype == np.uint64
    ints = Ring(bits=cfg.bits).to_signed(enc)
    ev = event(cfg, 1, 100, adjacency="zero_out")
    assert float(np.linalg.norm(ints)) <= ev.l2_sensitivity
    assert float(np.abs(ints).sum()) <= ev.l1_sensitivity
    dec = decode_sum(enc, cfg, SEED, 100, 1)
    assert np.abs(dec - _clip(x, 2.0)).max() < 2e-3  # within rounding of gamma


def test_event_sensitivities() -> None:
    cfg = DistributedDP(clip=1.0, gamma=1 / 64, noise="skellam", mu=3.0, bits=30, beta=0.1)
    ev = event(cfg, 7, 100, steps=5, adjacency="zero_out")
    assert isinstance(ev, DistributedSkellam)
    d2 = rounded_l2_bound(64.0, 128, 0.1)
    assert ev.l2_sensitivity == d2
    assert ev.l1_sensitivity >= min(math.sqrt(128) * d2, d2 * d2)
    assert ev.l1_sensitivity == pytest.approx(min(math.sqrt(128) * d2, d2 * d2), rel=1e-15)
    assert (ev.mu, ev.devices, ev.steps) == (3.0, 7, 5)
    dg = event(
        DistributedDP(clip=1.0, gamma=1 / 64, noise="discrete_gaussian", sigma=2.0, bits=30),
        7,
        100,
        adjacency="zero_out",
    )
    assert isinstance(dg, DistributedDiscreteGaussian) and dg.dim == 128
    assert ev.adjacency == dg.adjacency == "zero_out"
    # Substitution: the target's share stays, its vector may move from v to v': 2 D2, 2 D1.
    sub = event(cfg, 7, 100, steps=5, adjacency="substitution")
    assert isinstance(sub, DistributedSkellam) and sub.adjacency == "substitution"
    assert sub.l2_sensitivity == 2 * d2
    assert sub.l1_sensitivity >= 2 * min(math.sqrt(128) * d2, d2 * d2)
    assert sub.l1_sensitivity == pytest.approx(2 * ev.l1_sensitivity, rel=1e-15)


def test_epsilon_of_the_sum_example() -> None:
    # n = 100 devices, d = 21840, C = 1, gamma = 2^-10, sigma = 102.4 per device: the
    # central noise std is sqrt(100) * 102.4 * gamma = 1.0 C (noise multiplier 1).
    n, d = 100, 21840
    dg = DistributedDP(
        clip=1.0,
        gamma=2.0**-10,
        noise="discrete_gaussian",
        sigma=102.4,
        bits=choose_bits(n, d, 1.0, 2.0**-10, 102.4, 1e-6),
    )
    sk = DistributedDP(clip=1.0, gamma=2.0**-10, noise="skellam", mu=102.4**2 / 2, bits=dg.bits)
    eps_dg = discrete_epsilon(event(dg, n, d, adjacency="zero_out"), 1e-5)
    eps_sk = discrete_epsilon(event(sk, n, d, adjacency="zero_out"), 1e-5)
    print(
        f"\nn={n}, d={d}, C=1, gamma=2^-10, sigma={dg.sigma}, bits={dg.bits}: "
        f"eps(1e-5) of one round: DDG={eps_dg:.4f}, Skellam={eps_sk:.4f}"
    )
    assert dg.bits == 15
    assert 4.7285 < eps_dg < 4.76  # Gaussian with z = 1 gives 4.7285
    assert eps_dg < eps_sk < 4.80


# ------------------------------------------------------------------------ choose_bits


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 2000),
    d=st.integers(1, 1 << 18),
    c=st.floats(0.01, 100.0),
    gamma=st.floats(1e-5, 1.0),
    sigma=st.floats(0.0, 1e4),
    p=st.floats(1e-12, 0.5),
    factor=st.floats(1.0, 10.0),
    noise=st.sampled_from(["discrete_gaussian", "skellam"]),
)
def test_choose_bits_is_monotone(
    n: int, d: int, c: float, gamma: float, sigma: float, p: float, factor: float, noise: str
) -> None:
    def bits(**kw: float) -> int:
        args = {
            "devices": n,
            "dim": d,
            "c": c,
            "gamma": gamma,
            "sigma": sigma,
            "wrap_probability": p,
        } | kw
        try:
            return choose_bits(**args, noise=noise)  # type: ignore[arg-type]
        except ValueError as e:
            assert "bits > 62" in str(e)
            return 63

    base = bits()
    assert 2 <= base <= 63
    assert bits(devices=n * 2) >= base
    # (Not monotone in dim: a longer rotation spreads the signal thinner per coordinate.)
    assert bits(c=c * factor) >= base
    assert bits(sigma=sigma * factor) >= base
    assert bits(gamma=gamma * factor) <= base
    assert bits(wrap_probability=min(p * factor, 0.9)) <= base
    if base <= 62:
        assert wrap_probability_bound(n, d, c, gamma, sigma, base, noise=noise) <= p  # type: ignore[arg-type]
        if base > 2:
            assert wrap_probability_bound(n, d, c, gamma, sigma, base - 1, noise=noise) > p  # type: ignore[arg-type]


def test_choose_bits_errors() -> None:
    with pytest.raises(ValueError, match=r"needs \d+ bits > 62 for devices=10000"):
        choose_bits(10_000, 1 << 20, 1.0, 1e-18, 1e6, 1e-9)
    with pytest.raises(ValueError, match=r"wrap_probability must be in \(0, 1\), got 0"):
        choose_bits(10, 64, 1.0, 0.1, 1.0, 0)
    with pytest.raises(ValueError, match="noise must be 'discrete_gaussian' or 'skellam'"):
        choose_bits(10, 64, 1.0, 0.1, 1.0, 1e-3, noise="laplace")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="devices must be >= 1, got 0"):
        choose_bits(0, 64, 1.0, 0.1, 1.0, 1e-3)


def test_discrete_gaussian_is_sigma2_sub_gaussian() -> None:
    # choose_bits relies on E[e^(tX)] <= e^(t^2 sigma^2 / 2) for X ~ N_Z(0, sigma^2).
    for sigma in (0.2, 0.5, 1.0, 3.0):
        k = np.arange(-int(60 * sigma) - 60, int(60 * sigma) + 61, dtype=np.float64)
        logw = -(k**2) / (2 * sigma**2)
        for t in np.linspace(0.0, 8.0, 33):
            log_mgf = logsumexp(logw + t * k) - logsumexp(logw)
            assert log_mgf <= t**2 * sigma**2 / 2 + 1e-12


def test_skellam_tail_is_chernoff_not_gaussian() -> None:
    # Small mu: Poisson tails are heavier than a Gaussian of the same variance.
    g = wrap_probability_bound(1, 1, 1e-9, 1.0, 1.0, 5, noise="discrete_gaussian")
    s = wrap_probability_bound(1, 1, 1e-9, 1.0, 1.0, 5, noise="skellam")
    assert g < s < 1
    exact = 2 * stats.skellam.sf(14, 0.5, 0.5)  # |N| >= 15 = 2^4 - 1
    assert exact <= s


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip": 0.0}, "clip must be finite and > 0, got 0.0"),
        ({"gamma": -1.0}, "gamma must be finite and > 0, got -1.0"),
        ({"gamma": 1e-12}, r"clip / gamma must be <= 2\^30"),
        ({"bits": 63}, r"bits must be in \[2, 62\], got 63"),
        ({"noise": "laplace"}, "noise must be 'discrete_gaussian' or 'skellam', got 'laplace'"),
        ({"sigma": None, "mu": 1.0}, "noise='discrete_gaussian' takes sigma and no mu"),
        ({"noise": "skellam"}, "noise='skellam' takes mu and no sigma"),
        ({"sigma": -0.5}, "sigma must be finite and >= 0, got -0.5"),
        ({"beta": 1.0}, r"beta must be in \[0, 1\), got 1.0"),
        ({"max_rounding_tries": 0}, r"max_rounding_tries must be >= 1, got 0"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "clip": 1.0,
        "gamma": 0.01,
        "noise": "discrete_gaussian",
        "bits": 20,
        "sigma": 1.0,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        DistributedDP(**args)  # type: ignore[arg-type]


def test_encode_decode_reject_bad_input() -> None:
    cfg = DistributedDP(clip=1.0, gamma=0.01, noise="skellam", mu=2.0, bits=20)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="x must be finite, got inf at flat index 2"):
        encode_device(np.array([0.0, 1.0, math.inf]), cfg, SEED, rng)
    with pytest.raises(ValueError, match=r"x must be 1-D \(d,\) or 2-D"):
        encode_device(np.zeros((2, 2, 2)), cfg, SEED, rng)
    with pytest.raises(ValueError, match="round_seed must be at least 16 bytes, got 3"):
        encode_device(np.zeros(4), cfg, b"abc", rng)
    with pytest.raises(ValueError, match="round_seed must be bytes, got str"):
        encode_device(np.zeros(4), cfg, "a" * 20, rng)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"padded_dim\(100\) = 128, got shape \(100,\)"):
        decode_sum(np.zeros(100, dtype=np.uint64), cfg, SEED, 100, 3)
    with pytest.raises(ValueError, match="sum_mod must be an integer array, got dtype float64"):
        decode_sum(np.zeros(128), cfg, SEED, 100, 3)
    with pytest.raises(ValueError, match="devices=524288 cannot be decoded in 20 bits"):
        decode_sum(np.zeros(128, dtype=np.uint64), cfg, SEED, 100, 1 << 19)
    with pytest.raises(ValueError, match=r"y must have padded_dim\(d=5\) = 8 entries per row"):
        unrotate(np.zeros(4), SEED, 5)


# ------------------------------------------------- per-record encoding (sample-level DDG)


@settings(max_examples=40, deadline=None)
@given(
    rows=hnp.arrays(np.float64, st.tuples(st.integers(1, 12), st.integers(1, 40)),
                    elements=st.floats(-50.0, 50.0)),
    scale=st.sampled_from([16.0, 1024.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_rows_one_record_moves_the_sum_by_at_most_d2(
    rows: np.ndarray, scale: float, seed: int
) -> None:
    clip = 1.0
    ints = ddp.round_rows(rows, clip, clip / scale, np.random.default_rng(seed))
    d2 = rounded_l2_bound(scale, rows.shape[1], ddp.DEFAULT_BETA)
    assert ints.dtype == np.int64 and ints.shape == rows.shape
    total = ints.sum(axis=0)
    for i in range(len(rows)):  # add/remove record i: the others' encodings are unchanged
        without = np.delete(ints, i, axis=0).sum(axis=0)
        assert float(np.linalg.norm((total - without).astype(np.float64))) <= d2
        assert int(ints[i] @ ints[i]) <= d2 * d2


def test_round_rows_decodes_to_the_clipped_sum() -> None:
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(50, 300)) * rng.choice([0.01, 1.0], size=(50, 1))
    rows[3] = 0.0  # an all-zero record stays zero
    clip, gamma = 0.5, 0.5 / 1024
    ints = ddp.round_rows(rows, clip, gamma, rng)
    assert not ints[3].any()
    decoded = gamma * ints.sum(axis=0)
    # each record's rounding moves each coordinate by < 1 integer step
    assert np.abs(decoded - _clip(rows, clip).sum(axis=0)).max() < 50 * gamma


def test_round_rows_rejects_bad_input() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"rows must be 2-D \(rows, d\), got shape \(3,\)"):
        ddp.round_rows(np.ones(3), 1.0, 0.01, rng)
    with pytest.raises(ValueError, match="rows must be finite, got nan"):
        ddp.round_rows(np.array([[1.0, np.nan]]), 1.0, 0.01, rng)
    with pytest.raises(ValueError, match="clip must be finite and > 0, got inf"):
        ddp.round_rows(np.ones((2, 3)), math.inf, 0.01, rng)
    with pytest.raises(ValueError, match="clip / gamma must be <= 2\\^30"):
        ddp.round_rows(np.ones((2, 3)), 1.0, 1e-12, rng)


def test_choose_bits_bounded() -> None:
    # no noise: the smallest b with 2^(b-1) > the signal bound
    assert ddp.choose_bits_bounded(1000.0, 10, 100, 0.0, 1e-9) == 11
    assert ddp.choose_bits_bounded(1023.0, 10, 100, 0.0, 1e-9) == 11
    assert ddp.choose_bits_bounded(1024.0, 10, 100, 0.0, 1e-9) == 12
    b = ddp.choose_bits_bounded(6.2e6, 10, 21840, 3000.0, 1e-9)
    assert ddp.bounded_wrap_probability(6.2e6, 10, 21840, 3000.0, b) <= 1e-9
    assert ddp.bounded_wrap_probability(6.2e6, 10, 21840, 3000.0, b - 1) > 1e-9
    assert ddp.choose_bits_bounded(6.2e6, 10, 21840, 30000.0, 1e-9) >= b
    # the tail by hand: one coordinate, n sigma^2 = 1, a = 2^(b-1) - S = 4: 2 e^-8
    assert ddp.bounded_wrap_probability(4.0, 1, 1, 1.0, 4) == pytest.approx(2 * math.exp(-8))
    with pytest.raises(ValueError, match=r"wrap_probability must be in \(0, 1\), got 1"):
        ddp.choose_bits_bounded(10.0, 10, 100, 1.0, 1)
    with pytest.raises(ValueError, match=r"needs \d+ bits > 62 for max_abs_signal"):
        ddp.choose_bits_bounded(2.0**70, 10, 100, 1.0, 1e-9)
    with pytest.raises(ValueError, match="max_abs_signal must be finite and >= 0, got -1"):
        ddp.bounded_wrap_probability(-1.0, 10, 100, 1.0, 20)
