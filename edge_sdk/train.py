"""One local round on the device: tau steps of per-sample-clipped, Gaussian-noised SGD.

zCDP paper (Hu-Guo-Gong), Algorithm 1 lines 5-10, with per-sample clipping to C in place
of its bounded-gradient assumption (Assumption 1) and the noise expressed as a
multiplier of C: each step adds N(0, (z C)^2 I) to the sum of the clipped per-sample
gradients, divides by the public batch size B of the plan (never by min(m, B): a device
with fewer than B records would otherwise move the cohort's sum by B / m times the
sensitivity every member is accounted with) and takes an SGD step. The round returns
theta_tau - theta_0 and the privacy event it released, as data for an accountant.

Sparsified rounds (Fed-SPA, Hu-Gong-Guo, eq. (5)) keep a coordinate set omega of k = p*d
coordinates, fixed for the round and independent of the data: each step moves only
those, by (1/p) * ([clipped sum]_omega + [noise]_omega) / B. Fed-SPA's Theorem 1 charges
the kept values a sensitivity of sqrt(p) * C, but that only holds on average over omega:
a single sample's gradient can put all its norm on the kept coordinates, and omega is
known to the aggregator. We make the reduced sensitivity true instead of assumed: each
per-sample gradient restricted to omega is clipped to sqrt(p) * C. The noise std on the
kept coordinates stays z * C, so the accounted noise multiplier is z / sqrt(p).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from edge_sdk.engine import Engine
from edge_sdk.errors import EdgeError
from edge_sdk.privacy.events import (
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
)

if TYPE_CHECKING:
    from edge_sdk.privacy.binomial import CpsgdBinomial

__all__ = [
    "LocalResult",
    "LocalTraining",
    "NoiseDraw",
    "TrainingDiverged",
    "dp_sgd_step",
    "BinomialResult",
    "DdgResult",
    "sample_grad_rows",
    "local_round",
    "local_round_ddg",
    "local_round_binomial",
    "local_round_update_noise",
    "coordinate_masks",
    "round_event",
    "subsample_size",
    "update_noise_event",
]

Sampling = Literal["poisson", "shuffle"]


class TrainingDiverged(EdgeError, ArithmeticError):
    """The local round produced a non-finite update (nothing is released)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTraining:
    """Settings of one local round.

    Attributes:
        steps: local SGD steps tau.
        batch_size: Poisson sampling uses the rate q = batch_size / m (the expected batch
            size is batch_size); shuffling uses fixed batches of batch_size.
        lr: local step size eta.
        clip: per-sample L2 clip bound C (``inf``: no clipping, only without noise).
        noise_multiplier: z, the noise std on the clipped sum divided by C (0: no noise).
        sampling: ``"poisson"`` (accounted with subsampling amplification) or
            ``"shuffle"`` (each epoch a permutation; accounted without amplification).
        sparsity: kept fraction p in (0, 1] of the rand-k coordinate set (1: dense).
    """

    steps: int
    batch_size: int
    lr: float
    clip: float = math.inf
    noise_multiplier: float = 0.0
    sampling: Sampling = "poisson"
    sparsity: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity (kept fraction p) must be in (0, 1], got {self.sparsity!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0 (inf for none), got {self.clip!r}")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(
                f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier!r}"
            )
        if self.noise_multiplier > 0 and math.isinf(self.clip):
            raise ValueError("noise_multiplier > 0 needs a finite clip bound C (noise std is z*C)")
        if self.sampling not in ("poisson", "shuffle"):
            raise ValueError(f"sampling must be 'poisson' or 'shuffle', got {self.sampling!r}")


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What a local round returns.

    Attributes:
        update: theta_tau - theta_0, one array per parameter.
        event: the privacy event released, for the accountant (noise multiplier 0 means
            no DP guarantee: its epsilon is infinite).
        num_samples: the size m of the local data set.
        mean_loss: mean per-sample training loss over the round's batches.
    """

    update: list[np.ndarray]
    event: PoissonSubsampledGaussian | Gaussian | SampledWithoutReplacementGaussian
    num_samples: int
    mean_loss: float


def _batches(m: int, cfg: LocalTraining, rng: np.random.Generator):
    if cfg.sampling == "poisson":
        q = min(1.0, cfg.batch_size / m)
        for _ in range(cfg.steps):
            yield np.flatnonzero(rng.random(m) < q), float(cfg.batch_size)
        return
    b = min(cfg.batch_size, m)
    per_epoch = m // b
    order = rng.permutation(m)
    for s in range(cfg.steps):
        k = s % per_epoch
        if s and k == 0:
            order = rng.permutation(m)
        yield order[k * b : (k + 1) * b], float(cfg.batch_size)


def round_event(
    m: int, cfg: LocalTraining, kept_fraction: float = 1.0
) -> PoissonSubsampledGaussian | Gaussian:
    """The privacy event of one local round over m samples (sample-level DP).

    With a rand-k set keeping ``kept_fraction`` p of the coordinates, the kept values are
    clipped to sqrt(p) * C while the noise std stays z * C: noise multiplier z / sqrt(p).

    Poisson: the subsampled Gaussian with q = batch_size / m, tau steps (add/remove
    adjacency; it holds under zero-out too, the step being divided by the public B). Shuffle:
    no amplification is claimed; each sample is used once per epoch, so the round composes
    one Gaussian per epoch touched, and because reshuffling makes add/remove awkward to
    argue we charge substitution (sensitivity 2C, i.e. noise multiplier z/2), which is
    loose but never low; the event says so in its ``adjacency``.
    """
    z = cfg.noise_multiplier / math.sqrt(kept_fraction)
    if cfg.sampling == "poisson":
        return PoissonSubsampledGaussian(
            noise_multiplier=z, sample_rate=min(1.0, cfg.batch_size / m), steps=cfg.steps
        )
    per_epoch = m // min(cfg.batch_size, m)
    return Gaussian(noise_multiplier=z / 2, steps=math.ceil(cfg.steps / per_epoch),
                    adjacency="substitution")


NoiseDraw = Callable[[], list[np.ndarray]]
"""A step's noise drawn on call: absolute noise per parameter (std z*C), as ``dp_sgd_step``'s
``noise`` takes it when the draw may overlap the per-sample-gradient graph."""

_noise_worker: list[ThreadPoolExecutor] = []  # made on first use by an engine of >= 2 threads


def _overlapped(draw: NoiseDraw) -> Future[list[np.ndarray]]:
    """``draw()`` on the one noise worker thread (made on first use, then reused)."""
    if not _noise_worker:
        _noise_worker.append(ThreadPoolExecutor(1, thread_name_prefix="fedge-noise"))
    return _noise_worker[0].submit(draw)


def dp_sgd_step(
    engine: Engine,
    theta: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    clip: float,
    noise: list[np.ndarray] | NoiseDraw | None,
    lr: float,
    denom: float,
    masks: list[np.ndarray] | None = None,
) -> float:
    """One DP-SGD step in place: theta -= lr * (sum_i clip_C(g_i) + noise) / denom.

    Args:
        theta: parameters, updated in place.
        x, y: the batch (may be empty: then only the noise moves theta).
        clip: per-sample L2 bound C.
        noise: absolute noise per parameter (std z*C, drawn by the caller), a function
            that draws it (called exactly once), or None. The noise does not depend on the
            batch, so with an engine of ``threads`` >= 2 the function runs on a second
            thread while the per-sample-gradient graph runs (onnxruntime releases the GIL
            in ``run``); the graph reads nothing the draw writes, and the caller's rng is
            used by nobody else meanwhile, so theta comes out bitwise as when the draw runs
            first. With 1 thread (or without ``threads``) it runs first, on this thread:
            no other thread is started.
        lr: step size; denom: the batch size normalisation, the plan's public B.
        masks: 0/1 arrays of a rand-k coordinate set: norms, clipping and the sum are
            restricted to it (the caller scales clip, noise and lr; see :func:`local_round`).

    Returns:
        The sum of the per-sample losses of the batch (before the step).
    """
    pending = None
    if callable(noise):
        if len(y) and getattr(engine, "threads", 1) >= 2:
            pending = _overlapped(noise)
        else:
            noise = noise()
    try:
        grads, loss = _batch_grads(engine, theta, x, y, clip, masks)
    finally:
        if pending is not None:  # never leave the draw running: it holds the caller's rng
            noise = pending.result()
    step = np.float32(lr / denom)
    for i, (t, g) in enumerate(zip(theta, grads, strict=True)):
        if noise is not None:
            g = g + noise[i]
        t -= step * g
    return loss


def _batch_grads(engine: Engine, theta: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                 clip: float, masks: list[np.ndarray] | None) -> tuple[list[np.ndarray], float]:
    """The batch's clipped gradient sum (unclipped when C = inf) and its summed loss."""
    plain = getattr(engine, "grad_sum", None)  # test doubles may only clip
    if len(y) and clip == math.inf and masks is None and plain is not None:
        # no per-sample clipping (the device-level mode clips the whole update): the plain
        # graph's batch sum, without per-sample norms or gradients
        summed = plain(theta, x, y)
        return summed.grad_sum, float(summed.losses.sum())
    if len(y):
        res = engine.clipped_grad_sum(theta, x, y, clip, masks=masks)
        return res.clipped_sum, float(res.losses.sum())
    return [np.zeros_like(t) for t in theta], 0.0


def local_round(
    engine: Engine,
    params: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    cfg: LocalTraining,
    rng: np.random.Generator,
    coords: np.ndarray | None = None,
) -> LocalResult:
    """Run tau local steps from ``params`` on the device's data (x, y).

    Args:
        engine: computes per-sample norms and the clipped gradient sum.
        params: the global model theta_0 (graph order); not modified.
        x, y: the local data set, m samples.
        cfg: the round's settings (C and z: noise std z*C on the clipped sum).
        rng: the only source of randomness (batches and noise).
        coords: the round's rand-k coordinate set (flat indices into the parameters in
            graph order), required when ``cfg.sparsity < 1``; p is then k / d exactly.

    Returns:
        The update theta_tau - theta_0 and the privacy event released.

    Raises:
        ValueError: empty or mis-shaped data. TrainingDiverged: a non-finite update.
    """
    m = len(y)
    if m == 0 or len(x) != m:
        raise ValueError(f"local data must be non-empty with len(x) == len(y), got {len(x)}, {m}")
    theta = [np.array(p, dtype=np.float32, copy=True) for p in params]
    std = cfg.noise_multiplier * cfg.clip
    masks, p_kept = _masks(theta, cfg, coords)
    clip, lr = cfg.clip * math.sqrt(p_kept), cfg.lr / p_kept  # Fed-SPA eq. (5): S = rand_k / p
    losses, seen = 0.0, 0
    for idx, denom in _batches(m, cfg, rng):
        # drawn on every step, also for an empty Poisson batch; after this step's batch in
        # the rng's stream, before the next one's (dp_sgd_step waits for it)
        noise = _noise_draw(rng, std, [t.shape for t in theta], masks) if std > 0 else None
        losses += dp_sgd_step(engine, theta, x[idx], y[idx], clip=clip, noise=noise,
                              lr=lr, denom=denom, masks=masks)
        seen += len(idx)
    update = [t - np.asarray(p, dtype=np.float32) for t, p in zip(theta, params, strict=True)]
    if not all(np.isfinite(u).all() for u in update):
        raise TrainingDiverged(f"local round produced a non-finite update (lr={cfg.lr})")
    return LocalResult(update, round_event(m, cfg, p_kept), m, losses / max(seen, 1))


def _noise_draw(rng: np.random.Generator, std: float, shapes: list[tuple[int, ...]],
                masks: list[np.ndarray] | None) -> NoiseDraw:
    """A step's noise N(0, std^2) per coordinate from ``rng`` (only on the kept coordinates
    when ``masks`` is given), as a function for :func:`dp_sgd_step`."""

    def draw() -> list[np.ndarray]:
        noise = [rng.normal(0.0, std, size=s).astype(np.float32) for s in shapes]
        if masks is not None:
            noise = [n * mk for n, mk in zip(noise, masks, strict=True)]
        return noise

    return draw


def coordinate_masks(shapes: list[tuple[int, ...]], coords: np.ndarray) -> list[np.ndarray]:
    """0/1 float32 masks shaped like the parameters, 1 at the flat indices ``coords``."""
    d = sum(math.prod(s) for s in shapes)
    coords = np.asarray(coords)
    if coords.ndim != 1 or coords.size == 0 or coords.min() < 0 or coords.max() >= d:
        raise ValueError(f"coordinate set must be non-empty flat indices in [0, {d})")
    if np.unique(coords).size != coords.size:
        raise ValueError("coordinate set has repeated indices")
    flat = np.zeros(d, dtype=np.float32)
    flat[coords] = 1.0
    out, start = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[start : start + n].reshape(s))
        start += n
    return out


def _masks(theta: list[np.ndarray], cfg: LocalTraining, coords: np.ndarray | None):
    if cfg.sparsity == 1.0:
        if coords is not None:
            raise ValueError("a coordinate set was given but sparsity is 1 (dense)")
        return None, 1.0
    if coords is None:
        raise ValueError(f"sparsity {cfg.sparsity} needs the round's coordinate set (coords)")
    masks = coordinate_masks([t.shape for t in theta], coords)
    d = sum(t.size for t in theta)
    return masks, len(coords) / d


def local_round_update_noise(
    engine: Engine,
    params: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    cfg: LocalTraining,
    rng: np.random.Generator,
    *,
    update_clip: float | None = None,
) -> LocalResult:
    """Privatized FedPAQ's mechanism (Mohammadi et al., Alg. 2): noise once, on the update.

    A subsample D_s of E*b records is drawn without replacement (ratio gamma = E*b/m), E
    steps of per-sample-clipped SGD run on disjoint batches of b from it with no noise,
    the update is clipped to L2 norm S and N(0, (z*S)^2 I) is added once (the caller then
    quantizes it, Alg. 2 line 9).

    Accounting: the noisy update is a Gaussian mechanism on D_s whose substitution
    sensitivity is 2S (one changed record can move the clipped update anywhere in the S
    ball: through later steps a non-convex model propagates the change, so the paper's
    per-step sensitivity does not bound the update), amplified by sampling without
    replacement: ``SampledWithoutReplacementGaussian(z / 2, E*b, m)``. The default S =
    E * lr * C is the radius every update already lies in (each step moves at most lr*C).

    Args:
        cfg: E = ``cfg.steps``, b = ``cfg.batch_size``, lr, per-sample clip C and z (the
            noise std divided by S). ``cfg.sampling`` and ``cfg.sparsity`` must be defaults.
        update_clip: S (default E * lr * C; must be finite when z > 0).
    """
    update, _, loss, s_bound = _subsample_update(engine, params, x, y, cfg, rng,
                                                 update_clip, cfg.noise_multiplier > 0)
    std = cfg.noise_multiplier * s_bound
    if std > 0:
        update = [u + rng.normal(0.0, std, size=u.shape).astype(np.float32) for u in update]
    return LocalResult(update, update_noise_event(len(y), cfg), len(y), loss)


def subsample_size(m: int, cfg: LocalTraining) -> int:
    """E*b, the records of a without-replacement subsample of the update-noise and binomial
    rounds over ``m`` >= 1 local records, with b = min(B, max(1, m // E)) (public given m)."""
    b = min(cfg.batch_size, max(1, m // cfg.steps))
    return min(m, cfg.steps * b)


def update_noise_event(m: int, cfg: LocalTraining) -> SampledWithoutReplacementGaussian:
    """The privacy event of one :func:`local_round_update_noise` over ``m`` >= 1 records
    (its docstring: the Gaussian of substitution sensitivity 2S on the subsample, amplified
    by sampling without replacement, Wang, Balle, Kasiviswanathan 2019), known before any
    training: ``SampledWithoutReplacementGaussian(z / 2, E*b, m)``."""
    return SampledWithoutReplacementGaussian(
        noise_multiplier=cfg.noise_multiplier / 2, sample_size=subsample_size(m, cfg),
        dataset_size=m)


def _subsample_update(engine, params, x, y, cfg: LocalTraining, rng, update_clip, noisy):
    """E clipped-SGD steps on a without-replacement subsample, the update clipped to S."""
    if cfg.sparsity != 1.0:
        raise ValueError("the update-noise and binomial mechanisms are dense: sparsity must be 1")
    m = len(y)
    if m == 0 or len(x) != m:
        raise ValueError(f"local data must be non-empty with len(x) == len(y), got {len(x)}, {m}")
    s_bound = cfg.steps * cfg.lr * cfg.clip if update_clip is None else float(update_clip)
    if not s_bound > 0 or (noisy and not math.isfinite(s_bound)):
        raise ValueError(f"update_clip S must be > 0 and finite with noise, got {s_bound!r}")
    b = min(cfg.batch_size, max(1, m // cfg.steps))
    n_sub = subsample_size(m, cfg)
    subsample = rng.choice(m, size=n_sub, replace=False)
    theta = [np.array(p, dtype=np.float32, copy=True) for p in params]
    losses = 0.0
    for k in range(cfg.steps):
        idx = subsample[(k * b) % n_sub : (k * b) % n_sub + b]
        losses += dp_sgd_step(engine, theta, x[idx], y[idx], clip=cfg.clip, noise=None,
                              lr=cfg.lr, denom=float(len(idx)))
    update = [t - np.asarray(p, dtype=np.float32) for t, p in zip(theta, params, strict=True)]
    norm = math.sqrt(sum(float(np.dot(u.ravel(), u.ravel())) for u in update))
    if not math.isfinite(norm):
        raise TrainingDiverged(f"local round produced a non-finite update (lr={cfg.lr})")
    if norm > s_bound:
        update = [u * np.float32(s_bound / norm) for u in update]
    return update, n_sub, losses / (cfg.steps * b), s_bound


@dataclass(frozen=True, slots=True)
class BinomialResult:
    """A binomial-mechanism round: integers on the wire and what they decode to."""

    integers: np.ndarray  # int64, flat, graph order
    grid: float
    decoded: list[np.ndarray]
    event: CpsgdBinomial
    num_samples: int
    mean_loss: float


def local_round_binomial(
    engine: Engine,
    params: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    cfg: LocalTraining,
    rng: np.random.Generator,
    *,
    trials: int,
    levels: int,
    update_clip: float | None = None,
) -> BinomialResult:
    """cpSGD-style binomial mechanism (the baseline Fed-SPA compares against).

    The clipped update of :func:`local_round_update_noise` (no Gaussian noise) is
    quantized without bias onto the grid of spacing g = S / levels, then
    Binomial(trials, 1/2) - trials/2 is added to each integer. Its privacy: the event's
    restricted-RDP bound (:meth:`~edge_sdk.privacy.binomial.CpsgdBinomial.epsilon`);
    cpSGD's Theorem 1 only as a labelled paper figure (it can be below the true epsilon).
    The device runs it through :mod:`edge_sdk.mechanisms.binomial` (its ledger event
    :class:`~edge_sdk.privacy.events.Binomial`).
    """
    # Imported here: compress pulls in `cryptography`, which the plain DP-SGD path never needs,
    # and the binomial mechanism is simulation-only (a device never loads its accountant).
    from edge_sdk.compress import binomial_noise
    from edge_sdk.privacy.binomial import CpsgdBinomial

    if trials < 2 or trials % 2 or levels < 1:
        raise ValueError(f"need an even trials >= 2 and levels >= 1, got {trials}, {levels}")
    update, n_sub, loss, s_bound = _subsample_update(engine, params, x, y, cfg, rng,
                                                     update_clip, True)
    grid = s_bound / levels
    flat = np.concatenate([u.ravel() for u in update]).astype(np.float64) / grid
    low = np.floor(flat)
    ints = (low + (rng.random(flat.shape) < flat - low)).astype(np.int64)
    ints += binomial_noise(ints.shape, trials, rng)
    decoded, start = [], 0
    for u in update:
        decoded.append((ints[start : start + u.size] * grid).astype(np.float32).reshape(u.shape))
        start += u.size
    event = CpsgdBinomial(trials=trials, grid=grid, dim=int(ints.size), update_clip=s_bound,
                          sample_rate=n_sub / len(y))
    return BinomialResult(ints, grid, decoded, event, len(y), loss)


def sample_grad_rows(
    engine: Engine,
    params: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    coords: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's (unclipped) gradient, restricted to ``coords``, one row per sample.

    The engine's own per-sample gradients and losses when it has them
    (``per_sample_grads_and_losses``, the numpy engine), else one unclipped batch-of-one
    call per sample (the ONNX graph only returns clipped sums). The caller clips
    (:func:`edge_sdk.ddp.round_rows` does, in float64, on exactly the kept coordinates it
    encodes).

    Args:
        params: the model (graph order).
        x, y: a batch of B samples.
        coords: flat indices of the kept coordinates (None: all d).

    Returns:
        (rows, losses): float32 (B, k) gradients and the per-sample losses (B,).
    """
    per_sample = getattr(engine, "per_sample_grads_and_losses", None)
    if per_sample is not None:
        grads, losses = per_sample(params, x, y)
        grads = np.asarray(grads, dtype=np.float32)
        losses = np.asarray(losses, dtype=np.float64)
    else:
        grads = np.empty((len(y), sum(p.size for p in params)), dtype=np.float32)
        losses = np.empty(len(y), dtype=np.float64)
        for i in range(len(y)):
            res = engine.clipped_grad_sum(params, x[i : i + 1], y[i : i + 1], math.inf)
            np.concatenate([g.ravel() for g in res.clipped_sum], out=grads[i])
            losses[i] = float(res.losses[0])
    return (grads if coords is None else grads[:, coords]), losses


@dataclass(frozen=True, slots=True)
class DdgResult:
    """One device's distributed-discrete-Gaussian round (sample-level, one release).

    Attributes:
        residues: uint64 (k,), in [0, 2^bits): the upload (the secure-aggregation input).
        integers: int64 (k,), the rounded sum plus noise before the reduction mod 2^bits.
            For the simulator's wrap-around diagnostics only; never uploaded.
        num_samples: m, the local data set size.
        mean_loss: mean per-sample training loss at the round's model.
    """

    residues: np.ndarray
    integers: np.ndarray
    num_samples: int
    mean_loss: float


def local_round_ddg(
    engine: Engine,
    params: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    rng: np.random.Generator,
    *,
    clip: float,
    gamma: float,
    sigma: float,
    bits: int,
    coords: np.ndarray | None = None,
    chunk: int = 32,
) -> DdgResult:
    """The device side of one FedSGD round with distributed discrete Gaussian noise.

    Kairouz, Liu, Steinke 2021 (distributed discrete Gaussian), at the sample level: every
    one of the m local samples' gradients (q = 1: no subsampling, no amplification by
    sampling claimed), restricted to the round's coordinate set, is clipped to C, scaled
    by 1/gamma and conditionally rounded on its own (:func:`edge_sdk.ddp.round_rows`), so
    one sample moves the device's integer sum by at most D2 = rounded_l2_bound(C/gamma, k,
    beta) in L2. The device adds N_Z(0, sigma^2) per coordinate (the exact sampler) and
    reduces mod 2^bits. One release per round: with several local steps, only the last
    would provably be covered by the other devices' noise.

    Args:
        params: the global model (graph order); not modified.
        x, y: the local data set, m samples.
        rng: randomness of the rounding and the noise.
        clip: C, per-sample L2 bound, model units (> 0).
        gamma: model units per integer step (> 0).
        sigma: per-device discrete Gaussian parameter, integer scale (>= 0).
        bits: ring exponent (2..62).
        coords: the round's rand-k set (flat indices), None for all coordinates.
        chunk: samples per gradient batch (memory: chunk x k float64).

    Returns:
        The residues to upload and the diagnostics of :class:`DdgResult`.
    """
    from edge_sdk import ddp  # pulls in `cryptography`, which plain DP-SGD never needs

    m = len(y)
    if m == 0 or len(x) != m:
        raise ValueError(f"local data must be non-empty with len(x) == len(y), got {len(x)}, {m}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    k = sum(p.size for p in params) if coords is None else len(coords)
    total = np.zeros(k, dtype=np.int64)
    losses = 0.0
    for s in range(0, m, chunk):
        rows, batch_losses = sample_grad_rows(engine, params, x[s : s + chunk],
                                              y[s : s + chunk], coords)
        if not np.isfinite(rows).all():  # nothing is released
            raise TrainingDiverged("DDG round: a per-sample gradient is not finite")
        total += ddp.round_rows(rows, clip, gamma, rng).sum(axis=0)
        losses += float(np.sum(batch_losses))
    integers = total + ddp.sample_discrete_gaussian(sigma, k, rng)
    residues = integers.view(np.uint64) & np.uint64((1 << bits) - 1)
    return DdgResult(residues, integers, m, losses / m)
