"""aggregator.plain_sum: a round without secure aggregation's messages ends as SecAgg+ ends it.

The oracle is a real SecAgg+ round (``aggregator.secagg_server.run_round``: keys, Shamir
shares, masks, every message encoded and decoded) on the same cohort, graph, threshold, ring
and dropout pattern: both give the same survivors and the same total, or the same failure
word for word. Random cohorts, graphs (Harary and complete), thresholds, ring widths and
dropouts at every stage, within the neighbourhoods' tolerance and beyond it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_secagg import World, random_inputs, ring_sum

from aggregator.plain_sum import STAGES, PlainSum
from aggregator.secagg_server import run_round
from edge_sdk.errors import LocalProtocolError, RoundFailed
from edge_sdk.hazmat.ring import Ring
from edge_sdk.secagg import RoundConfig

SETTINGS = settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
# the vanish stage -> the first message run_round's dropped device does not send
AS_SECAGG = {"keys": "advertise", "shares": "share_keys", "masked": "masked_input",
             "unmask": "unmask"}


@st.composite
def rounds(draw: st.DrawFn) -> tuple[RoundConfig, World, dict[str, str]]:
    n = draw(st.integers(3, 12))
    full = draw(st.booleans()) or n <= 4
    k = n - 1 if full else draw(st.sampled_from(list(range(2, n - 1, 2))))
    t = draw(st.integers(k // 2 + 1, k))
    w = World(n, seed=draw(st.integers(0, 3)))
    cfg = w.config(
        bits=draw(st.sampled_from([1, 7, 16, 32, 63, 64])),
        length=draw(st.integers(1, 6)),
        degree=k,
        threshold=t,
        full_graph=full,
        round_id=draw(st.integers(0, 2**40)),
    )
    rate = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]))
    drops = {}
    for u in cfg.cohort:
        if draw(st.floats(0, 1)) < rate:
            drops[u] = draw(st.sampled_from(STAGES))
    return cfg, w, drops


def _secagg(cfg: RoundConfig, w: World, drops: dict[str, str],
            xs: dict[str, np.ndarray]) -> tuple[np.ndarray | None, tuple[str, ...], str | None]:
    server = w.server(cfg)
    try:
        total = run_round(server=server, clients=w.clients(cfg), inputs=xs,
                          dropouts={d: AS_SECAGG[s] for d, s in drops.items()})  # type: ignore[misc]
    except RoundFailed as e:
        return None, server.survivors, str(e)
    return total, server.survivors, None


def _plain(cfg: RoundConfig, drops: dict[str, str],
           xs: dict[str, np.ndarray]) -> tuple[np.ndarray | None, tuple[str, ...], str | None]:
    ps = PlainSum.for_config(cfg, vanished=drops)
    for d in ps.survivors:
        ps.add(d, xs[d])
    try:
        return ps.total(), ps.survivors, None
    except RoundFailed as e:
        assert ps.failed is not None and str(e).endswith(ps.failed)
        return None, ps.survivors, str(e)


@SETTINGS
@given(case=rounds(), seed=st.integers(0, 2**32))
def test_plain_sum_ends_the_round_as_secagg_does(
    case: tuple[RoundConfig, World, dict[str, str]], seed: int
) -> None:
    cfg, w, drops = case
    xs = random_inputs(cfg, seed)
    want_total, want_survivors, want_failed = _secagg(cfg, w, drops, xs)
    got_total, got_survivors, got_failed = _plain(cfg, drops, xs)
    assert got_failed == want_failed
    if want_failed is None:
        assert got_survivors == want_survivors
        assert got_total is not None and want_total is not None
        assert got_total.dtype == want_total.dtype
        np.testing.assert_array_equal(got_total, want_total)
        np.testing.assert_array_equal(
            got_total, ring_sum([xs[d] for d in got_survivors], cfg.bits, cfg.length))
        # a device that vanished before uploading is never in the sum
        assert not {d for d, s in drops.items() if s != "unmask"} & set(got_survivors)


def test_both_outcomes_occur_in_the_strategy() -> None:
    """The property above is not vacuous: the strategy yields rounds that succeed with
    dropouts and rounds that fail, at more than one stage."""
    seen: set[str] = set()

    @settings(max_examples=80, deadline=None, derandomize=True)
    @given(case=rounds())
    def collect(case: tuple[RoundConfig, World, dict[str, str]]) -> None:
        cfg, _, drops = case
        ps = PlainSum.for_config(cfg, vanished=drops)
        if ps.failed is None:
            seen.add("ok with dropouts" if drops else "ok")
        else:
            seen.add(ps.failed.split(" ")[0])  # "only", "survivor", "dropped", "no"

    collect()
    assert {"ok", "ok with dropouts", "only"} <= seen and len(seen) >= 4, seen


def _config(n: int = 6, **kw: object) -> tuple[RoundConfig, World]:
    w = World(n, seed=1)
    return w.config(bits=16, length=4, full_graph=True, **kw), w  # type: ignore[arg-type]


def test_no_dropouts_sums_everyone() -> None:
    cfg, _ = _config()
    xs = random_inputs(cfg, 7)
    ps = PlainSum.for_config(cfg, vanished={})
    assert ps.survivors == cfg.cohort and ps.failed is None
    for d in reversed(cfg.cohort):
        ps.add(d, xs[d])
    np.testing.assert_array_equal(ps.total(), ring_sum(list(xs.values()), cfg.bits, cfg.length))


def test_add_refuses_outsiders_twice_and_bad_values_and_keeps_the_sum() -> None:
    cfg, _ = _config()
    gone = cfg.cohort[0]
    ps = PlainSum.for_config(cfg, vanished={gone: "masked"})
    d = ps.survivors[0]
    ok = np.arange(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="'zz' is not a survivor"):
        ps.add("zz", ok)
    with pytest.raises(ValueError, match=f"'{gone}' is not a survivor"):
        ps.add(gone, ok)
    with pytest.raises(ValueError, match="must have 4 entries, got 3"):
        ps.add(d, ok[:3])
    with pytest.raises(ValueError, match=r"residues in \[0, 2\^16\), got 65536 at 2"):
        ps.add(d, np.array([0, 1, 1 << 16, 3], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"got -1 at 0"):
        ps.add(d, np.array([-1, 1, 2, 3]))
    with pytest.raises(ValueError, match="1-D integer array"):
        ps.add(d, ok.astype(np.float64))
    with pytest.raises(ValueError, match="1-D integer array"):
        ps.add(d, ok.reshape(2, 2))
    ps.add(d, ok)
    with pytest.raises(ValueError, match="already added"):
        ps.add(d, ok)
    with pytest.raises(LocalProtocolError, match="before the values of survivors"):
        ps.total()
    for u in ps.survivors[1:]:
        ps.add(u, np.zeros(4, dtype=np.uint64))
    np.testing.assert_array_equal(ps.total(), ok)  # the refused adds left nothing behind


def test_failure_is_secagg_servers_round_failed() -> None:
    cfg, _ = _config(n=5, threshold=3)  # k = 4, t = 3: two dropouts are too many
    ps = PlainSum.for_config(cfg, vanished={cfg.cohort[0]: "keys", cfg.cohort[1]: "keys"})
    assert ps.failed is not None and ps.survivors == ()
    with pytest.raises(RoundFailed, match=f"^round {cfg.round_id} failed: only 3 devices "
                                          "advertised keys"):
        ps.total()


def test_constructor_names_bad_arguments() -> None:
    cfg, _ = _config()
    g = cfg.graph()
    base = dict(round_id=1, cohort=cfg.cohort, graph=g, threshold=3, ring=Ring(bits=8),
                length=2, vanished={})
    PlainSum(**base)  # type: ignore[arg-type]
    for change, match in [
        ({"vanished": {"d00": "upload"}}, "vanish stages must be among"),
        ({"vanished": {"zz": "keys"}}, r"outside the cohort: \['zz'\]"),
        ({"cohort": cfg.cohort[:-1]}, "graph must have exactly the cohort's devices"),
        ({"cohort": (*cfg.cohort, cfg.cohort[0])}, "cohort must be distinct"),
        ({"threshold": 6}, r"threshold must be in \[1, 5\], got 6"),
        ({"length": 0}, "length must be >= 1"),
        ({"round_id": -1}, "round_id must be >= 0"),
        ({"ring": 8}, "ring must be a Ring"),
    ]:
        with pytest.raises(ValueError, match=match):
            PlainSum(**{**base, **change})  # type: ignore[arg-type]
    w = World(4, seed=0)
    with pytest.raises(ValueError, match="amortized"):
        PlainSum.for_config(w.config(amortized=True, full_graph=True), vanished={})


def test_answered_counts_what_the_round_machine_judges_at_each_stage() -> None:
    """Per stage the round reaches: who answered among those the aggregator still asked
    (the last stage's survivors), what ``round_core.short_of_survivors`` compares with
    min_survivors; a stage the round never opens is not listed."""
    cfg, _ = _config()
    d = cfg.cohort
    ps = PlainSum.for_config(cfg, vanished={d[0]: "keys", d[1]: "shares"})
    assert ps.failed is None and ps.survivors == (d[2], d[3], d[4], d[5])
    assert ps.answered == (("collect_keys", 5, 6), ("collect_shares", 4, 5),
                           ("collect_masked", 4, 4))
    ps = PlainSum.for_config(cfg, vanished={d[0]: "masked"})
    assert ps.answered == (("collect_keys", 6, 6), ("collect_shares", 6, 6),
                           ("collect_masked", 5, 6))
    # too few advertise: the round fails closing the key stage, the rest never opens
    gone = {u: "keys" for u in d[: 6 - cfg.threshold]}
    ps = PlainSum.for_config(cfg, vanished=gone)
    assert ps.failed is not None and ps.failed.startswith("only")
    assert ps.answered == (("collect_keys", cfg.threshold, 6),)
