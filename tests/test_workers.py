"""One gateway's aggregation over several workers (issue 19, tools/workers.py): a
coordinator draws the round's cohort and hands it out as disjoint jobs through an MQTT v5
shared subscription; the workers' sums add up to the same sums and model whether one
worker runs every job or two run them side by side."""

from __future__ import annotations

import pytest

from tools.inproc import MemoryBroker
from tools.simconfig import SimConfig
from tools.workers import Workers

CFG = dict(dataset="digits", model="logreg", participation=0.4, local_steps=2,
           batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0, value_bound=2.0, seed=3,
           secagg=True, progress=False, rounds=2, dropout=0.1)


def _run(tmp, devices: int, workers: int) -> dict:
    w = Workers(SimConfig(**{**CFG, "devices": devices}), tmp / f"w{workers}",
                workers=workers, jobs=2)
    try:
        return w.run()
    finally:
        w.close()


@pytest.mark.parametrize("devices", [100, pytest.param(500, marks=pytest.mark.slow)])
def test_two_workers_give_the_same_sums_as_one(tmp_path, devices: int) -> None:
    one, two = _run(tmp_path, devices, 1), _run(tmp_path, devices, 2)
    for s in (one, two):
        assert [r["completed"] for r in s["rounds"]] == [True, True]
        assert all(len(r["jobs"]) == 2 for r in s["rounds"])  # both jobs summed
    assert all(v == ["worker-0"] for v in one["ran_by"].values())
    assert all(v == ["worker-0", "worker-1"] for v in two["ran_by"].values())  # shared
    assert [r["sum"] for r in one["rounds"]] == [r["sum"] for r in two["rounds"]]
    assert one["model_sha256"] == two["model_sha256"]
    assert sum(r["survivors"] for r in two["rounds"]) < 2 * 2 * round(0.4 * devices / 2)


def test_memory_broker_shared_subscriptions_deliver_each_message_once_in_turn() -> None:
    got: list[tuple[str, str]] = []

    class Sub:
        def __init__(self, name, filters):
            self.name, self.filters = name, filters

        def subscriptions(self):
            return self.filters

        def on_message(self, topic, payload, now):
            got.append((self.name, payload.decode()))
            return []

        def on_tick(self, now):
            return []

    b = MemoryBroker()
    from edge_sdk.wire import Publish

    b.retained["a/job"] = b"old"  # retained messages never go to a shared subscription
    for n in ("w0", "w1"):
        b.attach(n, Sub(n, ["$share/g/a/+"]), 0.0)
    b.attach("plain", Sub("plain", ["a/#"]), 0.0)
    assert got == [("plain", "old")]
    got.clear()
    for i in range(4):
        b.publish("x", Publish("a/job", str(i).encode()))
    b.run(0.0)
    assert sorted(p for n, p in got if n != "plain") == ["0", "1", "2", "3"]  # once each
    assert [n for n, _ in got if n != "plain"] == ["w0", "w1", "w0", "w1"]  # in turn
    assert [p for n, p in got if n == "plain"] == ["0", "1", "2", "3"]  # plain: all
    b.unsubscribe("w1", ["$share/g/a/+"])
    got.clear()
    b.publish("x", Publish("a/job", b"4"))
    b.run(0.0)
    assert ("w0", "4") in got and not any(n == "w1" for n, _ in got)
    with pytest.raises(ValueError, match="share"):
        b.subscribe("w0", ["$share//a"])
