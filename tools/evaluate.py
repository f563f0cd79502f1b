"""Test-set accuracy of a model, the one evaluation both simulator paths report (the
aggregator's, ``aggregator.evaluation.evaluate``, which also gives the cross-entropy)."""

from __future__ import annotations

import numpy as np

from aggregator.evaluation import evaluate as _evaluate
from edge_sdk.engine import Engine

__all__ = ["evaluate"]


def evaluate(engine: Engine, params: list[np.ndarray], x: np.ndarray, y: np.ndarray,
             batch: int = 2000) -> float:
    """Top-1 accuracy of ``params`` on (x, y)."""
    return _evaluate(engine, params, x, y, batch=batch).accuracy
