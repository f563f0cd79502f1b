"""Privacy accounting for fedge devices: loose where it must be, never below the true epsilon.

Mechanisms are frozen data (:mod:`~edge_sdk.privacy.events`); accountants interpret them:

* :class:`RdpAccountant` -- Renyi DP, exact for the Poisson-subsampled Gaussian at every
  order, the Wang-Balle-Kasiviswanathan bound for sampling without replacement, improved
  RDP-to-DP conversion. Fast; what the simulator uses.
* :class:`PldAccountant` -- privacy loss distributions with pessimistic ("connect the
  dots") discretization: the tightest epsilon we report.
* :class:`ZcdpAccountant` -- zCDP rho, Bun-Steinke and Canonne-Kamath-Steinke conversions.

One :data:`Event` union holds every mechanism, the discrete Gaussian / Skellam noise that
secure aggregation's distributed DP adds in the integers included (Kairouz-Liu-Steinke 2021,
Agarwal-Kairouz-Liu 2021; their RDP bounds in :mod:`edge_sdk.privacy.discrete`). Each
accountant says which events it interprets (``supports``) and raises
:class:`UnsupportedEventError` for the others: :class:`RdpAccountant` takes them all,
:class:`Binomial` (cpSGD's restricted Renyi moment with an additive delta0,
:mod:`edge_sdk.privacy.binomial`) at the orders it carries.

:func:`calibrate_noise_multiplier` finds the smallest safe noise for a target. The papers'
own formulas live in :mod:`edge_sdk.privacy.paper_bounds` (labelled, not re-exported here:
they are not necessarily sound).

Adjacency is data: every event names the neighbouring relation it holds under
(add/remove, substitution, zero-out); accountants restate events to theirs soundly or raise
(:func:`restate`). :func:`aggregate_event` builds the secure-sum view of a round where a
theorem supports one.

Units throughout: epsilon in nats at a stated delta; ``noise_multiplier`` z is noise std
divided by L2 sensitivity; RDP in nats per order.
"""

from typing import Any

from edge_sdk.privacy.events import (
    ADJACENCIES,
    IGNORES_NULL_RECORD,
    Binomial,
    Composed,
    DiscreteEvent,
    DistributedDiscreteGaussian,
    DistributedSkellam,
    Event,
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
    SelfComposed,
    SelfSampled,
    UnsupportedEventError,
    adjacencies_of,
    restate,
)

__all__ = [
    "ADJACENCIES",
    "DEFAULT_ORDERS",
    "IGNORES_NULL_RECORD",
    "Binomial",
    "Composed",
    "DiscreteEvent",
    "DiscretePld",
    "DistributedDiscreteGaussian",
    "DistributedSkellam",
    "Event",
    "Gaussian",
    "PldAccountant",
    "PoissonSubsampledGaussian",
    "RdpAccountant",
    "SampledWithoutReplacementGaussian",
    "SelfComposed",
    "SelfSampled",
    "UnsupportedEventError",
    "ZcdpAccountant",
    "adjacencies_of",
    "aggregate_event",
    "calibrate_noise_multiplier",
    "compute_rdp",
    "compute_rho",
    "ddg_tau",
    "discrete_epsilon",
    "discretize_subsampled_gaussian",
    "epsilon_for",
    "gaussian_rho",
    "rdp_distributed_discrete_gaussian",
    "rdp_distributed_skellam",
    "rdp_gaussian",
    "rdp_of",
    "rdp_poisson_subsampled_gaussian",
    "rdp_sampled_without_replacement_gaussian",
    "rdp_self_sampled",
    "rdp_to_epsilon",
    "rdp_to_epsilon_classic",
    "restate",
    "rho_to_epsilon",
    "rho_to_epsilon_bun_steinke",
    "rho_to_epsilon_cks",
    "zhu_wang_bound",
]

# The events (the data every module here speaks) load with the package; the accountants and
# the rest on first use (PEP 562). A device's training step needs only the events, and the
# accountants' modules (with calibration and zCDP, which a device never calls) were a fifth
# of the device stack's own import time (issue 15's bench, tools/bench/stacks.py).
_LAZY: dict[str, str] = {
    "aggregate_event": "aggregate",
    "calibrate_noise_multiplier": "calibration",
    "epsilon_for": "calibration",
    "ddg_tau": "discrete",
    "rdp_distributed_discrete_gaussian": "discrete",
    "rdp_distributed_skellam": "discrete",
    "DiscretePld": "pld",
    "PldAccountant": "pld",
    "discretize_subsampled_gaussian": "pld",
    "DEFAULT_ORDERS": "rdp",
    "RdpAccountant": "rdp",
    "compute_rdp": "rdp",
    "discrete_epsilon": "rdp",
    "rdp_gaussian": "rdp",
    "rdp_of": "rdp",
    "rdp_poisson_subsampled_gaussian": "rdp",
    "rdp_sampled_without_replacement_gaussian": "rdp",
    "rdp_self_sampled": "rdp",
    "rdp_to_epsilon": "rdp",
    "rdp_to_epsilon_classic": "rdp",
    "zhu_wang_bound": "rdp",
    "ZcdpAccountant": "zcdp",
    "compute_rho": "zcdp",
    "gaussian_rho": "zcdp",
    "rho_to_epsilon": "zcdp",
    "rho_to_epsilon_bun_steinke": "zcdp",
    "rho_to_epsilon_cks": "zcdp",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
