"""A site above gateways (issue 19, aggregator.site): gateways securely aggregate their own
cohorts and forward only the released sum; the site combines them. In memory here (the
deployed round machines, a bridge that forwards what mosquitto's would); the same over
bridged mosquittos in tests/test_hierarchy_mqtt.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator.site import (
    SiteMachine,
    SitePolicy,
    Upstream,
    check_gateway_policy,
    combine,
    gateway_sum,
)
from edge_sdk import secagg, wire
from tools.hierarchy import Hierarchy
from tools.simconfig import SimConfig

BASE = dict(dataset="digits", model="logreg", devices=40, participation=0.5, local_steps=5,
            batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0, value_bound=2.0, seed=3,
            secagg=True, progress=False)


def _pair(tmp: Path, **settings: Any) -> tuple[Hierarchy, dict[str, Any], dict[str, Any]]:
    cfg = SimConfig(**{**BASE, **settings.pop("cfg", {})})
    h = Hierarchy(cfg, tmp / "site", gateways=2, **settings)
    try:
        site = h.run()
        flat = h.run_flat_twin(tmp / "flat")
    finally:
        h.close()
    return h, site, flat


@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.slow), 0.2])
def test_two_gateways_equal_the_flat_run_bit_for_bit(tmp_path, dropout: float) -> None:
    h, site, flat = _pair(tmp_path, cfg={"rounds": 3, "dropout": dropout})
    assert [r["completed"] for r in site["rounds"]] == [True] * 3
    assert all(r["gateways"] == ["gw-0", "gw-1"] for r in site["rounds"])
    # the same survivors each round, and the same model, bit for bit
    assert [r["survivors"] for r in site["rounds"]] == [r["survivors"] for r in flat["rounds"]]
    assert site["model_sha256"] == flat["model_sha256"]
    if dropout:
        assert sum(r["survivors"] for r in site["rounds"]) < 3 * 20  # devices did drop
    # every gateway's plan is the template: cohort 10 of its 20, ring for the site's 20
    assert h.policy.cohort_size == 10 and h.policy.sum_cohort == 20


@pytest.mark.parametrize("stage", [pytest.param("masked", marks=pytest.mark.slow), "forward"])
def test_a_gateway_lost_mid_round_costs_only_its_cohort(tmp_path, stage: str) -> None:
    h, site, flat = _pair(tmp_path, cfg={"rounds": 4, "dropout": 0.1},
                          kill=(2, 1, stage), round_timeout=200.0)
    rounds = {r["round"]: r for r in site["rounds"]}
    assert [r["completed"] for r in site["rounds"]] == [True] * 4
    assert rounds[2]["gateways"] == ["gw-0"] and "gw-1" in rounds[2]["missing"]
    assert rounds[3]["gateways"] == rounds[4]["gateways"] == ["gw-0", "gw-1"]  # it is back
    assert site["killed"] == {"2": "gw-1"}
    # the flat run without gw-1's cohort in round 2 makes the same model
    assert site["model_sha256"] == flat["model_sha256"]
    assert [r["survivors"] for r in site["rounds"]] == [r["survivors"] for r in flat["rounds"]]


# ---------------------------------------------------------------------------- the site


def _site(policy_kw: dict[str, Any] | None = None):
    from aggregator.round_core import RoundPolicy

    policy = RoundPolicy(fleet="f", cohort_size=3, min_survivors=3, max_colluders=0,
                         bits=32, sum_cohort=6, **(policy_kw or {}))
    site_id = secagg.AggregatorIdentity.generate(random_bytes=lambda n: b"\x01" * n)
    gws = {g: secagg.AggregatorIdentity.generate(random_bytes=lambda n, c=c: bytes([c]) * n)
           for c, g in ((2, "gw-a"), (3, "gw-b"))}
    params = [np.zeros(4, np.float32)]
    m = SiteMachine(policy=SitePolicy(site="s", round_timeout=10.0), round_policy=policy,
                    identity=site_id, gateways={g: i.public_key for g, i in gws.items()},
                    params=params, random_bytes=lambda n: b"\x07" * n)
    return m, policy, site_id, gws


def _plan(policy, announce: wire.SiteRound, cohort: tuple[str, ...]) -> wire.RoundPlan:
    from aggregator.round_core import draw_plan

    return draw_plan(policy, round_id=announce.round_id, model_version=announce.model_version,
                     cohort=cohort, dim=4, random_bytes=lambda n: b"\x09" * n,
                     round_seed=announce.round_seed)


def _report(m, gw, ident, plan, total, survivors, *, topic_gw=None):
    msg = wire.sign(gateway_sum(plan, gateway=gw, total=total, survivors=survivors), ident)
    topic = wire.gateway_up_topic("s", topic_gw or gw, "gateway_sum")
    return m.on_message(topic, wire.encode(msg), 1.0)


def test_site_combines_sums_in_the_ring_and_rejects_what_does_not_fit() -> None:
    m, policy, site_id, gws = _site()
    out = m.on_connect(0.0)
    announce = wire.decode(next(p.payload for p in out if p.topic.endswith("site/round")),
                           wire.SITE_KINDS)
    wire.verify(announce, site_id.public_key)
    assert [type(e).__name__ for e in m.take_events()] == ["SiteRoundStarted"]
    pa = _plan(policy, announce, ("a1", "a2", "a3"))
    pb = _plan(policy, announce, ("b1", "b2", "b3"))
    top = np.uint64(2**32 - 1)  # -1 in the ring: the sum wraps exactly as a flat one would
    ta = np.array([top, 1, 2, 3], np.uint64)
    tb = np.array([2, 5, 0, top], np.uint64)
    # not the gateway's topic, an outsider, a replayed or forged sum: rejected, nothing changes
    assert _report(m, "gw-a", gws["gw-a"], pa, ta, 3, topic_gw="gw-b") == []
    outsider = secagg.AggregatorIdentity.generate(random_bytes=lambda n: b"\x05" * n)
    assert _report(m, "gw-a", outsider, pa, ta, 3) == []  # bad signature
    bad = dataclasses.replace(pa, round_seed=b"\x00" * 32)
    assert _report(m, "gw-a", gws["gw-a"], bad, ta, 3) == []  # not the site's seed
    m.on_message(wire.gateway_up_topic("s", "gw-a", "gateway_sum"), b"\xc1garbage", 1.0)
    events = m.take_events()
    assert len(events) == 4 and all(type(e).__name__ == "SiteRejected" for e in events)
    assert m.waiting_for == {"gw-a", "gw-b"}
    assert _report(m, "gw-a", gws["gw-a"], pa, ta, 3) == []
    assert _report(m, "gw-a", gws["gw-a"], pa, ta, 3) == []  # duplicate: rejected
    assert [type(e).__name__ for e in m.take_events()] == ["GatewayReported", "SiteRejected"]
    out = _report(m, "gw-b", gws["gw-b"], pb, tb, 2)
    outcome = m.history[-1]
    assert outcome.completed and outcome.survivors == 5
    np.testing.assert_array_equal(outcome.total, (ta + tb) & np.uint64(2**32 - 1))
    assert m.model_version == 1
    model = wire.decode(next(p.payload for p in out if p.topic.endswith("site/model")),
                        wire.MODEL_KINDS)
    wire.verify(model, site_id.public_key)
    assert model.version == 1
    # the next round is announced at once
    assert any(p.topic.endswith("site/round") and p.retain for p in out)


def test_site_round_with_a_silent_gateway_closes_at_its_deadline() -> None:
    m, policy, _, gws = _site()
    m.on_connect(0.0)
    assert m.open_round == 1
    assert m.on_tick(5.0) == []
    out = m.on_tick(10.0)  # nobody reported: the round fails, the model stays
    assert not m.history[-1].completed and m.model_version == 0
    assert "below min_gateways" in m.history[-1].detail
    assert any(p.topic.endswith("site/round") for p in out)  # round 2 announced


def test_combine_refuses_failed_mixed_and_overlapping_sums() -> None:
    _, policy, _, gws = _site()
    ann = wire.SiteRound(round_id=1, model_version=0, round_seed=b"\x03" * 32, deadline_s=1.0)
    pa = _plan(policy, ann, ("a1", "a2", "a3"))
    ok = gateway_sum(pa, gateway="gw-a", total=np.zeros(4, np.uint64), survivors=3)
    failed = gateway_sum(pa, gateway="gw-b", total=None, survivors=0, detail="x")
    with pytest.raises(ValueError, match="failed"):
        combine([ok, failed], round_id=1)
    with pytest.raises(ValueError, match="overlaps"):
        combine([ok, dataclasses.replace(ok, sender="gw-b")], round_id=1)
    other = gateway_sum(dataclasses.replace(pa, bits=40, cohort=("b1", "b2", "b3")),
                        gateway="gw-b", total=np.zeros(4, np.uint64), survivors=3)
    with pytest.raises(ValueError, match="differs"):
        combine([ok, other], round_id=1)


def test_gateway_policies_that_cannot_combine_are_refused() -> None:
    from aggregator.round_core import RoundPolicy

    with pytest.raises(ValueError, match="full cohorts"):
        check_gateway_policy(RoundPolicy(fleet="f", cohort_size=8, min_cohort=7))
    with pytest.raises(ValueError, match="mechanism"):
        check_gateway_policy(RoundPolicy(fleet="f", cohort_size=5, mechanism="binomial",
                                         update_clip=1.0, trials=64, levels=8))
    with pytest.raises(ValueError, match="32-byte"):
        Upstream(site="s", gateway="g", site_key=b"short")


def test_gateway_sum_wire_checks() -> None:
    _, policy, _, gws = _site()
    ann = wire.SiteRound(round_id=1, model_version=0, round_seed=b"\x03" * 32, deadline_s=1.0)
    pa = _plan(policy, ann, ("a1", "a2", "a3"))
    msg = gateway_sum(pa, gateway="gw-a", total=np.zeros(4, np.uint64), survivors=3)
    with pytest.raises(ValueError, match="exceed"):
        wire.sign(dataclasses.replace(msg, survivors=4), gws["gw-a"])
    with pytest.raises(ValueError, match="exactly when"):
        wire.sign(dataclasses.replace(msg, total=None), gws["gw-a"])
    big = wire.WireArray.of(np.array([0, 0, 0, 2**40], np.uint64))
    with pytest.raises(ValueError, match="not below"):
        wire.sign(dataclasses.replace(msg, total=big), gws["gw-a"])


def test_each_gateway_sum_carries_the_noise_its_own_cohort_needs(tmp_path) -> None:
    """Device-level DP through a site: a device's release, as its own ledger records it,
    is exactly the one it makes in a flat single gateway of the same cohort size (sigma on
    that cohort's honest members alone), so the guarantee holds against its gateway and
    against the site (which sees each gateway's sum apart); the site's wider ring
    (sum_cohort) changes the bits, never the noise."""
    from tools.fleet import Fleet

    dp = {"mechanism": "device-dp", "update_clip": 1.0, "rounds": 2, "dropout": 0.0}
    h = Hierarchy(SimConfig(**{**BASE, **dp}), tmp_path / "site", gateways=2)
    try:
        site = h.run()
        events = {e.device_event for f in h.fleets for led in f.ledgers.values()
                  for e in led.entries() if e.kind == "reserve"}
        cohorts = {e.cohort_size for f in h.fleets for led in f.ledgers.values()
                   for e in led.entries() if e.kind == "reserve"}
    finally:
        h.close()
    assert [r["completed"] for r in site["rounds"]] == [True, True]
    # one gateway on its own: 20 devices, a cohort of 10, the same settings
    flat = Fleet(SimConfig(**{**BASE, **dp, "devices": 20}), tmp_path / "flat")
    try:
        flat.run()
        want = {e.device_event for led in flat.ledgers.values() for e in led.entries()
                if e.kind == "reserve"}
        want_cohorts = {e.cohort_size for led in flat.ledgers.values() for e in led.entries()
                        if e.kind == "reserve"}
    finally:
        flat.close()
    assert None not in events and len(events) == 1  # one release, the same for everyone
    assert events == want and cohorts == want_cohorts
    from aggregator.round_core import mechanism_params

    no_site = dataclasses.replace(h.policy, sum_cohort=None)
    wide, _, bits = mechanism_params(h.policy, dim=650)
    narrow, _, narrow_bits = mechanism_params(no_site, dim=650)
    assert wide.sigma == narrow.sigma and bits >= narrow_bits


def test_fedge_site_command_runs_and_checks_the_flat_model(tmp_path, capsys) -> None:
    from tools.cli import main

    out = tmp_path / "site.json"
    assert main(["site", "--rounds", "2", "--check-flat", "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "site round 2: done, gateways gw-0, gw-1" in text and "(the same)" in text
    import json

    summary = json.loads(out.read_text())
    assert summary["model_sha256"] == summary["flat_model_sha256"]


def test_site_restarted_mid_round_keeps_the_sums_it_acknowledged() -> None:
    from aggregator.site import SiteSnapshotError

    def run(crash: bool):
        m, policy, site_id, gws = _site()
        saved: list[bytes] = []
        m._checkpoint = saved.append
        out = m.on_connect(0.0)
        ann = wire.decode(next(p.payload for p in out if p.topic.endswith("site/round")),
                          wire.SITE_KINDS)
        pa = _plan(policy, ann, ("a1", "a2", "a3"))
        pb = _plan(policy, ann, ("b1", "b2", "b3"))
        _report(m, "gw-a", gws["gw-a"], pa, np.arange(4, dtype=np.uint64), 3)
        if crash:  # the process dies; a new one starts from the last checkpoint
            kw = dict(policy=m.policy, round_policy=m.round_policy, identity=site_id,
                      gateways={g: i.public_key for g, i in gws.items()})
            m = SiteMachine.restore(saved[-1], **kw)
            assert m.open_round == 1 and m.waiting_for == {"gw-b"}
            with pytest.raises(SiteSnapshotError, match="other gateways"):
                SiteMachine.restore(saved[-1], **{**kw, "gateways": {"gw-a": b"\x00" * 32}})
            with pytest.raises(SiteSnapshotError):
                SiteMachine.restore(saved[-1][:-5], **kw)
            # the acknowledged sum is not taken twice
            assert _report(m, "gw-a", gws["gw-a"], pa, np.arange(4, dtype=np.uint64), 3) == []
        _report(m, "gw-b", gws["gw-b"], pb, np.ones(4, dtype=np.uint64), 3)
        return m.history[-1], m.params, m.open_round

    plain, crashed = run(False), run(True)
    assert plain[0].completed and crashed[0].completed
    np.testing.assert_array_equal(plain[0].total, crashed[0].total)
    for a, b in zip(plain[1], crashed[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert plain[2] == crashed[2] == 2  # the next round id, not a repeated one
