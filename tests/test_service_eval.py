"""The aggregator's evaluation set (``[evaluation] data`` in aggregator.toml, issue 20): after
each completed round the service scores the new global model on it, and the accuracy in the
``round_end`` line, on the status board and in the Prometheus gauge is that model's on the
engine; bad evaluation files stop the service at start with an error naming them. The
service runs on the in-memory broker on a deterministic clock (as in test_service_log)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator.evaluation import evaluate
from aggregator.service import AggregatorConfig, AggregatorService
from edge_sdk import wire
from edge_sdk.config import ConfigError, load_device_identity, load_registry
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.device import DeviceConfig
from edge_sdk.engine import load_engine
from edge_sdk.ledger import Ledger
from edge_sdk.session import DeviceSession
from models import ONNX_DIR
from tools.enroll import enroll
from tools.inproc import MemoryBroker
from tools.seeding import seeded_bytes

FLEET = "ev"
MODEL = "logreg-64-10"
AGG = "aggregator"


def _fleet(tmp: Path) -> tuple[Any, AggregatorConfig]:
    names = [f"dev-{i:04d}" for i in range(4)]
    fl = enroll(tmp / "fleet", devices=names, fleet=FLEET, port=18883, tls=False,
                policy={"cohort_size": 4, "stage_timeout": 8.0, "max_rounds": 3,
                        "lr": 0.5},
                budget_epsilon=1000.0, model=MODEL, metrics_port=None)
    assert fl.aggregator_config is not None
    cfg = dataclasses.replace(AggregatorConfig.from_toml(fl.aggregator_config),
                              zoo_dir=ONNX_DIR)
    return fl, cfg


def test_each_completed_round_is_scored_on_the_aggregators_evaluation_set(
        tmp_path: Path, digits: Any) -> None:
    fl, cfg = _fleet(tmp_path)
    eval_file = Path(fl.aggregator_config).parent / "eval.npz"
    np.savez(eval_file, x=digits.x_test, y=digits.y_test)
    with open(fl.aggregator_config, "a") as f:
        f.write('\n[evaluation]\ndata = "eval.npz"\n')
    cfg = dataclasses.replace(AggregatorConfig.from_toml(fl.aggregator_config),
                              zoo_dir=ONNX_DIR)
    assert cfg.evaluation == eval_file  # relative to the TOML
    clock = [0.0]
    out = io.StringIO()
    svc = AggregatorService(cfg, out=out, random_bytes=seeded_bytes("svc-eval"),
                            clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0])
    engine = load_engine(ONNX_DIR / f"{MODEL}.json")
    registry = load_registry(fl.registry, fleet=FLEET)
    broker = MemoryBroker()
    ledgers: list[Ledger] = []
    published: dict[int, list[np.ndarray]] = {}  # round -> the model it published
    try:
        assert svc.status.snapshot(at=0.0, bytes_in=0, bytes_out=0).evaluation == str(
            eval_file)
        broker.attach(AGG, svc.endpoint, clock[0])
        for i, (name, dc_path) in enumerate(sorted(fl.device_configs.items())):
            dc = DeviceConfig.from_toml(dc_path)
            led = Ledger.open(dc.ledger, device_id=name, create=False)
            ledgers.append(led)
            x, y = digits.x_train[i::4], digits.y_train[i::4]
            broker.attach(name, DeviceSession(
                fleet=FLEET, identity=load_device_identity(dc.identity), registry=registry,
                ledger=led, engine=engine, spec=engine.spec, data=lambda x=x, y=y: (x, y),
                round_rng=seeded_round_rng(i), random_bytes=seeded_bytes(f"svc-eval/{name}")),
                clock[0])
        def drop(name: str, topic: str, payload: bytes) -> bool:
            """Keeps each model the service publishes (retained, to every device)."""
            if topic == wire.model_topic(FLEET):
                update = wire.decode(payload, wire.MODEL_KINDS)
                assert isinstance(update, wire.ModelUpdate)
                published[update.round_id] = update.params()
            return False

        broker.drop = drop
        m = svc.machine
        for _ in range(200):
            broker.run(clock[0])
            if len(m.history) == 3:
                break
            clock[0] += 1.0
            broker.tick(clock[0])
        assert len(m.history) == 3, (m.stage, m.history, out.getvalue()[-800:])
        snap = svc.status.snapshot(at=2000.0, bytes_in=0, bytes_out=0)
        metrics = svc.metrics.text()
    finally:
        svc.close()
        for led in ledgers:
            led.close()
    ends = [json.loads(line) for line in out.getvalue().splitlines()
            if json.loads(line)["event"] == "round_end"]
    assert [e["completed"] for e in ends] == [True, True, True], ends
    expect = {r: evaluate(engine, p, digits.x_test, digits.y_test) for r, p in
              published.items()}
    assert sorted(expect) == [0, 1, 2, 3]
    del expect[0]  # the initial model: no round, no score
    for e in ends:
        want = expect[e["round"]]
        assert (e["accuracy"], e["loss"]) == (want.accuracy, want.loss)
    assert {r.round_id: (r.accuracy, r.loss) for r in snap.rounds} == {
        r: (ev.accuracy, ev.loss) for r, ev in expect.items()}
    # the model learns: the scores are not a constant (nor the initial model's)
    first = evaluate(engine, published[1], digits.x_test, digits.y_test)
    assert 0.0 < first.accuracy <= 1.0 and first.loss is not None and first.loss > 0
    assert len({ev.loss for ev in expect.values()}) == 3
    (line,) = [ln for ln in metrics.splitlines()
               if ln.startswith("fedge_aggregator_last_round_accuracy ")]
    assert float(line.split()[1]) == expect[3].accuracy


def test_without_an_evaluation_set_nothing_is_measured(tmp_path: Path) -> None:
    _, cfg = _fleet(tmp_path)
    assert cfg.evaluation is None
    svc = AggregatorService(cfg, out=io.StringIO(), random_bytes=seeded_bytes("x"))
    try:
        assert svc.status.snapshot(at=0.0, bytes_in=0, bytes_out=0).evaluation is None
        (line,) = [ln for ln in svc.metrics.text().splitlines()
                   if ln.startswith("fedge_aggregator_last_round_accuracy ")]
        assert line.split()[1] == "NaN"  # not measured: never a number
    finally:
        svc.close()


@pytest.mark.parametrize(("write", "match"), [
    (None, "no such file"),
    (lambda p: np.savez(p, x=np.zeros((5, 63), np.float32), y=np.zeros(5, np.int64)),
     "array x has shape [5, 63], expected float32 [m, 64]"),
    (lambda p: np.savez(p, x=np.zeros((5, 64), np.float32), y=np.full(5, 10, np.int64)),
     "array y has 5 labels outside [0, 10)"),
    (lambda p: np.savez(p, x=np.zeros((5, 64), np.float32)), "no array 'y'"),
    (lambda p: p.write_bytes(b"not a zip"), "not a .npz file"),
    (lambda p: np.savez(p, x=np.zeros((0, 64), np.float32), y=np.zeros(0, np.int64)),
     "holds no samples"),
])
def test_bad_evaluation_files_are_refused_at_start(tmp_path: Path, write: Any,
                                                   match: str) -> None:
    fl, _ = _fleet(tmp_path)
    bad = Path(fl.aggregator_config).parent / "bad.npz"
    if write is not None:
        write(bad)
    with open(fl.aggregator_config, "a") as f:
        f.write('\n[evaluation]\ndata = "bad.npz"\n')
    cfg = dataclasses.replace(AggregatorConfig.from_toml(fl.aggregator_config),
                              zoo_dir=ONNX_DIR)
    out = io.StringIO()
    with pytest.raises(ConfigError, match=r"\[evaluation\] data: .*bad\.npz") as err:
        AggregatorService(cfg, out=out, random_bytes=seeded_bytes("x"))
    assert match in str(err.value)
    assert out.getvalue() == ""  # refused before it started


def test_unknown_evaluation_settings_are_refused(tmp_path: Path) -> None:
    fl, _ = _fleet(tmp_path)
    with open(fl.aggregator_config, "a") as f:
        f.write('\n[evaluation]\nfile = "eval.npz"\n')
    with pytest.raises(ConfigError, match="evaluation"):
        AggregatorConfig.from_toml(fl.aggregator_config)
