"""The aggregator's own evaluation set: accuracy and cross-entropy of each new global model.

``[evaluation] data = "eval.npz"`` in ``aggregator.toml`` names a file in the format of a
device's owner files (``edge_sdk.data``: ``x`` float32 ``[m, *input_shape]``, ``y`` int
labels in ``[0, num_classes)``). It is the aggregator operator's data, never a device's:
nothing a device sends is evaluated or stored, so measuring accuracy spends no privacy
budget and needs no theorem. After every completed round the service scores the new global
model on it (:func:`evaluate`, with the model's engine's logits) and reports the result on
the status page, in the ``round_end`` log line and as a Prometheus gauge.

:func:`load_evaluation` reads and checks the file at start (a bad file stops the service
with a :class:`~edge_sdk.config.ConfigError` naming it); :func:`score` is the pure math.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.data import DataFileError, read_samples
from edge_sdk.engine import Engine
from edge_sdk.model import ModelSpec

__all__ = ["EVAL_BATCH", "Evaluation", "EvaluationSet", "evaluate", "load_evaluation",
           "score"]

EVAL_BATCH = 512  # samples per logits call: bounds the activations held at once


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationSet:
    """The checked evaluation samples (x float32 [m, *input_shape], y int64 [m], m >= 1)."""

    path: Path
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """One model on the evaluation set.

    Attributes:
        accuracy: fraction of samples whose largest logit is their label, in [0, 1].
        loss: mean cross-entropy (nats per sample); None when a logit is not finite.
        samples: how many samples were scored.
    """

    accuracy: float
    loss: float | None
    samples: int


def load_evaluation(path: str | os.PathLike[str], spec: ModelSpec) -> EvaluationSet:
    """Read ``path`` (one ``.npz`` with ``x`` and ``y``) against ``spec``'s input shape and
    classes.

    Raises:
        ConfigError: the file is missing, unreadable, not in the owner-file format, does
            not fit the model, or holds no samples (``read_samples``' message, naming the
            file).
    """
    p = Path(path)
    try:
        x, y = read_samples([p], input_shape=spec.input_shape, num_classes=spec.num_classes)
    except DataFileError as e:
        raise ConfigError(f"[evaluation] data: {e}") from None
    return EvaluationSet(path=p, x=x, y=y)


def score(logits: np.ndarray, y: np.ndarray) -> Evaluation:
    """Accuracy and mean cross-entropy of ``logits`` [m, classes] against labels ``y`` [m]
    (float64 log-sum-exp, so large logits do not overflow)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    if z.ndim != 2 or z.shape[0] != y.shape[0] or z.shape[0] == 0:
        raise ValueError(f"expected logits [m, classes] and labels [m] with m >= 1, got "
                         f"{z.shape} and {y.shape}")
    accuracy = float(np.mean(np.argmax(z, axis=1) == y))
    if not np.all(np.isfinite(z)):
        return Evaluation(accuracy=accuracy, loss=None, samples=int(y.shape[0]))
    top = z.max(axis=1)
    lse = top + np.log(np.sum(np.exp(z - top[:, None]), axis=1))
    loss = float(np.mean(lse - z[np.arange(z.shape[0]), y]))
    return Evaluation(accuracy=accuracy, loss=loss if math.isfinite(loss) else None,
                      samples=int(y.shape[0]))


def evaluate(engine: Engine, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, *,
             batch: int = EVAL_BATCH) -> Evaluation:
    """``params`` scored on samples ``x`` with labels ``y`` with ``engine``'s logits,
    ``batch`` samples a call (the one evaluation: the simulators' test accuracy,
    ``tools.evaluate``, is this one's)."""
    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    logits = np.concatenate([engine.logits(params, x[i:i + batch])
                             for i in range(0, x.shape[0], batch)] or [np.zeros((0, 0))])
    return score(logits, y)
