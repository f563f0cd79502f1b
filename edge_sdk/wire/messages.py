"""Every message of a round, declared on :mod:`edge_sdk.wire.schema` (protocol 6).

One envelope ``{"v": 5, "kind", "round", "from" | "to", ...fields, "sig"?}``, one naming
rule (:func:`~edge_sdk.wire.schema.Name`), one decoder with caps and one signature rule for
every kind; ``tests/golden/wire_vectors.json`` pins each encoding. Topics
(``edge_sdk.wire.topics``) end with the kind::

    kind              direction                  signed by    signature context
    checkin           device -> aggregator       the device   -
    decline           device -> aggregator       the device   -
    advertise_keys    device -> aggregator       the device   RoundConfig digest
    share_keys        device -> aggregator       the device   RoundConfig digest
    masked_part       device -> aggregator       the device   RoundConfig digest
    unmask_response   device -> aggregator       the device   RoundConfig digest
    reveal_response   device -> aggregator       the device   RoundConfig digest
    plan              aggregator -> cohort       aggregator   -
    neighbour_keys    aggregator -> device       aggregator   RoundConfig digest
    forwarded_shares  aggregator -> device       aggregator   RoundConfig digest
    unmask_request    aggregator -> device       aggregator   RoundConfig digest
    reveal_request    aggregator -> device       aggregator   RoundConfig digest
    error             aggregator -> device       aggregator   -
    model             aggregator -> everyone     aggregator   -   (retained)
    site_round        site -> every gateway      the site     -   (retained; issue 19)
    gateway_sum       gateway -> site            the gateway  -   (issue 19)

The two site kinds join gateways to a site (``aggregator.site``): a device never decodes
them (they are not in :data:`DEVICE_KINDS`). Their roles map onto the schema's: the site
signs like an aggregator (its key is the gateways' ``site_key``), a gateway like a device
(``"from"`` names it; its key is in the site's gateway registry).

``encrypted_share`` travels only inside ``share_keys`` and ``forwarded_shares``: signed by
the device that sealed it, so the recipient can check it after the aggregator's relay.
The masked vector of secure aggregation travels as ``masked_part`` s (raw packed residues,
each part signed; ``edge_sdk.wire.chunking`` cuts and joins them), never as msgpack inside
msgpack. The SecAgg kinds (Bonawitz et al., CCS 2017, Fig. 4, with Bell et al.'s SecAgg+
neighbourhoods; the amortized variant's reveal kinds, Hu et al., Sec. IV-B) bind the
round's ``RoundConfig.digest()`` as their signature context, so a message of another round
or built on another view of the round fails verification. The wire does not know
``RoundConfig`` (the wire is below secure aggregation): the endpoint passes the digest in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass
from types import MappingProxyType
from typing import Any, TypeAlias

import numpy as np

from edge_sdk.hazmat.graph import neighbourhood_problem
from edge_sdk.hazmat.masking import SEED_BYTES
from edge_sdk.hazmat.shamir import SHARE_BYTES
from edge_sdk.wire.schema import (
    AGGREGATOR,
    DEVICE,
    ROUND_HI,
    Bytes,
    Float,
    From,
    Int,
    Limits,
    ListOf,
    Map,
    Message,
    Name,
    Names,
    Optional,
    ParamsOf,
    Record,
    Round,
    Sig,
    Str,
    Struct,
    To,
    catalog,
    message,
    record,
)

__all__ = [
    "ALL_KINDS",
    "DEVICE_KINDS",
    "DOWN_KINDS",
    "MECHANISM_PARAMS",
    "MODEL_KINDS",
    "SECAGG_DOWN",
    "SECAGG_UP",
    "SecAggDown",
    "SecAggUp",
    "UP_KINDS",
    "AdvertiseKeys",
    "CheckIn",
    "BinomialParams",
    "DdgParams",
    "DeviceDpParams",
    "Decline",
    "EncryptedShare",
    "ErrorNotice",
    "ForwardedShares",
    "GaussianParams",
    "MaskedPart",
    "ModelUpdate",
    "NeighbourKeys",
    "RevealRequest",
    "RevealResponse",
    "RoundPlan",
    "SECAGG_PROTOCOLS",
    "SITE_KINDS",
    "OFFER_KINDS",
    "BufferOffer",
    "Ready",
    "GatewaySum",
    "ShareKeys",
    "SiteRound",
    "UnmaskRequest",
    "UnmaskResponse",
    "UpdateNoiseParams",
    "WireArray",
    "colluder_problem",
]

_KEY_BYTES = 32  # X25519 public keys
_NONCE_BYTES = 12  # ChaCha20-Poly1305
_SHARE_CT_BYTES = 2 * SHARE_BYTES + 16  # two Shamir shares, sealed (16-byte tag)
_MAX_LENGTH = 1 << 31  # values one secure sum may hold (RoundConfig.length)
_DTYPES = ("<f4", "<f8", "<i4", "<i8", "<u2", "<u4", "<u8", "|u1")  # "<u2": ring sums at 9..16 bits
_SAMPLING = ("poisson", "shuffle")
SECAGG_PROTOCOLS = ("secagg+", "amortized")
"""The secure-aggregation protocols a round plan may name (``RoundPlan.secagg``)."""


# =========================================================================== arrays


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class WireArray(Record):
    """A numpy array on the wire: raw little-endian bytes, dtype string and shape.

    Float arrays must be finite (checked on construction, so on decode too).
    """

    dtype: str = Str(choices=_DTYPES)
    shape: tuple[int, ...] = ListOf(Int(0, "max_array_elements"), max="max_ndim")
    data: bytes = Bytes(max="max_message_bytes")

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.shape, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.shape
        ):
            raise ValueError(f"shape must be a tuple of integers >= 0, got {self.shape!r}")
        want = math.prod(self.shape) * np.dtype(self.dtype).itemsize
        if not isinstance(self.data, bytes) or len(self.data) != want:
            got = len(self.data) if isinstance(self.data, bytes) else type(self.data).__name__
            raise ValueError(f"an array of dtype {self.dtype} and shape {self.shape} takes "
                             f"{want} bytes, got {got}")
        if self.dtype[1] == "f":
            a = np.frombuffer(self.data, dtype=self.dtype)
            if not np.isfinite(a).all():
                bad = int(np.flatnonzero(~np.isfinite(a))[0])
                raise ValueError(f"float array holds {a[bad]!r} at flat index {bad}; "
                                 f"only finite values are allowed")

    def wire_check(self, limits: Limits) -> None:
        if math.prod(self.shape) > limits.max_array_elements:
            raise ValueError(f"array of shape {list(self.shape)} exceeds "
                             f"{limits.max_array_elements} elements")

    @classmethod
    def of(cls, array: np.ndarray) -> WireArray:
        """The wire form of ``array`` (converted to little-endian)."""
        a = np.asarray(array)
        dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
        code = dt.str
        if code not in _DTYPES:
            raise ValueError(f"arrays of dtype {a.dtype} cannot travel; use one of {_DTYPES}")
        return cls(dtype=code, shape=tuple(int(n) for n in a.shape),
                   data=np.ascontiguousarray(a, dtype=dt).tobytes())

    def to_numpy(self) -> np.ndarray:
        """A fresh, writable array in native byte order."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape).astype(
            np.dtype(self.dtype).newbyteorder("="))


# =========================================================================== plan


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class GaussianParams(Record):
    """The ``gaussian`` mechanism's part of a round plan: local DP-SGD (Abadi et al., CCS
    2016) with optional rand-k and QSGD, encoded in fixed point for secure aggregation.

    Attributes:
        steps, batch_size, lr, sampling: the local round (``edge_sdk.train.LocalTraining``;
            Poisson rate q = batch_size / m).
        clip: per-sample L2 bound C; noise_multiplier: z (noise std z*C).
        sparsity: rand-k kept fraction p (1: dense; the coordinate set comes from the
            plan's ``round_seed``, ``compress.coordinate_set``).
        quant_levels: QSGD levels s applied to the kept values before encoding (0: none).
        scale, value_bound: fixed-point encoding (``fixedpoint.FixedPoint``); each value is
            clamped to [-value_bound, value_bound] first so the cohort's sum cannot wrap.
    """

    steps: int = Int(1, 1 << 20)
    batch_size: int = Int(1, 1 << 24)
    lr: float = Float(0.0, open_lo=True)
    sampling: str = Str(choices=_SAMPLING)
    clip: float = Float(0.0, open_lo=True)
    noise_multiplier: float = Float(0.0)
    sparsity: float = Float(0.0, 1.0, open_lo=True)
    quant_levels: int = Int(0, (1 << 31) - 1)
    scale: float = Float(0.0, open_lo=True)
    value_bound: float = Float(0.0, open_lo=True)


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateNoiseParams(Record):
    """The ``update-noise`` mechanism's part of a round plan: privatized FedPAQ (Reisizadeh
    et al., AISTATS 2020, Alg. 2; ``edge_sdk.mechanisms.update_noise``): noise once on the
    clipped update, encoded in fixed point for secure aggregation.

    Attributes:
        steps, batch_size, lr, clip: the local round E, b, lr and per-sample clip C
            (``edge_sdk.train.local_round_update_noise``; a without-replacement subsample).
        update_clip: S, the L2 bound of the update (model units).
        noise_multiplier: z (the update's noise std is z*S).
        quant_levels: QSGD levels s applied to the noisy update before encoding (0: none).
        scale, value_bound: fixed-point encoding (``fixedpoint.FixedPoint``); each value is
            clamped to [-value_bound, value_bound] first so the cohort's sum cannot wrap
            (``update_noise.value_bound`` sets it at a stated clamp probability).
    """

    steps: int = Int(1, 1 << 20)
    batch_size: int = Int(1, 1 << 24)
    lr: float = Float(0.0, open_lo=True)
    clip: float = Float(0.0, open_lo=True)
    update_clip: float = Float(0.0, open_lo=True)
    noise_multiplier: float = Float(0.0)
    quant_levels: int = Int(0, (1 << 31) - 1)
    scale: float = Float(0.0, open_lo=True)
    value_bound: float = Float(0.0, open_lo=True)


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class DdgParams(Record):
    """The ``ddg`` mechanism's part of a round plan: FedSGD with the distributed discrete
    Gaussian (Kairouz, Liu, Steinke, ICML 2021; ``edge_sdk.mechanisms.ddg``), integers
    straight into the ring (the plan's ``bits``).

    Attributes:
        clip: per-sample L2 bound C (model units).
        gamma: model units per integer step.
        sigma: each device's discrete Gaussian parameter (integer scale).
        sparsity: rand-k kept fraction p (1: dense; the set from the plan's ``round_seed``).
        lr: the FedSGD step the server takes along the decoded mean gradient.
        nominal_samples: the fleet's public mean local data size (the decode's divisor;
            never a round's true count, which depends on the data).
    """

    clip: float = Float(0.0, open_lo=True)
    gamma: float = Float(0.0, open_lo=True)
    sigma: float = Float(0.0)
    sparsity: float = Float(0.0, 1.0, open_lo=True)
    lr: float = Float(0.0, open_lo=True)
    nominal_samples: float = Float(0.0, open_lo=True)


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class BinomialParams(Record):
    """The ``binomial`` mechanism's part of a round plan: the cpSGD binomial mechanism
    (Agarwal et al., NeurIPS 2018; ``edge_sdk.mechanisms.binomial``): the clipped update
    rounded onto a grid of S / levels plus Binomial(trials, 1/2) - trials/2, integers
    straight into the ring (the plan's ``bits``).

    Attributes:
        steps, batch_size, lr, clip: the local round E, b, lr and per-sample clip C
            (``edge_sdk.train.local_round_binomial``; a without-replacement subsample).
        update_clip: S, the L2 bound of the update (model units).
        trials: N, coin flips per coordinate (even; the device checks the range).
        levels: grid steps per S (the grid is S / levels).
    """

    steps: int = Int(1, 1 << 20)
    batch_size: int = Int(1, 1 << 24)
    lr: float = Float(0.0, open_lo=True)
    clip: float = Float(0.0, open_lo=True)
    update_clip: float = Float(0.0, open_lo=True)
    trials: int = Int(2, 1 << 20)
    levels: int = Int(1, 1 << 20)


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceDpParams(Record):
    """The ``device-dp`` mechanism's part of a round plan: device-level DP-FedAvg with the
    distributed discrete Gaussian (``edge_sdk.mechanisms.device_dp``): local steps, the
    update clipped to S, rotated, scaled, conditionally rounded and noised into the ring.

    Attributes:
        steps, batch_size, lr, sampling: the local round (tau steps of SGD).
        local_clip, local_noise_multiplier: local DP-SGD (per-sample clip C, noise std z_l C);
            ``local_noise_multiplier`` 0 means plain SGD (no per-sample clipping, no noise,
            ``local_clip`` unused).
        update_clip: S, the L2 bound of the whole update (model units).
        gamma: model units per integer step.
        noise_multiplier: z, the target: the noise summed over the honest members
            (min_survivors - max_colluders) has std at least z S / gamma (integer scale).
        sigma: each device's discrete Gaussian parameter (integer scale), calibrated so.
        sparsity: rand-k kept fraction p (1: dense; the set from the plan's ``round_seed``).
        indicator_scale: c, adaptive clipping's indicator (Andrew et al. 2021): each device
            appends c (b - 1/2), b = 1 if its update's norm was <= S, to the vector it
            clips, rotates and noises (L2 bound sqrt(S^2 + c^2/4)); 0: fixed clipping.
        sample_rate: q, self-sampled check-ins (issue 16): each member sends its data with
            probability q by its own hidden coin, the null record (zeros) otherwise, its
            noise share either way; 1: always its data.
    """

    steps: int = Int(1, 1 << 20)
    batch_size: int = Int(1, 1 << 24)
    lr: float = Float(0.0, open_lo=True)
    sampling: str = Str(choices=_SAMPLING)
    local_clip: float = Float(0.0, open_lo=True)
    local_noise_multiplier: float = Float(0.0)
    update_clip: float = Float(0.0, open_lo=True)
    gamma: float = Float(0.0, open_lo=True)
    noise_multiplier: float = Float(0.0)
    sigma: float = Float(0.0)
    sparsity: float = Float(0.0, 1.0, open_lo=True)
    indicator_scale: float = Float(0.0)
    sample_rate: float = Float(0.0, 1.0, open_lo=True)


MECHANISM_PARAMS: Mapping[str, type[Record]] = MappingProxyType({
    "gaussian": GaussianParams, "update-noise": UpdateNoiseParams, "ddg": DdgParams,
    "binomial": BinomialParams, "device-dp": DeviceDpParams})
"""Each mechanism's parameter record, by the name a plan's ``mechanism`` field carries
(``edge_sdk.mechanisms.MECHANISMS`` has the same names)."""


def colluder_problem(max_colluders: int, *, threshold: int, min_survivors: int) -> str | None:
    """Why ``max_colluders`` cannot go with this threshold and survivor floor (None: it can).

    Colluding members plus the aggregator must stay below the Shamir threshold t (with t
    or more shares among them they could unmask an honest device's input without it), and
    every unmasked sum must keep at least one honest member's noise
    (``min_survivors - max_colluders >= 1``).
    """
    if isinstance(max_colluders, bool) or not isinstance(max_colluders, int) \
            or max_colluders < 0:
        return f"max_colluders must be an integer >= 0, got {max_colluders!r}"
    if max_colluders >= threshold:
        return (f"max_colluders must be below the secagg threshold {threshold} (colluders "
                f"holding t shares unmask an honest device), got {max_colluders}")
    if min_survivors - max_colluders < 1:
        return (f"min_survivors {min_survivors} - max_colluders {max_colluders} must leave "
                f"at least one honest member in every sum")
    return None


def _check_secagg_settings(msg: Any, n: int, what: str) -> None:
    """A plan's (or an offer's) SecAgg+ settings for ``n`` members: the neighbourhood rule,
    threshold <= min_survivors <= n, and the colluder rule (ValueError naming which)."""
    problem = neighbourhood_problem(n, msg.degree, msg.threshold)
    if problem:
        raise ValueError(f"secagg parameters: {problem}")
    if not msg.threshold <= msg.min_survivors <= n:
        raise ValueError(f"min_survivors must be in [threshold={msg.threshold}, "
                         f"{what}={n}], got {msg.min_survivors}")
    problem = colluder_problem(msg.max_colluders, threshold=msg.threshold,
                               min_survivors=msg.min_survivors)
    if problem:
        raise ValueError(problem)


@message(kind="plan", signer=AGGREGATOR, party=None)
@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan(Message):
    """Aggregator -> each cohort member: everything a device needs for one round.

    Attributes:
        round_id: the round, unique and increasing per fleet, >= 1.
        model_version: the global model version to train from.
        cohort: the selected devices, sorted (also the secagg cohort).
        mechanism: the mechanism's name (a key of :data:`MECHANISM_PARAMS`);
        params: its parameters (the record that name chooses).
        round_seed: the round's public 32-byte seed (the rand-k coordinate set).
        bits: ring size exponent b of the secure sum (sums are mod 2^b).
        length: values summed by secure aggregation (k = kept_count(d, p)).
        nonce, degree, threshold: the rest of ``secagg.RoundConfig`` (the neighbourhood
            rule of ``hazmat.graph.neighbourhood_problem``).
        min_survivors: the fewest uploads the aggregator will ever unmask (the ledger's
            aggregate-view ``cohort_size``); a device refuses an unmask request for fewer.
        max_colluders: how many cohort members the fleet's policy assumes may collude with
            the aggregator (each knows, and can subtract, its own noise), so the sum is
            accounted on ``min_survivors - max_colluders`` honest members' noise. Valid
            plans have ``0 <= max_colluders < threshold`` and
            ``min_survivors - max_colluders >= 1`` (:func:`colluder_problem`).
        stage_timeout: seconds the aggregator waits per stage (a device gives up on the
            round after several of these without news).
        secagg: the secure-aggregation protocol: ``"secagg+"`` (per-round keys, Shamir
            shares, double masking; Bonawitz et al. 2017 with Bell et al. 2020) or
            ``"amortized"`` (pairwise seeds agreed at enrollment, one masked upload and,
            only for dropped neighbours, a reveal; the zCDP paper's Fig. 2, with the weaker
            dropout story stated in :mod:`edge_sdk.secagg`). Protocol 8, issue 18.
    """

    round_id: int = Round(1)
    model_version: int = Int(0, ROUND_HI)
    cohort: tuple[str, ...] = Names(min=3, sorted_unique=True)
    mechanism: str = Name()
    params: Any = ParamsOf("mechanism", MECHANISM_PARAMS)
    round_seed: bytes = Bytes(32)
    bits: int = Int(2, 64)
    length: int = Int(1, "max_array_elements")
    nonce: bytes = Bytes(32)
    degree: int = Int(2, "max_cohort")
    threshold: int = Int(1, "max_cohort")
    min_survivors: int = Int(1, "max_cohort")
    max_colluders: int = Int(0, "max_cohort")
    stage_timeout: float = Float(0.0, 86400.0, open_lo=True)
    secagg: str = Str(choices=SECAGG_PROTOCOLS, default="secagg+")
    sig: bytes = Sig()

    def wire_check(self, limits: Limits) -> None:
        _check_secagg_settings(self, len(self.cohort), "cohort size")


# =========================================================================== device -> aggregator


@message(kind="checkin", signer=DEVICE)
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckIn(Message):
    """Device -> aggregator: "I am available" (DESIGN, one round, step 1).

    Attributes:
        round_id: the last round the device saw a plan of (0: none); informational.
        sender: the device (must match the topic's device).
        data_size: number of local training samples.
        remaining_epsilon: local epsilon left in the device's budget (its ledger's figure,
            ``Ledger.remaining()``; 0 when the ledger cannot be read).
        budget_epsilon, budget_delta: the owner's budget the ledger enforces (``Ledger.budget``:
            local epsilon in nats, zero-out adjacency, at ``budget_delta``).
        spent_epsilon: the local epsilon (nats) the ledger counts as spent at ``budget_delta``
            (``Ledger.spent().local_epsilon``, every reservation counted); None when the
            ledger cannot be read (no figure rather than a made-up one). Reported as the
            ledger says it, not clipped to the budget.
        model_version: the global model version the device holds (-1: none yet).

    Every figure is the device's own statement: the receiver can check its form (finite,
    >= 0, a delta in (0, 1)), not its truth.
    """

    round_id: int = Round()
    sender: str = From()
    data_size: int = Int(0, 1 << 40)
    remaining_epsilon: float = Float(0.0)
    budget_epsilon: float = Float(0.0, open_lo=True)
    budget_delta: float = Float(0.0, 1.0, open_lo=True, open_hi=True)
    spent_epsilon: float | None = Optional(Float(0.0), default=MISSING)
    model_version: int = Int(-1, ROUND_HI)
    sig: bytes = Sig()


@message(kind="decline", signer=DEVICE)
@dataclass(frozen=True, slots=True, kw_only=True)
class Decline(Message):
    """Device -> aggregator: the device will not take part in the round.

    Attributes:
        round_id: the round declined; sender: the device.
        reason: a short machine-readable code (``"budget"``, ``"stale_model"``,
            ``"already_committed"``, ``"no_data"``, ...).
        detail: human-readable explanation.
    """

    round_id: int = Round()
    sender: str = From()
    reason: str = Name()
    detail: str = Str(default="")
    sig: bytes = Sig()


@message(kind="advertise_keys", signer=DEVICE, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class AdvertiseKeys(Message):
    """Device -> aggregator -> neighbours: this round's two X25519 public keys
    (Bonawitz et al. Fig. 4, round 0 "AdvertiseKeys")."""

    round_id: int = Round()
    sender: str = From()
    mask_key: bytes = Bytes(_KEY_BYTES)
    enc_key: bytes = Bytes(_KEY_BYTES)
    sig: bytes = Sig()


@message(kind="encrypted_share", signer=DEVICE, party="both", context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class EncryptedShare(Message):
    """One owner's two shares for one holder, sealed with ChaCha20-Poly1305; travels inside
    ``share_keys`` (owner -> aggregator) and ``forwarded_shares`` (aggregator -> holder).

    Plaintext: mask-key share (66 bytes) || self-mask-seed share (66 bytes). Associated
    data: ``b"fedge/secagg/v1/share" + digest + lp(sender) + lp(recipient)``.
    """

    round_id: int = Round()
    sender: str = From()
    recipient: str = To()
    nonce: bytes = Bytes(_NONCE_BYTES)
    ciphertext: bytes = Bytes(_SHARE_CT_BYTES)
    sig: bytes = Sig()


@message(kind="share_keys", signer=DEVICE, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class ShareKeys(Message):
    """Device -> aggregator: its encrypted shares, one per neighbour (round 1 "ShareKeys")."""

    round_id: int = Round()
    sender: str = From()
    shares: tuple[EncryptedShare, ...] = ListOf(Struct(EncryptedShare), max="max_cohort")
    sig: bytes = Sig()


@message(kind="masked_part", signer=DEVICE, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class MaskedPart(Message):
    """Device -> aggregator: part ``part`` of ``parts`` of the masked vector y_u, ``count``
    residues packed at ``bits`` (``hazmat.ring.Ring.pack``: ``ceil(count * bits / 8)``
    bytes in all), cut into byte ranges below the packet size (``wire.chunking``).

    Attributes:
        part: 0-based index; parts: how many; digest: SHA-256 of the whole packed vector;
        data: this part's bytes of it (raw, never msgpack inside msgpack).
    """

    round_id: int = Round()
    sender: str = From()
    part: int = Int(0, "max_chunks")
    parts: int = Int(1, "max_chunks")
    bits: int = Int(1, 64)
    count: int = Int(1, _MAX_LENGTH)
    digest: bytes = Bytes(32)
    data: bytes = Bytes(min=1, max="max_upload_bytes")
    sig: bytes = Sig()

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole packed vector."""
        return (self.count * self.bits + 7) // 8

    def wire_check(self, limits: Limits) -> None:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} must be below parts = {self.parts}")
        if self.total_bytes > limits.max_upload_bytes:
            raise ValueError(f"{self.count} residues of {self.bits} bits take "
                             f"{self.total_bytes} bytes, above {limits.max_upload_bytes}")
        if len(self.data) > self.total_bytes:
            raise ValueError(f"a part of {len(self.data)} bytes exceeds the whole vector's "
                             f"{self.total_bytes}")


@message(kind="unmask_response", signer=DEVICE, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class UnmaskResponse(Message):
    """Device -> aggregator: the requested shares, as (owner, 66-byte share) pairs."""

    round_id: int = Round()
    sender: str = From()
    mask_key_shares: tuple[tuple[str, bytes], ...] = Map(Name(), Bytes(SHARE_BYTES),
                                                         max="max_cohort")
    self_seed_shares: tuple[tuple[str, bytes], ...] = Map(Name(), Bytes(SHARE_BYTES),
                                                          max="max_cohort")
    sig: bytes = Sig()


@message(kind="reveal_response", signer=DEVICE, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class RevealResponse(Message):
    """Amortized variant, survivor -> aggregator: this round's pairwise seeds toward the
    dropped neighbours, as (peer, 32-byte round seed) pairs."""

    round_id: int = Round()
    sender: str = From()
    seeds: tuple[tuple[str, bytes], ...] = Map(Name(), Bytes(SEED_BYTES), max="max_cohort")
    sig: bytes = Sig()


# =========================================================================== aggregator -> device


@message(kind="neighbour_keys", signer=AGGREGATOR, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class NeighbourKeys(Message):
    """Aggregator -> device: the signed advertisements of its neighbours that advertised."""

    round_id: int = Round()
    recipient: str = To()
    adverts: tuple[AdvertiseKeys, ...] = ListOf(Struct(AdvertiseKeys), max="max_cohort")
    sig: bytes = Sig()


@message(kind="forwarded_shares", signer=AGGREGATOR, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardedShares(Message):
    """Aggregator -> device: the shares its neighbours sealed for it."""

    round_id: int = Round()
    recipient: str = To()
    shares: tuple[EncryptedShare, ...] = ListOf(Struct(EncryptedShare), max="max_cohort")
    sig: bytes = Sig()


@message(kind="unmask_request", signer=AGGREGATOR, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class UnmaskRequest(Message):
    """Aggregator -> surviving device: which of its neighbours dropped (reveal their
    mask-key shares) and which survived (reveal their self-mask shares), and how many
    uploads in all (``survivor_count`` = |U3|, the recipient included) the unmasked sum
    will contain: a device whose accounting assumes a minimum checks it before answering
    (``edge_sdk.session``). With the complete graph the device can verify it (its
    surviving neighbours plus itself); with SecAgg+ neighbourhoods it is the
    aggregator's word (the aggregator is assumed semi-honest, see :mod:`edge_sdk.secagg`)."""

    round_id: int = Round()
    recipient: str = To()
    dropped: tuple[str, ...] = Names()
    survivors: tuple[str, ...] = Names()
    survivor_count: int = Int(1, "max_cohort")
    sig: bytes = Sig()


@message(kind="reveal_request", signer=AGGREGATOR, context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class RevealRequest(Message):
    """Amortized variant, aggregator -> survivor: these neighbours of yours dropped."""

    round_id: int = Round()
    recipient: str = To()
    dropped: tuple[str, ...] = Names()
    sig: bytes = Sig()


@message(kind="error", signer=AGGREGATOR)
@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorNotice(Message):
    """Aggregator -> device: a round ended without the device (``"round_failed"``), or a
    message of the device's was rejected (``"rejected"``).

    Attributes:
        round_id: the round concerned (0: none); recipient: the device;
        code: machine-readable; detail: human-readable.
    """

    round_id: int = Round()
    recipient: str = To()
    code: str = Name()
    detail: str = Str(default="")
    sig: bytes = Sig()


@message(kind="model", signer=AGGREGATOR, party=None)
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelUpdate(Message):
    """Aggregator -> everyone (retained): the global model.

    Attributes:
        round_id: the round that produced it (0 for the initial model).
        version: model version (0: the initial model; +1 per completed round).
        arrays: the parameters in graph order.
    """

    round_id: int = Round()
    version: int = Int(0, ROUND_HI)
    arrays: tuple[WireArray, ...] = ListOf(Struct(WireArray), min=1, max="max_arrays")
    sig: bytes = Sig()

    def wire_check(self, limits: Limits) -> None:
        total = sum(math.prod(a.shape) for a in self.arrays)
        if total > limits.max_array_elements:
            raise ValueError(f"the model has {total} values, above "
                             f"{limits.max_array_elements}")

    @classmethod
    def of(cls, *, version: int, round_id: int, params: Iterable[np.ndarray]) -> ModelUpdate:
        return cls(version=version, round_id=round_id,
                   arrays=tuple(WireArray.of(p) for p in params))

    def params(self) -> list[np.ndarray]:
        return [a.to_numpy() for a in self.arrays]


# =========================================================================== buffered rounds


@message(kind="offer", signer=AGGREGATOR, party=None)
@dataclass(frozen=True, slots=True, kw_only=True)
class BufferOffer(Message):
    """Aggregator -> every device (retained on the fleet's round topic): buffered
    asynchronous rounds are open (FedBuff, Nguyen et al. 2022; ``aggregator.rounds``, issue
    19). A device that holds the newest model and no update trains one ahead, under the
    spend of a round with these settings (reserved in its ledger first), and says so with
    :class:`Ready`; the aggregator starts a round (a :class:`RoundPlan`) once
    ``buffer_size`` devices are ready, and each member adds its held update, weighted by
    its staleness, to that round's secure sum.

    Attributes:
        round_id: the offer's generation (>= 1; a new one whenever its settings change).
        mechanism, params, bits, length, degree, threshold, min_survivors, max_colluders,
            stage_timeout, secagg: exactly those of every plan the buffered rounds will send
            (``RoundPlan``); the device reserves the event these imply and refuses a plan
            whose event differs.
        buffer_size: K, the members of each buffered round (its cohort size).
        max_staleness: the most model versions a held update may lag the plan's model
            (0: only updates trained on the plan's own model).
        staleness_exponent: a in the weight (1 + tau)^-a that a member trained tau versions
            behind applies to its clipped update before noise and masking (FedBuff's
            polynomial staleness weight; 0: no weighting). The weight is at most 1, so the
            update's L2 bound, and with it every privacy event, stays the plan's.
    """

    round_id: int = Round(1)
    mechanism: str = Name()
    params: Any = ParamsOf("mechanism", MECHANISM_PARAMS)
    bits: int = Int(2, 64)
    length: int = Int(1, "max_array_elements")
    degree: int = Int(2, "max_cohort")
    threshold: int = Int(1, "max_cohort")
    min_survivors: int = Int(1, "max_cohort")
    max_colluders: int = Int(0, "max_cohort")
    stage_timeout: float = Float(0.0, 86400.0, open_lo=True)
    secagg: str = Str(choices=SECAGG_PROTOCOLS, default="secagg+")
    buffer_size: int = Int(3, "max_cohort")
    max_staleness: int = Int(0, ROUND_HI)
    staleness_exponent: float = Float(0.0, 8.0)
    sig: bytes = Sig()

    def wire_check(self, limits: Limits) -> None:
        _check_secagg_settings(self, self.buffer_size, "buffer_size")

    def weight(self, staleness: int) -> float:
        """(1 + staleness)^-a, the factor a member ``staleness`` versions behind applies."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        return float((1.0 + staleness) ** -self.staleness_exponent)


@message(kind="ready", signer=DEVICE)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """Device -> aggregator: "I hold an update trained ahead under offer ``offer``"
    (buffered rounds, :class:`BufferOffer`).

    Attributes:
        round_id: the last round the device saw a plan of (0: none); informational.
        sender: the device.
        offer: the offer generation the update's spend was reserved under.
        trained_version: the model version the update was trained from; the aggregator
            selects it only into a round whose model is at most the offer's
            ``max_staleness`` versions newer.
        attempt: the update's number among those this device trained on that version (0
            first; a device trains again on the same version after a round that took its
            update failed): (trained_version, attempt) names one update, which one round
            at most takes.
    """

    round_id: int = Round()
    sender: str = From()
    offer: int = Int(1, ROUND_HI)
    trained_version: int = Int(0, ROUND_HI)
    attempt: int = Int(0, ROUND_HI)
    sig: bytes = Sig()


# =========================================================================== site <-> gateway


@message(kind="site_round", signer=AGGREGATOR, party=None)
@dataclass(frozen=True, slots=True, kw_only=True)
class SiteRound(Message):
    """Site -> every gateway (retained): "run round ``round_id`` from model
    ``model_version``" (``aggregator.site``).

    Attributes:
        round_id: the site's round, unique and increasing, >= 1; each gateway runs a
            round of this id with its own cohort.
        model_version: the site's model version the round trains from (the gateways
            republish that model to their devices).
        round_seed: the round's public 32-byte seed, the same in every gateway's plan (the
            rand-k coordinate set: the gateways' sums add up only on one set).
        deadline_s: seconds the site waits for gateway sums once it announced the round.
        cohort, job: empty and 0 for a gateway, which draws its own cohort; a job for one of
            a gateway's workers (``aggregator.site``, issue 19) names the cohort to run and
            its index among the round's jobs (published on ``site/job``, which the workers
            take through an MQTT v5 shared subscription: each job reaches one worker).
    """

    round_id: int = Round(1)
    model_version: int = Int(0, ROUND_HI)
    round_seed: bytes = Bytes(32)
    deadline_s: float = Float(0.0, 86400.0, open_lo=True)
    cohort: tuple[str, ...] = Names(sorted_unique=True, default=())
    job: int = Int(0, "max_cohort", default=0)
    sig: bytes = Sig()


@message(kind="gateway_sum", signer=DEVICE)
@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySum(Message):
    """Gateway -> site: what its secure aggregation of site round ``round_id`` released.

    The gateway forwards exactly the view it had: the sum mod 2^bits of its
    ``survivors`` uploads (each already noised by its device for this gateway's cohort
    alone, as the plan's mechanism requires) and their count, with the plan fields the
    site's decoding needs. ``survivors == 0``: the gateway's round failed (``detail``
    says why) and ``total`` is absent.

    Attributes:
        sender: the gateway's name; model_version, mechanism, params, round_seed, bits,
            length: those of the plan its cohort ran (``RoundPlan``);
        cohort: the gateway's cohort (sorted device names; the site's decoding plan is
            for their union); survivors: uploads in the sum (0: failed);
        total: the ring sum, ``length`` unsigned integers below 2^bits;
        detail: why it failed ("" when it did not); job: the job it ran (a worker's; 0
            for a gateway).
    """

    round_id: int = Round(1)
    sender: str = From()
    model_version: int = Int(0, ROUND_HI)
    mechanism: str = Name()
    params: Any = ParamsOf("mechanism", MECHANISM_PARAMS)
    round_seed: bytes = Bytes(32)
    bits: int = Int(2, 64)
    length: int = Int(1, "max_array_elements")
    cohort: tuple[str, ...] = Names(min=3, sorted_unique=True)
    survivors: int = Int(0, "max_cohort")
    total: WireArray | None = Optional(Struct(WireArray))
    detail: str = Str(default="")
    job: int = Int(0, "max_cohort", default=0)
    sig: bytes = Sig()

    def wire_check(self, limits: Limits) -> None:
        if self.survivors > len(self.cohort):
            raise ValueError(f"survivors {self.survivors} exceed the cohort's "
                             f"{len(self.cohort)} devices")
        if (self.survivors == 0) != (self.total is None):
            raise ValueError("a gateway sum has a total exactly when survivors >= 1, got "
                             f"survivors {self.survivors} and "
                             f"{'no total' if self.total is None else 'a total'}")
        if self.total is None:
            return
        if self.total.dtype[1] != "u" or self.total.shape != (self.length,):
            raise ValueError(f"total must be {self.length} unsigned integers, got dtype "
                             f"{self.total.dtype} shape {list(self.total.shape)}")
        if self.bits < 8 * np.dtype(self.total.dtype).itemsize:
            top = int(self.total.to_numpy().max(initial=0))
            if top >> self.bits:
                raise ValueError(f"total holds {top}, not below 2^{self.bits}")


# =========================================================================== catalogs

SecAggUp: TypeAlias = AdvertiseKeys | ShareKeys | MaskedPart | UnmaskResponse | RevealResponse
SecAggDown: TypeAlias = NeighbourKeys | ForwardedShares | UnmaskRequest | RevealRequest

SECAGG_UP = catalog(AdvertiseKeys, ShareKeys, MaskedPart, UnmaskResponse, RevealResponse)
"""The SecAgg kinds a device sends (their signatures bind the RoundConfig digest)."""
SECAGG_DOWN = catalog(NeighbourKeys, ForwardedShares, UnmaskRequest, RevealRequest)
"""The SecAgg kinds the aggregator sends to one device."""
UP_KINDS = catalog(CheckIn, Decline, Ready, *SECAGG_UP.values())
"""Everything the aggregator accepts from a device (its ``up/<kind>`` topics)."""
DOWN_KINDS = catalog(RoundPlan, ErrorNotice, *SECAGG_DOWN.values())
"""Everything a device accepts on its ``down/<kind>`` topics."""
MODEL_KINDS = catalog(ModelUpdate)
"""The retained model topic's one kind."""
OFFER_KINDS = catalog(BufferOffer)
"""The fleet round topic's one kind (retained): the offer of buffered rounds."""
DEVICE_KINDS = catalog(RoundPlan, ErrorNotice, ModelUpdate, BufferOffer,
                       *SECAGG_DOWN.values())
"""Everything a device decodes (down topics, the model and the offer)."""
SITE_KINDS = catalog(SiteRound, GatewaySum)
"""The site <-> gateway kinds (``aggregator.site``); no device decodes them."""
ALL_KINDS = catalog(*UP_KINDS.values(), *DOWN_KINDS.values(), ModelUpdate, BufferOffer,
                    *SITE_KINDS.values())
"""Every top-level kind (``encrypted_share`` only travels nested)."""

