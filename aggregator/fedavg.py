"""Cohort selection and averaging of device updates (in the clear; secure sum comes later)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["mean_update", "select_cohort"]


def select_cohort(names: Sequence[str], size: int, *, seed: int,
                  round_id: int) -> tuple[str, ...]:
    """``size`` distinct names out of ``names``, uniformly without replacement (zCDP paper
    Alg. 1 line 2), sorted.

    The draw is ``default_rng([seed, round_id]).choice`` over the names in sorted order, so
    it depends only on the seed, the round and the set of names: the round machine's cohort
    (``RoundPolicy.seed``; a deployment's seed is public, the cohort is not secret) and the
    fast simulator's are the same draw.
    """
    pool = sorted(names)
    if len(set(pool)) != len(pool):
        raise ValueError(f"device names must be distinct, got {len(pool)} names with repeats")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= len(pool):
        raise ValueError(f"cohort size must be an integer in [1, {len(pool)}] (the names "
                         f"given), got {size!r}")
    rng = np.random.default_rng([seed, round_id])
    return tuple(sorted(pool[i] for i in rng.choice(len(pool), size, replace=False)))


def mean_update(
    updates: Sequence[Sequence[np.ndarray]], weights: Sequence[float] | None = None
) -> list[np.ndarray]:
    """Weighted mean of per-device updates (uniform when ``weights`` is None).

    Uniform weighting is the zCDP paper's (1/r) sum; sample-count weighting is FedAvg's.
    """
    if not updates:
        raise ValueError("no updates to average")
    w = np.ones(len(updates)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(updates),) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise ValueError(f"weights must be {len(updates)} finite non-negative numbers, sum > 0")
    w = (w / w.sum()).astype(np.float32)
    out = [np.zeros_like(np.asarray(u, dtype=np.float32)) for u in updates[0]]
    for wi, upd in zip(w, updates, strict=True):
        if len(upd) != len(out):
            raise ValueError(f"update has {len(upd)} arrays, expected {len(out)}")
        for acc, u in zip(out, upd, strict=True):
            if u.shape != acc.shape:
                raise ValueError(f"update array of shape {u.shape}, expected {acc.shape}")
            acc += wi * u
    return out
