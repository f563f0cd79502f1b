"""Shared fixtures. Reference tests import torch/opacus lazily via importorskip-free imports:
the dev extra installs them, and a missing oracle must fail loudly, not skip."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from edge_sdk.engine import load_engine
from edge_sdk.model import build_spec
from models import manifest_path
from tools.datasets import load_dataset

# Every property test draws the same examples on every run (derandomize): the default suite
# must be deterministic, and a property that fails only on some runs is found once by
# whoever runs the explorer, not by CI at random. `HYPOTHESIS_PROFILE=explore` searches
# afresh (random examples, 10x as many); a failure it finds becomes an @example.
settings.register_profile("default", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture(scope="module")
def digits() -> Any:
    """The bundled digits data set (sklearn's 8x8 digits, 10 classes)."""
    return load_dataset("digits")


@pytest.fixture(scope="module")
def engine(digits: Any) -> Any:
    """(spec, engine) of the logreg model on digits; the service tests override it with the
    engine alone."""
    spec = build_spec("logreg", digits.input_shape, digits.num_classes)
    return spec, load_engine(manifest_path(spec.name, spec.input_shape, spec.num_classes))
