"""The Grafana dashboard (deploy/grafana/fedge-aggregator.json) and the metric names of the
README (issue 20): the JSON has a dashboard's shape, every PromQL query names only metrics
the aggregator exports, every exported metric is in the README's table with its type, and a
live aggregator over a real mosquitto serves every metric the dashboard uses."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_services import POLICY, ServiceFleet, engine, make_fleet, pump_until  # noqa: F401

from aggregator.service import _Metrics

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "fedge-aggregator.json"

# The sample names each family type exposes (prometheus-client's text format).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}
# PromQL words that look like names but are not metrics.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset", "inf", "nan"}


def _families() -> dict[str, str]:
    """Family name (counters without ``_total``) -> type, from the aggregator's registry."""
    return {m.name: m.type for m in _Metrics().registry.collect()}


def _exported() -> set[str]:
    return {name + s for name, kind in _families().items() for s in SUFFIXES[kind]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: every identifier that is not a function
    (followed by "("), a keyword, a label (inside {...}, by/without (...)), a range or a
    string."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries ($__rate_interval)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = m.group(), e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in KEYWORDS:
            continue
        if re.fullmatch(r"\d", e[m.start() - 1:m.start()] or "x"):  # 1e5's "e5"
            continue
        names.add(word)
    return names


def test_metric_names_parser() -> None:
    assert metric_names('sum by (le, stage) (rate(a_bucket{x=~"b|c"}[$__rate_interval]))'
                        ' / on (stage) b_count offset 5m > 1e5') == {"a_bucket", "b_count"}
    assert metric_names("histogram_quantile(0.95, x) + clamp_min(y, 2) or vector(1)") == {
        "x", "y"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets(dash: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield p["title"], t


def dashboard_metrics(dash: dict[str, Any]) -> set[str]:
    names = set()
    for _, t in _targets(dash):
        names |= metric_names(t["expr"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert q, var
            names.add(q.group(1))
    return names


def test_dashboard_has_grafanas_shape() -> None:
    dash = _dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    assert isinstance(dash["panels"], list) and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["type"] in {"stat", "timeseries"}, p["type"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + \
            p["gridPos"]["w"] <= 24, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["expr"].count("(") == t["expr"].count(")"), t
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_query_names_only_exported_metrics_and_uses_them_all() -> None:
    exported = _exported()
    used = dashboard_metrics(_dashboard())
    assert used and used <= exported, sorted(used - exported)
    # every family is on the dashboard (``_created`` timestamps aside)
    missing = sorted(f for f, kind in _families().items()
                     if not {f + s for s in SUFFIXES[kind] if s != "_created"} & used)
    assert not missing, missing


def test_readme_documents_every_metric_with_its_type() -> None:
    rows = re.findall(r"^\| `(fedge_aggregator_\w+)` \| (\w+) \| ([^|]*) \| ([^|]+) \|",
                      (REPO / "README.md").read_text(), flags=re.M)
    documented = {name: kind for name, kind, _labels, meaning in rows if meaning.strip()}
    # the README names what a scrape shows: a counter as its _total sample
    want = {name + ("_total" if kind == "counter" else ""): kind
            for name, kind in _families().items()}
    assert documented == want


def _scraped(text: str) -> tuple[set[str], set[str]]:
    """(sample names with a value, names a ``# TYPE`` line declares) of an exposition."""
    samples, declared = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            declared |= {name} if kind in ("counter", "gauge") else {
                name + s for s in SUFFIXES[kind]}
        elif line and not line.startswith("#"):
            samples.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group())  # type: ignore[union-attr]
    return samples, declared


@pytest.mark.broker
def test_live_aggregator_serves_every_metric_the_dashboard_uses(
        make_fleet: Callable[..., ServiceFleet]) -> None:  # noqa: F811
    f = make_fleet(devices=3, in_process=3, policy={**POLICY, "cohort_size": 3})
    agg = f.start_aggregator()
    start = f.wait_line(agg, lambda e: e["event"] == "start", 30, "the aggregator")
    f.wait_line(agg, lambda e: e["event"] == "round_end" and e["completed"], 180,
                "a completed round")
    url = f"http://127.0.0.1:{start['metrics_port']}/metrics"
    used = dashboard_metrics(_dashboard())
    # the round's last gauges are set with its round_end line; scrape until they show
    pump_until(f.loop, lambda: "fedge_aggregator_last_round_survivors 3.0" in
               urllib.request.urlopen(url, timeout=5).read().decode(), 30, f.procs,
               "the last round's gauges")
    samples, declared = _scraped(urllib.request.urlopen(url, timeout=5).read().decode())
    assert used <= samples | declared, sorted(used - samples - declared)
    # after a completed round only the flood guard's per-device counters have no sample
    # (no device flooded; they are declared and get one per quarantined device)
    assert sorted(used - samples) == ["fedge_aggregator_flood_dropped_messages_total",
                                      "fedge_aggregator_quarantined_total"]
