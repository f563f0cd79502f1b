"""Many registered devices, few online (issue 19, tools/scale.py): what exists per device
follows the online set, ledgers persist across activations, and the aggregator forgets
check-ins and flood buckets of devices that left. The 100,000-device figures are in
docs/benchmarks.md (``fedge bench scale``)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.guard import FloodGuard, FloodLimits
from edge_sdk.ledger import Ledger
from tools.inproc import MemoryBroker, topic_matches
from tools.scale import ScaleFleet
from tools.simconfig import SimConfig


def test_a_fleet_of_2000_registered_runs_rounds_with_only_its_online_devices(tmp_path) -> None:
    cfg = SimConfig(dataset="digits", model="logreg", devices=2000, participation=0.01,
                    local_steps=2, batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0,
                    value_bound=2.0, seed=5, secagg=True, progress=False, rounds=3,
                    dropout=0.05)
    fleet = ScaleFleet(cfg, tmp_path, available=60)
    seen: list[int] = []
    activate = fleet._activate

    def spy(names, round_id, now):  # how many devices exist while a round runs
        activate(names, round_id, now)
        seen.append(len(fleet.active))

    fleet._activate = spy
    try:
        s = fleet.run()
    finally:
        fleet.close()
    assert len(fleet.registry.devices) == 2000
    assert [r["completed"] for r in s["rounds"]] == [True] * 3
    assert [r["cohort"] for r in s["rounds"]] == [20] * 3
    assert seen == [60] * 3 and not fleet.active  # online set only, gone after the round
    files = sorted((tmp_path / "ledgers").glob("*.db"))
    assert len(files) == s["ledger_files"] <= 3 * 60  # a ledger per device ever online
    assert s["machine_checkins"] == 0  # check-ins on old models forgotten
    assert len(fleet.machine._guard._buckets) <= 60
    assert set(fleet.broker.endpoints) == {"aggregator"}
    # a device online in two rounds kept its spending: its ledger holds both releases
    counts = {}
    for f in files:
        led = Ledger.open(f, device_id=f.stem)
        counts[f.stem] = len(led.entries())
        led.close()
    assert max(counts.values()) >= 1 and sum(counts.values()) >= s["device_rounds"]


def test_flood_guard_forgets_only_full_buckets() -> None:
    g = FloodGuard(FloodLimits(burst=4, rate=1.0))
    assert g.admit("a", 0.0) and g.admit("b", 0.0, size=3 << 20)  # b spends all 4 tokens
    assert g.forget_full(0.0) == 0  # a has 3 of 4: kept
    assert g.forget_full(1.0) == 1  # a is full again: dropped; b has 1 of 4
    assert not g.admit("b", 1.0, size=3 << 20)  # b's debt is remembered
    assert g.forget_full(10.0) == 1


_LEVEL = st.sampled_from(["fedge", "f", "dev", "d1", "d2", "up", "down", "x"])


@settings(max_examples=200, deadline=None)
@given(filters=st.lists(st.lists(st.one_of(_LEVEL, st.just("+"), st.just("#")), min_size=1,
                                 max_size=5).map("/".join), max_size=12),
       topic=st.lists(_LEVEL, min_size=1, max_size=6).map("/".join))
def test_memory_broker_routes_like_a_scan_of_every_filter(filters, topic) -> None:
    class Sink:
        def __init__(self, subs):
            self.subs = subs

        def subscriptions(self):
            return self.subs

    b = MemoryBroker()
    for i, f in enumerate(filters):
        if "#" in f and not f.endswith("#"):
            continue
        b.attach(f"c{i % 3}-{i}", Sink([f]), 0.0)
    want = [(f, n) for f, n in b.subs if topic_matches(f, topic)]
    assert b._route(topic) == want
    if b.subs:  # and after a detach
        b.detach(b.subs[0][1])
        assert b._route(topic) == [(f, n) for f, n in b.subs if topic_matches(f, topic)]


def test_scale_bench_is_registered() -> None:
    from tools.bench.report import TARGETS

    assert any(t.section == "scale" and t.issue == 19 for t in TARGETS)
    assert Path("tools/bench/scale.py").exists()
