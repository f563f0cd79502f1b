"""tools.bench.sampler: the sizes are the zoo's parameter counts; rows are well formed."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from edge_sdk.model import build_spec, init_params
from tools.bench.sampler import SIZES, run_sampler_bench


@pytest.mark.parametrize("model", sorted(SIZES))
def test_sizes_are_the_zoo_parameter_counts(model: str) -> None:
    params = init_params(build_spec(model, (1, 28, 28), 10), np.random.default_rng(0))
    assert sum(math.prod(p.shape) for p in params) == SIZES[model]


def test_rows_and_bad_reps() -> None:
    out = io.StringIO()
    rows = run_sampler_bench(reps=1, out=out)
    assert [r["model"] for r in rows] == list(SIZES)
    for r in rows:
        assert r["numpy_per_s"] > 0 and r["secure_per_s"] > 0
        assert r["numpy_over_secure"] == pytest.approx(r["numpy_per_s"] / r["secure_per_s"])
    assert out.getvalue().count("SecureRng") == len(SIZES)
    with pytest.raises(ValueError, match="reps"):
        run_sampler_bench(reps=0)
