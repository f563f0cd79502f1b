"""Beyond one gateway: a site above gateways, sans-I/O (issue 19; DESIGN, "Scale").

Topology (``tools.hierarchy`` runs it over mosquitto bridges or in memory)::

    devices -- gateway broker + RoundMachine(upstream=...) \\
    devices -- gateway broker + RoundMachine(upstream=...)  }-- bridges -- site broker
    ...                                                    /               + SiteMachine

One site round (:class:`SiteMachine`)::

    announce   SiteRound(round r, model v, round seed)  retained on fedge/<site>/site/round
    gateways   each runs round r of secure aggregation over its own cohort (its own
               RoundMachine, its devices' plans signed by it), from model v, on the
               site's round seed, and forwards GatewaySum: the ring sum its
               aggregation released and the count of uploads in it (or that it failed)
    combine    when every gateway has reported, or at the deadline: the sums of the
               gateways that completed, added mod 2^bits, are decoded once by the plan's
               mechanism as one sum of all their survivors, and the server optimizer
               applies it; the new model, signed by the site, is retained on
               fedge/<site>/site/model; each gateway adopts it and republishes it, signed
               by itself, as its devices' retained model

A gateway that does not report (its broker or process died, its round failed) costs its
own cohort for that round and nothing else: the site combines the others. Fewer than
``SitePolicy.min_gateways`` sums: the site round fails and the model stays.

Why the sums add up to a flat round's: every gateway's plan is the site's template (the
same mechanism parameters, ring bits and vector length, from one ``RoundPolicy`` whose
``sum_cohort`` sizes the grid and ring for the site's total cohort, and the site's round
seed for the coordinate set), so the survivors' ring values are exactly those they would
upload in one flat round with the union of the cohorts, and the sum mod 2^bits of the
gateways' sums is that round's sum. ``tests/test_hierarchy.py`` checks the final model
bit for bit against a flat single-gateway run with the same seeds and cohorts.

Privacy, for every party that sees a sum:

* a **gateway** sees its cohort's sum, as the one aggregator of a flat round does: each
  device's plan states the noise for this gateway's cohort alone (device-dp: sigma on its
  ``min_survivors - max_colluders`` honest members, ``round_core._device_dp``), and the
  device checks and accounts it (``edge_sdk.round``), so the device-level guarantee holds
  against the gateway under the flat round's assumptions (semi-honest, fewer than
  ``threshold`` colluders);
* the **site** sees each gateway's sum separately (never less aggregated than a gateway's
  view), so it learns nothing a gateway does not: the same guarantee, with the gateway
  not trusted more than the site. The site's combined sum carries every gateway's noise,
  more than one cohort needs; that surplus is not claimed (no theorem here counts noise
  across gateways' sums when each is seen on its own);
* the **model** each device receives is post-processing of those sums.

The site takes a gateway's sum as that gateway's signed statement: like a flat round's
aggregator, a gateway is semi-honest (it runs the protocol; a gateway that forwards a
made-up sum corrupts the model, as a lying aggregator would, without learning more).

A gateway's cohort noise is thus not shared across gateways: the price of not trusting a
gateway more than the site is G times the noise in the site's sum.

Persistence: :meth:`SiteMachine.snapshot` is the whole state as bytes (model, optimizer
state, the open round's announcement, deadline and the gateway sums it holds, history);
the injected ``checkpoint`` callable (``aggregator.store.CheckpointStore.save``) gets it
after every change, before that change's messages are returned for sending, so a
restarted site (:meth:`SiteMachine.restore`) neither forgets a sum it acknowledged nor
announces a round id twice.

Not here yet: adaptive clipping (which moves S from the sum) is refused in a hierarchy,
because each gateway would move its own S.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from aggregator.errors import AggregatorError
from aggregator.optimizers import OPTIMIZERS, state_leaves, state_rebuild
from aggregator.round_core import (
    RoundPolicy,
    eligible_devices,
    finish,
    mechanism_params,
    round_secrets,
    select_cohort,
    server_half,
)
from edge_sdk import wire
from edge_sdk.errors import RemoteProtocolError, ReplayedMessage
from edge_sdk.secagg import AggregatorIdentity, Registry
from edge_sdk.wire import CheckIn, GatewaySum, ModelUpdate, Publish, RoundPlan, SiteRound

__all__ = [
    "HIERARCHY_MECHANISMS",
    "GatewayReported",
    "SiteMachine",
    "SiteOutcome",
    "SitePolicy",
    "SiteRejected",
    "SiteRoundEnded",
    "SiteRoundStarted",
    "SiteSnapshotError",
    "Upstream",
    "check_gateway_policy",
    "combine",
    "gateway_sum",
]

logger = logging.getLogger("fedge.site")

HIERARCHY_MECHANISMS = ("gaussian", "device-dp")
"""The mechanisms whose plans size their ring by ``RoundPolicy.sum_cohort`` (so gateways'
sums can be added) and whose noise is per gateway cohort."""
_EVENTS = 4096
_HISTORY = 1000  # site rounds kept in the history (and the snapshot)
_SNAPSHOT_FORMAT = "fedge-site"
_SNAPSHOT_VERSION = 2  # 2: jobs and check-ins


class SiteSnapshotError(AggregatorError):
    """A site snapshot that cannot be restored (malformed, or another site's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    """A gateway's link to its site (``RoundMachine(upstream=...)``).

    Attributes:
        site: the site's name (its topics ``fedge/<site>/site/...``).
        gateway: this gateway's name at the site (its ``GatewaySum`` sender).
        site_key: the site's Ed25519 public key (32 bytes): it verifies the site's round
            announcements and models.
    """

    site: str
    gateway: str
    site_key: bytes

    def __post_init__(self) -> None:
        wire.check_name("site", self.site)
        wire.check_name("gateway", self.gateway)
        if not isinstance(self.site_key, bytes) or len(self.site_key) != 32:
            raise ValueError("site_key must be a 32-byte Ed25519 public key")


@dataclass(frozen=True, slots=True, kw_only=True)
class SitePolicy:
    """How the site runs rounds.

    Attributes:
        site: the site's name (topics ``fedge/<site>/...``).
        round_timeout: seconds the site waits for the gateways' sums after announcing a
            round (then it combines those that came).
        min_gateways: the fewest completed gateway sums a site round applies (>= 1).
    """

    site: str
    round_timeout: float = 300.0
    min_gateways: int = 1

    def __post_init__(self) -> None:
        wire.check_name("site", self.site)
        if not (math.isfinite(self.round_timeout) and self.round_timeout > 0):
            raise ValueError(f"round_timeout must be finite and > 0, got {self.round_timeout!r}")
        if isinstance(self.min_gateways, bool) or not (
                isinstance(self.min_gateways, int) and self.min_gateways >= 1):
            raise ValueError(f"min_gateways must be an integer >= 1, got {self.min_gateways!r}")


def check_gateway_policy(policy: RoundPolicy) -> None:
    """Raise ValueError unless gateways of a site can run rounds under ``policy``: a
    mechanism of :data:`HIERARCHY_MECHANISMS`, full cohorts only (every gateway's plan
    is then the site's template), no adaptive clipping (each gateway would move its own
    S)."""
    if policy.mechanism not in HIERARCHY_MECHANISMS:
        raise ValueError(f"a site's gateways run mechanism one of {list(HIERARCHY_MECHANISMS)}"
                         f", got {policy.mechanism!r}")
    if policy.min_cohort not in (None, policy.cohort_size):
        raise ValueError(f"a site's gateways run full cohorts (min_cohort None or "
                         f"cohort_size={policy.cohort_size}), got {policy.min_cohort!r}")
    if policy.adaptive_clip_quantile is not None:
        raise ValueError("adaptive clipping is not supported across gateways (each would "
                         "move its own S); set adaptive_clip_quantile None")


def gateway_sum(plan: RoundPlan, *, gateway: str, total: np.ndarray | None,
                survivors: int, detail: str = "", job: int = 0) -> GatewaySum:
    """The (unsigned) report of a gateway's round of ``plan``: its ring ``total`` of
    ``survivors`` uploads, or (survivors 0, total None) a failure and why."""
    arr = None
    if total is not None:
        dtype = np.uint64 if plan.bits > 32 else np.uint32 if plan.bits > 16 else np.uint16
        arr = wire.WireArray.of(np.asarray(total, dtype=np.uint64).astype(dtype))
    return GatewaySum(round_id=plan.round_id, sender=gateway,
                      model_version=plan.model_version, mechanism=plan.mechanism,
                      params=plan.params, round_seed=plan.round_seed, bits=plan.bits,
                      length=plan.length, cohort=plan.cohort, survivors=survivors,
                      total=arr, detail=detail[:256], job=job)


def combine(sums: Sequence[GatewaySum], *, round_id: int) -> tuple[RoundPlan, np.ndarray, int]:
    """(A plan for the union of the gateways' cohorts, the sum mod 2^bits of their totals,
    the survivors in it) from completed gateway sums that agree on the template.

    The plan is for decoding only (never sent or signed): the union cohort (sorted),
    the shared mechanism, params, seed, bits and length; its SecAgg fields are
    placeholders nothing reads.

    Raises:
        ValueError: no sum, a failed one, sums that disagree on the template, or cohorts
            that overlap.
    """
    if not sums:
        raise ValueError("combine needs at least one completed gateway sum")
    first = sums[0]
    key = _template_key(first)
    members: set[str] = set()
    bits = first.bits
    mask = np.uint64((1 << bits) - 1) if bits < 64 else None
    total = np.zeros(first.length, dtype=np.uint64)
    survivors = 0
    for s in sums:
        if s.total is None or s.survivors < 1:
            raise ValueError(f"gateway {s.sender!r}'s round failed; only completed sums "
                             "combine")
        if _template_key(s) != key:
            raise ValueError(f"gateway {s.sender!r}'s plan differs from {first.sender!r}'s")
        overlap = members & set(s.cohort)
        if overlap:
            raise ValueError(f"gateway {s.sender!r}'s cohort overlaps another's: "
                             f"{sorted(overlap)[:3]}")
        members |= set(s.cohort)
        total += s.total.to_numpy().astype(np.uint64)  # uint64 wraps mod 2^64
        if mask is not None:
            total &= mask
        survivors += s.survivors
    cohort = tuple(sorted(members))
    plan = RoundPlan(round_id=round_id, model_version=first.model_version, cohort=cohort,
                     mechanism=first.mechanism, params=first.params,
                     round_seed=first.round_seed, bits=bits, length=first.length,
                     nonce=bytes(32), degree=2, threshold=1, min_survivors=1,
                     max_colluders=0, stage_timeout=1.0)
    return plan, total, survivors


def _template_key(s: GatewaySum) -> tuple[Any, ...]:
    return (s.model_version, s.mechanism, s.params, s.round_seed, s.bits, s.length)


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class SiteOutcome:
    """How a site round ended: ``completed`` (a model was made from ``gateways``' sums),
    the gateways that reported a completed sum, those missing or failed (with why), the
    survivors and ring ``total`` of the combination, and the model version after it."""

    round_id: int
    completed: bool
    gateways: tuple[str, ...]
    missing: Mapping[str, str]
    survivors: int
    total: np.ndarray | None
    model_version: int
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SiteRoundStarted:
    round_id: int
    model_version: int


@dataclass(frozen=True, slots=True)
class GatewayReported:
    round_id: int
    gateway: str
    survivors: int
    detail: str


@dataclass(frozen=True, slots=True)
class SiteRoundEnded:
    outcome: SiteOutcome


@dataclass(frozen=True, slots=True)
class SiteRejected:
    topic: str
    gateway: str | None
    reason: str


SiteEvent = SiteRoundStarted | GatewayReported | SiteRoundEnded | SiteRejected


@dataclass(slots=True)
class _SiteRound:
    announce: SiteRound
    deadline: float
    sums: dict[str, GatewaySum] = field(default_factory=dict)
    jobs: dict[int, tuple[str, ...]] = field(default_factory=dict)  # jobs > 0: job -> cohort


class SiteMachine:
    """The site's rounds over its gateways (module docstring).

    Args:
        policy: the site's settings.
        round_policy: the gateways' round policy (one file for all): the template every
            gateway's plan must match (``check_gateway_policy``), the server optimizer and
            ``max_rounds``.
        identity: the site's signing key (gateways hold its public key).
        gateways: gateway name -> its Ed25519 public key (32 bytes).
        params: the initial global model (version 0), graph order.
        random_bytes: the rounds' seeds (``os.urandom``; seeded in simulations: the same
            draws, in the same order, as a flat ``RoundMachine``'s, so both have the same
            round seeds).
        start_gate: called before a round is announced; it waits while this returns False
            (a simulator starts rounds only once every gateway is ready).
        checkpoint: called with :meth:`snapshot` after every change of state, before the
            change's messages are returned.
        jobs: 0: the gateways draw their own cohorts (a site of gateways). > 0: the site is
            one gateway's coordinator over its workers: it takes the devices' check-ins,
            draws one cohort of ``jobs`` x ``round_policy.cohort_size`` from them (the
            round core's uniform draw) and hands it out as ``jobs`` disjoint jobs on
            ``site/job``, which the workers take through an MQTT v5 shared subscription;
            it waits for one sum per job, from whichever worker ran it.
        registry: the enrolled devices (jobs > 0: the check-ins' signatures).
    """

    def __init__(self, *, policy: SitePolicy, round_policy: RoundPolicy,
                 identity: AggregatorIdentity, gateways: Mapping[str, bytes],
                 params: Sequence[np.ndarray],
                 random_bytes: Callable[[int], bytes] = os.urandom,
                 start_gate: Callable[[], bool] | None = None,
                 checkpoint: Callable[[bytes], None] | None = None,
                 jobs: int = 0, registry: Registry | None = None) -> None:
        check_gateway_policy(round_policy)
        if jobs and registry is None:
            raise ValueError("a site that hands out jobs selects the devices: it needs the "
                             "registry (their check-ins are signed)")
        if jobs < 0:
            raise ValueError(f"jobs must be >= 0, got {jobs!r}")
        if not gateways:
            raise ValueError("a site needs at least one gateway")
        for name, key in gateways.items():
            wire.check_name("gateway", name)
            if not isinstance(key, bytes) or len(key) != 32:
                raise ValueError(f"gateway {name!r}: the public key must be 32 bytes of "
                                 f"Ed25519, got {key!r:.80}")
        if policy.min_gateways > len(gateways):
            raise ValueError(f"min_gateways {policy.min_gateways} exceeds the "
                             f"{len(gateways)} gateways")
        self.policy = policy
        self.round_policy = round_policy
        self._idn = identity
        self._gateways = dict(gateways)
        self._random = random_bytes
        self._start_gate = start_gate
        self._opt = OPTIMIZERS[round_policy.server_opt](server_lr=round_policy.server_lr)
        self._params = [np.array(p, dtype=np.float32) for p in params]
        if not all(np.isfinite(p).all() for p in self._params):
            raise ValueError("initial params must be finite")
        self._opt_state = self._opt.init(self._params)
        self._dim = sum(p.size for p in self._params)
        self._template = mechanism_params(round_policy, dim=self._dim)
        self._version = 0
        self._model_round = 0
        self._model_msg = self._sign_model()
        self._last_round = 0
        self._round: _SiteRound | None = None
        self._history: list[SiteOutcome] = []
        self._events: deque[SiteEvent] = deque(maxlen=_EVENTS)
        self._checkpoint = checkpoint
        self._jobs = jobs
        self._reg = registry
        self._available: dict[str, CheckIn] = {}  # jobs > 0: the devices' check-ins

    # ------------------------------------------------------------------ properties

    @property
    def params(self) -> list[np.ndarray]:
        return [p.copy() for p in self._params]

    @property
    def model_version(self) -> int:
        return self._version

    @property
    def history(self) -> tuple[SiteOutcome, ...]:
        return tuple(self._history)

    @property
    def open_round(self) -> int | None:
        return None if self._round is None else self._round.announce.round_id

    @property
    def waiting_for(self) -> frozenset[str]:
        """Gateways (or, handing out jobs, ``job-<i>`` s) the open round still waits for."""
        r = self._round
        return frozenset() if r is None else frozenset(self._expected()) - r.sums.keys()

    @property
    def checkins(self) -> dict[str, CheckIn]:
        """jobs > 0: the devices' latest check-ins (device -> CheckIn)."""
        return dict(self._available)

    def _expected(self) -> list[str]:
        return [f"job-{i}" for i in range(self._jobs)] if self._jobs else list(self._gateways)

    @property
    def deadline(self) -> float | None:
        return None if self._round is None else self._round.deadline

    def take_events(self) -> list[SiteEvent]:
        out = list(self._events)
        self._events.clear()
        return out

    # ------------------------------------------------------------------ endpoint

    def subscriptions(self) -> list[str]:
        ups = [f"{wire.fleet_topic(self.policy.site)}/gw/+/up/+"]
        if not self._jobs:
            return ups
        root = wire.fleet_topic(self.round_policy.fleet)
        return [*ups, f"{root}/dev/+/up/{CheckIn.KIND}", f"{root}/status/+"]

    def on_connect(self, now: float) -> list[Publish]:
        out = [self._model_publish()]
        if self._round is not None:
            out.append(self._announce_publish(self._round.announce))
        return out + self._maybe_start(now)

    def on_tick(self, now: float) -> list[Publish]:
        r = self._round
        if r is not None and now >= r.deadline:
            return self._close(now, why="deadline")
        return self._maybe_start(now)

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        """One gateway message. Never raises: a bad one is logged and changes nothing."""
        gw = _topic_gateway(topic, self.policy.site)
        try:
            return self._handle(gw, topic, payload, now)
        except (RemoteProtocolError, ReplayedMessage) as e:
            self._events.append(SiteRejected(topic=topic, gateway=gw, reason=str(e)))
            logger.warning("site %s rejected a message on %s: %s", self.policy.site, topic, e,
                           extra={"fedge": {"event": "site_rejected", "topic": topic,
                                            "gateway": gw, "reason": str(e)}})
        return []

    # ------------------------------------------------------------------ inbound

    def _handle(self, gw: str | None, topic: str, payload: bytes, now: float
                ) -> list[Publish]:
        if gw is None and self._jobs:
            return self._device_message(topic, payload, now)
        if gw is None:
            raise RemoteProtocolError(f"not a gateway uplink of site {self.policy.site!r}")
        key = self._gateways.get(gw)
        if key is None:
            raise RemoteProtocolError(f"message from unknown gateway {gw!r}")
        msg = wire.decode(payload, wire.SITE_KINDS)
        if not isinstance(msg, GatewaySum) or not topic.endswith("/" + msg.KIND):
            raise RemoteProtocolError(f"a {msg.KIND} message on {topic!r}")
        if msg.sender != gw:
            raise RemoteProtocolError(f"gateway_sum names {msg.sender!r} but came on "
                                      f"{gw!r}'s topic")
        wire.verify(msg, key)
        r = self._round
        if r is None or msg.round_id != r.announce.round_id:
            raise RemoteProtocolError(f"gateway_sum for round {msg.round_id}, the open "
                                      f"round is {None if r is None else r.announce.round_id}")
        slot = gw
        if self._jobs:  # any worker may have run a job: the sum is the job's
            if msg.job not in r.jobs or tuple(msg.cohort) != r.jobs[msg.job]:
                raise RemoteProtocolError(f"{gw!r} reports job {msg.job} of round "
                                          f"{msg.round_id} with a cohort the site did not "
                                          "hand out")
            slot = f"job-{msg.job}"
        if slot in r.sums:
            raise ReplayedMessage(f"{slot} already reported round {msg.round_id}")
        if msg.survivors:
            self._check_template(msg, r.announce)
        r.sums[slot] = msg
        self._save()
        self._events.append(GatewayReported(round_id=msg.round_id, gateway=gw,
                                            survivors=msg.survivors, detail=msg.detail))
        logger.info("site round %d: gateway %s reported %d survivors%s", msg.round_id, gw,
                    msg.survivors, f" ({msg.detail})" if msg.detail else "",
                    extra={"fedge": {"event": "gateway_reported", "round": msg.round_id,
                                     "gateway": gw, "survivors": msg.survivors,
                                     "detail": msg.detail}})
        if not self.waiting_for:
            return self._close(now, why="all gateways reported")
        return []

    def _check_template(self, msg: GatewaySum, announce: SiteRound) -> None:
        params, length, bits = self._template
        if msg.model_version != announce.model_version or msg.round_seed != announce.round_seed:
            raise RemoteProtocolError(f"gateway {msg.sender!r} ran round {msg.round_id} from "
                                      "another model or seed than the site announced")
        if (msg.mechanism, msg.params, msg.length, msg.bits) != (
                self.round_policy.mechanism, params, length, bits):
            raise RemoteProtocolError(f"gateway {msg.sender!r}'s plan is not the site's "
                                      "template (another policy or cohort size?)")
        r = self._round
        others = set() if r is None else {d for s in r.sums.values() for d in s.cohort}
        if others & set(msg.cohort):
            raise RemoteProtocolError(f"gateway {msg.sender!r}'s cohort names devices "
                                      "another gateway already summed")

    def _device_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        """jobs > 0: a device's check-in (or its status: offline withdraws it)."""
        assert self._reg is not None
        root = wire.fleet_topic(self.round_policy.fleet)
        parts = topic.split("/")
        if topic.startswith(f"{root}/status/") and len(parts) == 4:
            if bytes(payload) == b"offline":
                self._available.pop(parts[3], None)
            return []
        if not (topic.startswith(f"{root}/dev/") and len(parts) == 6
                and parts[4] == "up" and parts[5] == CheckIn.KIND):
            raise RemoteProtocolError(f"not a check-in of fleet {self.round_policy.fleet!r}")
        device = parts[3]
        if device not in self._reg.devices:
            raise RemoteProtocolError(f"check-in from outsider {device!r}")
        msg = wire.decode(payload, wire.UP_KINDS)
        if not isinstance(msg, CheckIn) or msg.sender != device:
            raise RemoteProtocolError(f"a {msg.KIND} from {getattr(msg, 'sender', '?')!r} "
                                      f"on {device!r}'s check-in topic")
        self._reg.verify_message(msg)
        self._available[device] = msg
        return self._maybe_start(now)

    # ------------------------------------------------------------------ rounds

    def _maybe_start(self, now: float) -> list[Publish]:
        if self._round is not None:
            return []
        mr = self.round_policy.max_rounds
        if mr is not None and self._last_round >= mr:
            return []
        cohort: tuple[str, ...] = ()
        if self._jobs:
            eligible = eligible_devices({d: c.remaining_epsilon for d, c in
                                         self._available.items()
                                         if c.model_version == self._version})
            whole = self._jobs * self.round_policy.cohort_size
            if len(eligible) < whole:
                return []  # every job is a full cohort (check_gateway_policy)
        if self._start_gate is not None and not self._start_gate():
            return []
        round_id = self._last_round + 1
        round_seed, _ = round_secrets(self._random)  # a flat RoundMachine's draws, in order
        if self._jobs:
            cohort = select_cohort(eligible, whole, seed=self.round_policy.seed,
                                   round_id=round_id)
            for d in cohort:  # they check in again when the round is over
                self._available.pop(d, None)
        announce = wire.sign(SiteRound(round_id=round_id, model_version=self._version,
                                       round_seed=round_seed,
                                       deadline_s=float(self.policy.round_timeout)), self._idn)
        jobs = {i: tuple(str(d) for d in part)
                for i, part in enumerate(np.array_split(np.array(cohort, dtype=object),
                                                        self._jobs))} if self._jobs else {}
        self._round = _SiteRound(announce=announce, deadline=now + self.policy.round_timeout,
                                 jobs=jobs)
        self._last_round = round_id
        self._events.append(SiteRoundStarted(round_id=round_id, model_version=self._version))
        logger.info("site round %d announced (model version %d%s)", round_id, self._version,
                    f", {len(jobs)} jobs of {len(cohort) // max(1, len(jobs))}" if jobs else "",
                    extra={"fedge": {"event": "site_round_started", "round": round_id,
                                     "model_version": self._version, "jobs": len(jobs)}})
        self._save()
        return [self._announce_publish(announce)] + [
            Publish(wire.site_job_topic(self.policy.site), wire.encode(wire.sign(
                dataclasses.replace(announce, cohort=c, job=i, sig=b""), self._idn)))
            for i, c in jobs.items()]

    def _close(self, now: float, *, why: str) -> list[Publish]:
        r = self._round
        assert r is not None
        rid = r.announce.round_id
        done = [s for _, s in sorted(r.sums.items()) if s.survivors > 0]
        missing = {g: (r.sums[g].detail or "failed") if g in r.sums else f"no sum by the {why}"
                   for g in sorted(self._expected()) if g not in r.sums
                   or r.sums[g].survivors == 0}
        self._round = None
        if len(done) < self.policy.min_gateways:
            detail = (f"{len(done)} gateway sums by the {why}, below min_gateways "
                      f"{self.policy.min_gateways}")
            return self._end(SiteOutcome(round_id=rid, completed=False, gateways=(),
                                         missing=missing, survivors=0, total=None,
                                         model_version=self._version, detail=detail), now)
        plan, total, survivors = combine(done, round_id=rid)
        out = finish(plan, total, survivors, params=self._params,
                     server=server_half(plan, dim=self._dim), optimizer=self._opt,
                     opt_state=self._opt_state)
        self._params, self._opt_state = out.params, out.opt_state
        self._version += 1
        self._model_round = rid
        self._model_msg = self._sign_model()
        return [self._model_publish()] + self._end(SiteOutcome(
            round_id=rid, completed=True, gateways=tuple(s.sender for s in done),
            missing=missing, survivors=survivors, total=total, model_version=self._version),
            now)

    def _end(self, outcome: SiteOutcome, now: float) -> list[Publish]:
        self._history = [*self._history, outcome][-_HISTORY:]
        self._save()
        self._events.append(SiteRoundEnded(outcome=outcome))
        logger.info("site round %d %s: gateways %s, %d survivors, model version %d%s",
                    outcome.round_id, "done" if outcome.completed else "FAILED",
                    list(outcome.gateways), outcome.survivors, outcome.model_version,
                    f" ({outcome.detail})" if outcome.detail else "",
                    extra={"fedge": {"event": "site_round_ended", "round": outcome.round_id,
                                     "completed": outcome.completed,
                                     "gateways": list(outcome.gateways),
                                     "survivors": outcome.survivors,
                                     "model_version": outcome.model_version,
                                     "detail": outcome.detail}})
        return self._maybe_start(now)

    # ------------------------------------------------------------------ snapshots

    def _save(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint(self.snapshot())

    def snapshot(self) -> bytes:
        """The whole state as deterministic msgpack bytes (:meth:`restore` reads it)."""
        r = self._round
        state = {
            "format": _SNAPSHOT_FORMAT, "v": _SNAPSHOT_VERSION,
            "site": self.policy.site, "site_key": self._idn.public_key,
            "gateways": sorted([g, k] for g, k in self._gateways.items()),
            "version": self._version, "model_round": self._model_round,
            "last_round": self._last_round,
            "params": [wire.WireArray.of(p).to_wire() for p in self._params],
            "opt_state": [wire.WireArray.of(a).to_wire() for a in state_leaves(self._opt_state)],
            "round": None if r is None else {
                "announce": wire.encode(r.announce), "deadline": r.deadline,
                "sums": [[k, wire.encode(m)] for k, m in sorted(r.sums.items())],
                "jobs": sorted([i, list(c)] for i, c in r.jobs.items())},
            "available": [wire.encode(c) for _, c in sorted(self._available.items())],
            "history": [[o.round_id, o.completed, list(o.gateways), sorted(o.missing.items()),
                         o.survivors, None if o.total is None else
                         wire.WireArray.of(o.total).to_wire(), o.model_version, o.detail]
                        for o in self._history],
        }
        return msgpack.packb(state, use_bin_type=True)

    @classmethod
    def restore(cls, data: bytes, *, policy: SitePolicy, round_policy: RoundPolicy,
                identity: AggregatorIdentity, gateways: Mapping[str, bytes],
                random_bytes: Callable[[int], bytes] = os.urandom,
                start_gate: Callable[[], bool] | None = None,
                checkpoint: Callable[[bytes], None] | None = None,
                jobs: int = 0, registry: Registry | None = None) -> SiteMachine:
        """The site exactly as :meth:`snapshot` captured it; its open round keeps its
        deadline on the clock it was driven with (call :meth:`on_connect` to announce it
        again).

        Raises:
            SiteSnapshotError: malformed, or taken by another site, key or gateway set.
        """
        try:
            s = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
            if s.get("format") != _SNAPSHOT_FORMAT or s.get("v") != _SNAPSHOT_VERSION:
                raise SiteSnapshotError(f"not a {_SNAPSHOT_FORMAT} v{_SNAPSHOT_VERSION} "
                                        "snapshot")
            if (s["site"], s["site_key"]) != (policy.site, identity.public_key):
                raise SiteSnapshotError("the snapshot was taken by another site or key")
            if {g: bytes(k) for g, k in s["gateways"]} != dict(gateways):
                raise SiteSnapshotError("the snapshot was taken with other gateways")
            lim = wire.LIMITS
            params = [wire.WireArray.from_wire(a, lim).to_numpy() for a in s["params"]]
            m = cls(policy=policy, round_policy=round_policy, identity=identity,
                    gateways=gateways, params=params, random_bytes=random_bytes,
                    start_gate=start_gate, checkpoint=checkpoint, jobs=jobs,
                    registry=registry)
            leaves = [wire.WireArray.from_wire(a, lim).to_numpy() for a in s["opt_state"]]
            m._opt_state = state_rebuild(m._opt.init(m._params), leaves)
            m._version, m._model_round = int(s["version"]), int(s["model_round"])
            m._last_round = int(s["last_round"])
            m._model_msg = m._sign_model()
            rs = s["round"]
            if rs is not None:
                announce = wire.decode(rs["announce"], wire.SITE_KINDS)
                assert isinstance(announce, SiteRound)
                m._round = _SiteRound(announce=announce, deadline=float(rs["deadline"]),
                                      jobs={int(i): tuple(c) for i, c in rs["jobs"]})
                for slot, raw in rs["sums"]:
                    msg = wire.decode(raw, wire.SITE_KINDS)
                    assert isinstance(msg, GatewaySum)
                    wire.verify(msg, m._gateways[msg.sender])
                    m._round.sums[slot] = msg
            for raw in s["available"]:
                c = wire.decode(raw, wire.UP_KINDS)
                assert isinstance(c, CheckIn) and m._reg is not None
                m._available[c.sender] = c
            m._history = [SiteOutcome(
                round_id=h[0], completed=h[1], gateways=tuple(h[2]), missing=dict(h[3]),
                survivors=h[4], total=None if h[5] is None else
                wire.WireArray.from_wire(h[5], lim).to_numpy(), model_version=h[6],
                detail=h[7]) for h in s["history"]]
            return m
        except SiteSnapshotError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AssertionError,
                msgpack.UnpackException, RemoteProtocolError) as e:
            raise SiteSnapshotError(f"cannot restore the site: {type(e).__name__}: {e}"
                                    ) from None

    # ------------------------------------------------------------------ publishes

    def _sign_model(self) -> bytes:
        return wire.encode(wire.sign(ModelUpdate.of(version=self._version,
                                                    round_id=self._model_round,
                                                    params=self._params), self._idn))

    def _model_publish(self) -> Publish:
        return Publish(wire.site_model_topic(self.policy.site), self._model_msg, retain=True)

    def _announce_publish(self, announce: SiteRound) -> Publish:
        return Publish(wire.site_round_topic(self.policy.site), wire.encode(announce),
                       retain=True)


def _topic_gateway(topic: str, site: str) -> str | None:
    parts = topic.split("/")
    if (len(parts) == 6 and parts[0] == "fedge" and parts[1] == site and parts[2] == "gw"
            and parts[4] == "up"):
        return parts[3]
    return None
