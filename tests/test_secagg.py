"""Secure aggregation: edge_sdk.hazmat's masking, shamir and graph (the arithmetic both
sides share), edge_sdk.secagg (messages, device side) and aggregator.secagg_server
(aggregator side), both ends driven through an in-memory transport.

Oracles: RFC 8439 A.1 (ChaCha20), RFC 7748 6.1 (X25519), RFC 8032 7.1 (Ed25519) for the
primitives; hand-computed ring arithmetic for the sign convention; the golden vectors in
``tests/golden/secagg_vectors.json`` pin every wire format (regenerate them only with a new
version label: ``python tests/test_secagg.py --regenerate``). Statistical checks use fixed
seeds (deterministic) and a significance level of 1e-3.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import string
import sys
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

import edge_sdk.secagg
from aggregator import secagg_server
from aggregator.secagg_server import (
    AmortizedSecAggServer,
    SecAggServer,
    ServerStage,
    run_amortized_round,
    run_round,
)
from edge_sdk import compress, secagg
from edge_sdk.errors import (
    EdgeError,
    LocalProtocolError,
    RemoteProtocolError,
    ReplayedMessage,
    RoundFailed,
    UnmaskRefused,
)
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.hazmat import graph, masking, prg
from edge_sdk.hazmat.graph import default_degree, default_threshold, neighbour_graph
from edge_sdk.hazmat.masking import (
    amortized_pair_seed,
    amortized_round_seed,
    derive_pairwise_seed,
    derive_share_key,
    mask,
    mask_sign,
    unmask,
)
from edge_sdk.hazmat.ring import Ring
from edge_sdk.hazmat.shamir import (
    SHAMIR_PRIME,
    combine_shares,
    share_from_bytes,
    share_to_bytes,
    split_secret,
)
from edge_sdk.secagg import (
    AggregatorIdentity,
    AmortizedSecAggClient,
    ClientState,
    DeviceIdentity,
    PairwiseSeeds,
    Registry,
    RoundConfig,
    SecAggClient,
)
from edge_sdk.wire import (
    SECAGG_DOWN,
    SECAGG_UP,
    SIGNING_LABEL,
    AdvertiseKeys,
    EncryptedShare,
    ForwardedShares,
    MaskedPart,
    NeighbourKeys,
    RevealRequest,
    UnmaskRequest,
    decode,
    encode,
)
from edge_sdk.wire.schema import catalog

SECAGG_KINDS = catalog(*SECAGG_UP.values(), *SECAGG_DOWN.values(), EncryptedShare)
"""Every SecAgg kind (``encrypted_share`` only travels nested; decoded alone here)."""


def encode_message(msg: Any) -> bytes:
    return encode(msg)


def decode_message(data: bytes) -> Any:
    return decode(data, SECAGG_KINDS)

GOLDEN_PATH = Path(__file__).parent / "golden" / "secagg_vectors.json"
PROTO = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
FAST = settings(max_examples=60, deadline=None, derandomize=True)
ALPHA = 1e-3

# RFC 8439 Appendix A.1, test vector #1: key 0^32, nonce 0, block counter 0.
RFC8439_A1_KEYSTREAM = (
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
)
# RFC 7748 section 6.1.
RFC7748_ALICE = "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"
RFC7748_BOB = "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"
RFC7748_SHARED = "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
# RFC 8032 section 7.1, TEST 1 secret key.
RFC8032_TEST1_SK = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"


def det_random(label: str | int) -> Callable[[int], bytes]:
    """A deterministic ``random_bytes`` for reproducible tests (never for production)."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(str(label).encode()).digest()[:8]))
    return lambda n: rng.bytes(n)


# --------------------------------------------------------------------------- worlds


class World:
    """Enrolled devices and an aggregator; builds configs, clients and servers."""

    def __init__(self, n: int, *, seed: int = 0, names: list[str] | None = None) -> None:
        self.ids = sorted(names or [f"d{i:02d}" for i in range(n)])
        rnd = det_random(f"world/{seed}")
        self.devices = {d: DeviceIdentity.generate(d, random_bytes=rnd) for d in self.ids}
        self.outsider = DeviceIdentity.generate("zz-outsider", random_bytes=rnd)
        self.aggregator = AggregatorIdentity.generate(random_bytes=rnd)
        self.registry = Registry.of(self.aggregator, [*self.devices.values(), self.outsider])
        self.seed = seed

    def config(
        self,
        *,
        round_id: int = 1,
        bits: int = 16,
        length: int = 6,
        cohort: list[str] | None = None,
        **kw: Any,
    ) -> RoundConfig:
        nonce = hashlib.sha256(f"nonce/{self.seed}/{round_id}".encode()).digest()
        return RoundConfig.for_cohort(
            round_id=round_id,
            nonce=nonce,
            cohort=cohort or self.ids,
            bits=bits,
            length=length,
            **kw,
        )

    def clients(self, cfg: RoundConfig, tag: object = 0) -> dict[str, SecAggClient]:
        return {
            d: SecAggClient(
                identity=self.devices[d],
                registry=self.registry,
                config=cfg,
                random_bytes=det_random(f"{self.seed}/{cfg.round_id}/{d}/{tag}"),
            )
            for d in cfg.cohort
        }

    def server(self, cfg: RoundConfig) -> SecAggServer:
        return SecAggServer(identity=self.aggregator, registry=self.registry, config=cfg)


def ring_sum(xs: list[np.ndarray], bits: int, length: int) -> np.ndarray:
    """The sum mod 2^bits computed with Python integers (the oracle)."""
    out = [sum(int(x[i]) for x in xs) % (1 << bits) for i in range(length)]
    return np.array(out, dtype=np.uint64)


def random_inputs(cfg: RoundConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hi = (1 << cfg.bits) - 1
    return {
        d: rng.integers(0, hi, size=cfg.length, dtype=np.uint64, endpoint=True) for d in cfg.cohort
    }


class Stepper:
    """Drives one round stage by stage, so tests can interfere between stages."""

    def __init__(self, world: World, cfg: RoundConfig, inputs: dict[str, np.ndarray]) -> None:
        self.w, self.cfg, self.x = world, cfg, inputs
        self.server = world.server(cfg)
        self.clients = world.clients(cfg)
        self.sent: dict[str, list[Any]] = {}

    def _send(self, dev: str, msgs: Any) -> None:
        for msg in msgs if isinstance(msgs, tuple) else (msgs,):  # masked parts: a tuple
            self.sent.setdefault(msg.KIND, []).append(msg)
            self.server.receive(decode_message(encode_message(msg)))

    def advertise(self, skip: Collection[str] = ()) -> dict[str, NeighbourKeys]:
        for d, c in self.clients.items():
            if d not in skip:
                self._send(d, c.advertise())
        return self.server.close_advertise()

    def share(
        self,
        nk: dict[str, NeighbourKeys],
        skip: Collection[str] = (),
    ) -> dict[str, ForwardedShares]:
        for d, m in nk.items():
            if d not in skip:
                self._send(d, self.clients[d].share_keys(m))
        return self.server.close_share_keys()

    def masked(
        self,
        fwd: dict[str, ForwardedShares],
        skip: Collection[str] = (),
    ) -> dict[str, UnmaskRequest]:
        for d, m in fwd.items():
            if d not in skip:
                self._send(d, self.clients[d].mask_input(m, self.x[d]))
        return self.server.close_masked_input()

    def unmask(
        self,
        req: dict[str, UnmaskRequest],
        skip: Collection[str] = (),
    ) -> np.ndarray:
        for d, m in req.items():
            if d not in skip:
                self._send(d, self.clients[d].unmask(m))
        return self.server.finalize()


# --------------------------------------------------------------------------- API


@pytest.mark.parametrize("module", [secagg, secagg_server])
def test_all_is_honest(module: Any) -> None:
    public = {n for n in dir(module) if not n.startswith("_")}
    assert set(module.__all__) <= public
    defined_here = {
        n for n in public if getattr(getattr(module, n), "__module__", None) == module.__name__
    }
    assert defined_here <= set(module.__all__)


def test_exception_tree() -> None:
    assert issubclass(ReplayedMessage, RemoteProtocolError)
    assert issubclass(UnmaskRefused, RemoteProtocolError)
    for e in (LocalProtocolError, RemoteProtocolError, RoundFailed):
        assert issubclass(e, EdgeError)  # one root for edge_sdk (edge_sdk.errors)
    assert not issubclass(RoundFailed, RemoteProtocolError)


def test_recipe_api_is_the_recipes() -> None:
    """edge_sdk.secagg exports the recipes only; the misusable primitives stay in hazmat."""
    assert set(secagg.__all__) == {
        "SecAggClient", "AmortizedSecAggClient", "PairwiseSeeds", "ClientState",
        "RoundConfig", "DeviceIdentity", "AggregatorIdentity", "Registry", "Enrollment"}
    for primitive in ("prg_expand", "mask", "unmask", "split_secret", "combine_shares"):
        assert not hasattr(secagg, primitive)


def test_edge_sdk_does_not_import_aggregator() -> None:
    for package in (edge_sdk.secagg, edge_sdk.hazmat):
        for path in Path(package.__file__).parent.glob("*.py"):
            source = path.read_text()
            assert "import aggregator" not in source and "from aggregator" not in source


# --------------------------------------------------------------------------- PRG


@pytest.mark.parametrize(("bits", "width"), [(1, "<u1"), (16, "<u2"), (32, "<u4"), (64, "<u8")])
def test_prg_is_rfc8439_chacha20_keystream_at_the_ring_width(bits: int, width: str) -> None:
    want = np.frombuffer(bytes.fromhex(RFC8439_A1_KEYSTREAM), dtype=width)
    got = prg.expand(bytes(32), want.size, Ring(bits=bits))
    assert got.dtype == Ring(bits=bits).dtype and got.dtype.itemsize == want.dtype.itemsize
    np.testing.assert_array_equal(got, want)


def test_prg_at_b32_reads_exactly_4_bytes_per_coordinate() -> None:
    s = bytes(range(32))
    words = prg.expand(s, 1001, Ring(bits=32))
    assert words.dtype == np.uint32
    assert words.astype("<u4").tobytes() == prg.keystream_bytes(s, 4 * 1001)


def test_prg_prefix_consistent_and_seed_sensitive() -> None:
    s = bytes(range(32))
    ring = Ring(bits=64)
    long = prg.expand(s, 1000, ring)
    np.testing.assert_array_equal(prg.expand(s, 17, ring), long[:17])
    assert prg.expand(s, 0, ring).shape == (0,)
    other = prg.expand(bytes(range(1, 33)), 1000, ring)
    assert not np.any(long == other)
    assert long.dtype == np.uint64 and long.flags.writeable
    buf = np.empty(17, dtype=np.uint32)
    assert prg.expand(s, 17, Ring(bits=20), out=buf) is buf
    with pytest.raises(ValueError, match="uint32 array of shape"):
        prg.expand(s, 17, Ring(bits=32), out=np.empty(17, dtype=np.uint64))


@pytest.mark.parametrize("seed", [b"", bytes(16), bytes(31), bytes(33), "x" * 32])
def test_prg_requires_a_32_byte_seed(seed: Any) -> None:
    with pytest.raises(ValueError, match="seed must be 32 bytes"):
        prg.expand(seed, 4, Ring(bits=32))


def test_prg_words_mod_2b_uniform() -> None:
    for bits in (1, 4, 8, 12):
        ring = Ring(bits=bits)
        w = prg.expand(hashlib.sha256(b"uniform").digest(), 1 << 15, ring) & ring.dtype.type(
            (1 << bits) - 1
        )
        counts = np.bincount(w.astype(np.int64), minlength=1 << bits)
        assert stats.chisquare(counts).pvalue > ALPHA


# --------------------------------------------------------------------------- masks


seeds32 = st.binary(min_size=32, max_size=32)
signs = st.sampled_from([1, -1])


@FAST
@given(bits=st.integers(1, 64), data=st.data())
def test_unmask_inverts_mask(bits: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 20))
    x = np.array(
        data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n)),
        dtype=np.uint64,
    )
    terms = data.draw(st.lists(st.tuples(signs, seeds32), max_size=4))
    y = mask(x, bits=bits, terms=terms)
    assert y.dtype == Ring(bits=bits).dtype and (bits == 64 or int(y.max()) < 1 << bits)
    np.testing.assert_array_equal(unmask(y, bits=bits, terms=terms), x)


@FAST
@given(bits=st.integers(1, 64), data=st.data())
def test_pairwise_masks_cancel_in_the_sum(bits: int, data: st.DataObject) -> None:
    ids = sorted(
        data.draw(
            st.sets(
                st.text(alphabet=string.ascii_letters + string.digits + "_.-", min_size=1,
                        max_size=5),
                min_size=2,
                max_size=6,
            )
        )
    )
    n = data.draw(st.integers(1, 8))
    xs = {
        u: np.array(
            data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n)),
            dtype=np.uint64,
        )
        for u in ids
    }
    pair = {
        frozenset(p): hashlib.sha256("|".join(sorted(p)).encode()).digest()
        for p in itertools.combinations(ids, 2)
    }
    ys = [
        mask(
            xs[u],
            bits=bits,
            terms=[(mask_sign(u, v), pair[frozenset((u, v))]) for v in ids if v != u],
        )
        for u in ids
    ]
    total = np.zeros(n, dtype=np.uint64)
    for y in ys:
        total += y
    np.testing.assert_array_equal(
        unmask(total, bits=bits, terms=[]), ring_sum(list(xs.values()), bits, n)
    )


@pytest.mark.parametrize("signs", [(1, -1), (-1, 1), (-1, -1)])
@pytest.mark.parametrize("x_dtype", ["uint64", "ring"])
@pytest.mark.parametrize("bits", [20, 32, 40, 64])
def test_mask_streams_the_same_words_as_prg_expand_across_chunks(
    bits: int, x_dtype: str, signs: tuple[int, int]
) -> None:
    ring = Ring(bits=bits)
    # several chunks and a partial one
    n = 3 * (masking._CHUNK_BYTES // ring.dtype.itemsize) + 123  # noqa: SLF001
    x = (np.arange(n, dtype=np.uint64) * 0x9E3779B97F4A7C15) % np.uint64(ring.modulus - 1)
    x = x.astype(ring.dtype if x_dtype == "ring" else np.uint64)
    s1, s2 = hashlib.sha256(b"s1").digest(), hashlib.sha256(b"s2").digest()
    # the words at the ring's width, summed in Python integers (no wrap to rely on)
    a, b = (prg.expand(s, n, ring).astype(object) for s in (s1, s2))
    want = (x.astype(object) + signs[0] * a + signs[1] * b) % ring.modulus
    terms = [(signs[0], s1), (signs[1], s2)]
    got = mask(x, bits=bits, terms=terms)
    assert got.dtype == ring.dtype
    np.testing.assert_array_equal(got.astype(object), want)
    np.testing.assert_array_equal(unmask(got, bits=bits, terms=terms), x)
    if bits < 64:  # an unreduced wider sum unmasks too
        wide = got.astype(np.uint64) + np.uint64(ring.modulus)
        np.testing.assert_array_equal(unmask(wide, bits=bits, terms=terms), x)


def test_a_big_endian_host_swaps_each_word_once(monkeypatch) -> None:
    """The words are little-endian by definition; on a big-endian host the masking loop
    swaps every word it fills, the first term's too. Forced here on a little-endian host,
    the result is that of byte-swapped words."""
    monkeypatch.setattr(masking, "_BIG_ENDIAN", True)
    ring = Ring(bits=32)
    n = masking._CHUNK_BYTES // 4 + 7  # noqa: SLF001 (two chunks)
    x = np.arange(n, dtype=np.uint32)
    s1, s2 = hashlib.sha256(b"s1").digest(), hashlib.sha256(b"s2").digest()
    a, b = (prg.expand(s, n, ring).byteswap().astype(object) for s in (s1, s2))
    got = mask(x, bits=32, terms=[(1, s1), (-1, s2)])
    np.testing.assert_array_equal(got.astype(object), (x.astype(object) + a - b) % 2**32)


def test_mask_checks_every_chunk_of_a_wide_input() -> None:
    n = 2 * (masking._CHUNK_BYTES // 4) + 5  # noqa: SLF001
    x = np.zeros(n, dtype=np.uint32)
    x[n - 2] = 1 << 20  # in the last chunk: out of a 20-bit ring, in its uint32 dtype
    with pytest.raises(ValueError, match=rf"residues in \[0, 2\^20\), got 1048576 at {n - 2}"):
        mask(x, bits=20, terms=[(1, bytes(32))])
    x[n - 2] = (1 << 20) - 1
    assert int(mask(x, bits=20, terms=[]).max()) == (1 << 20) - 1


def test_mask_sign_convention() -> None:
    assert mask_sign("alice", "bob") == 1 and mask_sign("bob", "alice") == -1
    assert mask_sign("d10", "d9") == 1  # string order, not numeric
    assert mask_sign("Z", "a") == 1  # code points: upper case sorts first
    with pytest.raises(ValueError, match="two distinct devices"):
        mask_sign("a", "a")


def test_mask_rejects_out_of_ring_inputs() -> None:
    with pytest.raises(ValueError, match=r"residues in \[0, 2\^4\), got 16 at 1"):
        mask(np.array([3, 16]), bits=4, terms=[])
    with pytest.raises(ValueError, match="got -1 at 0"):
        mask(np.array([-1, 0]), bits=8, terms=[])
    with pytest.raises(ValueError, match="1-D integer array"):
        mask(np.array([0.5]), bits=8, terms=[])
    with pytest.raises(ValueError, match="sign must be"):
        mask(np.array([1]), bits=8, terms=[(2, bytes(32))])


@FAST
@given(bits=st.integers(1, 64), data=st.data())
def test_pack_roundtrip_and_size(bits: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 40))
    v = np.array(
        data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n)),
        dtype=np.uint64,
    )
    raw = Ring(bits=bits).pack(v)
    assert len(raw) == (n * bits + 7) // 8
    np.testing.assert_array_equal(Ring(bits=bits).unpack(raw, n), v)


def test_unpack_rejects_bad_length_and_padding() -> None:
    raw = Ring(bits=3).pack(np.array([1, 2, 3], dtype=np.uint64))  # 9 bits -> 2 bytes
    with pytest.raises(ValueError, match="take 2 bytes, got 3"):
        Ring(bits=3).unpack(raw + b"\0", 3)
    with pytest.raises(ValueError, match="padding bits"):
        Ring(bits=3).unpack(raw[:1] + bytes([raw[1] | 0x80]), 3)


# --------------------------------------------------------------------------- Shamir


@FAST
@given(data=st.data())
def test_shamir_any_t_shares_recover_the_secret(data: st.DataObject) -> None:
    secret = data.draw(st.integers(0, (1 << 256) - 1))
    k = data.draw(st.integers(1, 12))
    t = data.draw(st.integers(1, k))
    xs = data.draw(st.lists(st.integers(1, 1 << 16), min_size=k, max_size=k, unique=True))
    shares = split_secret(secret, threshold=t, xs=xs, random_bytes=det_random(secret))
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=k, unique=True))
    assert combine_shares({x: shares[x] for x in subset}, threshold=t) == secret
    if t > 1:
        with pytest.raises(ValueError, match=f"at least threshold = {t} shares"):
            combine_shares({x: shares[x] for x in subset[: t - 1]}, threshold=t)


@pytest.mark.parametrize(("p", "t"), [(5, 2), (7, 3), (5, 4)])
def test_shamir_t_minus_1_shares_are_independent_of_the_secret_exhaustive(p: int, t: int) -> None:
    """By construction: for EVERY secret, the map from the t - 1 random coefficients to the
    t - 1 shares at fixed points is a bijection of GF(p)^(t-1); uniform coefficients thus
    give uniform shares, the same distribution whatever the secret."""
    xs = list(range(1, t))
    for secret in range(p):
        images = set()
        for coeffs in itertools.product(range(p), repeat=t - 1):
            poly = (secret, *coeffs)
            images.add(tuple(sum(c * x**i for i, c in enumerate(poly)) % p for x in xs))
        assert len(images) == p ** (t - 1)


def test_shamir_t_minus_1_shares_same_distribution_statistically() -> None:
    """split_secret itself, small field: the t - 1 = 2 shares of secret 0 and of secret 4 are
    both uniform on GF(5)^2 and indistinguishable (chi-square, fixed seeds)."""
    p, t, xs, trials = 5, 3, [1, 2, 3], 4000
    tables = []
    for secret in (0, 4):
        rnd = det_random(f"shamir-stat/{secret}")
        counts = np.zeros(p * p, dtype=np.int64)
        for _ in range(trials):
            sh = split_secret(secret, threshold=t, xs=xs, random_bytes=rnd, prime=p)
            counts[sh[1] * p + sh[2]] += 1
        assert stats.chisquare(counts).pvalue > ALPHA
        tables.append(counts)
    assert stats.chi2_contingency(np.array(tables)).pvalue > ALPHA


def test_shamir_t_minus_1_real_shares_fit_every_secret() -> None:
    """Over the real field: t - 1 shares of a secret are consistent with any other secret
    (a degree t - 1 polynomial through them and (0, s') exists for every s')."""
    t, xs = 4, [3, 7, 9, 11]
    shares = split_secret(12345, threshold=t, xs=xs, random_bytes=det_random("real"))
    seen = {x: shares[x] for x in xs[: t - 1]}
    for other in (0, 1, 2**256 - 1):
        # the polynomial through (0, s') and the t - 1 shares: its value at the t-th point
        # completes a valid share set, and combining reproduces s'
        pts = {0: other, **seen}
        x_new = xs[t - 1]
        value = _interpolate(pts, x_new, SHAMIR_PRIME)
        assert combine_shares({**seen, x_new: value}, threshold=t) == other


def _interpolate(points: dict[int, int], x: int, p: int) -> int:
    total = 0
    for xi, yi in points.items():
        num = den = 1
        for xj in points:
            if xj != xi:
                num = num * (x - xj) % p
                den = den * (xi - xj) % p
        total += yi * num * pow(den, -1, p)
    return total % p


def test_share_encoding() -> None:
    assert share_to_bytes(1) == bytes(65) + b"\x01"
    assert share_from_bytes(share_to_bytes(SHAMIR_PRIME - 1)) == SHAMIR_PRIME - 1
    with pytest.raises(ValueError, match="must be < 2\\^521 - 1"):
        share_from_bytes((SHAMIR_PRIME).to_bytes(66, "big"))
    with pytest.raises(ValueError, match="66 bytes"):
        share_from_bytes(bytes(65))


# --------------------------------------------------------------------------- graph, config


def test_default_degree_and_threshold() -> None:
    assert default_degree(1000) == 20 and default_threshold(20) == 11
    assert default_degree(100) == 14 and default_degree(5) == 4 and default_degree(3) == 2
    assert default_threshold(2) == 2 and default_threshold(99) == 50


@pytest.mark.parametrize(("n", "k"), [(3, 2), (10, 4), (11, 6), (50, 12), (8, 7), (30, 29)])
def test_neighbour_graph_is_k_regular_symmetric_and_seeded(n: int, k: int) -> None:
    ids = [f"n{i:03d}" for i in range(n)]
    g = neighbour_graph(ids, degree=k, seed=bytes(32))
    assert sorted(g) == ids
    for u, nb in g.items():
        assert len(nb) == k and u not in nb and list(nb) == sorted(nb)
        assert all(u in g[v] for v in nb)
    assert g == neighbour_graph(ids, degree=k, seed=bytes(32))
    if k < n - 1:
        assert g != neighbour_graph(ids, degree=k, seed=bytes([1]) * 32)


def test_neighbour_graph_rejects_bad_degree() -> None:
    with pytest.raises(ValueError, match="degree must be even"):
        neighbour_graph([f"n{i}" for i in range(10)], degree=5, seed=bytes(32))
    with pytest.raises(ValueError, match=r"degree must be in \[2, 9\]"):
        neighbour_graph([f"n{i}" for i in range(10)], degree=10, seed=bytes(32))


def test_config_validation_names_the_value() -> None:
    w = World(6)
    with pytest.raises(ValueError, match="threshold must exceed degree / 2 = 2.5"):
        w.config(threshold=2)
    with pytest.raises(ValueError, match="cohort must be sorted"):
        RoundConfig(
            round_id=1,
            nonce=bytes(32),
            cohort=("b", "a", "c"),
            bits=8,
            length=1,
            degree=2,
            threshold=2,
        )
    with pytest.raises(ValueError, match="bits must be in"):
        w.config(bits=65)
    with pytest.raises(ValueError, match="cohort size must be >= 3, got 2"):
        w.config(cohort=["d00", "d01"])


def test_config_wire_roundtrip_and_digest_binds_every_field() -> None:
    cfg = World(7).config(round_id=3, degree=4)
    assert RoundConfig.from_wire(msgpack.unpackb(msgpack.packb(cfg.to_wire()))) == cfg
    variants = [
        replace(cfg, round_id=4),
        replace(cfg, nonce=bytes(32)),
        replace(cfg, bits=17),
        replace(cfg, length=7),
        replace(cfg, threshold=4),
        replace(cfg, amortized=True),
        replace(cfg, cohort=cfg.cohort[:-1]),
    ]
    digests = {v.digest() for v in variants} | {cfg.digest()}
    assert len(digests) == len(variants) + 1
    with pytest.raises(RemoteProtocolError, match="round_config"):
        RoundConfig.from_wire({**cfg.to_wire(), "threshold": 1})


# --------------------------------------------------------------------------- golden vectors


def build_vectors() -> dict[str, Any]:
    """Every wire-level value, recomputed from the code (compared to the stored file)."""
    seed_a = bytes(range(32))
    shared_a = bytes(range(32, 64))
    pair_seed = derive_pairwise_seed(shared_a, context=seed_a)
    alice = X25519PrivateKey.from_private_bytes(bytes.fromhex(RFC7748_ALICE))
    bob = X25519PrivateKey.from_private_bytes(bytes.fromhex(RFC7748_BOB))
    dh = alice.exchange(bob.public_key())
    xa = np.array([1, 2, 3, 65535], dtype=np.uint64)
    xb = np.array([10, 20, 30, 40], dtype=np.uint64)
    dh_seed = derive_pairwise_seed(dh, context=bytes(32))
    ya = mask(xa, bits=16, terms=[(mask_sign("alice", "bob"), dh_seed)])
    yb = mask(xb, bits=16, terms=[(mask_sign("bob", "alice"), dh_seed)])
    amort = amortized_pair_seed(shared_a, "bob", "alice")
    shares = split_secret(
        int.from_bytes(seed_a, "big"), threshold=3, xs=[1, 2, 5], random_bytes=_counter_stream()
    )
    cfg = RoundConfig(
        round_id=42,
        nonce=bytes(range(32)),
        cohort=("alice", "bob", "carol"),
        bits=16,
        length=4,
        degree=2,
        threshold=2,
    )
    signer = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(RFC8032_TEST1_SK))
    advert = AdvertiseKeys(
        round_id=42, sender="alice", mask_key=bytes(range(32)), enc_key=bytes(range(32, 64))
    )
    advert = replace(advert, sig=signer.sign(advert.signing_bytes(cfg.digest())))
    graph_ids = [f"d{i}" for i in range(10)]
    return {
        "about": "Golden vectors of edge_sdk.secagg wire formats (version fedge/secagg/v2); the "
        "aggregator's tests read them too. Regenerate only with a new version label.",
        "prg": {
            "spec": "ChaCha20 (RFC 8439) keystream, key = seed, counter 0, nonce 0, as "
            "little-endian unsigned words of the ring's width w (the narrowest of 8, 16, 32, "
            "64 bits that holds b bits); masks are words & (2^b - 1)",
            "vectors": [
                {
                    "seed_hex": s.hex(),
                    "bits": b,
                    "width": 8 * Ring(bits=b).dtype.itemsize,
                    "n_words": 8,
                    "words": [str(w) for w in prg.expand(s, 8, Ring(bits=b)).tolist()],
                }
                for s in (bytes(32), seed_a)
                for b in (8, 16, 32, 64)
            ],
            "rfc8439_a1_keystream_hex": RFC8439_A1_KEYSTREAM,
        },
        "derivations": {
            "shared_secret_hex": shared_a.hex(),
            "context_hex": seed_a.hex(),
            "pairwise_seed_hex": pair_seed.hex(),
            "share_key_hex": derive_share_key(shared_a, context=seed_a).hex(),
            "amortized_pair_seed_alice_bob_hex": amort.hex(),
            "amortized_round_seed_round_5_hex": amortized_round_seed(amort, 5).hex(),
        },
        "sign_convention": {
            "spec": "the lower id (str order) adds PRG(s_uv), the higher subtracts it",
            "x25519_alice_sk_hex": RFC7748_ALICE,
            "x25519_bob_sk_hex": RFC7748_BOB,
            "x25519_shared_hex": dh.hex(),
            "context_hex": bytes(32).hex(),
            "pairwise_seed_hex": dh_seed.hex(),
            "bits": 16,
            "mask_words": [int(w) & 0xFFFF for w in prg.expand(dh_seed, 4, Ring(bits=16)).tolist()],
            "x_alice": xa.tolist(),
            "x_bob": xb.tolist(),
            "y_alice": ya.tolist(),
            "y_bob": yb.tolist(),
        },
        "pack_residues": [
            {
                "bits": b,
                "values": v,
                "packed_hex": Ring(bits=b).pack(np.array(v, dtype=np.uint64)).hex(),
            }
            for b, v in ((12, [1, 0xABC, 0xFFF, 0]), (3, [7, 0, 5]), (64, [2**64 - 1]))
        ],
        "shamir": {
            "prime": "2^521 - 1",
            "secret_hex": seed_a.hex(),
            "threshold": 3,
            "random_bytes": "SHA-256(b'fedge/test/stream' + u32be(i)) for i = 0, 1, ... "
            "concatenated",
            "shares_hex": {str(x): share_to_bytes(v).hex() for x, v in shares.items()},
        },
        "graph": {
            "cohort": graph_ids,
            "degree": 4,
            "seed_hex": bytes(32).hex(),
            "neighbours": {
                u: list(v) for u, v in neighbour_graph(graph_ids, degree=4, seed=bytes(32)).items()
            },
        },
        "config": {
            "wire_hex": msgpack.packb(cfg.to_wire(), use_bin_type=True).hex(),
            "digest_hex": cfg.digest().hex(),
        },
        "signed_advertise_keys": {
            "ed25519_sk_hex": RFC8032_TEST1_SK,
            "wire_hex": encode_message(advert).hex(),
        },
    }


def _counter_stream() -> Callable[[int], bytes]:
    buf = bytearray()
    counter = itertools.count()

    def take(n: int) -> bytes:
        while len(buf) < n:
            buf.extend(
                hashlib.sha256(b"fedge/test/stream" + next(counter).to_bytes(4, "big")).digest()
            )
        out = bytes(buf[:n])
        del buf[:n]
        return out

    return take


def test_golden_vectors_match_the_code() -> None:
    assert json.loads(GOLDEN_PATH.read_text()) == json.loads(json.dumps(build_vectors()))


def test_golden_vectors_against_independent_oracles() -> None:
    g = json.loads(GOLDEN_PATH.read_text())
    ks = bytes.fromhex(g["prg"]["rfc8439_a1_keystream_hex"])
    zero_seed = [v for v in g["prg"]["vectors"] if v["seed_hex"] == bytes(32).hex()]
    assert sorted(v["width"] for v in zero_seed) == [8, 16, 32, 64]
    for v in zero_seed:  # the keystream cut into words of the ring's width
        want = np.frombuffer(ks, f"<u{v['width'] // 8}")[: v["n_words"]].tolist()
        assert [int(w) for w in v["words"]] == want
    sc = g["sign_convention"]
    assert sc["x25519_shared_hex"] == RFC7748_SHARED
    m = sc["mask_words"]
    # by hand: alice < bob adds the mask, bob subtracts it, both mod 2^16
    assert sc["y_alice"] == [(x + w) % 65536 for x, w in zip(sc["x_alice"], m, strict=True)]
    assert sc["y_bob"] == [(x - w) % 65536 for x, w in zip(sc["x_bob"], m, strict=True)]
    assert [(a + b) % 65536 for a, b in zip(sc["y_alice"], sc["y_bob"], strict=True)] == [
        (a + b) % 65536 for a, b in zip(sc["x_alice"], sc["x_bob"], strict=True)
    ]
    p12 = g["pack_residues"][0]
    stream = int.from_bytes(bytes.fromhex(p12["packed_hex"]), "little")
    assert [(stream >> (12 * i)) & 0xFFF for i in range(4)] == p12["values"]
    sh = {int(x): int(v, 16) for x, v in g["shamir"]["shares_hex"].items()}
    assert _interpolate(sh, 0, SHAMIR_PRIME) == int(g["shamir"]["secret_hex"], 16)
    adv = decode_message(bytes.fromhex(g["signed_advertise_keys"]["wire_hex"]))
    pub = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(RFC8032_TEST1_SK)).public_key()
    pub.verify(
        adv.sig,
        SIGNING_LABEL
        + bytes.fromhex(g["config"]["digest_hex"])
        + msgpack.packb(
            {
                k: v
                for k, v in msgpack.unpackb(
                    bytes.fromhex(g["signed_advertise_keys"]["wire_hex"])
                ).items()
                if k != "sig"
            }
        ),
    )


# --------------------------------------------------------------------------- messages


def _all_messages() -> list[Any]:
    w = World(6)
    cfg = w.config(length=4, bits=12)
    st_ = Stepper(w, cfg, random_inputs(cfg, 0))
    nk = st_.advertise()
    fwd = st_.share(nk, skip={"d04"})
    req = st_.masked(fwd, skip={"d03"})
    st_.unmask(req)
    msgs = [m for kind in st_.sent.values() for m in kind]
    msgs += [nk["d00"], fwd["d00"], req["d00"], st_.sent["share_keys"][0].shares[0]]
    amo = World(4)
    acfg = amo.config(amortized=True, length=3)
    seeds = {d: PairwiseSeeds(identity=amo.devices[d], registry=amo.registry) for d in amo.ids}
    srv = AmortizedSecAggServer(identity=amo.aggregator, registry=amo.registry, config=acfg)
    cl = {
        d: AmortizedSecAggClient(
            identity=amo.devices[d], registry=amo.registry, config=acfg, seeds=seeds[d]
        )
        for d in amo.ids
    }
    for d in amo.ids[1:]:
        for part in cl[d].mask_input(np.zeros(3, dtype=np.uint64)):
            srv.receive(part)
    reqs = srv.close_masked_input()
    r = next(iter(reqs.values()))
    msgs += [r, cl[r.recipient].reveal(r)]
    return msgs


MESSAGES = _all_messages()


def test_every_message_kind_is_covered() -> None:
    assert {m.KIND for m in MESSAGES} == set(SECAGG_KINDS)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.KIND)
def test_message_wire_roundtrip(msg: Any) -> None:
    assert decode_message(encode_message(msg)) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.KIND)
def test_every_truncated_prefix_fails_cleanly(msg: Any) -> None:
    data = encode_message(msg)
    for i in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode_message(data[:i])


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.KIND)
def test_wrong_field_types_fail_cleanly(msg: Any) -> None:
    wire = msg.to_wire()
    for key in wire:
        for bad in (None, -1, 2**63, "x", b"", [], {}, 1.5, True):
            if type(bad) is type(wire[key]) and bad == wire[key]:
                continue
            mutated = msgpack.packb({**wire, key: bad}, use_bin_type=True)
            try:
                out = decode_message(mutated)
            except RemoteProtocolError:
                continue
            # a few substitutions are still valid messages (e.g. an empty list of shares):
            # then they must be faithfully what was sent
            assert out.to_wire()[key] == bad, (key, bad)
    for extra in (
        {**wire, "extra": 1},
        {k: v for k, v in wire.items() if k != "sig"},
        {**wire, "v": 1},
        {**wire, "kind": "nope"},
        [wire],
    ):
        with pytest.raises(RemoteProtocolError):
            decode_message(msgpack.packb(extra, use_bin_type=True))


def test_decode_rejects_non_bytes_and_huge_claims() -> None:
    with pytest.raises(RemoteProtocolError, match="must be bytes"):
        decode_message("text")  # type: ignore[arg-type]
    # a bin32 header claiming 4 GiB with 3 bytes behind it
    with pytest.raises(RemoteProtocolError, match="malformed"):
        decode_message(b"\xc6\xff\xff\xff\xff\x00\x00\x00")


# --------------------------------------------------------------------------- exactness


STAGES = ("advertise", "share_keys", "masked_input", "unmask")


@st.composite
def rounds(draw: st.DrawFn) -> tuple[RoundConfig, World, dict[str, str], bool]:
    n = draw(st.integers(3, 10))
    full = draw(st.booleans()) or n <= 4
    k = n - 1 if full else draw(st.sampled_from([d for d in range(2, n - 1, 2)]))
    t = draw(st.integers(k // 2 + 1, k))
    bits = draw(st.sampled_from([1, 5, 16, 31, 32, 63, 64]))
    w = World(n, seed=draw(st.integers(0, 3)))
    cfg = w.config(
        bits=bits,
        length=draw(st.integers(1, 5)),
        degree=k,
        threshold=t,
        full_graph=full,
        round_id=draw(st.integers(0, 2**40)),
    )
    g = cfg.graph()
    order = draw(st.permutations(cfg.cohort))
    drops: dict[str, str] = {}
    bounded = draw(st.booleans())
    for u in order:
        if not draw(st.booleans()):
            continue
        stage = draw(st.sampled_from(STAGES))
        if bounded:
            # keep every neighbourhood within its tolerance k - t
            trial = {**drops, u: stage}
            if any(sum(v in trial for v in g[x]) > k - t for x in cfg.cohort):
                continue
        drops[u] = stage
    within = all(sum(v in drops for v in g[x]) <= k - t for x in cfg.cohort)
    return cfg, w, drops, within


@PROTO
@given(case=rounds(), seed=st.integers(0, 2**32))
def test_secagg_sum_is_exact_under_dropouts_at_every_stage(
    case: tuple[RoundConfig, World, dict[str, str], bool], seed: int
) -> None:
    cfg, w, drops, within = case
    xs = random_inputs(cfg, seed)
    server = w.server(cfg)
    try:
        total = run_round(server=server, clients=w.clients(cfg), inputs=xs, dropouts=drops)  # type: ignore[arg-type]
    except RoundFailed:
        assert not within, "a round within every neighbourhood's tolerance must not fail"
        assert server.stage is ServerStage.FAILED
        return
    assert total.dtype == Ring(bits=cfg.bits).dtype  # summed at the ring's width, not widened
    uploaded = {d for d in cfg.cohort if drops.get(d) in (None, "unmask")}
    assert set(server.survivors) <= uploaded
    if within:
        assert set(server.survivors) == uploaded
    np.testing.assert_array_equal(
        total, ring_sum([xs[d] for d in server.survivors], cfg.bits, cfg.length)
    )


@PROTO
@given(case=rounds())
def test_survivor_sets_end_the_round_as_the_server_does(
    case: tuple[RoundConfig, World, dict[str, str], bool],
) -> None:
    """hazmat.graph.survivor_sets, given only who reached each stage, predicts the
    server's survivors or its failure, word for word (a plain sum can end rounds alike)."""
    cfg, w, drops, _ = case
    server = w.server(cfg)
    try:
        run_round(server=server, clients=w.clients(cfg), inputs=random_inputs(cfg, 0),
                  dropouts=drops)  # type: ignore[arg-type]
        failed = None
    except RoundFailed as e:
        failed = str(e).removeprefix(f"round {cfg.round_id} failed: ")
    reached = [d for d in cfg.cohort if d not in drops]

    def past(stage: str) -> list[str]:
        return reached + [d for d, s in drops.items() if STAGES.index(s) > STAGES.index(stage)]

    got = graph.survivor_sets(cfg.graph(), cfg.threshold, advertised=past("advertise"),
                              shared=past("share_keys"), uploaded=past("masked_input"),
                              answered=reached)
    assert got.failed == failed
    if failed is None:
        assert tuple(sorted(got.u3)) == server.survivors


def test_pending_close_stage_and_replay_rebuild_the_server() -> None:
    """The surface a round driver uses: who each stage waits for, closing it without
    naming it, and a server rebuilt from its input log that finishes bit for bit alike."""
    w = World(8, seed=3)
    cfg = w.config(bits=32, length=7, full_graph=True)  # k = 7, t = 4: two may vanish
    xs = random_inputs(cfg, 3)
    clients = w.clients(cfg)
    server = w.server(cfg)
    log: list[secagg_server.LogEntry] = []
    gone = cfg.cohort[2]  # vanishes after sharing its keys

    def send(msgs: Any) -> None:
        for msg in msgs if isinstance(msgs, tuple) else (msgs,):  # masked parts: a tuple
            data = encode_message(msg)
            server.receive(decode_message(data))
            log.append((secagg_server.RECV, data))

    def close() -> dict[str, Any]:
        stage = server.stage.value
        out = server.close_stage()
        log.append((secagg_server.CLOSE, stage.encode()))
        return out

    assert server.pending() == frozenset(cfg.cohort)
    for d in cfg.cohort[1:]:
        send(clients[d].advertise())
    assert server.pending() == {cfg.cohort[0]}
    out = close()
    assert server.stage is ServerStage.COLLECT_SHARES and cfg.cohort[0] not in out
    assert server.pending() == frozenset(out)
    for d, m in out.items():
        send(clients[d].share_keys(m))
    assert server.pending() == frozenset()
    out = close()
    for d, m in out.items():
        if d != gone:
            send(clients[d].mask_input(m, xs[d]))
    assert server.pending() == {gone}
    requests = close()
    assert server.stage is ServerStage.COLLECT_UNMASK
    with pytest.raises(LocalProtocolError, match="close_stage"):
        server.close_stage()
    first = sorted(requests)[0]
    send(clients[first].unmask(requests[first]))
    assert server.pending() == frozenset(requests) - {first}
    for d in sorted(requests)[1:]:
        send(clients[d].unmask(requests[d]))

    twin = w.server(cfg)
    twin.replay(log)
    assert (twin.stage, twin.survivors, twin.pending()) == (
        server.stage, server.survivors, server.pending())
    total = server.finalize()
    np.testing.assert_array_equal(twin.finalize(), total)
    np.testing.assert_array_equal(
        total, ring_sum([xs[d] for d in server.survivors], cfg.bits, cfg.length))
    assert gone not in server.survivors
    with pytest.raises(LocalProtocolError, match="closes stage"):
        w.server(cfg).replay([(secagg_server.CLOSE, b"collect_masked")])
    with pytest.raises(LocalProtocolError, match="log entries"):
        w.server(cfg).replay([("shout", b"")])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("n", "degree", "full"), [(12, 6, False), (7, None, True)])
def test_k_minus_t_dropouts_in_one_neighbourhood_at_each_stage(
    stage: str, n: int, degree: int | None, full: bool
) -> None:
    w = World(n, seed=1)
    cfg = w.config(bits=32, length=8, degree=degree, full_graph=full)
    victim = cfg.cohort[0]
    drops = dict.fromkeys(cfg.neighbours(victim)[: cfg.degree - cfg.threshold], stage)
    xs = random_inputs(cfg, 5)
    server = w.server(cfg)
    total = run_round(server=server, clients=w.clients(cfg), inputs=xs, dropouts=drops)  # type: ignore[arg-type]
    assert victim in server.survivors
    np.testing.assert_array_equal(
        total, ring_sum([xs[d] for d in server.survivors], cfg.bits, cfg.length)
    )


def test_no_dropouts_sums_everyone() -> None:
    w = World(9)
    cfg = w.config(bits=64, length=10)
    xs = random_inputs(cfg, 9)
    server = w.server(cfg)
    total = run_round(server=server, clients=w.clients(cfg), inputs=xs)
    assert server.survivors == cfg.cohort
    np.testing.assert_array_equal(total, ring_sum(list(xs.values()), 64, 10))


def test_fixed_point_sum_decodes_after_secure_aggregation(rng: np.random.Generator) -> None:
    fp = FixedPoint(scale=2.0**10, bits=32)
    w = World(6)
    cfg = w.config(bits=32, length=5)
    reals = {d: rng.uniform(-3, 3, size=5) for d in cfg.cohort}
    fp.check_no_wrap(3.0, len(cfg.cohort))
    enc = {d: fp.encode(v, rng) for d, v in reals.items()}
    total = run_round(server=w.server(cfg), clients=w.clients(cfg), inputs=enc)
    np.testing.assert_allclose(
        fp.decode(total, len(cfg.cohort)), sum(reals.values()), atol=len(cfg.cohort) / fp.scale
    )


# --------------------------------------------------------------------------- failure


def test_too_few_survivors_fails_before_anything_is_revealed() -> None:
    w = World(6)
    cfg = w.config(full_graph=True)  # k = 5, t = 3
    run = Stepper(w, cfg, random_inputs(cfg, 1))
    fwd = run.share(run.advertise())
    with pytest.raises(RoundFailed, match="below the threshold 3"):
        run.masked(fwd, skip={"d00", "d01", "d02"})
    assert run.server.stage is ServerStage.FAILED
    assert "unmask_response" not in run.sent
    assert all(c.state in (ClientState.SHARED, ClientState.MASKED) for c in run.clients.values())
    with pytest.raises(LocalProtocolError, match="stage failed"):
        run.server.finalize()


def test_too_few_answers_during_recovery_fails_cleanly() -> None:
    w = World(6)
    cfg = w.config(full_graph=True)  # k = 5, t = 3
    run = Stepper(w, cfg, random_inputs(cfg, 1))
    req = run.masked(run.share(run.advertise()))
    with pytest.raises(RoundFailed, match="only 2 shares"):
        run.unmask(req, skip={"d00", "d01", "d02", "d03"})
    assert run.server.stage is ServerStage.FAILED


def test_prune_keeps_the_t_core() -> None:
    # a triangle with a pendant path: the 2-core is the triangle
    g = {"a": ("b", "c"), "b": ("a", "c"), "c": ("a", "b", "d"), "d": ("c", "e"), "e": ("d",)}
    assert graph.prune(set(g), g, 2) == {"a", "b", "c"}  # noqa: SLF001
    assert graph.prune(set(g), g, 3) == set()  # noqa: SLF001


def test_too_few_live_neighbours_at_advertise_fails_before_any_share_is_made() -> None:
    """On the ring-like Harary graph with 2t > k, a device that loses more than k - t
    neighbours leaves a gap whose edges have only k/2 < t live neighbours: the t-core is
    empty, and the round fails at the first stage, before any device shares or masks."""
    w = World(10, seed=2)
    cfg = w.config(degree=4, threshold=3)
    victim = cfg.cohort[3]
    run = Stepper(w, cfg, random_inputs(cfg, 2))
    with pytest.raises(RoundFailed, match="no device has 3 live neighbours"):
        run.advertise(skip=set(cfg.neighbours(victim)[:2]))
    assert all(
        c.state is ClientState.ADVERTISED
        for d, c in run.clients.items()
        if d not in cfg.neighbours(victim)[:2]
    )


def test_empty_round_fails() -> None:
    w = World(4)
    cfg = w.config()
    with pytest.raises(RoundFailed):
        run_round(
            server=w.server(cfg),
            clients=w.clients(cfg),
            inputs={},
            dropouts=dict.fromkeys(cfg.cohort, "advertise"),
        )


# --------------------------------------------------------------------------- server's view


def test_one_masked_upload_is_uniform_and_independent_of_its_input() -> None:
    """Device d00's upload over many rounds at b = 4, for input all-zero and all-15: each
    is uniform on Z_16 (chi-square) and the two are indistinguishable (contingency)."""
    w = World(3, seed=3)
    tables = []
    for value in (0, 15):
        counts = np.zeros(16, dtype=np.int64)
        for r in range(120):
            cfg = w.config(round_id=r, bits=4, length=16)
            x = {d: np.full(16, value if d == "d00" else 7, dtype=np.uint64) for d in cfg.cohort}
            grab: list[bytes] = []

            def keep(dev: str, data: bytes, grab: list[bytes] = grab) -> None:
                if dev == "d00":
                    grab.append(data)

            run_round(
                server=w.server(cfg), clients=w.clients(cfg, tag=value), inputs=x, on_message=keep
            )
            up = next(m for m in map(decode_message, grab) if isinstance(m, MaskedPart))
            assert up.parts == 1  # 16 residues of 4 bits: one part holds the whole vector
            counts += np.bincount(
                Ring(bits=4).unpack(up.data, 16).astype(np.int64), minlength=16
            )
        assert stats.chisquare(counts).pvalue > ALPHA
        tables.append(counts)
    assert stats.chi2_contingency(np.array(tables)).pvalue > ALPHA


def test_t_minus_1_unmask_answers_reconstruct_nothing() -> None:
    w = World(6)
    cfg = w.config(full_graph=True)  # t = 3
    run = Stepper(w, cfg, random_inputs(cfg, 1))
    req = run.masked(run.share(run.advertise()))
    answers = [run.clients[d].unmask(req[d]) for d in ("d00", "d01")]
    for a in answers:
        run.server.receive(a)
    with pytest.raises(RoundFailed, match="below the threshold 3"):
        run.server.recover()


class _Snapshot:
    """What a rejected message must not change: the server's observable state."""

    def __init__(self, server: SecAggServer) -> None:
        self.server = server
        self.value = self.take()

    def take(self) -> tuple[Any, ...]:
        s = self.server
        return (
            s.stage,
            s.survivors,
            dict(s._adverts),
            dict(s._sharekeys),  # noqa: SLF001
            s._sum.copy().tolist(),
            dict(s._responses),
            dict(s._seen),
        )  # noqa: SLF001

    def unchanged(self) -> bool:
        return self.take() == self.value


def _signed_by(identity: DeviceIdentity, msg: Any, cfg: RoundConfig) -> Any:
    return replace(msg, sig=identity.sign(msg.signing_bytes(cfg.digest())))


def test_replayed_unsigned_forged_outsider_and_wrong_round_messages_are_rejected() -> None:
    w = World(6)
    cfg = w.config()
    other_round = w.config(round_id=2)
    run = Stepper(w, cfg, random_inputs(cfg, 4))
    adv = run.clients["d00"].advertise()
    run.server.receive(adv)
    snap = _Snapshot(run.server)
    old_adv = SecAggClient(
        identity=w.devices["d01"], registry=w.registry, config=other_round
    ).advertise()
    outsider = _signed_by(w.outsider, replace(adv, sender="zz-outsider", sig=b""), cfg)
    forged = _signed_by(w.devices["d00"], replace(adv, sender="d02", sig=b""), cfg)
    cases: list[tuple[Any, type[Exception], str]] = [
        (adv, ReplayedMessage, "already accepted"),
        (replace(adv, mask_key=bytes(32)), RemoteProtocolError, "second, different"),
        (replace(old_adv, sig=bytes(64)), RemoteProtocolError, "round 2, this is round 1"),
        (old_adv, RemoteProtocolError, "this is round 1"),
        (replace(old_adv, round_id=1), RemoteProtocolError, "bad signature"),
        (replace(forged, sig=bytes(64)), RemoteProtocolError, "bad signature"),
        (forged, RemoteProtocolError, "bad signature from 'd02'"),
        (outsider, RemoteProtocolError, "outsider 'zz-outsider'"),
        (replace(adv, sender="nobody"), RemoteProtocolError, "outsider 'nobody'"),
    ]
    for msg, err, match in cases:
        with pytest.raises(err, match=match):
            run.server.receive(decode_message(encode_message(msg)))
        assert snap.unchanged()
    # the round goes on, exact, as if nothing had happened
    for d in cfg.cohort[1:]:
        run.server.receive(run.clients[d].advertise())
    nk = run.server.close_advertise()
    total = run.unmask(run.masked(run.share(nk)))
    np.testing.assert_array_equal(total, ring_sum(list(run.x.values()), cfg.bits, cfg.length))


def test_low_order_x25519_keys_are_refused_by_the_aggregator() -> None:
    w = World(4)
    cfg = w.config()
    adv = w.clients(cfg)["d00"].advertise()
    bad = _signed_by(w.devices["d00"], replace(adv, mask_key=bytes(32), sig=b""), cfg)
    server = w.server(cfg)
    with pytest.raises(RemoteProtocolError, match="mask_key is a low-order X25519 point"):
        server.receive(bad)
    server.receive(adv)


def test_rejections_in_later_stages_change_nothing() -> None:
    w = World(6)
    cfg = w.config()
    run = Stepper(w, cfg, random_inputs(cfg, 4))
    nk = run.advertise()
    sk = run.clients["d00"].share_keys(nk["d00"])
    run.server.receive(sk)
    snap = _Snapshot(run.server)
    bad_inner = replace(sk, shares=(replace(sk.shares[0], ciphertext=bytes(148)), *sk.shares[1:]))
    cases = [
        (sk, ReplayedMessage),
        (_signed_by(w.devices["d00"], bad_inner, cfg), RemoteProtocolError),  # re-signed
        (
            _signed_by(w.devices["d01"], replace(sk, sender="d01", shares=sk.shares[:2]), cfg),
            RemoteProtocolError,
        ),  # wrong recipients
        (
            _signed_by(w.devices["d01"], replace(sk, sender="d01"), cfg),
            RemoteProtocolError,
        ),  # shares signed by d00 inside d01's message
        (run.sent["advertise_keys"][1], ReplayedMessage),
    ]
    for msg, err in cases:
        with pytest.raises(err):
            run.server.receive(msg)
        assert snap.unchanged()
    for d in cfg.cohort[1:]:
        run.server.receive(run.clients[d].share_keys(nk[d]))
    req = run.masked(run.server.close_share_keys())
    mi = run.sent["masked_part"][0]
    snap = _Snapshot(run.server)
    for msg in (
        mi,
        replace(mi, data=bytes(len(mi.data))),
        _signed_by(
            w.devices[mi.sender],
            replace(mi, count=mi.count - 1, data=mi.data[:-2]),
            cfg,
        ),
    ):
        with pytest.raises(RemoteProtocolError):
            run.server.receive(msg)
        assert snap.unchanged()
    total = run.unmask(req)
    np.testing.assert_array_equal(total, ring_sum(list(run.x.values()), cfg.bits, cfg.length))


def test_a_masked_upload_in_parts_joins_in_any_order_and_conflicts_change_nothing() -> None:
    """The masked vector travels as signed masked_part s (no msgpack inside msgpack): the
    server takes them in any order, counts the device once its last part arrives, and
    refuses an unsigned, foreign or conflicting part without a trace."""
    w = World(5)
    cfg = w.config(bits=32, length=1000)  # 4000 bytes: 7 parts of at most 640
    run = Stepper(w, cfg, random_inputs(cfg, 9))
    fwd = run.share(run.advertise())
    parts = {d: run.clients[d].mask_input(m, run.x[d], max_packet=1024)
             for d, m in fwd.items()}
    assert all(len(p) == 7 for p in parts.values())
    assert sum(len(p.data) for p in parts["d00"]) == 4000  # the raw packed residues
    order = np.random.default_rng(3).permutation(7)
    for i in order[:-1]:
        run.server.receive(decode_message(encode_message(parts["d00"][i])))
    assert "d00" not in run.server.survivors  # not counted before its last part
    last = parts["d00"][order[-1]]
    snap = _Snapshot(run.server)
    forged_bytes = replace(last, data=bytes(len(last.data)))  # same index, other bytes
    resigned = _signed_by(w.devices["d00"], replace(last, digest=bytes(32)), cfg)
    for msg, match in [(forged_bytes, "bad signature"), (resigned, "another upload"),
                       (replace(last, sig=bytes(64)), "bad signature"),
                       (_signed_by(w.outsider, replace(last, sender="zz-outsider"), cfg),
                        "outsider")]:
        with pytest.raises(RemoteProtocolError, match=match):
            run.server.receive(msg)
        assert snap.unchanged()
    run.server.receive(last)
    assert "d00" in run.server.survivors
    with pytest.raises(ReplayedMessage):
        run.server.receive(last)
    for d in sorted(parts)[1:]:
        for p in parts[d]:
            run.server.receive(p)
    total = run.unmask(run.server.close_masked_input())
    np.testing.assert_array_equal(total, ring_sum(list(run.x.values()), cfg.bits, cfg.length))


def test_an_upload_contradicting_its_own_digest_is_dropped_and_replays_alike() -> None:
    """A device that signs parts whose bytes contradict their digest loses its upload (it
    counts as gone), further parts of it are refused, the round finishes without it, and a
    replay of the accepted messages rebuilds the same server."""
    w = World(5)
    cfg = w.config(bits=32, length=1000)
    run = Stepper(w, cfg, random_inputs(cfg, 10))
    fwd = run.share(run.advertise())
    log: list[secagg_server.LogEntry] = []
    for d, m in fwd.items():
        parts = run.clients[d].mask_input(m, run.x[d], max_packet=1024)
        if d == "d02":  # the same wrong digest on every part, each validly signed
            parts = bad = tuple(_signed_by(w.devices[d], replace(p, digest=bytes(32)), cfg)
                                for p in parts)
        for p in parts:
            run.server.receive(p)
            log.append((secagg_server.RECV, encode_message(p)))
    assert set(run.server.spoiled) == {"d02"} and "digest" in run.server.spoiled["d02"]
    assert "d02" not in run.server.survivors and run.server.pending() == frozenset()
    snap = _Snapshot(run.server)
    with pytest.raises(RemoteProtocolError, match="dropped"):  # nothing more of d02's
        run.server.receive(_signed_by(w.devices["d02"], replace(bad[0], part=7, parts=8),
                                      cfg))
    assert snap.unchanged()
    twin = w.server(cfg)
    twin.replay([*_key_log(run), *log])
    assert twin.spoiled == run.server.spoiled and twin.survivors == run.server.survivors
    total = run.unmask(run.server.close_masked_input())
    want = ring_sum([x for d, x in run.x.items() if d != "d02"], cfg.bits, cfg.length)
    np.testing.assert_array_equal(total, want)


def _key_log(run: Stepper) -> list[secagg_server.LogEntry]:
    """The key stages of ``run`` as a server log (what it sent, and the two closes)."""
    out: list[secagg_server.LogEntry] = []
    for kind, stage in (("advertise_keys", "collect_keys"), ("share_keys", "collect_shares")):
        out += [(secagg_server.RECV, encode_message(m)) for m in run.sent[kind]]
        out.append((secagg_server.CLOSE, stage.encode()))
    return out


def test_aggregator_cannot_forge_a_neighbours_keys() -> None:
    w = World(6)
    cfg = w.config()
    run = Stepper(w, cfg, random_inputs(cfg, 4))
    nk = run.advertise()
    client = run.clients["d00"]
    honest = nk["d00"]
    mitm = X25519PrivateKey.from_private_bytes(bytes(range(32))).public_key().public_bytes_raw()
    swapped = replace(
        honest, adverts=(replace(honest.adverts[0], mask_key=mitm), *honest.adverts[1:])
    )
    resigned = replace(swapped, sig=w.aggregator.sign(swapped.signing_bytes(cfg.digest())))
    with pytest.raises(RemoteProtocolError, match="bad signature from 'd0"):
        client.share_keys(resigned)
    with pytest.raises(RemoteProtocolError, match="bad signature from the aggregator"):
        client.share_keys(replace(honest, sig=bytes(64)))
    with pytest.raises(RemoteProtocolError, match="addressed to 'd01'"):
        client.share_keys(nk["d01"])
    stale = replace(honest, round_id=9)
    with pytest.raises(RemoteProtocolError, match="round 9, this is round 1"):
        client.share_keys(
            replace(
                stale, sig=w.aggregator.sign(stale.signing_bytes(w.config(round_id=9).digest()))
            )
        )
    assert client.state is ClientState.ADVERTISED
    client.share_keys(honest)
    assert client.state is ClientState.SHARED
    with pytest.raises(RemoteProtocolError, match="not expected in state shared"):
        client.share_keys(honest)


def test_client_rejects_tampered_forwarded_shares() -> None:
    w = World(6)
    cfg = w.config()
    run = Stepper(w, cfg, random_inputs(cfg, 4))
    fwd = run.share(run.advertise())
    client, honest = run.clients["d00"], fwd["d00"]
    share = honest.shares[0]
    tampered = replace(share, ciphertext=bytes(len(share.ciphertext)))
    cases = [
        replace(honest, shares=(tampered, *honest.shares[1:])),  # inner signature breaks
        replace(
            honest, shares=(_signed_by(w.devices[share.sender], tampered, cfg), *honest.shares[1:])
        ),  # signed but does not open
        replace(honest, shares=honest.shares[:1] * 2),
    ]
    for bad in cases:
        bad = replace(bad, sig=w.aggregator.sign(bad.signing_bytes(cfg.digest())))
        with pytest.raises(RemoteProtocolError):
            client.mask_input(bad, run.x["d00"])
        assert client.state is ClientState.SHARED
    with pytest.raises(ValueError, match="length = 6"):
        client.mask_input(honest, run.x["d00"][:3])
    client.mask_input(honest, run.x["d00"])
    assert client.state is ClientState.MASKED


def test_device_never_reveals_both_shares_of_one_owner() -> None:
    w = World(6)
    cfg = w.config(full_graph=True)
    run = Stepper(w, cfg, random_inputs(cfg, 4))
    req = run.masked(run.share(run.advertise()))
    client, honest = run.clients["d00"], req["d00"]

    def signed(r: UnmaskRequest) -> UnmaskRequest:
        return replace(r, sig=w.aggregator.sign(r.signing_bytes(cfg.digest())))

    both = signed(replace(honest, dropped=("d01",), survivors=honest.survivors))
    with pytest.raises(UnmaskRefused, match=r"both .* \['d01'\]"):
        client.unmask(both)
    with pytest.raises(UnmaskRefused, match="itself"):
        client.unmask(signed(replace(honest, dropped=("d00",), survivors=())))
    with pytest.raises(RemoteProtocolError, match="bad signature"):
        client.unmask(replace(honest, sig=bytes(64)))
    assert client.state is ClientState.MASKED
    first = client.unmask(honest)
    assert client.unmask(honest) == first  # a duplicate request gets the same answer
    flipped = signed(replace(honest, dropped=honest.survivors[:1], survivors=honest.survivors[1:]))
    with pytest.raises(UnmaskRefused, match="already answered a different"):
        client.unmask(flipped)


def test_calls_out_of_order_are_local_errors() -> None:
    w = World(4)
    cfg = w.config()
    client = w.clients(cfg)["d00"]
    client.advertise()
    with pytest.raises(LocalProtocolError, match="advertise"):
        client.advertise()
    server = w.server(cfg)
    with pytest.raises(LocalProtocolError, match="close_share_keys"):
        server.close_share_keys()
    with pytest.raises(LocalProtocolError, match="recover"):
        server.recover()


# --------------------------------------------------------------------------- amortized


def _amortized(
    w: World, seeds: dict[str, PairwiseSeeds], cfg: RoundConfig
) -> tuple[AmortizedSecAggServer, dict[str, AmortizedSecAggClient]]:
    server = AmortizedSecAggServer(identity=w.aggregator, registry=w.registry, config=cfg)
    clients = {
        d: AmortizedSecAggClient(
            identity=w.devices[d], registry=w.registry, config=cfg, seeds=seeds[d]
        )
        for d in cfg.cohort
    }
    return server, clients


@PROTO
@given(data=st.data())
def test_amortized_variant_is_exact_over_rounds(data: st.DataObject) -> None:
    n = data.draw(st.integers(3, 9))
    w = World(n, seed=data.draw(st.integers(0, 2)))
    full = data.draw(st.booleans()) or n <= 4
    seeds = {d: PairwiseSeeds(identity=w.devices[d], registry=w.registry) for d in w.ids}
    for r in range(1, 4):
        cfg = w.config(
            round_id=r,
            bits=data.draw(st.sampled_from([3, 32, 64])),
            length=4,
            amortized=True,
            full_graph=full,
        )
        k, t = cfg.degree, cfg.threshold
        g = cfg.graph()
        drops: dict[str, str] = {}
        for u in data.draw(st.permutations(cfg.cohort)):
            if data.draw(st.booleans()):
                trial = {**drops, u: "masked_input"}
                if all(sum(v in trial for v in g[x]) <= k - t for x in cfg.cohort):
                    drops = trial
        xs = random_inputs(cfg, r)
        server, clients = _amortized(w, seeds, cfg)
        total = run_amortized_round(server=server, clients=clients, inputs=xs, dropouts=drops)  # type: ignore[arg-type]
        assert set(server.survivors) == set(cfg.cohort) - set(drops)
        np.testing.assert_array_equal(
            total, ring_sum([xs[d] for d in server.survivors], cfg.bits, cfg.length)
        )


def test_amortized_seeds_are_symmetric_and_never_revealed() -> None:
    w = World(4)
    seeds = {d: PairwiseSeeds(identity=w.devices[d], registry=w.registry) for d in w.ids}
    assert seeds["d00"].seed("d01") == seeds["d01"].seed("d00")
    assert seeds["d00"].seed("d01") != seeds["d00"].seed("d02")
    cfg = w.config(amortized=True, full_graph=True)
    server, clients = _amortized(w, seeds, cfg)
    for d in ("d00", "d01", "d02"):
        for part in clients[d].mask_input(np.zeros(cfg.length, dtype=np.uint64)):
            server.receive(part)
    reqs = server.close_masked_input()
    resp = clients["d00"].reveal(reqs["d00"])
    [(peer, round_seed)] = resp.seeds
    assert peer == "d03"
    assert round_seed == amortized_round_seed(seeds["d00"].seed("d03"), cfg.round_id)
    assert round_seed != seeds["d00"].seed("d03")
    assert round_seed != amortized_round_seed(seeds["d00"].seed("d03"), cfg.round_id + 1)


def test_amortized_refuses_round_reuse_and_exposing_reveals() -> None:
    w = World(5)
    seeds = {d: PairwiseSeeds(identity=w.devices[d], registry=w.registry) for d in w.ids}
    cfg = w.config(round_id=5, amortized=True, full_graph=True)  # k = 4, t = 3
    server, clients = _amortized(w, seeds, cfg)
    clients["d00"].mask_input(np.zeros(cfg.length, dtype=np.uint64))
    again = AmortizedSecAggClient(
        identity=w.devices["d00"],
        registry=w.registry,
        config=w.config(round_id=5, amortized=True, full_graph=True),
        seeds=seeds["d00"],
    )
    with pytest.raises(RemoteProtocolError, match="reusing a round id"):
        again.mask_input(np.zeros(cfg.length, dtype=np.uint64))
    req = RevealRequest(round_id=5, recipient="d00", dropped=("d01", "d02"))
    req = replace(req, sig=w.aggregator.sign(req.signing_bytes(cfg.digest())))
    with pytest.raises(UnmaskRefused, match="leave 2 neighbours masked"):
        clients["d00"].reveal(req)
    assert clients["d00"].state is ClientState.MASKED


def test_amortized_survivor_silent_in_recovery_fails_the_round() -> None:
    w = World(6)
    seeds = {d: PairwiseSeeds(identity=w.devices[d], registry=w.registry) for d in w.ids}
    cfg = w.config(amortized=True, full_graph=True)
    server, clients = _amortized(w, seeds, cfg)
    with pytest.raises(RoundFailed, match="did not reveal"):
        run_amortized_round(
            server=server,
            clients=clients,
            inputs=random_inputs(cfg, 1),
            dropouts={"d00": "masked_input", "d01": "unmask"},
        )


# --------------------------------------------------------------------------- sparse


def test_sparse_round_masks_only_the_kept_coordinates() -> None:
    d, k, bits = 50, 7, 12
    omega = compress.coordinate_set(b"round-seed-sparse-0001", d, k)
    w = World(6)
    cfg = w.config(bits=bits, length=k)
    rng = np.random.default_rng(11)
    dense = {u: rng.integers(0, 1 << bits, size=d, dtype=np.uint64) for u in cfg.cohort}
    run = Stepper(w, cfg, dense)
    fwd = run.share(run.advertise())
    for u, m in fwd.items():
        parts = run.clients[u].mask_input(m, dense[u], coordinates=omega)
        assert sum(len(p.data) for p in parts) == (k * bits + 7) // 8
        for p in parts:
            run.server.receive(p)
    reqs = run.server.close_masked_input()
    for u, m in reqs.items():
        run.server.receive(run.clients[u].unmask(m))
    total = run.server.finalize_dense(omega, d)
    want = np.zeros(d, dtype=np.uint64)
    want[omega] = ring_sum([v[omega] for v in dense.values()], bits, k)
    np.testing.assert_array_equal(total, want)


def test_sparse_coordinates_are_validated() -> None:
    w = World(4)
    cfg = w.config(length=3)
    run = Stepper(w, cfg, {})
    fwd = run.share(run.advertise())
    c = run.clients["d00"]
    x = np.zeros(10, dtype=np.uint64)
    with pytest.raises(ValueError, match="3 integer indices"):
        c.mask_input(fwd["d00"], x, coordinates=np.array([1, 2]))
    for bad in (
        np.array([3, 2, 5]),
        np.array([3, 2, 5], dtype=np.uint64),
        np.array([1, 1, 2]),
        np.array([1, 2, 10]),
    ):
        with pytest.raises(ValueError, match="sorted distinct"):
            c.mask_input(fwd["d00"], x, coordinates=bad)
    assert c.state is ClientState.SHARED


if __name__ == "__main__" and "--regenerate" in sys.argv:
    GOLDEN_PATH.write_text(json.dumps(build_vectors(), indent=1) + "\n")
    print(f"wrote {GOLDEN_PATH}")
