"""edge_sdk.compress: rand-k (Fed-SPA Def. 2, eq. (5)), QSGD (FedPAQ eq. (20)), packing,
fixed point for secure aggregation, the cpSGD binomial mechanism and top-k.

Statistical checks use fixed seeds and ``derandomize=True`` so that they are deterministic;
their tolerances are 5 standard errors computed from the *known* variance of the estimator.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_sdk import compress
from edge_sdk.compress import (
    HEADER_SIZE,
    Quantized,
    TopK,
    binomial_noise,
    coordinate_set,
    dequantize,
    desparsify,
    kept_count,
    pack_quantized,
    packed_size,
    quantize,
    rand_k,
    sparsify,
    symbol_bits,
    top_k_feedback,
    unpack_quantized,
)
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.hazmat import prg

GOLDEN = json.loads((Path(__file__).parent / "golden" / "compress_vectors.json").read_text())
SEED = bytes(range(32))
STAT = settings(max_examples=15, deadline=None, derandomize=True)
FED_SPA_CNN_D = 21840  # parameters of the Fed-SPA MNIST CNN (edge_sdk.model "cnn")

# Statistical tests square the entries: keep them where squares neither underflow nor
# lose the variance (tiny entries have their own tests).
vectors = hnp.arrays(
    np.float64,
    st.integers(1, 24),
    elements=st.floats(-10, 10).filter(lambda v: v == 0 or abs(v) >= 1e-30),
)


def _seed(i: int) -> bytes:
    return hashlib.sha256(b"fedge/test/" + i.to_bytes(4, "little")).digest()


# --------------------------------------------------------------------------- API


def test_all_is_honest() -> None:
    public = {n for n in dir(compress) if not n.startswith("_")}
    assert set(compress.__all__) <= public
    defined_here = {
        n for n in public if getattr(getattr(compress, n), "__module__", None) == compress.__name__
    }
    assert defined_here <= set(compress.__all__)


# --------------------------------------------------------------------------- kept_count


@pytest.mark.parametrize(
    ("d", "p", "k"),
    [
        (FED_SPA_CNN_D, 0.05, 1092),
        (10, 0.01, 1),
        (10, 1.0, 10),
        (10, 0.25, 2),
        (10, 0.35, 4),
        (1, 0.5, 1),
    ],
)
def test_kept_count(d: int, p: float, k: int) -> None:
    assert kept_count(d, p) == k


@pytest.mark.parametrize(
    ("d", "p"), [(0, 0.5), (10, 0.0), (10, 1.5), (10, math.nan), (10, -1), (2.5, 0.5), (10, True)]
)
def test_kept_count_rejects(d: object, p: object) -> None:
    with pytest.raises(ValueError, match=r"must be"):
        kept_count(d, p)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- coordinate set


def _hkdf_sha256_oracle(ikm: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 from the stdlib (independent of ``cryptography``'s HKDF)."""
    prk = hmac.new(b"\x00" * 32, ikm, hashlib.sha256).digest()
    okm, t, i = b"", b"", 1
    while len(okm) < length:
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        okm, i = okm + t, i + 1
    return okm[:length]


def _coordinate_set_oracle(seed: bytes, d: int, k: int) -> list[int]:
    """The documented algorithm, literally: a materialized array and sequential words."""
    key = _hkdf_sha256_oracle(seed, b"fedge/randk/v1")
    enc = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()

    def word() -> int:
        return int.from_bytes(enc.update(bytes(8)), "little")

    a = list(range(d))
    for i in range(k):
        n = d - i
        w = word()
        while w < 2**64 % n:
            w = word()
        j = i + w % n
        a[i], a[j] = a[j], a[i]
    return sorted(a[:k])


@pytest.mark.parametrize("vec", GOLDEN["coordinate_set"], ids=lambda v: f"d{v['d']}k{v['k']}")
def test_coordinate_set_golden(vec: dict) -> None:
    seed = bytes.fromhex(vec["seed_hex"])
    assert _hkdf_sha256_oracle(seed, compress.RANDK_INFO).hex() == vec["key_hex"]
    omega = coordinate_set(seed, vec["d"], vec["k"])
    assert omega.dtype == np.int64 and omega.size == vec["k"]
    assert omega[:16].tolist() == vec["first_indices"]
    assert hashlib.sha256(omega.astype("<i8").tobytes()).hexdigest() == vec["sha256_of_int64le"]
    if vec["d"] <= 100_000:
        assert omega.tolist() == _coordinate_set_oracle(seed, vec["d"], vec["k"])


@given(seed=st.binary(min_size=16, max_size=40), d=st.integers(1, 300), data=st.data())
@settings(max_examples=60, deadline=None)
def test_coordinate_set_matches_spec_oracle(seed: bytes, d: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, d))
    omega = coordinate_set(seed, d, k)
    assert omega.tolist() == _coordinate_set_oracle(seed, d, k)
    assert omega.dtype == np.int64 and omega.size == k
    assert np.all(np.diff(omega) > 0) and omega[0] >= 0 and omega[-1] < d
    assert np.array_equal(coordinate_set(bytearray(seed), d, k), omega)  # deterministic


def test_coordinate_set_full_and_seed_dependence() -> None:
    assert np.array_equal(coordinate_set(SEED, 50, 50), np.arange(50))
    sets = {tuple(coordinate_set(_seed(i), 1000, 20)) for i in range(20)}
    assert len(sets) == 20


def test_rejection_sampling_skips_biased_words() -> None:
    # n = 3: 2^64 mod 3 = 1, so the word 0 would favour index 0 and must be rejected.
    words = iter([0, 5])
    assert prg.fisher_yates(lambda: next(words), 3, 1) == [5 % 3]
    words = iter([2**64 - 1])  # accepted: (2^64 - 1) mod 3 = 0
    assert prg.fisher_yates(lambda: next(words), 3, 1) == [0]


def test_coordinate_set_index_frequencies_are_uniform() -> None:
    d, k, trials = 20, 5, 4000
    counts = np.zeros(d)
    for i in range(trials):
        counts[coordinate_set(_seed(i), d, k)] += 1
    q = k / d
    assert np.all(np.abs(counts - trials * q) <= 5 * math.sqrt(trials * q * (1 - q)))


def test_coordinate_set_subsets_are_uniform() -> None:
    d, k, trials = 5, 2, 3000
    seen: dict[tuple[int, ...], int] = {}
    for i in range(trials):
        key = tuple(coordinate_set(_seed(10_000 + i), d, k).tolist())
        seen[key] = seen.get(key, 0) + 1
    assert len(seen) == math.comb(d, k)
    expected = trials / math.comb(d, k)
    chi2 = sum((c - expected) ** 2 / expected for c in seen.values())
    assert chi2 < 33.7  # chi-square, 9 degrees of freedom, p = 1e-4


@pytest.mark.parametrize(
    ("seed", "d", "k", "match"),
    [
        (b"short", 10, 3, "at least 16 bytes"),
        ("text-seed-0123456789", 10, 3, "must be bytes"),
        (SEED, 0, 1, "d must be"),
        (SEED, 10, 0, r"k must be in \[1, 10\], got 0"),
        (SEED, 10, 11, r"k must be in \[1, 10\], got 11"),
    ],
)
def test_coordinate_set_rejects(seed: object, d: int, k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        coordinate_set(seed, d, k)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- sparsify


def test_sparsify_desparsify_layout() -> None:
    x = np.arange(1.0, 11.0, dtype=np.float32)
    idx = coordinate_set(SEED, 10, 4)
    values = sparsify(x, idx)
    assert values.dtype == np.float32
    np.testing.assert_allclose(values, x[idx] / 0.4, rtol=1e-7)
    np.testing.assert_allclose(sparsify(x, idx, 0.5), x[idx] * 2)
    dense = desparsify(values, idx, 10)
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(dense[idx], values)
    assert np.count_nonzero(np.delete(dense, idx)) == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sparsify(np.ones(4), np.array([0, 4])), r"\[0, 4\)"),
        (lambda: sparsify(np.ones(4), np.array([1, 1])), "distinct"),
        (lambda: sparsify(np.ones(4), np.array([0.5])), "integer"),
        (lambda: sparsify(np.ones(4), np.array([0]), 0.0), r"\(0, 1\]"),
        (lambda: sparsify(np.ones((2, 2)), np.array([0])), "1-D"),
        (lambda: sparsify(np.array([1.0, np.nan]), np.array([0])), "finite"),
        (lambda: sparsify(np.array([np.inf, 1.0]), np.array([0])), "finite"),
        (lambda: desparsify(np.ones(2), np.array([0]), 4), "len"),
        (lambda: rand_k(np.array([1.0, -np.inf]), 0.5, np.random.default_rng(0)), "finite"),
    ],
)
def test_sparsify_rejects(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@given(x=vectors, p=st.floats(0.05, 1.0))
@STAT
def test_rand_k_unbiased_with_variance_one_over_p_minus_one(x: np.ndarray, p: float) -> None:
    rng = np.random.default_rng(2024)
    d, trials = x.size, 2000
    k = kept_count(d, p)
    q = k / d  # the realized kept fraction: the inclusion probability of each coordinate
    draws = np.stack([rand_k(x, p, rng) for _ in range(trials)])
    # Mean: coordinate j is x_j / q w.p. q, else 0, so Var = x_j^2 (1/q - 1).
    se = np.sqrt(x**2 * (1 / q - 1) / trials)
    assert np.all(np.abs(draws.mean(axis=0) - x) <= 5 * se + 1e-12 * np.abs(x))
    # Squared error: e = ||x||^2 + c * sum_{j in omega} x_j^2, c = (1/q - 1)^2 - 1, so
    # E e = (1/q - 1) ||x||^2 and Var e = c^2 Var(sum of a k-sample without replacement).
    err = ((draws - x) ** 2).sum(axis=1)
    norm2 = float(x @ x)
    expected = (1 / q - 1) * norm2
    if k == d:
        assert np.allclose(err, 0.0)
        return
    c = (1 / q - 1) ** 2 - 1
    a = x**2
    var_e = c**2 * k * a.var() * (d - k) / (d - 1)
    assert abs(err.mean() - expected) <= 5 * math.sqrt(var_e / trials) + 1e-9 * norm2


def test_rand_k_of_zero_and_tiny_vectors() -> None:
    rng = np.random.default_rng(0)
    assert not rand_k(np.zeros(8), 0.25, rng).any()
    tiny = np.full(8, np.finfo(np.float32).smallest_subnormal, dtype=np.float32)
    out = rand_k(tiny, 0.5, rng)
    assert out.dtype == np.float32 and np.isfinite(out).all() and np.count_nonzero(out) == 4


# --------------------------------------------------------------------------- QSGD


@given(x=vectors, s=st.sampled_from([1, 2, 3, 7, 127]))
@STAT
def test_qsgd_unbiased_and_variance_within_bound(x: np.ndarray, s: int) -> None:
    rng = np.random.default_rng(7)
    trials, d = 2000, x.size
    qs = [quantize(x, s, rng) for _ in range(trials)]
    norm = float(qs[0].norm)
    assert norm >= float(np.linalg.norm(x)) and all(q.norm == qs[0].norm for q in qs)
    draws = np.stack([dequantize(q) for q in qs]).astype(np.float64)
    if norm == 0:
        assert not draws.any()
        return
    # FedPAQ eq. (20): level = floor(u) + Bernoulli(frac(u)), u = s |x| / norm.
    u = np.minimum(np.abs(x) / norm, 1.0) * s
    f = u - np.floor(u)
    step = norm / s
    # dequantize rounds once to float32; a Python float, so that under NumPy 2 promotion the
    # tolerances below stay float64 (a float32 f32 * step underflows to 0 for tiny norms)
    f32 = 4 * float(np.finfo(np.float32).eps) * norm
    se = np.sqrt(step**2 * f * (1 - f) / trials)
    assert np.all(np.abs(draws.mean(axis=0) - x) <= 5 * se + f32)
    # E||Q - x||^2 = step^2 sum f(1-f); per-draw variance from the two-point laws.
    expected = step**2 * float((f * (1 - f)).sum())
    var_e = step**4 * float((f * (1 - f) * ((1 - f) ** 3 + f**3 - f * (1 - f))).sum())
    err = ((draws - x) ** 2).sum(axis=1)
    assert abs(err.mean() - expected) <= 5 * math.sqrt(var_e / trials) + d * f32 * (2 * step)
    bound = min(d / s**2, math.sqrt(d) / s) * float(x @ x)
    assert expected <= bound * (1 + 1e-6)  # QSGD (Alistarh et al. 2017) Lemma 3.1


def test_qsgd_norm_is_float32_rounded_up_and_levels_in_range() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1000)
    q = quantize(x, 5, rng)
    assert isinstance(q.norm, np.float32)
    assert float(q.norm) >= np.linalg.norm(x)
    assert float(np.nextafter(q.norm, np.float32(0))) < np.linalg.norm(x)
    assert q.levels.dtype == np.uint8 and q.levels.max() <= 5 and q.n == 1000
    assert np.array_equal(q.signs, (x < 0) & (q.levels > 0))
    one_hot = np.zeros(4)
    one_hot[2] = -3.0
    q = quantize(one_hot, 4, rng)
    assert q.levels.tolist() == [0, 0, 4, 0] and q.signs.tolist() == [False, False, True, False]
    assert dequantize(q).tolist() == [0.0, 0.0, -3.0, 0.0]
    with pytest.raises(ValueError):
        q.levels[0] = 1  # read-only value


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_qsgd_zero_vector(dtype) -> None:
    q = quantize(np.zeros(6, dtype=dtype), 3, np.random.default_rng(0))
    assert q.norm == 0 and not q.levels.any() and not q.signs.any()
    out = dequantize(q)
    assert out.dtype == np.float32 and not out.any() and not np.signbit(out).any()
    assert unpack_quantized(pack_quantized(q), 6, 3).norm == 0
    empty = quantize(np.zeros(0), 3, np.random.default_rng(0))
    assert empty.n == 0 and dequantize(empty).size == 0
    assert len(pack_quantized(empty)) == HEADER_SIZE


@pytest.mark.parametrize(
    "x",
    [
        np.full(5, np.finfo(np.float32).smallest_subnormal, dtype=np.float32),
        np.array([1e-40, -1e-40, 0.0], dtype=np.float32),
        np.array([1e-300, -1e-310, 0.0]),
        np.array([np.finfo(np.float64).tiny, 0.0, 1.0]),
    ],
)
def test_qsgd_tiny_vectors(x: np.ndarray) -> None:
    rng = np.random.default_rng(3)
    q = quantize(x, 7, rng)
    out = dequantize(q)
    assert np.isfinite(float(q.norm)) and float(q.norm) > 0
    assert np.isfinite(out).all() and np.all(np.abs(out) <= q.norm)
    assert not np.any((out < 0) & (x > 0)) and not np.any((out > 0) & (x < 0))


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (np.array([1.0, np.nan]), "finite"),
        (np.array([np.inf]), "finite"),
        (np.array([-np.inf, 0.0], dtype=np.float32), "finite"),
        (np.array([1e39, 1e39]), "fit float32"),
        (np.ones((2, 2)), "1-D"),
        (np.array(["a"]), "numeric"),
    ],
)
def test_qsgd_rejects(x: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize(x, 3, np.random.default_rng(0))


@pytest.mark.parametrize("s", [0, -1, 2**31, 1.5])
def test_qsgd_rejects_levels(s: object) -> None:
    with pytest.raises(ValueError, match="quantization levels"):
        quantize(np.ones(3), s, np.random.default_rng(0))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- packing

level_counts = st.sampled_from(
    [1, 2, 3, 4, 7, 8, 15, 16, 127, 128, 255, 256, 1000, 65535, 65536, 2**31 - 1]
)


@given(
    s=level_counts,
    n=st.integers(0, 200),
    seed=st.integers(0, 2**32 - 1),
    norm=st.floats(0, 3.0000000054977558e38, width=32),
)
@settings(max_examples=150, deadline=None)
def test_pack_unpack_round_trip_is_exact(s: int, n: int, seed: int, norm: float) -> None:
    rng = np.random.default_rng(seed)
    levels = rng.integers(0, s, size=n, endpoint=True)
    q = Quantized(norm=norm, signs=rng.random(n) < 0.5, levels=levels, s=s)
    data = pack_quantized(q)
    assert len(data) == packed_size(n, s) == HEADER_SIZE + math.ceil(n * symbol_bits(s) / 8)
    back = unpack_quantized(data, n, s)
    assert back.norm == q.norm and back.s == s
    assert np.array_equal(back.levels, q.levels) and np.array_equal(back.signs, q.signs)
    assert pack_quantized(back) == data
    assert np.array_equal(dequantize(back), dequantize(q))
    assert unpack_quantized(memoryview(data), n, s).n == n


@pytest.mark.parametrize("s", [1, 2, 3, 4, 7, 8, 127, 128, 1000, 2**31 - 1])
def test_symbol_bits_is_ceil_log2_of_2s_plus_1(s: int) -> None:
    assert symbol_bits(s) == math.ceil(math.log2(2 * s + 1))
    assert 2 ** symbol_bits(s) >= 2 * s + 1 > 2 ** (symbol_bits(s) - 1)


@pytest.mark.parametrize("vec", GOLDEN["packed_qsgd"], ids=lambda v: f"s{v['s']}")
def test_pack_golden(vec: dict) -> None:
    q = Quantized(
        norm=vec["norm"], signs=np.array(vec["signs"]), levels=np.array(vec["levels"]), s=vec["s"]
    )
    assert pack_quantized(q).hex() == vec["packed_hex"]
    back = unpack_quantized(bytes.fromhex(vec["packed_hex"]), len(vec["levels"]), vec["s"])
    assert back.levels.tolist() == vec["levels"] and float(back.norm) == vec["norm"]


def test_pack_layout_by_hand() -> None:
    q = Quantized(
        norm=1.5, signs=np.array([False, True, False]), levels=np.array([2, 1, 0]), s=2
    )  # symbols 4, 1, 2 at 3 bits each
    data = pack_quantized(q)
    assert data[:4] == np.float32(1.5).tobytes() == bytes.fromhex("0000c03f")
    assert data[4:8] == (3).to_bytes(4, "little") and data[8:12] == (2).to_bytes(4, "little")
    assert data[12:] == (4 | 1 << 3 | 2 << 6).to_bytes(2, "little")


def _valid_message(s: int = 3, n: int = 9) -> bytes:
    rng = np.random.default_rng(5)
    return pack_quantized(quantize(rng.standard_normal(n), s, rng))


@pytest.mark.parametrize("s", [3, 127])
def test_unpack_rejects_every_truncation_and_oversize(s: int) -> None:
    data = _valid_message(s)
    expected = packed_size(9, s)
    for cut in range(len(data)):
        with pytest.raises(ValueError, match=rf"exactly {expected} bytes .* got {cut}$"):
            unpack_quantized(data[:cut], 9, s)
    with pytest.raises(ValueError, match=rf"exactly {expected} bytes .* got {expected + 1}$"):
        unpack_quantized(data + b"\x00", 9, s)


def _with_header(
    data: bytes, norm: float | None = None, n: int | None = None, s: int | None = None
) -> bytes:
    head = bytearray(data[:HEADER_SIZE])
    if norm is not None:
        head[0:4] = np.float32(norm).tobytes()
    if n is not None:
        head[4:8] = n.to_bytes(4, "little")
    if s is not None:
        head[8:12] = s.to_bytes(4, "little")
    return bytes(head) + data[HEADER_SIZE:]


def test_unpack_rejects_malformed_content() -> None:
    data = _valid_message(3, 9)
    with pytest.raises(ValueError, match="header says n=8, s=3, expected n=9, s=3"):
        unpack_quantized(_with_header(data, n=8), 9, 3)
    with pytest.raises(ValueError, match="header says n=9, s=4, expected n=9, s=3"):
        unpack_quantized(_with_header(data, s=4), 9, 3)
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="norm"):
            unpack_quantized(_with_header(data, norm=bad), 9, 3)
    # s = 3: 3-bit symbols in [0, 6]; 7 is not a symbol.
    with pytest.raises(ValueError, match="symbol 7 at coordinate 0 exceeds 2s = 6"):
        unpack_quantized(data[:HEADER_SIZE] + bytes([data[HEADER_SIZE] | 7]) + data[13:], 9, 3)
    # 9 symbols x 3 bits = 27 bits: the top 5 bits of the 4th payload byte are padding.
    with pytest.raises(ValueError, match="padding"):
        unpack_quantized(data[:-1] + bytes([data[-1] | 0x80]), 9, 3)
    # s = 127: one byte per symbol, 255 is not a symbol.
    d127 = _valid_message(127, 4)
    with pytest.raises(ValueError, match="symbol 255 at coordinate 3 exceeds 2s = 254"):
        unpack_quantized(d127[:-1] + b"\xff", 4, 127)
    with pytest.raises(TypeError, match="bytes-like"):
        unpack_quantized("not bytes", 9, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(norm=-1.0, signs=np.zeros(1, bool), levels=np.zeros(1, int), s=1), "norm"),
        (dict(norm=np.nan, signs=np.zeros(1, bool), levels=np.zeros(1, int), s=1), "norm"),
        (dict(norm=1.0, signs=np.zeros(2, bool), levels=np.zeros(1, int), s=1), "signs"),
        (dict(norm=1.0, signs=np.zeros(1, bool), levels=np.array([2]), s=1), r"\[0, s=1\]"),
        (dict(norm=1.0, signs=np.zeros(1, bool), levels=np.array([-1]), s=1), r"\[0, s=1\]"),
        (dict(norm=1.0, signs=np.zeros(1, bool), levels=np.zeros(1), s=1), "integer"),
        (dict(norm=1.0, signs=np.zeros(1, bool), levels=np.zeros(1, int), s=0), "levels"),
    ],
)
def test_quantized_validates(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Quantized(**kwargs)


def test_fed_spa_cnn_upload_size() -> None:
    """Issue 4, must show 2: the Fed-SPA CNN update at p = 0.05 with 8-bit values."""
    d, s = FED_SPA_CNN_D, 127
    k = kept_count(d, 0.05)
    assert symbol_bits(s) == 8
    rng = np.random.default_rng(0)
    update = (rng.standard_normal(d) * 1e-2).astype(np.float32)
    idx = coordinate_set(SEED, d, k)
    data = pack_quantized(quantize(sparsify(update, idx), s, rng))
    size = len(data)
    assert size == packed_size(k, s) == HEADER_SIZE + k == 1104
    assert size <= 1.05 * (k * 8 / 8 + HEADER_SIZE)
    assert 4 * d / size >= 60  # 87360 / 1104 = 79.1x


# --------------------------------------------------------------------------- fixed point


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(scale=0.0, bits=32), "scale"),
        (dict(scale=math.inf, bits=32), "scale"),
        (dict(scale=True, bits=32), "scale"),
        (dict(scale=1.0, bits=1), "bits"),
        (dict(scale=1.0, bits=65), "bits"),
        (dict(scale=1.0, bits=32.0), "bits"),
    ],
)
def test_fixed_point_config_validates(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FixedPoint(**kwargs)


def test_fixed_point_exact_on_grid_values() -> None:
    fp = FixedPoint(scale=2.0**10, bits=24)
    x = np.array([-3.5, -1 / 1024, 0.0, 1 / 1024, 2047.0, -2048.0])
    enc = fp.encode(x, np.random.default_rng(0))
    assert enc.dtype == np.uint64 and np.all(enc < 2**24)
    assert enc[0] == 2**24 - 3584 and enc[2] == 0
    assert np.array_equal(fp.decode(enc, 1), x)


@given(
    bits=st.integers(8, 64),
    log_scale=st.integers(0, 24),
    cohort=st.integers(1, 16),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=80, deadline=None)
def test_fixed_point_cohort_sum_decodes_within_count_over_scale(
    bits: int, log_scale: int, cohort: int, n: int, seed: int
) -> None:
    fp = FixedPoint(scale=2.0**log_scale, bits=bits)
    room = bits - 1 - (cohort - 1).bit_length()  # value bits the no-wrap check allows
    if room < 1:
        with pytest.raises(ValueError, match="may wrap"):
            fp.check_no_wrap(1.0 / fp.scale, cohort)
        return
    bound = min(2.0 ** (room - 1), 2.0**52) / fp.scale
    assert fp.check_no_wrap(bound, cohort) <= bits
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-bound, bound, size=(cohort, n))
    encs = np.stack([fp.encode(x, rng) for x in xs])
    for x, e in zip(xs, encs, strict=True):  # a single vector: within 1/scale
        assert np.all(np.abs(fp.decode(e, 1) - x) <= 1 / fp.scale)
    total = encs.sum(axis=0, dtype=np.uint64)  # wraps mod 2^64, a multiple of 2^bits
    exact = np.array([math.fsum(col) for col in xs.T])
    assert np.all(
        np.abs(fp.decode(total, cohort) - exact)
        <= cohort / fp.scale * (1 + 1e-12) + 1e-15 * np.abs(exact)
    )
    assert np.array_equal(
        fp.decode(total & np.uint64(fp.modulus - 1), cohort), fp.decode(total, cohort)
    )


def test_fixed_point_stochastic_rounding_is_unbiased() -> None:
    fp = FixedPoint(scale=4.0, bits=16)
    x = np.array([0.1, -0.3, 1.875, -2.0, 0.0])
    rng = np.random.default_rng(11)
    trials = 4000
    mean = np.mean([fp.decode(fp.encode(x, rng), 1) for _ in range(trials)], axis=0)
    frac = x * fp.scale - np.floor(x * fp.scale)
    se = np.sqrt(frac * (1 - frac) / trials) / fp.scale
    assert np.all(np.abs(mean - x) <= 5 * se + 1e-15)


def test_fixed_point_check_no_wrap_names_the_numbers() -> None:
    fp = FixedPoint(scale=2.0**16, bits=32)
    # |x| <= 1: ceil(65536) = 2^16 needs 17 bits; 100 devices add 7; + sign = 25.
    assert fp.check_no_wrap(1.0, 100) == 25
    assert fp.check_no_wrap(1.0, 2**14) == 32  # exactly fits
    with pytest.raises(
        ValueError,
        match=(
            r"needs 17 value bits, a cohort of 16385 adds "
            r"ceil\(log2\(16385\)\) = 15, plus 1 sign bit = 33 > "
            r"bits = 32"
        ),
    ):
        fp.check_no_wrap(1.0, 2**14 + 1)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_abs_value"):
            fp.check_no_wrap(bad, 2)
    with pytest.raises(ValueError, match="cohort_size"):
        fp.check_no_wrap(1.0, 0)


def test_fixed_point_wrap_is_what_the_check_prevents() -> None:
    fp = FixedPoint(scale=1.0, bits=8)
    enc = fp.encode(np.array([100.0]), np.random.default_rng(0))
    assert fp.decode(enc + enc, 2)[0] == 200 - 256  # wrapped: the check would have refused
    with pytest.raises(ValueError, match="= 9 > bits = 8"):
        fp.check_no_wrap(100.0, 2)


def test_fixed_point_encode_and_decode_reject() -> None:
    fp = FixedPoint(scale=1.0, bits=8)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="finite"):
        fp.encode(np.array([0.0, np.nan]), rng)
    with pytest.raises(ValueError, match="finite"):
        fp.encode(np.array([np.inf]), rng)
    with pytest.raises(ValueError, match="must be <= 127 to fit 8 bits"):
        fp.encode(np.array([128.0]), rng)
    with pytest.raises(ValueError, match="must be <= 9007199254740992"):
        FixedPoint(scale=1.0, bits=64).encode(np.array([2.0**60]), rng)
    with pytest.raises(ValueError, match="integer array"):
        fp.decode(np.array([1.0]), 1)
    with pytest.raises(ValueError, match="count"):
        fp.decode(np.array([1], dtype=np.uint64), 0)


def test_fixed_point_tiny_and_signed_sums() -> None:
    fp = FixedPoint(scale=2.0**20, bits=64)
    rng = np.random.default_rng(0)
    tiny = np.array([1e-300, -1e-300, np.finfo(np.float64).tiny, 0.0])
    assert np.all(np.abs(fp.decode(fp.encode(tiny, rng), 1)) <= 1 / fp.scale)
    signed_sum = np.array([-5, 3], dtype=np.int64)  # a sum kept in int64 also decodes
    assert fp.decode(signed_sum, 2).tolist() == [-5 / fp.scale, 3 / fp.scale]


# --------------------------------------------------------------------------- cpSGD


def test_binomial_noise_is_centered_with_variance_m_over_4() -> None:
    m, trials = 100, 40_000
    noise = binomial_noise((trials,), m, np.random.default_rng(9))
    assert noise.dtype == np.int64 and noise.shape == (trials,)
    assert noise.min() >= -m // 2 and noise.max() <= m // 2
    var = m / 4
    assert abs(noise.mean()) <= 5 * math.sqrt(var / trials)
    # Var of the sample variance ~ (mu4 - var^2) / N, mu4 = 3 var^2 - m/8 for Bin(m, 1/2).
    assert abs(noise.var() - var) <= 5 * math.sqrt((2 * var**2 - m / 8) / trials)
    assert not binomial_noise((2, 3), 0, np.random.default_rng(0)).any()


@pytest.mark.parametrize("m", [3, -2, 2.0])
def test_binomial_noise_rejects(m: object) -> None:
    with pytest.raises(ValueError, match="m"):
        binomial_noise(4, m, np.random.default_rng(0))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- top-k


def test_top_k_refused_under_dp() -> None:
    with pytest.raises(ValueError, match=r"data-dependent.*mask cancellation"):
        TopK(k=2, d=8, dp_enabled=True)
    with pytest.raises(ValueError, match="data-dependent"):
        top_k_feedback(np.ones(8), np.zeros(8), 2, dp_enabled=True)


def test_top_k_error_feedback_conserves_the_update() -> None:
    rng = np.random.default_rng(4)
    d, k = 50, 5
    tk = TopK(k=k, d=d, dp_enabled=False)
    sent = np.zeros(d)
    given_total = np.zeros(d)
    for _ in range(20):
        x = rng.standard_normal(d).astype(np.float32)
        before = tk.residual + x
        idx, values = tk.compress(x)
        assert idx.size == k and np.all(np.diff(idx) > 0) and values.dtype == np.float32
        top = np.sort(np.argsort(-np.abs(before), kind="stable")[:k])
        assert np.array_equal(idx, top)
        sent[idx] += values
        given_total += x
    np.testing.assert_allclose(sent + tk.residual, given_total, atol=1e-9)


def test_top_k_rejects() -> None:
    with pytest.raises(ValueError, match="finite"):
        top_k_feedback(np.array([np.nan, 1.0]), np.zeros(2), 1, dp_enabled=False)
    with pytest.raises(ValueError, match="residual"):
        top_k_feedback(np.ones(3), np.zeros(2), 1, dp_enabled=False)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        TopK(k=5, d=4, dp_enabled=False)
