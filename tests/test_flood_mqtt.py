"""One device floods, the fleet's round goes on (issue 13, "What it must show").

A real mosquitto set up as ``fedge enroll`` sets it up (TLS, per-device passwords, ACLs),
the real ``fedge aggregator`` process, six in-process devices. Round 1 is held in
collect_unmask (the devices freeze on their unmask requests); then dev-0005's own
credentials replay its captured upload chunk 50,000 times at QoS 1 with the real
``mosquitto_pub``, and the honest devices answer while the flood runs. The round must
complete with an exact sum, mosquitto must drop nothing queued for the aggregator (so every
honest answer arrived), the flooding device must be named (log line and metric), and the
aggregator's peak RSS must stay within a bound of its size before the flood.
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_services import MODEL, POLICY, Freezer, FrozenFleet, pump_until

from edge_sdk.engine import load_engine
from edge_sdk.session import DeviceSession
from edge_sdk.wire import Publish
from models import ONNX_DIR
from tools.datasets import load_dataset

pytestmark = pytest.mark.broker

FLOOD = 50_000  # more than the aggregator's queue holds (tools.broker: 1,000 + 20,000 here)
RSS_BOUND_MIB = 100  # peak growth allowed over the RSS before the flood


class _Recording(Freezer):
    """A freezer that keeps what its device sent (the flood replays a real upload chunk)."""

    def __init__(self, session: DeviceSession) -> None:
        super().__init__(session)
        self.sent: list[Publish] = []

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        out = super().on_message(topic, payload, now)
        self.sent += out
        return out

    def on_tick(self, now: float) -> list[Publish]:
        out = super().on_tick(now)
        self.sent += out
        return out


class FloodFleet(FrozenFleet):
    def wrap(self, name: str, session: DeviceSession) -> Any:
        self.freezers = getattr(self, "freezers", {})
        self.freezers[name] = _Recording(session)
        return self.freezers[name]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[FloodFleet]:
    f = FloodFleet(tmp_path, load_dataset("digits"), load_engine(ONNX_DIR / f"{MODEL}.json"),
                   devices=6, in_process=6,
                   policy={**POLICY, "cohort_size": 6, "min_cohort": 6, "max_rounds": 1,
                           "stage_timeout": 20.0})
    yield f
    f.close()


def _rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def test_one_device_flooding_50000_messages_does_not_fail_the_round(
        fleet: FloodFleet) -> None:
    f = fleet
    flooder = f.names[-1]
    f.freeze_on("collect_unmask")
    # no --exit-when-done: the aggregator stays through the whole flood (an aggregator
    # gone would leave its session to queue, and drop, the rest of the flood)
    agg = f.start_aggregator()
    start = f.wait_line(agg, lambda e: e["event"] == "start", 30, "the aggregator")
    f.wait_line(agg, lambda e: e["event"] == "stage" and e["stage"] == "collect_unmask", 60,
                "round 1's unmask stage")
    chunk = next(p for p in reversed(f.freezers[flooder].sent)
                 if p.topic.endswith("/up/masked_part"))
    f.loop.remove(flooder, timeout=2.0)  # the attacker now holds its credentials
    rss_before = _rss_kib(agg.p.pid)
    path = f.tmp / "chunk.bin"
    path.write_bytes(chunk.payload)
    c = f.broker.config
    t0 = time.monotonic()
    pub = subprocess.Popen(
        ["mosquitto_pub", "-h", c.host, "-p", str(c.port), "--cafile", str(c.ca_file),
         "-u", flooder, "-P", c.password(flooder), "-i", flooder, "-V", "mqttv5", "-q", "1",
         "-t", chunk.topic, "-f", str(path), "--repeat", str(FLOOD), "--repeat-delay", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # the honest devices answer only once the flood has filled the aggregator's queue
        # (unprotected, its first 1,000 messages reach it) or it has been quarantined
        seen = [0]

        def flooded(e: dict[str, Any]) -> bool:
            seen[0] += e.get("topic") == chunk.topic
            return e["event"] == "quarantined" or seen[0] >= 1000

        first = f.wait_line(agg, flooded, 60, "the flood at the aggregator")
        metric = (_metric(f"http://127.0.0.1:{start['metrics_port']}/metrics",
                          f'fedge_aggregator_quarantined_total{{device="{flooder}"}}')
                  if first["event"] == "quarantined" else "")
        f.freeze_on(None)
        pump_until(f.loop, lambda: pub.poll() is not None, 120, f.procs, "the flood's end")
        flood_s = time.monotonic() - t0
        assert pub.returncode == 0, pub.stderr.read() if pub.stderr else ""
        f.wait_line(agg, lambda e: e["event"] == "round_end", 120, "round 1's end")
        agg.signal(signal.SIGTERM)
    finally:
        if pub.poll() is None:
            pub.kill()
        pub.wait()
        if pub.stderr:
            pub.stderr.close()
    assert agg.wait() == 0
    broker_log = c.log_file.read_text(errors="replace")
    drops = broker_log.count("Outgoing messages are being dropped for client aggregator")
    ends = [e for e in agg.lines if e["event"] == "round_end"]
    named = [e for e in agg.lines if e["event"] == "quarantined"]
    rejected = [e for e in agg.lines if e["event"] in ("rejected", "duplicate")]
    stop = [e for e in agg.lines if e["event"] == "stop"]
    peak = (stop[-1].get("max_rss_kib") or 0) if stop else 0
    print(f"\nflood of {FLOOD} in {flood_s:.1f} s; rounds {[e['completed'] for e in ends]}; "
          f"broker drop lines for the aggregator {drops}; rejected/duplicate lines "
          f"{len(rejected)}; quarantined {[(e['device'], e['round']) for e in named]}; "
          f"released {[e['dropped'] for e in agg.lines if e['event'] == 'released']}; "
          f"RSS before {rss_before['VmRSS']} KiB, peak {peak} KiB; log lines {len(agg.lines)}")
    m = f.machine()
    assert [(o.round_id, o.completed) for o in m.history] == [(1, True)], ends
    assert set(m.history[0].survivors) == set(f.names)  # the flooder had uploaded
    f.check_sums(m)
    assert drops == 0, "mosquitto dropped messages queued for the aggregator"
    # named: quarantined in round 1 (again after its release if the flood outlasted it),
    # in the log and in the metrics
    assert {e["device"] for e in named} == {flooder}
    assert named[0]["round"] == 1 and first["event"] == "quarantined"
    assert metric.endswith(" 1.0"), metric
    # the log is not the flood's echo: a few lines per key, then counted summaries
    assert len(rejected) < 100, len(rejected)
    assert sum(e["count"] for e in agg.lines if e["event"] == "suppressed") > 0
    # bounded memory: the peak the process reported at its exit vs its size before
    assert peak > 0 and peak - rss_before["VmRSS"] < RSS_BOUND_MIB * 1024, (rss_before, peak)


def _metric(url: str, name: str) -> str:
    return next((line for line in urllib.request.urlopen(url, timeout=5).read().decode()
                 .splitlines() if line.startswith(name)), "")
