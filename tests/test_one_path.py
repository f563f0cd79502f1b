"""One round, one code path (issue 15, plan15 G3 and §6.1): the fast simulator
(``tools.simulate``: the round core, the mechanisms' device halves and PlainSum) and the
fleet (``tools.fleet``: DeviceSession and RoundMachine with SecAgg+, over the in-memory
broker or a real mosquitto) run the same rounds, so with the same config, seeds and
dropouts they end with the same model, bit for bit, and every device's ledger holds the
same spend."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tools.fleet import Fleet
from tools.simconfig import SimConfig, load_config
from tools.simulate import simulate

CONFIG = Path(__file__).parents[1] / "tools" / "configs" / "onepath.toml"
MECHANISMS = {"gaussian": {}, "gaussian-randk-qsgd": {"sparsity": 0.1, "quant_levels": 7},
              "update-noise": {"mechanism": "update-noise"},
              "ddg": {"mechanism": "ddg", "local_steps": 1},
              "binomial": {"mechanism": "binomial", "binomial_trials": 1024, "quant_levels": 31},
              "device-dp": {"mechanism": "device-dp", "update_clip": 1.0},
              # adaptive clipping: S is round state on both paths (round_core, the round
              # machine and its snapshot, the fast simulator's loop)
              "device-dp-adaptive": {"mechanism": "device-dp", "update_clip": 1.0,
                                     "adaptive_clip_quantile": 0.5},
              # self-sampled check-ins: each member's hidden coin on both paths
              "device-dp-self-sampled": {"mechanism": "device-dp", "update_clip": 1.0,
                                         "self_sample_rate": 0.5}}


def _config(mechanism: str, **more: Any) -> SimConfig:
    return load_config(CONFIG, progress=False, **MECHANISMS[mechanism], **more)


def _fleet(cfg: SimConfig, tmp: Path, data: Any = None, engine: Any = None
           ) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    fleet = Fleet(cfg, tmp, data=data, engine=engine)
    try:
        summary = fleet.run()
        spent = {n: fleet.ledgers[n].spent() for n in fleet.names}
    finally:
        fleet.close()
    assert summary["note"] == ""
    return summary, {n: (s.local_epsilon, s.aggregate_epsilon) for n, s in spent.items()}


def _same_rounds(fast: dict[str, Any], fleet: dict[str, Any]) -> None:
    def rows(s: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(r["round"], r["completed"], r["survivors"], r["dropped"]) for r in s["rounds"]]

    assert rows(fast) == rows(fleet)
    # the config drops someone in every round, and someone's upload is missing somewhere
    assert all(r["dropped"] for r in fast["rounds"])
    assert any(r["survivors"] < r["cohort"] for r in fast["rounds"])
    assert fast["rounds_completed"] >= 1


def _same_ledgers(fast: dict[str, Any], ledgers: dict[str, tuple[float, float]]) -> None:
    got = {n: tuple(v) for n, v in fast["device_epsilon"].items()}
    assert got == ledgers
    assert any(e > 0 for e, _ in ledgers.values())
    assert fast["epsilon"] == max(e for e, _ in ledgers.values())


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_fast_simulator_and_inproc_fleet_give_the_same_model(
        mechanism: str, tmp_path: Path, digits: Any, engine: Any) -> None:
    cfg = _config(mechanism)
    fast = simulate(cfg)
    fleet, ledgers = _fleet(replace(cfg, secagg=True, transport="inproc"), tmp_path,
                            digits, engine)
    _same_rounds(fast, fleet)
    assert fast["model_sha256"] == fleet["model_sha256"]
    _same_ledgers(fast, ledgers)
    assert fast["epsilon_aggregate"] == fleet["epsilon_aggregate"]
    # the device-level figure (issue 16): the same on both paths, per device, per round and
    # final; stated only by device-dp, None (never a partial figure) for every other one
    assert fast["device_level_epsilon"] == fleet["device_level_epsilon"]
    assert fast["epsilon_device"] == fleet["epsilon_device"]
    assert ([r["epsilon_device"] for r in fast["rounds"]]
            == [r["epsilon_device"] for r in fleet["rounds"]])
    if mechanism == "device-dp-adaptive":  # S moved with the rounds' noised fractions
        assert len({r["update_clip"] for r in fast["rounds"]}) > 1
    if mechanism.startswith("device-dp"):
        assert fast["epsilon_device"] == max(fast["device_level_epsilon"].values()) > 0
        # below the sample-level figures: one sample's change is bounded by the device's
        # substitution, twice the zero-out sensitivity
        assert fast["epsilon_device"] < fast["epsilon_aggregate"]
    else:
        assert fast["epsilon_device"] is None
        assert all(r["epsilon_device"] is None for r in fast["rounds"])
    # each survivor uploaded the plan's length of ring values, bit-packed at its width
    assert fast["rounds_failed"] == 0 and fast["bytes_up_payload"] == fast[
        "device_rounds"] * math.ceil(fast["kept_coordinates"] * fast["ring_bits"] / 8)


def test_the_round_machines_min_survivors_fails_the_same_rounds(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    """min_survivors = the whole cohort: a round in which someone vanishes before the
    unmask stage fails on both paths, with the round machine's words (the fast path judges
    PlainSum's counts with ``round_core.short_of_survivors``, as the machine does)."""
    cfg = _config("gaussian", min_survivors=6, max_colluders=0, rounds=4)
    fast = simulate(cfg)
    fleet, ledgers = _fleet(replace(cfg, secagg=True), tmp_path, digits, engine)

    def rows(s: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(r["round"], r["completed"], r["detail"], r["survivors"], r["dropped"])
                for r in s["rounds"]]

    assert rows(fast) == rows(fleet)
    assert any("below min_survivors 6" in r["detail"] for r in fast["rounds"])
    assert any(r["completed"] for r in fast["rounds"])
    assert fast["model_sha256"] == fleet["model_sha256"]
    _same_ledgers(fast, ledgers)


def test_a_different_dropout_seed_gives_another_model() -> None:
    """The equality above is not vacuous: the model depends on who drops out."""
    a = simulate(_config("gaussian"))
    b = simulate(_config("gaussian", dropout=0.4))
    assert a["rounds"] != b["rounds"] and a["model_sha256"] != b["model_sha256"]


@pytest.mark.broker
@pytest.mark.parametrize("mechanism", [
    "gaussian",
    pytest.param("gaussian-randk-qsgd", marks=pytest.mark.slow),
    pytest.param("update-noise", marks=pytest.mark.slow),
    pytest.param("ddg", marks=pytest.mark.slow),
    pytest.param("device-dp-adaptive", marks=pytest.mark.slow),
    "device-dp-self-sampled",  # 2 s: its coins over real mosquitto in the default suite
])
def test_fast_simulator_and_mqtt_fleet_give_the_same_model(
        mechanism: str, tmp_path: Path, digits: Any, engine: Any) -> None:
    cfg = _config(mechanism)
    fast = simulate(cfg)
    fleet, ledgers = _fleet(replace(cfg, transport="mqtt", secagg=True),
                            tmp_path, digits, engine)
    _same_rounds(fast, fleet)
    assert fast["model_sha256"] == fleet["model_sha256"]
    _same_ledgers(fast, ledgers)


@pytest.mark.parametrize("transport", ["inproc", pytest.param("mqtt", marks=pytest.mark.broker)])
def test_a_budget_that_runs_out_ends_both_paths_at_the_same_round(
        transport: str, tmp_path: Path, digits: Any, engine: Any) -> None:
    """Device budgets of epsilon 5 pay for about two rounds each: the devices that cannot
    pay decline once (``"budget"``) and are not selected again (``round_core.
    eligible_devices``), rounds run while a cohort can pay, and both paths end at the same
    round with the round core's note (``round_core.too_few_eligible``), the same model and
    the same ledgers. Before, the fleet stalled after a failed round (its decliners never
    checked in again) while the fast path reselected them and failed every later round."""
    cfg = _config("gaussian", budget_epsilon=5.0, rounds=10)
    fast = simulate(cfg)
    fleet = Fleet(replace(cfg, secagg=True, transport=transport), tmp_path, data=digits,
                  engine=engine)
    try:
        slow = fleet.run()
        ledgers = {n: (s.local_epsilon, s.aggregate_epsilon)
                   for n, s in ((n, fleet.ledgers[n].spent()) for n in fleet.names)}
    finally:
        fleet.close()

    def rows(s: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(r["round"], r["completed"], r["detail"], r["survivors"], r["dropped"])
                for r in s["rounds"]]

    assert rows(fast) == rows(slow)
    assert any(r["detail"].startswith(f"round {r['round']} failed: ") for r in fast["rounds"])
    assert fast["note"] == slow["note"]
    assert fast["note"].startswith(f"ended after {len(fast['rounds'])} rounds: ")
    assert "fewer than the min cohort 6; no round can start" in fast["note"]
    assert len(fast["rounds"]) < cfg.rounds  # the budget bit
    # devices declined for budget and some of those rounds still completed
    declined = [r for r in fast["rounds"] if r["declined"]]
    assert declined and any(r["completed"] for r in declined)
    # a device that declined for budget is never selected again
    seen: set[str] = set()
    for r in fast["rounds"]:
        assert not seen & set(r["declined"])
        seen |= set(r["declined"])
    assert fast["rounds_completed"] >= 3
    assert fast["model_sha256"] == slow["model_sha256"]
    _same_ledgers(fast, ledgers)
    assert all(e <= 5.0 for e, _ in ledgers.values())
