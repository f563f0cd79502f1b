"""Test-set accuracy of a model, the one evaluation both simulator paths report."""

from __future__ import annotations

import numpy as np

from edge_sdk.engine import Engine

__all__ = ["evaluate"]


def evaluate(engine: Engine, params: list[np.ndarray], x: np.ndarray, y: np.ndarray,
             batch: int = 2000) -> float:
    """Top-1 accuracy of ``params`` on (x, y)."""
    correct = 0
    for s in range(0, len(y), batch):
        logits = engine.logits(params, x[s : s + batch])
        correct += int((logits.argmax(axis=1) == y[s : s + batch]).sum())
    return correct / len(y)
