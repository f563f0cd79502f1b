"""The sample-level *aggregate* view: what one round costs against whoever sees only the sum.

The local view of a round (the device's upload, :func:`edge_sdk.train.round_event`) needs no
trust. The aggregate view counts other members' noise in the secure sum, and is claimed only
where the theorem below applies; everywhere else :func:`aggregate_event` returns the local
event, which is always sound for the sum (the sum is a post-processing of the target's own
upload and of uploads independent of the target's data).

Why not simply z * sqrt(r') for the whole round (what fedge did before): with tau > 1 local
steps a member's later gradients depend on its own unreleased earlier noise, so its update
need not carry tau steps of independent noise. Members whose data pulls them back to the
start cancel all but their last step's noise; then the sum of tau = 20 steps at z = 1, q = 1
over r' = 10 members is a Gaussian of sensitivity 20 C (lr / B) with noise std
sqrt(20 + 9) C (lr / B): epsilon 22.1 at delta 1e-5, where z * sqrt(10) over 20 composed
steps reported 6.57. No composition theorem covers a query that depends on hidden state.
"""

from __future__ import annotations

import math
import numbers

from edge_sdk.privacy.events import Composed, Event, PoissonSubsampledGaussian

__all__ = ["aggregate_event"]


def aggregate_event(local: Event, *, honest_members: int, linear_sum: bool) -> Event:
    """The privacy event of one round as seen by whoever sees only the cohort's sum.

    Theorem (the last-step construction). Let r' members each run tau local DP-SGD steps
    from the public theta_0, theta_{t+1} = theta_t - (lr / B) (g_t + n_t), where g_t is the
    sum of per-sample gradients clipped to C over a Poisson batch of rate q drawn afresh
    by the member's own coins, n_t ~ N(0, (z C)^2 I) is fresh, and B, lr, z, C, tau, q's
    batch size and any rand-k set omega are the signed plan's (public, the same for every
    member). Let Delta_i = theta_tau - theta_0 and S = sum_i Delta_i the released sum. At
    least r'' of the r' members are honest (the target among them); the others may
    collude with the aggregator. Then, for the target j and any zero-out (or add/remove)
    neighbour of j's data, S is (epsilon, delta)-DP with the parameters of

        Composed(PoissonSubsampledGaussian(z, q, steps = tau - 1),
                 PoissonSubsampledGaussian(z * sqrt(r''), q, steps = 1))

    (for tau = 1, the FedSGD case, only the second event).

    Proof. Write Delta_i = A_i - (lr / B) n_{i,tau-1}, splitting off member i's last noise.
    A_i is a function of i's data, i's batch coins and i's noise n_{i,0..tau-2} only: the
    last gradient is computed at theta_{i,tau-1}, before n_{i,tau-1} is drawn, so A_i is
    independent of n_{i,tau-1}; members train from theta_0 without interacting, so for
    i != j, A_i is independent of j's data and of j's randomness. Give the adversary, for
    free, (a) A_i of every other member and the whole update of every colluder, (b) the
    target's first tau - 1 noisy steps y_t = g_{j,t} + n_{j,t} (each a Poisson-subsampled
    Gaussian with multiplier z, chosen adaptively), which fix theta_{j,tau-1}, and (c) one
    more release Y = g_{j,tau-1}(theta_{j,tau-1}) + sum_{i honest} n_{i,tau-1}: the target's
    last clipped batch sum (sensitivity C, batch drawn by fresh coins independent of hidden
    state) plus r'' independent N(0, (z C)^2 I) draws, i.e. a subsampled Gaussian of
    multiplier z sqrt(r''). Then S = -(lr / B) (sum_t y_t + Y) + (terms in (a)) is a
    post-processing of (b), (c) and of (a), which is independent of j's data and of the
    mechanism's coins given its outputs. By adaptive composition (RDP: Mironov 2017,
    Proposition 1; each step's RDP by Mironov, Talwar, Zhang 2019; PLD composition is
    adaptive too) the view is bounded by the event above. Rand-k with the plan's omega:
    the kept values are clipped to sqrt(p) C and the noise on omega has std z C, so the
    same holds with the local multiplier z / sqrt(p), which is what ``local`` carries.

    Conditions, each required of the caller and checked where this function can:

    * ``linear_sum``: the released sum is the sum of the members' real-valued updates.
      Any per-member nonlinear step after the noise (clamping at a value bound, QSGD
      quantization, stochastic or deterministic rounding to a fixed-point grid) can remove
      a member's noise where it binds, and voids the construction: the local event is
      returned. Every secure-aggregation path of the deployed device rounds to fixed point
      and clamps, so there the aggregate view is the local one; the device-level mechanism
      with integer noise added after those steps (issue 16) is what gives the sum a
      guarantee of its own.
    * the sum is unweighted: the aggregator adds the updates as they are (a sum weighted
      by data size, as ``fedge simulate --weighting samples`` did before issue 15, scales
      other members' noise down relative to the target's signal and voids the
      construction).
    * every member divides every step by the same public B (never min(m, B)), and runs
      the plan's lr, z, C, tau and omega: the plan is signed and one for the cohort.
    * ``honest_members`` = r'' = min_survivors - max_colluders: a colluder knows, and can
      subtract, its own noise; the aggregator is semi-honest (follows the protocol; SecAgg's
      consistency round is not run), fewer than the threshold t parties collude, and a
      device refuses an unmask request naming fewer than min_survivors survivors. With
      r'' = 1 (or no secure aggregation: pass 1) the local event is returned.
    * a member that reveals anything else depending on its update (a "diverged" decline)
      is outside the sum: its round is covered by its local event only, which the ledger's
      local view accounts.
    * every member draws its last step's noise whatever its batch (also an empty Poisson
      batch: :func:`edge_sdk.train.local_round` does), so each honest member's last noise
      is present and independent of the rest of its update. Members may run different
      numbers of steps: only that last noise of each honest member and the target's own
      tau enter the construction (the plan fixes tau for all in any case).
    * arithmetic over the reals, as in all DP-SGD accounting: float32 rounding of the
      updates and of the sum is not modelled (see the device's sampler for the
      floating-point attack on the noise itself).
    * Poisson sampling only: for sampling without replacement / shuffling the batches of
      one epoch are not independent across steps and the last batch depends on the
      earlier ones; no analogue is derived here, so the local event is returned. A local
      event that is anything but one :class:`PoissonSubsampledGaussian` (whose ``steps``
      is tau) is returned unchanged.

    Args:
        local: the round's local event, as :func:`edge_sdk.train.round_event` returns it.
        honest_members: r'' >= 1, the fewest honest members (the target included) whose
            last-step noise the released sum certainly contains.
        linear_sum: whether the released sum is exactly the sum of the real-valued updates.

    Returns:
        An event never smaller than the truth under the conditions above; ``local`` where
        they do not hold. Its adjacency is ``local``'s.

    Raises:
        ValueError: ``honest_members`` is not an integer >= 1, or ``linear_sum`` not a bool.
    """
    r = honest_members
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
        raise ValueError(f"honest_members must be an integer >= 1, got {r!r}")
    if not isinstance(linear_sum, bool):
        raise ValueError(f"linear_sum must be a bool, got {linear_sum!r}")
    if r == 1 or not linear_sum or not isinstance(local, PoissonSubsampledGaussian):
        return local
    z, q, tau, adj = local.noise_multiplier, local.sample_rate, local.steps, local.adjacency
    last = PoissonSubsampledGaussian(noise_multiplier=z * math.sqrt(r), sample_rate=q, steps=1,
                                     adjacency=adj)
    if tau == 1:
        return last
    return Composed(events=(
        PoissonSubsampledGaussian(noise_multiplier=z, sample_rate=q, steps=tau - 1,
                                  adjacency=adj),
        last,
    ))
