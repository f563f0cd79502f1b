"""edge_sdk.csprng: the device's generator — distributions, construction, and who may seed it.

Statistical checks use a fixed key (a deterministic ``random_bytes``), so they are
deterministic; bands are wide (>= 6 sigma) so a correct sampler passes with any key.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk import compress, csprng, ddp
from edge_sdk.config import ConfigError
from edge_sdk.csprng import SecureRng, secure_round_rng, seeded_round_rng
from edge_sdk.device import DeviceConfig
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.session import DeviceSession
from edge_sdk.train import LocalTraining, local_round


def _key(label: str) -> Callable[[int], bytes]:
    def random_bytes(n: int) -> bytes:
        return hashlib.sha256(label.encode()).digest()[:n]

    return random_bytes


def _rng(label: str = "k") -> SecureRng:
    return SecureRng(random_bytes=_key(label))


def _chi2_ok(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson's statistic within mean + 6 sd of its chi-square(k - 1) law."""
    k = counts.size
    stat = float(np.sum((counts - expected) ** 2 / expected))
    return stat < (k - 1) + 6 * math.sqrt(2 * (k - 1))


# ----------------------------------------------------------------------- construction


def test_same_key_same_stream_fresh_key_other_stream() -> None:
    a, b = _rng("x"), _rng("x")
    assert np.array_equal(a.words(100), b.words(100))
    assert not np.array_equal(_rng("x").words(100), _rng("y").words(100))
    r1, r2 = secure_round_rng()(5), secure_round_rng()(5)  # os.urandom: same round, new keys
    assert not np.array_equal(r1.words(8), r2.words(8))


def test_words_are_the_mask_prg_with_fast_key_erasure() -> None:
    from edge_sdk.hazmat.prg import expand
    from edge_sdk.hazmat.ring import Ring

    key = _key("fke")(32)
    r = SecureRng(random_bytes=_key("fke"))
    first = r.words(10)
    block = expand(key, 4 + (1 << 15), Ring(bits=64))
    assert np.array_equal(first, block[4:14])  # output skips the next key's 4 words
    # crossing a block boundary: the next block is keyed by the previous block's words 0..3
    r.words((1 << 15) - 10)
    nxt = expand(block[:4].tobytes(), 4 + (1 << 15), Ring(bits=64))
    assert np.array_equal(r.words(5), nxt[4:9])
    big = r.words((1 << 15) + 7)  # a request larger than a block gets its own block
    assert big.size == (1 << 15) + 7 and big.dtype == np.uint64


def test_bad_key_source_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        SecureRng(random_bytes=lambda n: b"short")


def test_normal_is_four_draws_summed_and_halved() -> None:
    """The floating-point hardening (Holohan and Braghin; Opacus secure_mode) is there."""
    a, b, c = _rng("n"), _rng("n"), _rng("n")
    n = csprng._CHUNK + 1000  # noqa: SLF001 (two chunks, the second partial)
    z = a.standard_normal(n)
    want = []
    for size in (csprng._CHUNK, 1000):  # noqa: SLF001
        g = np.empty(4 * size)
        b._polar_into(g)  # noqa: SLF001
        want.append((g[:size] + g[size:2 * size] + g[2 * size:3 * size] + g[3 * size:]) * 0.5)
    assert np.array_equal(z, np.concatenate(want))
    # normal scales the same sum: (sum / 2) * scale, bit for bit, then shifts it
    assert np.array_equal(c.normal(1.5, 2.0, size=n), z * 2.0 + 1.5)


def _uniform_stream(key: bytes, count: int) -> np.ndarray:
    """The generator's signed 53-bit uniforms, recomputed from the keystream by hand."""
    from edge_sdk.hazmat.prg import expand
    from edge_sdk.hazmat.ring import Ring

    words = []
    while sum(w.size for w in words) < count:
        block = expand(key, 4 + (1 << 15), Ring(bits=64))
        key = block[:4].tobytes()
        words.append(block[4:])
    w = np.concatenate(words)[:count]
    return ((w >> np.uint64(11)).astype(np.int64) - 2**52).astype(np.float64) * 2.0**-52


def _reference_polar(u_stream: np.ndarray, p: int) -> np.ndarray:
    """Slot i of 2p gets its first accepted polar pair: the first pass's pair i (when p is
    large enough for that pass), or else the next accepted pair of the refill passes
    (sizes from csprng._refill_pairs)."""
    def polar(u, v):
        s = u * u + v * v
        ok = (s > 0) & (s < 1)
        f = np.sqrt(-2.0 * np.log(np.where(ok, s, 0.5)) / np.where(ok, s, 0.5))
        return u * f, v * f, ok

    if p >= csprng._SLOT_PASS_MIN:  # noqa: SLF001
        gu, gv, ok = polar(u_stream[:p], u_stream[p:2 * p])
        pos, open_ = 2 * p, list(np.flatnonzero(~ok))
    else:  # few slots: no in-place pass, all open
        gu, gv, pos, open_ = np.zeros(p), np.zeros(p), 0, list(range(p))
    while open_:
        m = csprng._refill_pairs(len(open_))  # noqa: SLF001
        ru, rv, rok = polar(u_stream[pos:pos + m], u_stream[pos + m:pos + 2 * m])
        pos += 2 * m
        for i in np.flatnonzero(rok)[:len(open_)]:
            slot = open_.pop(0)
            gu[slot], gv[slot] = ru[i], rv[i]
    return np.concatenate([gu, gv])


@pytest.mark.parametrize(("p", "short_refills"), [(5000, False), (5000, True), (20, False),
                                                  (100, True)])
def test_polar_slots_match_a_reference_from_the_keystream(monkeypatch, p, short_refills) -> None:
    """Every slot holds its first accepted pair, recomputed here from the raw words (also
    when refill passes come up short and must repeat); the uniforms are the exact
    ((w >> 11) - 2^52) * 2^-52."""
    if short_refills:  # a quarter of the pairs needed: several refill passes per call
        monkeypatch.setattr(csprng, "_refill_pairs", lambda r: r // 4 + 1)
    key = _key("slots")(32)
    r = SecureRng(random_bytes=_key("slots"))
    got = np.empty(2 * p)
    r._polar_into(got)  # noqa: SLF001
    want = _reference_polar(_uniform_stream(key, 20 * p), p)
    assert np.all(np.isfinite(got))
    # log and sqrt may round a last bit differently in a vector's tail: a wrong pair or a
    # wrong slot would be off by far more than 4 ulp
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_gaussian_path_leaves_no_draws_in_memory() -> None:
    """Fast key erasure for the Gaussian path: words are zeroed once used, and the reused
    work buffers hold nothing from which the returned noise could be recomputed."""
    r = _rng("erase")
    r.normal(0.0, 3.0, size=csprng._CHUNK + 77)  # noqa: SLF001
    assert not r._buf[4:r._pos].any()  # noqa: SLF001 (used words: zero)
    assert r._buf[r._pos:].any()  # noqa: SLF001 (the unused rest of the block is intact)
    for b in r._work:  # noqa: SLF001
        if b.dtype == np.float64:
            assert not b.any()


def test_polar_draws_are_standard_normal() -> None:
    """The single polar draws (before the four-sum): equiprobable-bin chi-square, tails,
    and no correlation between a slot's two values or between neighbouring slots."""
    from statistics import NormalDist

    r = _rng("polar")
    p = csprng._PAIRS  # noqa: SLF001 (the most slots one call fills)
    g = np.empty(2 * p)
    draws = []
    for _ in range(12):
        r._polar_into(g)  # noqa: SLF001
        draws.append(g.copy())
    x = np.concatenate(draws)
    edges = np.array([NormalDist().inv_cdf(i / 40) for i in range(1, 40)])
    counts = np.bincount(np.searchsorted(edges, x), minlength=40)
    assert _chi2_ok(counts, np.full(40, x.size / 40))
    assert abs(np.mean(np.abs(x) > 3) - 0.00269979606) < 6 * math.sqrt(0.0027 / x.size)
    slots = np.stack([d.reshape(2, p) for d in draws], axis=1).reshape(2, -1)
    u, v = slots
    for a, b in ((u, v), (u[:-1], u[1:])):
        assert abs(np.corrcoef(a, b)[0, 1]) < 6 / math.sqrt(a.size)


# ----------------------------------------------------------------------- distributions


def test_uniform_random_is_53_bit_and_uniform() -> None:
    r = _rng()
    u = r.random(200_000)
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    assert np.all(u * 2.0**53 == np.floor(u * 2.0**53))  # on the 2^-53 grid
    counts = np.bincount((u * 50).astype(int), minlength=50)
    assert _chi2_ok(counts, np.full(50, u.size / 50))
    assert isinstance(r.random(), float)
    v = r.uniform(-3.0, 5.0, size=(100, 3))
    assert v.shape == (100, 3) and v.min() >= -3.0 and v.max() < 5.0


@pytest.mark.parametrize("n", [3, 10, 7919, 2**63 + 5])
def test_integers_without_modulo_bias(n: int) -> None:
    r = _rng(f"i{n}")
    dtype = np.uint64 if n > 2**63 - 1 else np.int64
    x = r.integers(0, n, size=60_000, dtype=dtype)
    assert x.dtype == dtype and int(x.min()) >= 0 and int(x.max()) < n
    bins = min(n, 40)
    counts = np.bincount((x.astype(np.float64) / n * bins).astype(int) if n > 40
                         else x.astype(int), minlength=bins)[:bins]
    expected = np.array([(math.floor((i + 1) * n / bins) - math.floor(i * n / bins)) / n
                         for i in range(bins)]) * x.size if n > 40 else np.full(bins, x.size / n)
    assert _chi2_ok(counts, expected)


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(-(2**62), 2**62), span=st.integers(1, 2**62),
       size=st.integers(0, 50))
def test_integers_stay_in_range(lo: int, span: int, size: int) -> None:
    x = _rng("h").integers(lo, lo + span, size=size)
    assert x.shape == (size,) and (size == 0 or (x.min() >= lo and x.max() < lo + span))


def test_integers_edges() -> None:
    r = _rng()
    w = r.integers(0, 2**64, size=1000, dtype=np.uint64)
    assert w.dtype == np.uint64 and int(w.max()) > 2**63  # the full range is reachable
    s = r.integers(0, 2, size=50, dtype=np.int8)
    assert s.dtype == np.int8 and set(s.tolist()) <= {0, 1}
    assert 0 <= int(r.integers(7)) < 7
    with pytest.raises(ValueError, match="high - low"):
        r.integers(5, 5)
    with pytest.raises(ValueError, match="does not fit"):
        r.integers(0, 300, size=3, dtype=np.int8)


def test_normal_moments_and_tails() -> None:
    r = _rng("g")
    n = 400_000
    z = r.normal(1.5, 2.0, size=n)
    se = 2.0 / math.sqrt(n)
    assert abs(z.mean() - 1.5) < 6 * se
    assert abs(z.var() / 4.0 - 1) < 6 * math.sqrt(2 / n)
    s = (z - 1.5) / 2.0
    assert abs(np.mean(s**4) - 3) < 6 * math.sqrt(96 / n)  # var of z^4 is 105 - 9 = 96
    for k, p in ((1, 0.31731050786), (2, 0.04550026390), (3, 0.00269979606)):
        frac = np.mean(np.abs(s) > k)
        assert abs(frac - p) < 6 * math.sqrt(p * (1 - p) / n), (k, frac)
    assert r.normal(0.0, 0.0, size=4).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="scale"):
        r.normal(0.0, -1.0, size=2)


def test_permutations_are_uniform() -> None:
    r = _rng("p")
    perms = list(itertools.permutations(range(4)))
    index = {p: i for i, p in enumerate(perms)}
    counts = np.zeros(len(perms))
    for _ in range(24 * 400):
        counts[index[tuple(r.permutation(4).tolist())]] += 1
    assert _chi2_ok(counts, np.full(len(perms), 400.0))
    arr = np.arange(10) * 3
    assert sorted(r.permutation(arr).tolist()) == arr.tolist()


def test_choice_without_replacement() -> None:
    r = _rng("c")
    counts = np.zeros(20)
    for _ in range(3000):
        pick = r.choice(20, size=5, replace=False)
        assert len(set(pick.tolist())) == 5
        counts[pick] += 1
    assert _chi2_ok(counts, np.full(20, 3000 * 5 / 20))
    assert r.choice(np.array([7, 8, 9]), size=2).tolist()[0] in (7, 8, 9)
    with pytest.raises(ValueError, match="cannot choose"):
        r.choice(3, size=4, replace=False)


def test_binomial_is_exact_popcount() -> None:
    r = _rng("b")
    for trials in (1, 64, 100, 4096):
        x = r.binomial(trials, 0.5, size=50_000)
        mean, var = trials / 2, trials / 4
        assert x.min() >= 0 and x.max() <= trials
        assert abs(x.mean() - mean) < 6 * math.sqrt(var / x.size)
        assert abs(x.var() / var - 1) < 6 * math.sqrt(2 / x.size) + 0.01
    with pytest.raises(ValueError, match="p = 1/2 only"):
        r.binomial(10, 0.3, size=2)


@pytest.mark.parametrize("lam", [0.5, 3.0, 9.9, 10.0, 57.0, 4000.0])
def test_poisson_moments_and_pmf(lam: float) -> None:
    r = _rng(f"poi{lam}")
    n = 100_000
    x = r.poisson(lam, size=n)
    assert x.dtype == np.int64 and x.min() >= 0
    assert abs(x.mean() - lam) < 6 * math.sqrt(lam / n)
    assert abs(x.var() / lam - 1) < 6 * math.sqrt((2 + 1 / lam) / n)
    lo, hi = int(max(0, lam - 3 * math.sqrt(lam))), int(lam + 3 * math.sqrt(lam)) + 1
    ks = np.arange(lo, hi)
    pmf = np.exp(ks * math.log(lam) - lam - np.array([math.lgamma(k + 1) for k in ks]))
    counts = np.array([np.sum(x == k) for k in ks], dtype=float)
    keep = pmf * n > 20
    assert _chi2_ok(counts[keep], pmf[keep] * n)


# ----------------------------------------------------------------------- device code takes it


def test_device_mechanisms_run_on_the_secure_generator(rng) -> None:
    r = _rng("mech")
    q = compress.quantize(rng.normal(size=200), 4, r)
    assert q.levels.shape == (200,)
    fp = FixedPoint(scale=2.0**10, bits=32)
    assert fp.encode(rng.normal(size=50), r).dtype == np.uint64
    assert compress.binomial_noise(30, 64, r).shape == (30,)
    assert compress.rand_k(rng.normal(size=40), 0.25, r).shape == (40,)
    assert ddp.sample_discrete_gaussian(3.0, 500, r).dtype == np.int64
    assert ddp.sample_skellam(20.0, 100, r).shape == (100,)
    rows = ddp.round_rows(rng.normal(size=(4, 16)), 1.0, 0.05, r)
    assert rows.shape == (4, 16)


def test_local_round_with_the_secure_generator(rng) -> None:
    from edge_sdk.engine import load_engine
    from models import manifest_path

    engine = load_engine(manifest_path("logreg", (64,), 10))
    params = [np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    x = rng.normal(size=(40, 64)).astype(np.float32)
    y = rng.integers(0, 10, 40)
    for sampling in ("poisson", "shuffle"):
        cfg = LocalTraining(steps=3, batch_size=8, lr=0.1, clip=1.0, noise_multiplier=1.0,
                            sampling=sampling)
        res = local_round(engine, params, x, y, cfg, _rng(sampling))
        assert all(np.isfinite(u).all() for u in res.update)


# ----------------------------------------------------------------------- who may seed it


def test_seeded_factory_is_reproducible_and_only_for_simulation() -> None:
    f = seeded_round_rng(3)
    assert np.array_equal(f(7).random(5), np.random.default_rng([3, 7]).random(5))
    with pytest.raises(ValueError, match="seed"):
        seeded_round_rng(-1)


def test_session_has_no_seeded_default() -> None:
    param = inspect.signature(DeviceSession).parameters["round_rng"]
    assert param.default is inspect.Parameter.empty
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert "seed" not in inspect.signature(DeviceSession).parameters


def test_device_takes_no_randomness_argument() -> None:
    from edge_sdk.device import Device

    params = inspect.signature(Device).parameters
    assert not {"seed", "random_bytes", "round_rng", "rng"} & set(params), list(params)


def test_device_config_cannot_select_a_seed(tmp_path) -> None:
    assert "seed" not in {f for f in DeviceConfig.__dataclass_fields__}
    text = ('fleet = "lab"\ndevice = "dev-0000"\nmodel = "logreg-64-10"\n'
            'identity = "identity.key"\nregistry = "registry.json"\nledger = "ledger.db"\n'
            '{seed}[budget]\nepsilon = 8.0\ndelta = 1e-5\n'
            '[broker]\nport = 1883\npassword_file = "password"\n')
    ok = tmp_path / "ok.toml"
    ok.write_text(text.format(seed=""))
    assert DeviceConfig.from_toml(ok).device == "dev-0000"
    stale = tmp_path / "stale.toml"
    stale.write_text(text.format(seed="seed = 3\n"))
    with pytest.raises(ConfigError, match="'seed' is no longer a device setting.*CSPRNG"):
        DeviceConfig.from_toml(stale)
    with pytest.raises(ConfigError, match="seed"):
        DeviceConfig.from_toml(ok, seed=3)


def test_all_is_honest() -> None:
    from edge_sdk import csprng

    public = {n for n in dir(csprng) if not n.startswith("_")}
    assert set(csprng.__all__) <= public
    here = {n for n in public if getattr(getattr(csprng, n), "__module__", None)
            == csprng.__name__}
    assert here <= set(csprng.__all__)
