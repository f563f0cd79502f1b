"""Isolation between devices at the aggregator, sans-I/O: flood limits and a bounded log.

Issue 13: one device's credentials replayed a captured upload chunk 20,000 times at QoS 1;
mosquitto's queue for the aggregator's single session (1,000 messages) overflowed and
dropped honest devices' answers with the flood, and the rejection log grew 0.5-0.8 MB/s.

What was weighed (numbers from ``tests/test_flood_mqtt.py`` and the report of issue 13):

* **Quotas at the broker.** mosquitto 2.0 has no per-client publish rate or quota;
  ``max_inflight_messages`` only bounds unacknowledged messages and the broker acknowledges
  at once, ``max_connections`` is per listener, ``max_packet_size`` bounds one message. The
  one per-device control the broker does enforce is routing: a message no subscription
  matches is discarded on arrival. So the aggregator subscribes per device
  (``fedge/<fleet>/dev/<device>/up/+`` and ``.../status/<device>``) and *unsubscribes a
  flooding device*: from then on mosquitto throws its traffic away before any queue.
* **Sharded aggregator sessions.** With ``use_username_as_clientid`` every session of the
  aggregator user is one client id, so shards need one broker user per shard, and a shard's
  honest devices still share their queue with a flooder; unsubscribing isolates per device.
* **``max_queued_bytes`` instead of ``max_queued_messages``.** A byte bound is what protects
  the broker's memory, but the queue stays shared: a bigger queue only moves the point
  where honest messages are dropped. It is used for headroom, not for isolation
  (``tools.broker.write_broker_config``): the queue must hold what arrives between the
  flood's start and the unsubscribe taking effect.
* **Draining fast and dropping early** (:class:`FloodGuard`): each enrolled device has a
  token bucket (``burst`` tokens, refilled at ``rate`` per second, on the clock the
  machine is driven with, so deterministic; a message takes 1 token plus 1 per MiB). A
  device that empties it is quarantined for the round (``aggregator.rounds``): named once
  in the log and metrics, its further messages dropped before any decoding (a dictionary
  lookup each), its place in the round treated as a dropout that secure aggregation
  recovers, its subscriptions removed.
  A well-behaved device sends a handful of messages per round (check-ins, one answer per
  stage, its upload chunks, the answers to re-sent requests), far below the defaults.
* **The rejection log** (:class:`LogLimiter`): at most ``per_key`` lines per (device,
  reason) per ``interval_s``; the rest are counted and summarized in one line per key and
  interval, so a fuzzing device cannot turn the log into the disk-filling attack.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["FloodGuard", "FloodLimits", "LogLimiter", "Suppressed", "cost", "reason_class"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FloodLimits:
    """Per-device message limits of the aggregator (validated on construction).

    Attributes:
        burst: messages a device may send at once (the bucket's size).
        rate: messages per second the bucket refills.
    """

    burst: int = 200
    rate: float = 20.0

    def __post_init__(self) -> None:
        if not (isinstance(self.burst, int) and self.burst >= 1):
            raise ValueError(f"burst must be an integer >= 1, got {self.burst!r}")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be finite and > 0 messages/s, got {self.rate!r}")


def cost(size: int) -> int:
    """Tokens one message of ``size`` payload bytes takes: 1 plus 1 per whole MiB, so a
    flood of large packets is cut after as many bytes as many small ones would be (about
    ``burst`` MiB), while a device's chunked upload of a large model still fits a burst."""
    return 1 + (size >> 20)


class FloodGuard:
    """One token bucket per device; ``admit`` says whether a message is within the limits.

    Memory is one entry per device admitted since its bucket was last full again
    (:meth:`forget_full` drops full buckets: a fleet of 100,000 that checks in a thousand
    at a time keeps about a thousand); callers pass enrolled names only.
    """

    def __init__(self, limits: FloodLimits) -> None:
        self.limits = limits
        self._buckets: dict[str, tuple[float, float]] = {}  # device -> (tokens, at time)

    def admit(self, device: str, now: float, size: int = 0) -> bool:
        """Take the tokens of one message of ``size`` payload bytes (:func:`cost`) from
        ``device``'s bucket at time ``now`` (seconds); False, taking none, if too few."""
        lim = self.limits
        need = cost(size)
        tokens, at = self._buckets.get(device, (float(lim.burst), now))
        tokens = min(float(lim.burst), tokens + max(0.0, now - at) * lim.rate)
        if tokens < need:
            self._buckets[device] = (tokens, now)
            return False
        self._buckets[device] = (tokens - need, now)
        return True

    def reset(self, device: str) -> None:
        """A full bucket again (a quarantine ended)."""
        self._buckets.pop(device, None)

    def forget_full(self, now: float) -> int:
        """Drop the buckets that have refilled by ``now`` (an absent bucket is a full one,
        so nothing changes for any device); returns how many were dropped."""
        lim = self.limits
        full = [d for d, (tokens, at) in self._buckets.items()
                if tokens + max(0.0, now - at) * lim.rate >= lim.burst]
        for d in full:
            del self._buckets[d]
        return len(full)


_DIGITS = re.compile(r"\d+")
_QUOTED = re.compile(r"'[^']*'")


def reason_class(reason: str) -> str:
    """A rejection reason without its numbers and quoted values (peer-chosen), at most
    80 characters: the key under which similar rejections are counted."""
    return _DIGITS.sub("#", _QUOTED.sub("'…'", reason))[:80]


@dataclass(frozen=True, slots=True, kw_only=True)
class Suppressed:
    """Lines of one key not written in one interval."""

    device: str
    reason: str  # the reason class
    count: int
    interval_s: float


class LogLimiter:
    """At most ``per_key`` lines per (device, reason class) per interval; the rest counted.

    Intervals are fixed windows of ``interval_s`` seconds on the caller's clock. Keys per
    device are capped at ``reasons_per_device`` (further reasons share the key ``"*"``), so
    memory stays bounded by the number of devices whatever the reasons say.
    """

    def __init__(self, *, interval_s: float = 10.0, per_key: int = 5,
                 reasons_per_device: int = 8) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if per_key < 1 or reasons_per_device < 1:
            raise ValueError(f"per_key and reasons_per_device must be >= 1, got {per_key!r}, "
                             f"{reasons_per_device!r}")
        self.interval_s = interval_s
        self.per_key = per_key
        self.reasons_per_device = reasons_per_device
        self._window: float | None = None
        self._counts: dict[str, dict[str, int]] = {}  # device -> reason class -> seen

    def admit(self, device: str, reason: str, now: float) -> tuple[bool, list[Suppressed]]:
        """Whether to write this line, and the summaries of the interval that just ended
        (to be written first)."""
        done = self.flush(now)
        if self._window is None:
            self._window = now
        reasons = self._counts.setdefault(device, {})
        key = reason_class(reason)
        if key not in reasons and len(reasons) >= self.reasons_per_device:
            key = "*"
        reasons[key] = reasons.get(key, 0) + 1
        return reasons[key] <= self.per_key, done

    def flush(self, now: float) -> list[Suppressed]:
        """The summaries of a finished interval (each once), and start a new one."""
        if self._window is None or now < self._window + self.interval_s:
            return []
        out = [Suppressed(device=dev, reason=key, count=n - self.per_key,
                          interval_s=self.interval_s)
               for dev, reasons in sorted(self._counts.items())
               for key, n in sorted(reasons.items()) if n > self.per_key]
        self._counts.clear()
        self._window = None
        return out
