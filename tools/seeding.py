"""The simulators' seeded randomness: one place for what the fleet and the fast simulator
derive from a run's ``seed``, so both draw the same rounds.

Simulation and tests only. A deployment's aggregator draws its key material, round seeds and
nonces from ``os.urandom`` and each device its round randomness from
``edge_sdk.csprng.secure_round_rng``; nothing here is reachable from a device configuration.

* :func:`seeded_bytes`: a deterministic ``random_bytes`` over a label;
* :func:`round_random_bytes`: the aggregator's source of the rounds' seeds and nonces
  (:func:`aggregator.rounds.round_secrets` draws a pair per round);
* :func:`device_seed`: device ``index``'s seed for ``edge_sdk.csprng.seeded_round_rng``
  (round r's generator is then ``default_rng([device_seed, r])``).

The cohort is not here: both paths call :func:`aggregator.round_core.select_cohort` with the
run's seed and the round id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

__all__ = ["device_seed", "round_random_bytes", "seeded_bytes"]


def seeded_bytes(label: str) -> Callable[[int], bytes]:
    """A deterministic ``random_bytes`` (SHA-256 in counter mode over ``label``).
    Simulation only: a deployment's key material comes from ``os.urandom``."""
    counter = [0]

    def random_bytes(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            out += hashlib.sha256(f"{label}/{counter[0]}".encode()).digest()
            counter[0] += 1
        return bytes(out[:n])

    return random_bytes


def round_random_bytes(seed: int) -> Callable[[int], bytes]:
    """The ``random_bytes`` a simulated fleet of ``seed`` gives its round machine: the
    source of every round's seed and nonce, in round order (a fresh stream per call)."""
    return seeded_bytes(f"fedge-fleet/{seed}/rounds")


def device_seed(seed: int, index: int) -> int:
    """Device ``index``'s (0-based, in ``tools.broker.device_names`` order) seed for
    ``seeded_round_rng`` in a simulated fleet of ``seed``: a 32-bit word of
    ``SeedSequence([seed, 2, index])``."""
    return int(np.random.SeedSequence([seed, 2, index]).generate_state(1)[0])
