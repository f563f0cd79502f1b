"""Device-level DP-FedAvg with the distributed discrete Gaussian: the record is the device.

Issue 16 (DP-FedAvg, McMahan et al. 2018; distributed discrete Gaussian, Kairouz, Liu,
Steinke, ICML 2021, "KLS"). Device half (:class:`DeviceDpDevice`):

1. tau local steps of SGD from the global model on the device's data
   (:func:`local_update`, the one place the training is called): plain SGD (summed
   per-sample gradients without clipping or noise over the plan's public batch size B), or
   DP-SGD (per-sample clip C, noise std z_l C) when the plan asks for a sample-level local
   guarantee too (``local_noise_multiplier > 0``);
2. the update restricted to the round's rand-k coordinate set, if any (k values; the set
   comes from the plan's public ``round_seed``, independent of the data);
3. :func:`edge_sdk.ddp.encode_device`: the update clipped to L2 norm S (model units),
   rotated by the randomized Hadamard transform of the round seed (padded to k' = the next
   power of two), scaled by 1/gamma, conditionally rounded (the norm bound
   D2 = ``rounded_l2_bound(S / gamma, k', beta)`` checked after rounding, KLS Sec. 4),
   N_Z(0, sigma^2) added per coordinate, reduced mod 2^bits.

Why the discrete Gaussian and not Skellam (both are in :mod:`edge_sdk.ddp`):

* sampler exactness: the discrete Gaussian sampler is exact (CKS 2020, integer and rational
  arithmetic over the rng's 64-bit words); ``ddp.sample_skellam`` draws through numpy's
  floating-point Poisson sampler, whose law is not exactly Skellam;
* accounting at small n: the honest count n = min_survivors - max_colluders of a small
  IoT cohort is small. KLS Theorem 1's extra term tau = 10 sum_{k<n} exp(-2 pi^2 sigma^2
  k/(k+1)) <= 10 (n - 1) exp(-pi^2 sigma^2) is below 1e-34 for sigma >= 3 and n <= 1000
  (the per-device sigma here is z S / (gamma sqrt(n)), about 100 at S / gamma = 2^10,
  z = 1, n = 89, where tau is 0 in float64), so the RDP is a D2^2/(2 n sigma^2); the
  review of issue 15 (Q2, part B) found the claim tight against exact Renyi divergences
  at n = 7 and 89, and tests/test_device_dp.py checks it against the exact worst case at
  n = 2, 3 with sigma below 1, where tau is live. The Skellam bound (AKL 2021 Thm 3.5)
  carries a D1 / V^2 term on top;
* closure under sums: Skellam is closed under sums and the discrete Gaussian is not, but
  the only price of that here is tau, negligible at these sigmas.

Privacy (:meth:`DeviceDpDevice.events`). Aggregate event (against whoever sees only the
secure sum): :func:`edge_sdk.ddp.event` with ``devices`` = the honest shares certainly in
the sum, n = min_survivors - max(plan's, device's max_colluders) (``round.honest_members``;
the target included; uploads that drop after masking stay in the sum; colluders can
subtract their own shares), under **substitution of one device**: the neighbour is the same
round with this device's data replaced by any other, so its rounded update by any other of
norm <= D2 (the two differ by at most 2 D2 in L2, 2 D1 in L1), its noise share in the sum
in both. KLS 2021 Theorem 1 (RDP of the distributed discrete Gaussian,
``privacy.discrete.rdp_distributed_discrete_gaussian``), on the integer scale over k'
coordinates. Why substitution and not the tighter device-level zero-out (neighbour: the
update replaced by 0, D2): the ledger states its figures per sample (zero-out of one
record), and one sample's change moves a clipped update after tau steps by up to 2 S, not
S, so a zero-out figure at D2 would read LOW as a sample-level one; substitution of the
device covers every change to its data, a sample's included. Assumptions:
secure aggregation reveals only the sum to fewer than its threshold t of colluders; at most
``max_colluders`` members collude with the aggregator; a semi-honest aggregator (it unmasks
no fewer than ``min_survivors``: devices refuse to unmask fewer, but SecAgg+ neighbourhoods
leave that count the aggregator's word). Device level add/remove is never stated: an
absent device takes its share with it, and the bound needs the same summed noise in both
neighbours (``ddp.DEVICE_ADD_REMOVE_REFUSAL``). No amplification by sampling is claimed
(q = 1): the device cannot check the cohort draw.

Device-level event (:meth:`DeviceDpDevice.device_event`; the ledger's device unit, issue
16): the same KLS Theorem 1 bound with the same n, under device-level **zero-out**: the
neighbour is the same round with this device's update replaced by 0 (its noise share stays
in the sum), so the rounded vectors differ by at most D2 (D1), half the substitution
shift. The ledger keeps it apart from the sample-level figures (its own unit, composed
only with other device-level events), where it cannot be read as a per-sample figure.
Same assumptions as the aggregate event.

Local event (against whoever sees one upload): with local DP-SGD, its sample-level event
(``train.round_event``: the Poisson-subsampled Gaussian, tau steps); the upload is
post-processing of the DP-SGD output. Without it, the upload still carries the device's
own noise share, so the local event is the same device substitution event with
devices = 1 (KLS Theorem 1 at n = 1: the discrete Gaussian mechanism of CKS 2020; weak,
since sigma is the target over sqrt(n), but sound for any change of the device's data and
finite: the device ledger's budget, checked on the local view, can then pay for it).

Declining (:meth:`DeviceDpDevice.refusal`): before anything is reserved or trained, the
device checks that n shares of the plan's sigma carry the plan's target,
n Var(N_Z(0, sigma^2)) >= (z S / gamma)^2, with n counted from the signed plan and its own
colluder assumption; otherwise ``edge_sdk.round.open_round`` declines with reason
``"noise"``. The ledger charges what sigma and n give either way; the check refuses a
plan whose cohort or threshold would leave less than the noise the fleet promised.

Randomness (plan15 R8): all from the round's ``rng``, in this order: the local round's
batches (and DP-SGD noise), then ``encode_device``'s conditional rounding, then the noise.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021), when the plan's
``indicator_scale`` c is > 0: the device also releases b = 1 if its (kept) update's norm was
<= S, as one more coordinate c (b - 1/2) appended to the clipped update BEFORE the rotation,
so the one vector it rounds and noises has L2 norm <= S_joint = sqrt(S^2 + c^2/4) and the
events above are those of S_joint: one KLS Theorem 1 release covers the update and the
indicator together (nothing is released for free; the same theorem, adjacency and
assumptions). The target noise is z S_joint, so at the same z a round costs the same
epsilon as fixed clipping and the update's noise grows by sqrt(1 + (c / 2S)^2). The server
reads the noised count of b from the last coordinate (:meth:`DeviceDpServer.quantile`);
``aggregator.round_core`` moves S geometrically toward the target quantile for the next
plan (post-processing of the released sum).

Self-sampled check-ins (issue 16; random check-ins, Balle, Kairouz, McMahan, Thakkar,
Thakurta 2020, in the form a device can verify), when the plan's ``sample_rate`` q < 1:
after training, the device draws b ~ Bernoulli(q) from the round's rng (the OS CSPRNG on a
device) and, if b = 0, releases the null record (the zero vector, the indicator's
coordinate included) with its noise share, exactly as it would its update; the upload is
masked, so neither the aggregator nor fewer than the threshold of colluders learn b, and
the upload's timing does not depend on it (the training ran). Against whoever sees the
sum, the device's data is then in the round with probability q by a coin independent of
it: the device-level event is :class:`~edge_sdk.privacy.SelfSampled` over the zero-out
event above (Zhu and Wang 2019, Theorem 6; the null record sits in both neighbours, which
the amplification needs). What q does not change: the sample-level and local events
(a mixture of releases is no further apart than the releases themselves, joint
quasi-convexity of the Renyi divergence, so the unamplified figures stay sound), and who
the aggregator sees taking part. Why not a coin that skips the round (the textbook
check-in): an absent member takes its noise share with it, the sum's noise then says how
many took part, and no theorem here amplifies that. The price: a member whose coin says no
still uploads (bandwidth), and the sum carries about q times the signal at the same
noise. The server divides by q x survivors (the expected count of data senders).

Server half (:class:`DeviceDpServer`): :func:`edge_sdk.ddp.decode_sum` of the survivors'
ring sum (centered residue, times gamma, unrotated, padding dropped), divided by the
number of survivors (the count the aggregator itself unmasked: post-processing, no
privacy cost), scattered onto the rand-k set: the mean clipped update, which the server
optimizer applies as its delta.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk import compress, ddp
from edge_sdk.engine import Engine
from edge_sdk.mechanisms._layout import Layout, LayoutServer, shaped
from edge_sdk.mechanisms.base import Contribution
from edge_sdk.model import flatten_params
from edge_sdk.privacy.events import Event, SelfSampled
from edge_sdk.train import LocalTraining, local_round, round_event
from edge_sdk.wire import DeviceDpParams, RoundPlan

__all__ = [
    "RING_BOUNDS",
    "WRAP_PROBABILITY",
    "DeviceDp",
    "DeviceDpDevice",
    "DeviceDpRound",
    "DeviceDpServer",
    "device_dp_public",
    "device_sigma",
    "encoding",
    "joint_clip",
    "kept_length",
    "local_update",
    "ring_bits",
    "share_variance",
    "target_variance",
    "vector_length",
]

WRAP_PROBABILITY = 1e-9
"""Default per-round bound on the probability that the sum wraps."""

# Above this sigma, Var(N_Z(0, sigma^2)) equals sigma^2 to float64 precision (the deficit
# is below 8 pi^2 sigma^4 e^(-2 pi^2 sigma^2), CKS 2020), and summing the pmf would cost
# 40 sigma terms.
_EXACT_VARIANCE_UP_TO = 64.0


def share_variance(sigma: float) -> float:
    """Var(N_Z(0, sigma^2)), integer scale: ``ddp.discrete_gaussian_variance`` up to sigma
    = 64, sigma^2 above (where they agree to float precision)."""
    if sigma <= _EXACT_VARIANCE_UP_TO:
        return ddp.discrete_gaussian_variance(sigma)
    return sigma * sigma


def target_variance(noise_multiplier: float, update_clip: float, gamma: float) -> float:
    """(z S / gamma)^2: the variance the honest shares must sum to, integer scale."""
    return (noise_multiplier * update_clip / gamma) ** 2


def device_sigma(noise_multiplier: float, update_clip: float, gamma: float,
                 shares: int) -> float:
    """The smallest sigma (to a relative 1e-12) whose ``shares`` discrete Gaussian shares
    sum to at least :func:`target_variance`: z (S / gamma) / sqrt(shares), nudged up past
    the discrete Gaussian's variance deficit and float rounding.

    Raises:
        ValueError: ``shares`` < 1.
    """
    if isinstance(shares, bool) or not isinstance(shares, int) or shares < 1:
        raise ValueError(f"shares must be an integer >= 1, got {shares!r}")
    target = target_variance(noise_multiplier, update_clip, gamma)
    if target == 0:
        return 0.0
    def enough(sigma: float) -> bool:
        return shares * share_variance(sigma) >= target

    lo = math.sqrt(target / shares)  # Var(N_Z(0, s^2)) < s^2: lo is too small or just right
    if enough(lo):
        return lo
    hi, step = lo, 1e-12
    while not enough(hi):  # bracket, then bisect to a relative 1e-12
        lo, hi, step = hi, hi * (1.0 + step), step * 2.0
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def kept_length(dim: int, sparsity: float) -> int:
    """k: the coordinates of the update a device uploads before padding (d when dense)."""
    return dim if sparsity == 1.0 else compress.kept_count(dim, sparsity)


def joint_clip(update_clip: float, indicator_scale: float) -> float:
    """S_joint = sqrt(S^2 + c^2/4): the L2 bound of the clipped update with adaptive
    clipping's indicator coordinate c (b - 1/2) appended (S itself when c = 0)."""
    return math.hypot(update_clip, indicator_scale / 2.0) if indicator_scale else update_clip


def vector_length(dim: int, sparsity: float, indicator_scale: float) -> int:
    """The values a device rounds before padding: k, plus the indicator when c > 0."""
    return kept_length(dim, sparsity) + (1 if indicator_scale > 0 else 0)


def encoding(*, update_clip: float, gamma: float, sigma: float,
             bits: int) -> ddp.DistributedDP:
    """The round's ``ddp.DistributedDP`` (discrete Gaussian, KLS's default beta)."""
    return ddp.DistributedDP(clip=update_clip, gamma=gamma, noise="discrete_gaussian",
                             bits=bits, sigma=sigma)


RING_BOUNDS = ("bounded", "rotated")
"""How :func:`ring_bits` bounds the sum's coordinates (see there)."""


def ring_bits(*, update_clip: float, gamma: float, sigma: float, cohort_size: int,
              length: int, wrap_probability: float = WRAP_PROBABILITY,
              bound: str = "bounded") -> int:
    """The plan's bits, so that the sum of ``cohort_size`` uploads over the ``length`` = k'
    coordinates wraps with probability <= ``wrap_probability`` (fewer survivors only
    narrow the sum). ``bound``:

    * ``"bounded"``: ``ddp.choose_bits_bounded`` with every coordinate of the summed signal
      bounded by cohort_size x D2 (a rounded vector of L2 norm <= D2 has no coordinate
      above D2): deterministic, whatever the rotation's signs;
    * ``"rotated"``: ``ddp.choose_bits``: after the rotation each coordinate of the summed
      signal is a Rademacher sum of variance proxy (n S / gamma)^2 / k' (KLS Sec. 4), which
      assumes the signs (from the plan's seed) independent of the updates, as they are for
      honest devices; a device that shapes its update against the signs can wrap the sum,
      but it can send any residues anyway. Far fewer bits: at a cohort of 100, k' = 32768,
      S / gamma = 2^10, z = 1 over 89 honest shares, 15 bits (2-byte residues) against 18.

    A wrap costs the round's model update, never privacy: the decode is post-processing.

    Raises:
        ValueError: more than 62 bits needed (raise gamma), or an unknown ``bound``.
    """
    if bound == "rotated":
        return ddp.choose_bits(cohort_size, length, update_clip, gamma, sigma,
                               wrap_probability)
    if bound != "bounded":
        raise ValueError(f"bound must be one of {RING_BOUNDS}, got {bound!r}")
    l2 = ddp.rounded_l2_bound(update_clip / gamma, length, ddp.DEFAULT_BETA)
    return ddp.choose_bits_bounded(cohort_size * l2, cohort_size, length, sigma,
                                   wrap_probability)


def device_dp_public(*, steps: int, batch_size: int, lr: float, sampling: str,
                     local_clip: float, local_noise_multiplier: float, update_clip: float,
                     gamma: float, noise_multiplier: float, sparsity: float, dim: int,
                     cohort_size: int, honest: int,
                     wrap_probability: float = WRAP_PROBABILITY, ring_bound: str = "bounded",
                     indicator_scale: float = 0.0, sample_rate: float = 1.0,
                     ) -> tuple[DeviceDpParams, int, int]:
    """The server's choice for one round: (the plan's record, bits, length k').

    sigma is calibrated on the ``honest`` = min_survivors - max_colluders shares the
    devices account and check (:func:`device_sigma`, for the bound :func:`joint_clip` of S
    and the ``indicator_scale`` c); bits on all ``cohort_size`` shares (:func:`ring_bits`
    with ``bound=ring_bound``; a member whose coin says no sends zeros, which only narrows
    the sum). ``sample_rate``: q of self-sampled check-ins (the module docstring).

    Raises:
        ValueError: ``honest`` outside [1, cohort_size], more than 62 bits needed, or bad
            values (named).
    """
    if not 1 <= honest <= cohort_size:
        raise ValueError(f"honest must be in [1, cohort_size={cohort_size}], got {honest}")
    length = ddp.padded_dim(vector_length(dim, sparsity, indicator_scale))
    bound = joint_clip(update_clip, indicator_scale)
    sigma = device_sigma(noise_multiplier, bound, gamma, honest)
    bits = ring_bits(update_clip=bound, gamma=gamma, sigma=sigma,
                     cohort_size=cohort_size, length=length,
                     wrap_probability=wrap_probability, bound=ring_bound)
    params = DeviceDpParams(
        steps=steps, batch_size=batch_size, lr=lr, sampling=sampling, local_clip=local_clip,
        local_noise_multiplier=local_noise_multiplier, update_clip=update_clip, gamma=gamma,
        noise_multiplier=noise_multiplier, sigma=sigma, sparsity=sparsity,
        indicator_scale=indicator_scale, sample_rate=sample_rate)
    return params, bits, length


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceDpRound:
    """One round's public settings of the device-dp mechanism.

    Attributes:
        training: the local round (plain SGD: clip inf, z 0; or DP-SGD).
        update_clip: S, the update's L2 bound (model units, > 0).
        gamma: model units per integer step (> 0).
        noise_multiplier: z, the target (summed honest noise std z S / gamma).
        sigma: each device's discrete Gaussian parameter (integer scale, >= 0).
        sparsity: rand-k kept fraction p (1: dense).
        bits: the ring's exponent (2..62).
        dim: d, the model's parameter count.
        length: k' = padded_dim(k), the values each device adds.
        cohort_size: members of the cohort.
        round_seed: the plan's public seed (the rotation's signs).
        indicator_scale: c of adaptive clipping (0: fixed clipping; module docstring).
        sample_rate: q of self-sampled check-ins in (0, 1] (1: always the data; module
            docstring).

    Raises:
        ValueError: ``length`` is not padded_dim(k) of rand-k at p of d, bits beyond 62,
            S / gamma above 2^30, or bad values (from ``ddp.DistributedDP``).
    """

    training: LocalTraining
    update_clip: float
    gamma: float
    noise_multiplier: float
    sigma: float
    sparsity: float
    bits: int
    dim: int
    length: int
    cohort_size: int
    round_seed: bytes
    indicator_scale: float = 0.0
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        c = self.indicator_scale
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"indicator_scale must be finite and >= 0, got {c!r}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}")
        n = vector_length(self.dim, self.sparsity, c)
        if self.length != ddp.padded_dim(n):
            raise ValueError(f"length {self.length}, but rand-k at p = {self.sparsity} of "
                             f"{self.dim} parameters keeps {self.kept}"
                             + (" plus the indicator" if c else "")
                             + f", padded to {ddp.padded_dim(n)}")
        self.encoding  # noqa: B018 - validates clip, gamma, bits and sigma together

    @property
    def kept(self) -> int:
        """k, the coordinates uploaded before padding."""
        return kept_length(self.dim, self.sparsity)

    @property
    def values(self) -> int:
        """The values rounded before padding: k, plus the indicator with adaptive clipping."""
        return vector_length(self.dim, self.sparsity, self.indicator_scale)

    @property
    def bound(self) -> float:
        """The L2 bound of the vector released: S, or S_joint with the indicator."""
        return joint_clip(self.update_clip, self.indicator_scale)

    @property
    def encoding(self) -> ddp.DistributedDP:
        """The round's ``ddp.DistributedDP`` (clip: :attr:`bound`)."""
        return encoding(update_clip=self.bound, gamma=self.gamma, sigma=self.sigma,
                        bits=self.bits)

    @classmethod
    def from_plan(cls, plan: RoundPlan, *, dim: int) -> DeviceDpRound:
        """The settings a signed plan states, for a model of ``dim`` parameters.

        Raises:
            ValueError: settings that cannot go together (see the class).
        """
        w: DeviceDpParams = plan.params
        if w.local_noise_multiplier > 0:
            training = LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                                     clip=w.local_clip,
                                     noise_multiplier=w.local_noise_multiplier,
                                     sampling=w.sampling)
        else:  # plain SGD: no per-sample clipping, no noise
            training = LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                                     sampling=w.sampling)
        return cls(training=training, update_clip=w.update_clip, gamma=w.gamma,
                   noise_multiplier=w.noise_multiplier, sigma=w.sigma, sparsity=w.sparsity,
                   bits=plan.bits, dim=dim, length=plan.length, cohort_size=len(plan.cohort),
                   round_seed=plan.round_seed, indicator_scale=w.indicator_scale,
                   sample_rate=w.sample_rate)


def local_update(engine: Engine, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray,
                 training: LocalTraining, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """(theta_tau - theta_0 flattened in graph order, float64; mean per-sample loss): tau
    local steps of ``training`` (module docstring, step 1). The one call of the training.

    Plain SGD goes through ``train.local_round`` with C = inf and z = 0: each step sums the
    batch's unclipped per-sample gradients (the engine's clipped sum with no clipping) over
    the public B. (An engine with a plain-gradient graph can take this call over.)

    Raises:
        edge_sdk.train.TrainingDiverged: a non-finite update.
    """
    res = local_round(engine, list(params), x, y, training, rng)
    return flatten_params(res.update).astype(np.float64), res.mean_loss


@dataclass(frozen=True, slots=True)
class DeviceDpDevice:
    """The device half (see the module docstring)."""

    params: DeviceDpRound

    def refusal(self, *, honest: int) -> str | None:
        """Why the device declines the round (reason ``"noise"``), or None: ``honest``
        shares of the plan's sigma sum to less than the plan's target variance."""
        p = self.params
        target = target_variance(p.noise_multiplier, p.bound, p.gamma)
        have = honest * share_variance(p.sigma)
        if have < target:
            return (f"{honest} honest shares of sigma {p.sigma:.6g} carry noise variance "
                    f"{have:.6g} < the target (z S / gamma)^2 = {target:.6g} (z "
                    f"{p.noise_multiplier:g}, S {p.bound:g}, gamma {p.gamma:g})")
        return None

    def events(self, *, m: int, honest: int) -> tuple[Event, Event]:
        """(local, aggregate) events of one round (module docstring): the aggregate one
        the device's substitution with ``honest`` shares; the local one DP-SGD's
        sample-level event over ``m`` samples, or, with plain SGD, the device substitution
        event of the device's own share (devices = 1)."""
        p = self.params
        cfg = p.encoding

        def ev(devices: int) -> Event:
            # substitution (2 D2), not zero-out (D2): the ledger reads its figures per
            # sample, and a sample moves the clipped update by up to 2 S (module docstring)
            return ddp.event(cfg, devices, p.values, adjacency="substitution")

        local = round_event(m, p.training) if p.training.noise_multiplier > 0 else ev(1)
        return local, ev(honest)

    def device_event(self, *, honest: int) -> Event:
        """The device-level zero-out event of one round over ``honest`` shares (module
        docstring): KLS 2021 Theorem 1 at D2, the device's noise share in the sum; with
        self-sampling (q < 1) that release behind the device's own coin,
        :class:`~edge_sdk.privacy.SelfSampled` (Zhu and Wang 2019, Theorem 6)."""
        p = self.params
        inner = ddp.event(p.encoding, honest, p.values, adjacency="zero_out")
        if p.sample_rate == 1.0:
            return inner
        return SelfSampled(event=inner, sample_rate=p.sample_rate)  # type: ignore[arg-type]

    def contribute(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
                   engine: Engine, coords: np.ndarray | None, honest: int,
                   rng: np.random.Generator) -> Contribution:
        """Train, restrict to ``coords``, clip to S, rotate, scale, round, noise, reduce
        (:meth:`train` then :meth:`encode`, one ``rng``).

        Raises:
            ValueError: ``coords`` does not match the round (None iff dense, k of them).
            edge_sdk.train.TrainingDiverged: a non-finite update (nothing to release).
        """
        self._check_coords(coords)
        x, y = data
        update, loss = self.train(params=params, data=data, engine=engine, rng=rng)
        return self.encode(update, m=len(y), loss=loss, coords=coords, honest=honest,
                           rng=rng)

    def _check_coords(self, coords: np.ndarray | None) -> None:
        p = self.params
        if (coords is None) != (p.sparsity == 1.0) or (
                coords is not None and len(coords) != p.kept):
            raise ValueError(f"coords must be None when dense and {p.kept} indices "
                             f"otherwise (sparsity {p.sparsity})")

    def train(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
              engine: Engine, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        """(theta_tau - theta_0 over every parameter, float64; mean loss): the local round
        alone, what a buffered round's member does ahead of its plan (issue 19).

        Raises:
            edge_sdk.train.TrainingDiverged: a non-finite update.
        """
        x, y = data
        return local_update(engine, params, x, y, self.params.training, rng)

    def encode(self, update: np.ndarray, *, m: int, loss: float, coords: np.ndarray | None,
               honest: int, rng: np.random.Generator, weight: float = 1.0) -> Contribution:
        """Restrict :meth:`train`'s ``update`` (from ``m`` samples) to ``coords``, clip to S,
        scale by ``weight``, rotate, scale, round, noise, reduce.

        ``weight`` in (0, 1] is a buffered round's staleness weight (``wire.BufferOffer``):
        applied after the clip, so the weighted update's norm is at most weight x S <= S and
        every event of the round (stated for S) still holds; 1 leaves the values bit for bit
        those of the unweighted encoding.

        Raises:
            ValueError: ``coords`` does not match the round, or ``weight`` outside (0, 1]
                (with adaptive clipping only 1: the indicator reads the unweighted norm).
        """
        self._check_coords(coords)
        p = self.params
        if not (0.0 < weight <= 1.0):
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        if weight != 1.0 and p.indicator_scale:
            raise ValueError("a staleness weight cannot go with adaptive clipping")
        kept = update if coords is None else update[coords]
        norm = float(np.linalg.norm(kept))
        if weight != 1.0:
            # w clip_S(u): a stale update counts less however long it was
            kept = kept * (weight * min(1.0, p.update_clip / norm) if norm > 0 else weight)
        if p.indicator_scale:  # adaptive clipping: the indicator rides in the same release
            below = 1.0 if norm <= p.update_clip else 0.0
            clipped = kept * min(1.0, p.update_clip / norm) if norm > 0 else kept
            kept = np.append(clipped, p.indicator_scale * (below - 0.5))
        # self-sampling: the coin after the training, whatever it says (the time an upload
        # takes must not tell b), the null record (all zeros, the indicator's too) if no
        if p.sample_rate < 1.0 and not rng.random() < p.sample_rate:
            kept = np.zeros_like(kept)
        values = ddp.encode_device(kept, p.encoding, p.round_seed, rng)
        event, aggregate = self.events(m=m, honest=honest)
        return Contribution(values=values, event=event, aggregate_event=aggregate,
                            num_samples=m, mean_loss=loss,
                            diagnostics={"clipped": int(norm > p.update_clip)},
                            device_event=self.device_event(honest=honest))


@dataclass(frozen=True, slots=True)
class DeviceDpServer(LayoutServer):
    """The server half (see the module docstring). Its state is the model's layout."""

    params: DeviceDpRound

    def decode(self, total: np.ndarray, survivors: int, state: Layout, *,
               coords: np.ndarray | None) -> tuple[list[np.ndarray], Layout]:
        """The mean clipped update of the ``survivors`` (>= 1) whose residues sum to
        ``total`` (decoded, unrotated, divided by ``survivors``), zero off ``coords``, as
        float32 arrays of ``state``."""
        p = self.params
        if isinstance(survivors, bool) or not isinstance(survivors, int) or survivors < 1:
            raise ValueError(f"survivors must be an integer >= 1, got {survivors!r}")
        summed = ddp.decode_sum(np.asarray(total), p.encoding, p.round_seed, p.values,
                                survivors)[:p.kept]
        # self-sampling: q x survivors members are expected to have sent their data (the
        # fixed denominator of DP-FedAvg: an unbiased mean, the count itself never seen)
        return shaped(summed / (p.sample_rate * survivors), p.dim, coords, state), state

    def quantile(self, total: np.ndarray, survivors: int) -> float | None:
        """Adaptive clipping's noised fraction of the ``survivors`` whose update norm was
        <= S, clamped to [0, 1], from the indicator coordinate of the sum (module
        docstring); None with fixed clipping."""
        p = self.params
        if not p.indicator_scale:
            return None
        summed = ddp.decode_sum(np.asarray(total), p.encoding, p.round_seed, p.values,
                                survivors)
        expected = p.sample_rate * survivors  # members expected to have sent their data
        count = summed[p.kept] / p.indicator_scale + expected / 2.0
        return min(1.0, max(0.0, float(count) / expected))


class DeviceDp:
    """The mechanism object (registry name ``"device-dp"``)."""

    name: ClassVar[str] = "device-dp"
    Params: ClassVar[type] = DeviceDpParams  # what travels in RoundPlan.params
    Round: ClassVar[type] = DeviceDpRound  # settings read from a plan: Round.from_plan

    def device(self, params: DeviceDpRound) -> DeviceDpDevice:
        return DeviceDpDevice(params)

    def server(self, params: DeviceDpRound) -> DeviceDpServer:
        return DeviceDpServer(params)
