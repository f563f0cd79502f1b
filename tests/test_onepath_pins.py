"""Pins for issue 15's refactor (plan §4.0): the fingerprints of two small runs on each
path, recorded in tests/golden/onepath_pins.json before any code moved.

A step of the plan may change a pin only where the plan says so (the fast simulator's at its
re-seeding and arithmetic steps), and its commit message says why; the in-process fleet's
pins hold throughout for mechanism ``gaussian``. Regenerate (only then) with
``.venv/bin/python -m tests.test_onepath_pins --write``.

The fingerprints are bit-exact float32 models, so they pin this onnxruntime build on this
CPU family as well; a new machine that fails only here should compare the per-round
``sum_sha256`` first (integer sums, before any float decoding)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tools.fleet import Fleet
from tools.simulate import SimConfig, simulate

PINS = Path(__file__).parent / "golden" / "onepath_pins.json"
SEEDS = (5, 6)
# digits + logreg, a protocol-sized fleet: 12 devices, cohorts of 6, 3 rounds
COMMON = dict(dataset="digits", model="logreg", devices=12, participation=0.5, rounds=3,
              local_steps=5, batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0,
              value_bound=2.0, progress=False)
FLEET = dict(COMMON, secagg=True, transport="inproc", dropout=0.2)
FAST = dict(COMMON, secagg=False, transport="inproc", dropout=0.0)


def fleet_pins(seed: int, workdir: Path, data: Any = None, engine: Any = None
               ) -> dict[str, Any]:
    """The in-process fleet's final model and per-round integer sums, for ``seed``."""
    fleet = Fleet(SimConfig(**FLEET, seed=seed), workdir, data=data, engine=engine)
    try:
        summary = fleet.run()
    finally:
        fleet.close()
    if summary["note"]:
        raise AssertionError(f"fleet seed {seed} did not finish: {summary['note']}")
    return {"model_sha256": summary["model_sha256"],
            "rounds": [{"round": r["round"], "completed": r["completed"],
                        "survivors": r["survivors"], "sum_sha256": r["sum_sha256"]}
                       for r in summary["rounds"]]}


def fast_pins(seed: int) -> dict[str, Any]:
    """The fast simulator's final model for ``seed`` (without dropouts, as pinned before
    G3 let the fast path drop devices; tests/test_one_path.py checks it against the fleet
    with them)."""
    return {"model_sha256": simulate(SimConfig(**FAST, seed=seed))["model_sha256"]}


def compute(workdir: Path) -> dict[str, Any]:
    return {
        "about": ("issue 15 pins (plan15 §4.0): sha256 of the final model (float32 LE) and "
                  "of each round's secure sum (values as uint64 LE); see "
                  "tests/test_onepath_pins.py"),
        "fleet_config": FLEET,
        "fast_config": FAST,
        "fleet": {str(s): fleet_pins(s, workdir / f"fleet-{s}") for s in SEEDS},
        "fast": {str(s): fast_pins(s) for s in SEEDS},
    }


def _stored() -> dict[str, Any]:
    return json.loads(PINS.read_text())


def test_pins_describe_the_configs_run_here() -> None:
    stored = _stored()
    assert stored["fleet_config"] == FLEET and stored["fast_config"] == FAST
    assert sorted(stored["fleet"]) == sorted(stored["fast"]) == [str(s) for s in SEEDS]


@pytest.mark.parametrize("seed", SEEDS)
def test_fleet_pins_hold(seed: int, tmp_path: Path, digits: Any, engine: Any) -> None:
    got = fleet_pins(seed, tmp_path, data=digits, engine=engine)
    want = _stored()["fleet"][str(seed)]
    # per round first: a changed sum names the first round that moved
    assert got["rounds"] == want["rounds"]
    assert got["model_sha256"] == want["model_sha256"]


@pytest.mark.parametrize("seed", SEEDS)
def test_fast_simulator_pins_hold(seed: int) -> None:
    assert fast_pins(seed) == _stored()["fast"][str(seed)]


@pytest.mark.parametrize("seed", SEEDS)
def test_fast_simulator_with_the_fleets_dropouts_makes_the_fleets_model(seed: int) -> None:
    """Since G3 the fast path runs the fleet's round code: with the fleet's config (its
    dropouts included) it ends with the fleet's pinned model."""
    cfg = SimConfig(**{**FLEET, "secagg": False}, seed=seed)
    assert simulate(cfg)["model_sha256"] == _stored()["fleet"][str(seed)]["model_sha256"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_onepath_pins --write  (rewrites the pins)")
    with tempfile.TemporaryDirectory(prefix="fedge-pins-") as tmp:
        pins = compute(Path(tmp))
    PINS.write_text(json.dumps(pins, indent=1) + "\n")
    print(json.dumps(pins, indent=1))
