"""What the simulators' JSON summaries share: fingerprints, so that the fast simulator, the
in-process fleet and the MQTT fleet can be compared bit for bit (issue 15), and the three
epsilons of the devices' ledgers with their unit, view and adjacency (issue 16).

The fingerprints are SHA-256 hex digests of a canonical byte form, independent of the
array's dtype and memory layout: a model is hashed as its float32 values, a secure sum as
its integer values.

The epsilons (:data:`FIGURES`) are each the maximum over the devices' ledgers
(``edge_sdk.ledger``: ``Spent.local_epsilon``, ``aggregate_epsilon``, ``device_epsilon``)
at the run's delta, every reservation counted. A device-level figure exists only where every
round a device took part in states a device-level event (device-dp): one device without
one makes the fleet's figure None, never a partial maximum (:func:`device_level_max`)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EPSILON_NOTE", "FIGURES", "EpsilonFigure", "device_level_max", "epsilon_lines",
           "model_sha256", "sum_sha256", "worst"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EpsilonFigure:
    """One epsilon of a summary and what it means.

    Attributes:
        key: the summary's key (the final figure; rows carry ``row_key``).
        row_key: the per-round row's key.
        label: unit and view, as printed ("sample-level local").
        adjacency: the neighbouring relation of the unit.
        against: whom it holds against, and what it assumes.
    """

    key: str
    row_key: str
    label: str
    adjacency: str
    against: str


FIGURES: tuple[EpsilonFigure, ...] = (
    EpsilonFigure(key="epsilon", row_key="epsilon_local", label="sample-level local",
                  adjacency="zero-out of one sample",
                  against="against anyone who sees a device's upload"),
    EpsilonFigure(key="epsilon_aggregate", row_key="epsilon_aggregate",
                  label="sample-level aggregate", adjacency="zero-out of one sample",
                  against="against whoever sees only the sums: a semi-honest aggregator, "
                          "each sum holding the noise of min_survivors - max_colluders: "
                          "{honest} honest members"),
    EpsilonFigure(key="epsilon_device", row_key="epsilon_device",
                  label="device-level aggregate", adjacency="zero-out of one device's data",
                  against="against whoever sees only the sums, same assumptions"),
)
"""The three figures every summary of either path carries, in the order they are printed."""


EPSILON_NOTE = (
    "max over devices' ledgers (edge_sdk.ledger) at delta, every reservation counted; null = "
    "no guarantee stated. epsilon: SAMPLE-level local (zero-out of one sample), against "
    "anyone who sees a device's upload. epsilon_aggregate: SAMPLE-level aggregate, against "
    "whoever sees only the sums (semi-honest aggregator; each sum holds the noise of "
    "min_survivors - max_colluders honest members): equal to local for gaussian and "
    "update-noise, whose uploads are clamped and rounded before the sum; ddg counts the "
    "honest noise shares (KLS 2021 Thm 1); binomial's is the restricted-RDP bound (cpSGD "
    "Thm 1 only as the labelled paper_epsilon); device-dp's sample-level figures are its "
    "device's substitution event, sound for any change to the device's data. "
    "epsilon_device: DEVICE-level aggregate (zero-out of one device's data, same "
    "assumptions), device-dp only (KLS 2021 Thm 1 over the honest shares; with "
    "self_sample_rate q < 1, that release behind each device's own hidden coin, Zhu-Wang "
    "2019 Thm 6); null for every other mechanism, whose rounds state no device-level event")
"""The ``epsilon_note`` of both paths' summaries."""


def worst(previous: float | None, current: float | None) -> float | None:
    """The running maximum of a device-level figure: None (no figure) once either is."""
    if previous is None or current is None:
        return None
    return max(previous, current)


def device_level_max(values: Iterable[float | None]) -> float | None:
    """Max of the devices' device-level epsilons; None if any device's is None (it took
    part in a round without a device-level event: nothing is stated for the fleet)."""
    out: float | None = 0.0
    for v in values:
        out = worst(out, v)
    return out


def _num(v: float | None) -> str:
    return "none" if v is None or not math.isfinite(v) else f"{v:.4f}"


def epsilon_lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary's three epsilons as printed lines, each with its unit, view, adjacency,
    delta and assumptions. A None sample-level figure is "inf (no noise)"; a None
    device-level one says that this mechanism states no device-level guarantee."""
    cfg = summary.get("config", {})
    # the summary's resolved figures (a config's None min_survivors is the threshold)
    survivors = summary.get("min_survivors", cfg.get("min_survivors"))
    colluders = summary.get("max_colluders", cfg.get("max_colluders")) or 0
    honest = (f"{survivors} - {colluders} = {survivors - colluders}" if survivors is not None
              else f"(the SecAgg threshold) - {colluders}")
    delta = summary.get("delta")
    out = []
    for f in FIGURES:
        v = summary.get(f.key)
        if v is None and f.key == "epsilon_device" and cfg.get("mechanism") != "device-dp":
            out.append(f"epsilon {f.label}: none stated (mechanism "
                       f"{cfg.get('mechanism', '?')} gives no device-level guarantee; only "
                       "device-dp does)")
            continue
        value = "inf (no noise)" if v is None else f"{v:.4f} at delta {delta:g}"
        against = f.against.format(honest=honest, survivors=survivors, colluders=colluders)
        q = cfg.get("self_sample_rate", 1.0)
        if f.key == "epsilon_device" and v is not None and q != 1.0:
            against += (f"; each device sent its data with probability {q:g} by its own "
                        "hidden coin (amplification it can verify: Zhu-Wang 2019 Thm 6)")
        out.append(f"epsilon {f.label}: {value} ({f.adjacency}; {against})")
    return out


def model_sha256(params: Sequence[np.ndarray]) -> str:
    """SHA-256 (hex) of the model's parameter arrays in order, each as little-endian float32
    in C order: the fingerprint two runs must share to have produced the same model."""
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p, dtype="<f4").tobytes())
    return h.hexdigest()


def sum_sha256(total: np.ndarray) -> str:
    """SHA-256 (hex) of a round's integer sum (residues mod 2^bits), each value as a
    little-endian uint64: it changes when the values do, never when only the dtype does."""
    values = np.asarray(total)
    if values.dtype.kind not in "ui":
        raise TypeError(f"sum_sha256 hashes integer residues, got dtype {values.dtype}")
    if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
        raise ValueError(f"sum_sha256 hashes residues >= 0, got minimum {int(values.min())}")
    return hashlib.sha256(np.ascontiguousarray(values, dtype="<u8").tobytes()).hexdigest()
