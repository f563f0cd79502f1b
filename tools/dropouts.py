"""Seeded dropouts: which cohort members vanish in a round, and at which stage.

Simulation only: a run is a function of its seeds, so every path that drives a round (the
fleet over either transport, the fast simulator through ``aggregator.plain_sum.PlainSum``)
drops the same devices at the same stages. A device vanishes in a stage of
``aggregator.plain_sum.STAGES``, on receipt of the message that opens it, and answers
nothing from then on:

* ``keys`` (the plan): never advertises keys, so never trains, reserves or uploads;
* ``shares`` (neighbour keys): advertised, never shares its keys;
* ``masked`` (forwarded shares): shared its keys, never uploads;
* ``unmask`` (the unmask request): uploaded, never helps unmask.

The fleet (``tools.fleet``) cuts a vanished device off (over MQTT also its TCP connection)
and brings it back once the round is over, with whatever model and error notice it missed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aggregator.plain_sum import STAGES

__all__ = ["DropoutSchedule"]


class DropoutSchedule:
    """Which cohort members vanish in a round, and at which stage (seeded, cached).

    ``round(fraction * len(cohort))`` members, drawn with ``default_rng([seed, 7, round])``
    from the sorted cohort, each at a stage drawn uniformly from
    ``aggregator.plain_sum.STAGES`` (module docstring).
    """

    def __init__(self, fraction: float, seed: int) -> None:
        if not 0 <= fraction < 1:
            raise ValueError(f"dropout must be in [0, 1), got {fraction!r}")
        self.fraction = fraction
        self.seed = seed
        self._cache: dict[int, dict[str, str]] = {}

    def victims(self, round_id: int, cohort: Sequence[str]) -> dict[str, str]:
        """device -> stage name, for round ``round_id`` with this cohort."""
        got = self._cache.get(round_id)
        if got is None:
            members = sorted(cohort)
            m = min(len(members), round(self.fraction * len(members)))
            rng = np.random.default_rng([self.seed, 7, round_id])
            picked = rng.choice(len(members), m, replace=False) if m else []
            stages = list(STAGES)
            got = {members[int(i)]: stages[int(rng.integers(len(stages)))] for i in picked}
            self._cache[round_id] = got
        return got
