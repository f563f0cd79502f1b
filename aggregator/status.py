"""The aggregator's live status page: what the fleet is doing, from the round machine's events.

:class:`StatusBoard` is fed the :class:`~aggregator.rounds.RoundMachine`'s events (the same
values the service logs, ``RoundMachine.take_events``) and gives a :class:`Snapshot` of
them; :func:`snapshot_json` is that snapshot as the JSON ``/status.json`` serves and
:data:`PAGE` the page at ``/status`` that polls it (plain HTML with inline JS, no build
step). :func:`serve_http` is the aggregator's one HTTP server: ``/metrics`` (Prometheus
text), ``/status`` and ``/status.json``, read-only (GET and HEAD only), on the metrics
address (``[metrics] host``, loopback by default), so whatever guards the metrics endpoint
when it is exposed guards the page too.

What the page shows and where each figure comes from:

* the open round, its stage (and since when), its cohort, who declined; the last
  ``max_rounds`` rounds' outcomes (cohort, survivors, declined, dropped, bytes, duration);
* bytes received and sent (payload bytes, the service's counters, as in the metrics);
* devices seen (``max_devices`` most recently seen are kept; an enrolled fleet bounds
  them anyway) and when: the last status-topic message (``StatusSeen``) and the last
  accepted check-in (``CheckInSeen``);
* each device's privacy spend against its budget, local epsilon (nats, zero-out adjacency,
  the ledger's unit) at the budget's delta, *as reported by the device* in its last signed
  check-in (``CheckIn.spent_epsilon``, ``budget_epsilon``, ``budget_delta``: its ledger's
  ``spent().local_epsilon`` and ``budget``), with a bar of spent / budget, and the
  remaining epsilon it reported (``remaining()``). The aggregator cannot check them: they
  are the device's statements (its ledger, ``fedge ledger show``, is the record). A spend
  the device could not read is shown as not reported, never as zero;
* accuracy per round: only when the aggregator has an evaluation set of its own
  (``[evaluation] data``, ``aggregator.evaluation``; never a device's data): each completed
  round's new global model, its accuracy and mean cross-entropy (the service's
  :meth:`StatusBoard.evaluated`). Without one ``evaluation`` is None and the page says that
  accuracy is not measured here.

Everything a device controls (names, status payloads) reaches the page as JSON and is put
into the document with ``textContent`` only, never parsed as HTML; the page's Content
Security Policy allows no script but its own inline one (by hash) and no other origin.

The board is thread-safe (the service feeds it on its MQTT loop; the HTTP server thread
takes snapshots) and its memory is bounded by ``max_devices`` and ``max_rounds``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import socket
import socketserver
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from aggregator.rounds import (
    CheckInSeen,
    Declined,
    Event,
    Quarantined,
    Released,
    RoundEnded,
    RoundStarted,
    StageChanged,
    StatusSeen,
)

__all__ = ["PAGE", "DeviceView", "RoundView", "Snapshot", "StatusBoard", "serve_http",
           "snapshot_json"]

COHORT_SHOWN = 64  # cohort names listed on the page (the size is always given)
DEVICES_SHOWN = 500  # devices listed, most recently seen first (the count is always given)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceView:
    """One device as the aggregator last saw it (times: Unix seconds; None: never).

    Attributes:
        device: its name. status / status_at: its last status-topic payload (what the
            device or its broker will sent, e.g. ``online``) and when.
        checkin_at: its last accepted check-in; remaining_epsilon, spent_epsilon,
            budget_epsilon, budget_delta, data_size, model_version: what that check-in
            reported (None before one; spent_epsilon also None when the device could not
            read its ledger). Epsilon: local, nats, zero-out adjacency, at budget_delta.
        quarantined: its messages are being dropped (flood guard).
        last_round: the last round whose cohort it was in; last_uploaded: the last round
            whose upload from it was accepted (it spent budget on that round).
        seen_at: the latest of its times.
    """

    device: str
    status: str | None = None
    status_at: float | None = None
    checkin_at: float | None = None
    remaining_epsilon: float | None = None
    spent_epsilon: float | None = None
    budget_epsilon: float | None = None
    budget_delta: float | None = None
    data_size: int | None = None
    model_version: int | None = None
    quarantined: bool = False
    last_round: int | None = None
    last_uploaded: int | None = None
    seen_at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundView:
    """One ended round (bytes: payload bytes during it; duration_s, ended_at: seconds;
    accuracy in [0, 1] and loss, mean cross-entropy in nats, of its new model on the
    aggregator's evaluation set: None when there is none, the round failed or the loss is
    not finite)."""

    round_id: int
    completed: bool
    cohort: int
    survivors: int
    declined: int
    dropped: int
    uploaded: int
    bytes_in: int
    bytes_out: int
    duration_s: float
    ended_at: float
    model_version: int
    detail: str
    accuracy: float | None = None
    loss: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The page's content at ``at`` (Unix seconds).

    Attributes:
        round_id: the open round (None: idle); stage, stage_since: ``RoundMachine.stage``
            and since when (None: not seen since this process started).
        cohort: the open round's cohort (first ``COHORT_SHOWN`` names); cohort_size: all
            of it; declined: its members that declined.
        model_version: the global model's version (as of the last round event).
        bytes_in, bytes_out: payload bytes received and sent since the service started.
        rounds: the last rounds, newest first.
        devices: the ``DEVICES_SHOWN`` devices seen most recently, most recent first;
            devices_seen: how many devices the board holds; devices_forgotten: devices
            dropped from the board to bound its memory (least recently seen first).
        evaluation: the evaluation set's file (None: the aggregator has none, so no
            accuracy is measured).
    """

    at: float
    fleet: str
    round_id: int | None
    stage: str
    stage_since: float | None
    cohort: tuple[str, ...]
    cohort_size: int
    declined: tuple[str, ...]
    model_version: int
    bytes_in: int
    bytes_out: int
    rounds: tuple[RoundView, ...]
    devices: tuple[DeviceView, ...]
    devices_seen: int
    devices_forgotten: int
    evaluation: str | None


class StatusBoard:
    """What the status page shows, built from round-machine events (see the module).

    Args:
        fleet: the fleet's name; stage, model_version: the machine's when the board starts
            (a resumed service starts mid-round).
        max_devices: devices kept (least recently seen forgotten first); max_rounds: ended
            rounds kept. evaluation: the aggregator's evaluation set (its file; None: none).
    """

    def __init__(self, *, fleet: str, stage: str = "idle", round_id: int | None = None,
                 model_version: int = 0, max_devices: int = 10_000,
                 max_rounds: int = 50, evaluation: str | None = None) -> None:
        if not (isinstance(max_devices, int) and max_devices >= 1):
            raise ValueError(f"max_devices must be an int >= 1, got {max_devices!r}")
        if not (isinstance(max_rounds, int) and max_rounds >= 1):
            raise ValueError(f"max_rounds must be an int >= 1, got {max_rounds!r}")
        self._lock = threading.Lock()
        self._fleet = fleet
        self._stage, self._round_id, self._version = stage, round_id, model_version
        self._stage_since: float | None = None
        self._cohort: tuple[str, ...] = ()
        self._declined: list[str] = []
        self._round_start: tuple[float, int, int] | None = None  # at, bytes_in, bytes_out
        self._rounds: deque[RoundView] = deque(maxlen=max_rounds)
        self._devices: OrderedDict[str, DeviceView] = OrderedDict()
        self._max_devices = max_devices
        self._forgotten = 0
        self._evaluation = evaluation

    def feed(self, events: Iterable[Event], *, at: float, bytes_in: int,
             bytes_out: int) -> None:
        """Take ``events`` (oldest first) that happened at ``at`` (Unix seconds), when the
        service's payload byte counters stood at ``bytes_in``/``bytes_out`` (the bytes a
        round's first call sends count in that round: pass them not yet counted)."""
        with self._lock:
            for ev in events:
                self._feed(ev, at, bytes_in, bytes_out)

    def _feed(self, ev: Event, at: float, bytes_in: int, bytes_out: int) -> None:
        if isinstance(ev, StatusSeen):
            self._device(ev.device, at, status=ev.status, status_at=at)
        elif isinstance(ev, CheckInSeen):
            self._device(ev.device, at, checkin_at=at,
                         remaining_epsilon=_finite(ev.remaining_epsilon),
                         spent_epsilon=_finite(ev.spent_epsilon),
                         budget_epsilon=_finite(ev.budget_epsilon),
                         budget_delta=_finite(ev.budget_delta),
                         data_size=ev.data_size, model_version=ev.model_version)
        elif isinstance(ev, Quarantined):
            self._device(ev.device, at, quarantined=True)
        elif isinstance(ev, Released):
            self._device(ev.device, at, quarantined=False)
        elif isinstance(ev, Declined):
            if ev.device not in self._declined:
                self._declined.append(ev.device)
        elif isinstance(ev, RoundStarted):
            self._round_id, self._version = ev.round_id, ev.model_version
            self._cohort, self._declined = ev.cohort, []
            self._round_start = (at, bytes_in, bytes_out)
            for d in ev.cohort:
                self._device(d, None, last_round=ev.round_id)
        elif isinstance(ev, StageChanged):
            self._stage, self._stage_since = ev.stage, at
            self._round_id = None if ev.stage == "idle" else ev.round_id
        elif isinstance(ev, RoundEnded):
            o = ev.outcome
            start = self._round_start or (at, bytes_in, bytes_out)
            survivors, declined = len(o.survivors), len(ev.declined)
            self._rounds.appendleft(RoundView(
                round_id=o.round_id, completed=o.completed, cohort=len(ev.cohort),
                survivors=survivors, declined=declined,
                dropped=max(0, len(ev.cohort) - survivors - declined),
                uploaded=len(o.uploaded), bytes_in=bytes_in - start[1],
                bytes_out=bytes_out - start[2], duration_s=round(at - start[0], 3),
                ended_at=at, model_version=o.model_version, detail=o.detail))
            self._version, self._cohort, self._declined = o.model_version, (), []
            self._round_start = None
            for d in o.uploaded:
                self._device(d, None, last_uploaded=o.round_id)

    def evaluated(self, round_id: int, *, accuracy: float, loss: float | None) -> None:
        """Round ``round_id``'s new model scored ``accuracy`` (in [0, 1]) and mean
        cross-entropy ``loss`` (nats) on the evaluation set; a round no longer (or not yet)
        on the board is ignored."""
        if not (isinstance(accuracy, float) and 0.0 <= accuracy <= 1.0):
            raise ValueError(f"accuracy must be a float in [0, 1], got {accuracy!r}")
        if self._evaluation is None:
            raise ValueError("this board has no evaluation set; nothing can be evaluated")
        with self._lock:
            for i, r in enumerate(self._rounds):
                if r.round_id == round_id:
                    self._rounds[i] = replace(r, accuracy=accuracy, loss=_finite(loss))
                    return

    def _device(self, name: str, at: float | None, **changes: Any) -> None:
        """Update a device (``at``: it was seen then; None: news about it, not from it)."""
        old = self._devices.pop(name, None)
        if old is None:
            if at is None:
                return  # only devices that were seen are listed
            old = DeviceView(device=name)
        if at is not None:
            changes["seen_at"] = at
        self._devices[name] = replace(old, **changes)  # most recently touched last
        while len(self._devices) > self._max_devices:
            self._devices.popitem(last=False)
            self._forgotten += 1

    def snapshot(self, *, at: float, bytes_in: int, bytes_out: int) -> Snapshot:
        """The board at ``at`` with the service's byte counters now."""
        with self._lock:
            devices = sorted(self._devices.values(),
                             key=lambda d: (-d.seen_at, d.device))[:DEVICES_SHOWN]
            return Snapshot(
                at=at, fleet=self._fleet, round_id=self._round_id, stage=self._stage,
                stage_since=self._stage_since, cohort=self._cohort[:COHORT_SHOWN],
                cohort_size=len(self._cohort), declined=tuple(self._declined),
                model_version=self._version, bytes_in=bytes_in, bytes_out=bytes_out,
                rounds=tuple(self._rounds), devices=tuple(devices),
                devices_seen=len(self._devices), devices_forgotten=self._forgotten,
                evaluation=self._evaluation)


def _finite(x: float | None) -> float | None:
    """``x`` when it is a finite figure, else None (not reported: strict JSON has no inf,
    and the wire never lets one through anyway)."""
    return x if x is not None and math.isfinite(x) else None


def snapshot_json(snap: Snapshot) -> bytes:
    """``snap`` as the UTF-8 JSON ``/status.json`` serves (no NaN: strict JSON)."""
    return json.dumps(asdict(snap), allow_nan=False, separators=(",", ":")).encode()


# ----------------------------------------------------------------------- the page

_SCRIPT = r"""
"use strict";
const $ = (id) => document.getElementById(id);
function el(tag, text, cls) {  // text only: device-controlled strings are never HTML
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function ago(t, now) {
  if (t === null || t === undefined) return "never";
  const s = Math.max(0, now - t);
  if (s < 120) return s.toFixed(1) + " s ago";
  if (s < 7200) return (s / 60).toFixed(1) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}
function rows(body, items, cells) {
  const tb = $(body);
  tb.replaceChildren();
  for (const it of items) {
    const tr = document.createElement("tr");
    for (const [content, cls] of cells(it)) {  // text, or a node built with el()
      const node = content instanceof Node;
      const td = el("td", node ? undefined : content, cls);
      if (node) td.appendChild(content);
      tr.appendChild(td);
    }
    tb.appendChild(tr);
  }
}
function spend(d) {  // spent / budget (epsilon at delta) and a bar of spent / budget
  const box = el("span", undefined, "spend");
  if (d.spent_epsilon === null || d.budget_epsilon === null) {
    box.appendChild(el("span", "not reported", "spent"));
    return box;
  }
  const frac = d.spent_epsilon / d.budget_epsilon;
  const bar = el("span", undefined, "bar" + (frac >= 1 ? " full" : ""));
  const fill = el("span", undefined, "fill");
  fill.style.width = (100 * Math.min(1, Math.max(0, frac))).toFixed(1) + "%";
  bar.appendChild(fill);
  bar.title = (100 * frac).toFixed(1) + "% of the budget spent";
  box.append(el("span", d.spent_epsilon.toFixed(4), "spent"), " / ",
             el("span", d.budget_epsilon.toFixed(4), "budget"),
             " (\u03b5 at \u03b4 = ", el("span", d.budget_delta.toExponential(1), "delta"),
             ")", bar);  // the bar keeps its distance by its margin
  return box;
}
function render(s) {
  $("fleet").textContent = s.fleet;
  $("round").textContent = s.round_id === null ? "none open" : String(s.round_id);
  $("stage").textContent = s.stage;
  $("stage-since").textContent = ago(s.stage_since, s.at);
  $("model-version").textContent = String(s.model_version);
  $("cohort").textContent = s.cohort_size === 0 ? "none (no round open)" :
      s.cohort_size + (s.cohort_size === 1 ? " device: " : " devices: ") + s.cohort.join(", ") +
      (s.cohort_size > s.cohort.length ? " and " + (s.cohort_size - s.cohort.length) +
       " more" : "");
  $("declined").textContent = s.declined.length ? s.declined.join(", ") : "none";
  $("bytes-in").textContent = bytes(s.bytes_in);
  $("bytes-out").textContent = bytes(s.bytes_out);
  const last = s.rounds.length ? s.rounds[0] : null;
  $("last-round").textContent = last === null ? "none yet" : String(last.round_id);
  $("survivors").textContent = last === null ? "-" :
      last.survivors + " of " + last.cohort + (last.completed ? "" : " (failed)");
  $("evaluation").textContent = s.evaluation === null ?
      "No evaluation set is configured on this aggregator: accuracy per round is not " +
      "measured here." : "Accuracy: each completed round's new model on the aggregator's " +
      "own evaluation set (not devices' data), " + s.evaluation;
  rows("rounds", s.rounds, (r) => [
    [r.round_id], [r.completed ? "completed" : "failed: " + r.detail,
                   r.completed ? "ok" : "bad"],
    [r.cohort], [r.survivors], [r.declined], [r.dropped], [bytes(r.bytes_in)],
    [bytes(r.bytes_out)], [r.duration_s.toFixed(1) + " s"], [ago(r.ended_at, s.at)],
    [r.accuracy === null ? "-" : (100 * r.accuracy).toFixed(1) + "%", "acc"],
    [r.loss === null ? "-" : r.loss.toFixed(3), "loss"]]);
  rows("devices", s.devices, (d) => [
    [d.device, "name"], [d.status === null ? "-" : d.status], [ago(d.status_at, s.at)],
    [ago(d.checkin_at, s.at)], [spend(d), "eps"],
    [d.remaining_epsilon === null ? "not reported" : d.remaining_epsilon.toFixed(4), "eps"],
    [d.data_size === null ? "-" : d.data_size], [d.model_version === null ? "-" :
                                                 d.model_version],
    [d.last_round === null ? "-" : d.last_round],
    [d.last_uploaded === null ? "-" : d.last_uploaded],
    [d.quarantined ? "quarantined" : "", d.quarantined ? "bad" : ""]]);
  const total = s.devices_seen + s.devices_forgotten;
  $("forgotten").textContent = total > s.devices.length ? total + " devices seen; the " +
      s.devices.length + " seen most recently are listed." : "";
  $("updated").textContent = new Date(s.at * 1000).toISOString();
  $("error").textContent = "";
}
async function poll() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    $("error").textContent = "cannot reach the aggregator: " + e.message;
  }
  setTimeout(poll, 1500);
}
poll();
"""

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .3em; } h2 { font-size: 1.1em; margin: 1.2em 0 .3em; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; margin: 0; }
dt { color: #666; } dd { margin: 0; font-weight: 600; }
table { border-collapse: collapse; } td, th { padding: .15em .6em; text-align: right; }
th { background: #eee; } tr:nth-child(even) td { background: #f7f7f7; }
td.name { text-align: left; font-family: monospace; white-space: nowrap; }
td.eps { white-space: nowrap; } .ok { color: #070; }
.bad { color: #a00; } .note { color: #666; font-size: .9em; } #error { color: #a00; }
.bar { display: inline-block; width: 8em; height: .8em; background: #ddd;
       vertical-align: middle; margin-left: .4em; } .bar .fill { display: block;
       height: 100%; background: #37a; } .bar.full .fill { background: #a00; }
"""


def _page() -> tuple[bytes, str]:
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
           "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    html = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fedge aggregator status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_CSS}</style></head>
<body>
<h1>fedge aggregator: fleet <span id="fleet">?</span></h1>
<p class="note">Read-only; refreshed every 1.5 s from <a href="status.json">status.json</a>
(Prometheus metrics: <a href="metrics">metrics</a>). Updated <span id="updated">never</span>.
<span id="error"></span></p>
<h2>Now</h2>
<dl>
<dt>Open round</dt><dd id="round">?</dd>
<dt>Stage</dt><dd><span id="stage">?</span> (since <span id="stage-since">?</span>)</dd>
<dt>Cohort</dt><dd id="cohort">?</dd>
<dt>Declined</dt><dd id="declined">?</dd>
<dt>Model version</dt><dd id="model-version">?</dd>
<dt>Last ended round</dt><dd id="last-round">?</dd>
<dt>Its survivors</dt><dd id="survivors">?</dd>
<dt>Bytes received</dt><dd id="bytes-in">?</dd>
<dt>Bytes sent</dt><dd id="bytes-out">?</dd>
</dl>
<h2>Rounds</h2>
<p id="evaluation" class="note"></p>
<table><thead><tr><th>round</th><th>result</th><th>cohort</th><th>survivors</th>
<th>declined</th><th>dropped</th><th>bytes in</th><th>bytes out</th><th>duration</th>
<th>ended</th><th>accuracy</th><th>loss (nats)</th></tr></thead><tbody id="rounds"></tbody>
</table>
<h2>Devices</h2>
<p class="note">Privacy spend against budget: local &epsilon; (nats, zero-out adjacency) at
the budget's &delta;, spent / budget, from the device's ledger <b>as reported by the
device</b> in its last signed check-in; the aggregator cannot verify it (the device's
ledger is the record: <code>fedge ledger show</code>). <span id="forgotten"></span></p>
<table><thead><tr><th>device</th><th>status</th><th>status seen</th><th>last check-in</th>
<th>&epsilon; spent / budget (&epsilon; at &delta;), reported by the device</th>
<th>&epsilon; remaining</th><th>samples</th><th>model</th>
<th>last cohort</th><th>last upload</th><th></th></tr></thead><tbody id="devices"></tbody>
</table>
<script>{_SCRIPT}</script>
</body></html>
"""
    return html.encode(), csp


PAGE, _CSP = _page()


# ----------------------------------------------------------------------- serving


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # requests are not the service's log


def _app(metrics: Callable[..., Any], status: Callable[[], bytes]) -> Callable[..., Any]:
    headers = [("X-Content-Type-Options", "nosniff"), ("Cache-Control", "no-store")]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), *headers])
            return [b""]
        if path in ("/status", "/status/"):
            if path == "/status/":  # relative links (status.json) resolve from /status
                start_response("301 Moved Permanently", [("Location", "/status"), *headers])
                return [b""]
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                                      ("Content-Security-Policy", _CSP),
                                      ("X-Frame-Options", "DENY"), *headers])
            return [b"" if method == "HEAD" else PAGE]
        if path == "/status.json":
            body = status()
            start_response("200 OK", [("Content-Type", "application/json"), *headers])
            return [b"" if method == "HEAD" else body]
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


def serve_http(host: str, port: int, *, registry: Any,
               status: Callable[[], bytes]) -> WSGIServer:
    """Serve ``/metrics`` (and every other path: prometheus-client's exposition of
    ``registry``), ``/status`` and ``/status.json`` (``status()``'s bytes) on
    ``host:port`` (0: a free port) from a daemon thread; ``shutdown()`` and
    ``server_close()`` the result to stop. Raises OSError when the address is unusable."""
    from prometheus_client import make_wsgi_app

    class Server(_Server):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, _app(make_wsgi_app(registry), status), Server,
                        handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True,
                     name="fedge-http").start()
    return httpd
