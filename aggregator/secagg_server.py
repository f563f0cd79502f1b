"""The aggregator's side of secure aggregation: relay, recovery, unmasking.

Sans-I/O (h11-style): :class:`SecAggServer` takes messages with :meth:`~SecAggServer.receive`
and returns the messages to relay when the caller closes a stage (at a quorum or a
deadline, which are the caller's business). It never sees an individual input: it sums
the masked uploads as they arrive, then removes the masks that do not cancel. The
arithmetic is ``edge_sdk.hazmat``'s (masking, shamir, graph: the survivor rules), the
messages and keys ``edge_sdk.secagg``'s, so both sides compute the same bits.

What a round driver uses (``aggregator.rounds``): :attr:`~SecAggServer.stage`,
:meth:`~SecAggServer.pending` (who the open stage still waits for),
:meth:`~SecAggServer.close_stage` (close it at a quorum or a deadline),
:meth:`~SecAggServer.finalize`, :attr:`~SecAggServer.survivors`, and
:meth:`~SecAggServer.replay` to rebuild a server from its input log after a restart.

Stages (Bonawitz et al. 2017 Fig. 4 with SecAgg+ neighbourhoods, Bell et al. 2020)::

    COLLECT_KEYS    receive AdvertiseKeys   -> close_advertise()    -> NeighbourKeys per device
    COLLECT_SHARES  receive ShareKeys       -> close_share_keys()   -> ForwardedShares per device
    COLLECT_MASKED  receive MaskedPart s    -> close_masked_input() -> UnmaskRequest per survivor
    COLLECT_UNMASK  receive UnmaskResponse  -> recover(); finalize() -> the sum mod 2^b
    DONE | FAILED

Device sets: U1 advertised, U2 shared keys, U3 uploaded (the survivors), U5 answered
recovery. The survivor rules are ``edge_sdk.hazmat.graph``'s: closing the first two stages
prunes, repeatedly, any device left with fewer than t live neighbours (its shares could
never be recovered; pruning before it masks is free). Closing the upload stage checks,
*before any share is requested*, that every survivor and every dropped device with a
surviving neighbour has at least t survivors among its neighbours; otherwise the round
fails with ``RoundFailed`` and nothing is revealed. Recovery fails the same way if too few
survivors answer. (On the ring-like Harary graph
with 2t > k, a device that loses more than k - t neighbours opens a gap whose borders keep
only k/2 < t live neighbours, so pruning usually empties the whole round: it then fails at
that stage, early and cleanly, rather than later.)

Masks removed (sign convention of ``edge_sdk.hazmat.masking.mask_sign``)::

    sum = sum_{u in U3} y_u - sum_{u in U3} PRG(b_u)
          - sum_{v in U2 \\ U3} sum_{u in N(v) ∩ U3} sign(u, v) PRG(s_uv)      (mod 2^b)

(When the survivors' neighbour graph is disconnected, the aggregator learns each
component's sum, as in SecAgg+; the random k-regular graph makes that unlikely.)

:class:`AmortizedSecAggServer` is the amortized variant (zCDP paper Fig. 2): masked
uploads, then, if devices dropped, one reveal round; see ``edge_sdk.secagg`` for its
weaker dropout story. :func:`run_round` and :func:`run_amortized_round` drive both ends
through msgpack bytes in memory (the simulator's and the tests' transport).

A masked upload arrives as signed ``masked_part`` s (``edge_sdk.wire.chunking``); the
server checks each part's signature, joins the raw residue bytes and adds the vector to
the sum when its last part arrives.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from edge_sdk import compress
from edge_sdk.errors import LocalProtocolError, RemoteProtocolError, ReplayedMessage, RoundFailed
from edge_sdk.hazmat import graph
from edge_sdk.hazmat.masking import derive_pairwise_seed, mask_sign, unmask
from edge_sdk.hazmat.ring import Ring
from edge_sdk.hazmat.shamir import SHAMIR_PRIME, combine_shares, share_from_bytes
from edge_sdk.secagg import (
    AggregatorIdentity,
    AmortizedSecAggClient,
    Registry,
    RoundConfig,
    SecAggClient,
)
from edge_sdk.wire import schema
from edge_sdk.wire.chunking import MaskedVector, Reassembler, SpoiledUpload
from edge_sdk.wire.messages import (
    SECAGG_DOWN,
    SECAGG_UP,
    AdvertiseKeys,
    ForwardedShares,
    MaskedPart,
    NeighbourKeys,
    RevealRequest,
    RevealResponse,
    SecAggDown,
    SecAggUp,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
)

__all__ = [
    "RECV",
    "CLOSE",
    "AmortizedSecAggServer",
    "DropStage",
    "LogEntry",
    "SecAggServer",
    "ServerStage",
    "run_amortized_round",
    "run_round",
]


RECV = "recv"
CLOSE = "close"
LogEntry: TypeAlias = tuple[str, bytes]
"""One entry of a server's input log (:meth:`SecAggServer.replay`): ``(RECV, the accepted
message's ``wire.encode`` bytes)`` or ``(CLOSE, the closed stage's value, UTF-8)``."""


class ServerStage(enum.Enum):
    """Where the aggregator is in one round."""

    COLLECT_KEYS = "collect_keys"
    COLLECT_SHARES = "collect_shares"
    COLLECT_MASKED = "collect_masked"
    COLLECT_UNMASK = "collect_unmask"
    DONE = "done"
    FAILED = "failed"


class _Base:
    """Message checks common to both aggregators."""

    def __init__(
        self, *, identity: AggregatorIdentity, registry: Registry, config: RoundConfig
    ) -> None:
        if registry.aggregator_key != identity.public_key:
            raise ValueError("the registry's aggregator key is not this identity's")
        missing = [d for d in config.cohort if d not in registry.devices]
        if missing:
            raise ValueError(f"cohort members not enrolled: {missing}")
        self._idn = identity
        self._reg = registry
        self._cfg = config
        self._digest = config.digest()
        self._graph = config.graph()
        self._stage = ServerStage.COLLECT_KEYS
        self._seen: dict[tuple[str, str, int], SecAggUp] = {}
        n = len(config.cohort)
        self._parts = Reassembler(max_pending=n,
                                  max_bytes=n * ((config.length * config.bits + 7) // 8))
        self._spoiled: dict[str, str] = {}  # device -> why its masked upload was dropped

    @property
    def config(self) -> RoundConfig:
        return self._cfg

    @property
    def stage(self) -> ServerStage:
        return self._stage

    def _sign(self, msg: Any) -> Any:
        return schema.sign(msg, self._idn, context=self._digest)

    def _admit(self, msg: Any, stage: ServerStage, allowed: Iterable[str]) -> None:
        """Round, sender, duplicate and signature checks; raises before any state change."""
        if msg.round_id != self._cfg.round_id:
            raise RemoteProtocolError(
                f"{msg.KIND} is for round {msg.round_id}, this is round {self._cfg.round_id}"
            )
        sender = msg.sender
        if sender not in self._reg.devices or sender not in self._cfg.cohort:
            raise RemoteProtocolError(f"{msg.KIND} from outsider {sender!r}")
        prior = self._seen.get(_seen_key(msg))
        if prior is not None:
            if prior == msg:
                raise ReplayedMessage(f"{msg.KIND} from {sender!r} already accepted")
            raise RemoteProtocolError(f"a second, different {msg.KIND} from {sender!r}")
        if self._stage is not stage:
            raise RemoteProtocolError(
                f"{msg.KIND} from {sender!r} arrived in stage {self._stage.value}; dropped"
            )
        if sender not in allowed:
            raise RemoteProtocolError(
                f"{msg.KIND} from {sender!r}, which is not in this stage's set of devices"
            )
        self._reg.verify(sender, msg.sig, msg.signing_bytes(self._digest), msg.KIND)

    def _require(self, stage: ServerStage, what: str) -> None:
        if self._stage is not stage:
            raise LocalProtocolError(f"{what} called in stage {self._stage.value}")

    def _fail(self, reason: str) -> RoundFailed:
        self._stage = ServerStage.FAILED
        return RoundFailed(f"round {self._cfg.round_id} failed: {reason}")

    @property
    def spoiled(self) -> Mapping[str, str]:
        """Devices whose signed parts joined into a vector that contradicts its own digest,
        with the reason: their upload is dropped (they count as gone from the upload stage)
        and any further part of theirs is refused."""
        return dict(self._spoiled)

    def _take_part(self, msg: MaskedPart) -> np.ndarray | None:
        """The sender's masked vector when ``msg`` completes it, else None (admitted first).

        A completed vector that contradicts its digest is not an error of this part alone:
        the part is accepted (so a replay of the accepted messages reproduces the state) and
        the device's upload is dropped (:attr:`spoiled`)."""
        if msg.sender in self._spoiled:
            raise RemoteProtocolError(f"masked_part from {msg.sender!r}: its upload was "
                                      f"dropped ({self._spoiled[msg.sender]})")
        if msg.bits != self._cfg.bits or msg.count != self._cfg.length:
            raise RemoteProtocolError(
                f"masked_part from {msg.sender!r} has {msg.count} values of {msg.bits} bits, "
                f"the round wants {self._cfg.length} of {self._cfg.bits}"
            )
        try:
            whole: MaskedVector | None = self._parts.add(msg)  # WireError on a conflict
        except SpoiledUpload as e:
            self._spoiled[msg.sender] = str(e)
            return None
        if whole is None:
            return None
        try:
            return Ring(bits=whole.bits).unpack(whole.data, whole.count)
        except ValueError as e:
            raise RemoteProtocolError(f"masked upload of {msg.sender!r}: {e}") from None

    def replay(self, log: Iterable[LogEntry]) -> None:
        """Bring a fresh server to the state its input log describes: each ``(RECV, bytes)``
        is decoded and received, each ``(CLOSE, stage)`` closes that stage. The server is
        deterministic (sums, pruning, Ed25519 signatures), so the replay reproduces the
        logged server bit for bit; a caller that logs every accepted message and every
        successful close can snapshot a round as its log.

        Raises:
            RemoteProtocolError: a logged message does not decode or is not accepted.
            LocalProtocolError: a close entry names another stage than the open one, or an
                entry is neither kind.
            RoundFailed: a logged close fails now (the log is not this round's).
        """
        for op, data in log:
            if op == RECV:
                self.receive(_decode_up(data))
            elif op == CLOSE:
                if bytes(data).decode() != self._stage.value:
                    raise LocalProtocolError(
                        f"the log closes stage {bytes(data)!r}, the server is in "
                        f"{self._stage.value}"
                    )
                self.close_stage()
            else:
                raise LocalProtocolError(f"log entries are {RECV!r} or {CLOSE!r}, got {op!r}")


def _seen_key(msg: SecAggUp) -> tuple[str, str, int]:
    """Duplicates are per kind and sender, and per part for the masked upload."""
    return (msg.KIND, msg.sender, msg.part if isinstance(msg, MaskedPart) else 0)


class SecAggServer(_Base):
    """The aggregator's side of one SecAgg(+) round (see the module docstring).

    Args:
        identity: the aggregator's signing key (it signs what it sends).
        registry: the enrolled devices' public keys.
        config: the round (``amortized`` must be False).
    """

    def __init__(
        self, *, identity: AggregatorIdentity, registry: Registry, config: RoundConfig
    ) -> None:
        if config.amortized:
            raise ValueError("config.amortized is True: use AmortizedSecAggServer")
        super().__init__(identity=identity, registry=registry, config=config)
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._u1: frozenset[str] = frozenset()
        self._sharekeys: dict[str, ShareKeys] = {}
        self._u2: frozenset[str] = frozenset()
        self._sum = np.zeros(config.length, dtype=Ring(bits=config.bits).dtype)
        self._u3: list[str] = []
        self._requests: dict[str, UnmaskRequest] = {}
        self._responses: dict[str, UnmaskResponse] = {}
        self._recovered: tuple[dict[str, X25519PrivateKey], dict[str, bytes]] | None = None

    @property
    def survivors(self) -> tuple[str, ...]:
        """U3: the devices whose inputs are in the sum (sorted)."""
        return tuple(sorted(self._u3))

    def pending(self) -> frozenset[str]:
        """The devices the open stage still waits for: those of the stage's set (the
        cohort, U1, U2, or the survivors asked to unmask) that have not answered. Empty
        once the round is done or failed."""
        if self._stage is ServerStage.COLLECT_KEYS:
            return frozenset(self._cfg.cohort) - self._adverts.keys()
        if self._stage is ServerStage.COLLECT_SHARES:
            return self._u1 - self._sharekeys.keys()
        if self._stage is ServerStage.COLLECT_MASKED:
            return self._u2 - set(self._u3) - self._spoiled.keys()
        if self._stage is ServerStage.COLLECT_UNMASK:
            return frozenset(self._requests) - self._responses.keys()
        return frozenset()

    def close_stage(self) -> dict[str, SecAggDown]:
        """Close the open key or upload stage (:meth:`close_advertise`,
        :meth:`close_share_keys` or :meth:`close_masked_input`, by :attr:`stage`) and
        return the messages to send, by recipient. The unmask stage ends with
        :meth:`finalize` instead.

        Raises:
            RoundFailed: as the stage's close method.
            LocalProtocolError: the stage is COLLECT_UNMASK, DONE or FAILED.
        """
        close = {
            ServerStage.COLLECT_KEYS: self.close_advertise,
            ServerStage.COLLECT_SHARES: self.close_share_keys,
            ServerStage.COLLECT_MASKED: self.close_masked_input,
        }.get(self._stage)
        if close is None:
            raise LocalProtocolError(f"close_stage() called in stage {self._stage.value}")
        return dict(close())

    def receive(self, msg: SecAggUp) -> None:
        """Accept one device message, or raise and change nothing.

        Raises:
            RemoteProtocolError: wrong round, outsider, bad signature, wrong stage, a
                device not in the stage's set, malformed content.
            ReplayedMessage: an exact copy of an accepted message.
        """
        if isinstance(msg, AdvertiseKeys):
            self._admit(msg, ServerStage.COLLECT_KEYS, self._cfg.cohort)
            for name, key in (("mask_key", msg.mask_key), ("enc_key", msg.enc_key)):
                if not _usable_x25519(key):
                    raise RemoteProtocolError(
                        f"advertise_keys from {msg.sender!r}: {name} is a low-order X25519 "
                        f"point (every agreement with it is zero)"
                    )
            self._adverts[msg.sender] = msg
        elif isinstance(msg, ShareKeys):
            self._admit(msg, ServerStage.COLLECT_SHARES, self._u1)
            self._check_share_keys(msg)
            self._sharekeys[msg.sender] = msg
        elif isinstance(msg, MaskedPart):
            self._admit(msg, ServerStage.COLLECT_MASKED, self._u2)
            y = self._take_part(msg)
            if y is not None:
                np.add(self._sum, y, out=self._sum)
                self._u3.append(msg.sender)
        elif isinstance(msg, UnmaskResponse):
            self._admit(msg, ServerStage.COLLECT_UNMASK, self._requests)
            self._check_response(msg)
            self._responses[msg.sender] = msg
        else:
            raise RemoteProtocolError(f"the aggregator does not accept {type(msg).__name__}")
        self._seen[_seen_key(msg)] = msg

    def _check_share_keys(self, msg: ShareKeys) -> None:
        u = msg.sender
        want = {v for v in self._graph[u] if v in self._u1}
        got = [s.recipient for s in msg.shares]
        if sorted(got) != sorted(want):
            raise RemoteProtocolError(
                f"share_keys from {u!r} must seal one share for each advertised neighbour "
                f"{sorted(want)}, got {sorted(got)}"
            )
        for s in msg.shares:
            if s.sender != u or s.round_id != self._cfg.round_id:
                raise RemoteProtocolError(
                    f"share_keys from {u!r} carries a share of {s.sender!r} for round {s.round_id}"
                )
            self._reg.verify(u, s.sig, s.signing_bytes(self._digest), "encrypted_share")

    def _check_response(self, msg: UnmaskResponse) -> None:
        req = self._requests[msg.sender]
        if [o for o, _ in msg.mask_key_shares] != list(req.dropped) or [
            o for o, _ in msg.self_seed_shares
        ] != list(req.survivors):
            raise RemoteProtocolError(
                f"unmask_response from {msg.sender!r} does not answer its request"
            )
        try:
            for _, s in msg.mask_key_shares + msg.self_seed_shares:
                share_from_bytes(s)
        except ValueError as e:
            raise RemoteProtocolError(f"unmask_response from {msg.sender!r}: {e}") from None

    def close_advertise(self) -> dict[str, NeighbourKeys]:
        """End round 0: fix U1 (pruned to a t-core) and give each member its neighbours' keys.

        Raises:
            RoundFailed: no device can continue.
        """
        self._require(ServerStage.COLLECT_KEYS, "close_advertise()")
        u1, why = graph.stage_core(
            self._adverts, self._graph, self._cfg.threshold, did="advertised keys"
        )
        if why:
            raise self._fail(why)
        self._u1 = u1
        self._stage = ServerStage.COLLECT_SHARES
        return {
            u: self._sign(
                NeighbourKeys(
                    round_id=self._cfg.round_id,
                    recipient=u,
                    adverts=tuple(self._adverts[v] for v in self._graph[u] if v in u1),
                )
            )
            for u in sorted(u1)
        }

    def close_share_keys(self) -> dict[str, ForwardedShares]:
        """End round 1: fix U2 (pruned to a t-core) and forward each member the shares its
        neighbours in U2 sealed for it.

        Raises:
            RoundFailed: no device can continue.
        """
        self._require(ServerStage.COLLECT_SHARES, "close_share_keys()")
        u2, why = graph.stage_core(
            self._sharekeys, self._graph, self._cfg.threshold, did="shared keys"
        )
        if why:
            raise self._fail(why)
        self._u2 = u2
        inbox: dict[str, list[Any]] = {u: [] for u in u2}
        for owner in sorted(u2):
            for s in self._sharekeys[owner].shares:
                if s.recipient in u2:
                    inbox[s.recipient].append(s)
        self._stage = ServerStage.COLLECT_MASKED
        return {
            u: self._sign(
                ForwardedShares(round_id=self._cfg.round_id, recipient=u, shares=tuple(inbox[u]))
            )
            for u in sorted(u2)
        }

    def close_masked_input(self) -> dict[str, UnmaskRequest]:
        """End round 2: fix U3 and, if every needed neighbourhood keeps t survivors, ask
        each survivor for mask-key shares of its dropped neighbours and self-mask shares of
        its surviving ones.

        Raises:
            RoundFailed: a survivor, or a dropped device with a surviving neighbour, has
                fewer than t surviving neighbours. No request was made: nothing revealed.
        """
        self._require(ServerStage.COLLECT_MASKED, "close_masked_input()")
        u3 = set(self._u3)
        why = graph.upload_problem(self._graph, self._cfg.threshold, self._u2, u3)
        if why:
            raise self._fail(why)
        self._requests = {
            u: self._sign(
                UnmaskRequest(
                    round_id=self._cfg.round_id,
                    recipient=u,
                    dropped=tuple(v for v in self._graph[u] if v in self._u2 and v not in u3),
                    survivors=tuple(v for v in self._graph[u] if v in u3),
                    survivor_count=len(u3),
                )
            )
            for u in sorted(u3)
        }
        self._stage = ServerStage.COLLECT_UNMASK
        return dict(self._requests)

    def recover(self) -> None:
        """Reconstruct, from the responses so far, the dropped devices' mask keys and the
        survivors' self-mask seeds (Shamir; the bench times this apart from unmasking).

        Raises:
            RoundFailed: some needed secret has fewer than t shares among the responders,
                or a recovered mask key does not match its advertised public key.
        """
        self._require(ServerStage.COLLECT_UNMASK, "recover()")
        if self._recovered is not None:
            return
        t = self._cfg.threshold
        mask_shares: dict[str, dict[int, int]] = {}
        seed_shares: dict[str, dict[int, int]] = {}
        for holder, resp in self._responses.items():
            x = self._cfg.share_point(holder)
            for owner, s in resp.mask_key_shares:
                mask_shares.setdefault(owner, {})[x] = share_from_bytes(s)
            for owner, s in resp.self_seed_shares:
                seed_shares.setdefault(owner, {})[x] = share_from_bytes(s)
        u3 = set(self._u3)
        why = graph.share_shortfall(self._graph, t, self._u2, u3, self._responses)
        if why:
            raise self._fail(why)
        dropped, _ = graph.recovery_owners(self._graph, self._u2, u3)
        keys: dict[str, X25519PrivateKey] = {}
        for v in dropped:
            secret = combine_shares(mask_shares[v], threshold=t, prime=SHAMIR_PRIME)
            key = _x25519_from_int(secret)
            if key is None or _public(key) != self._adverts[v].mask_key:
                raise self._fail(
                    f"the mask key recovered for {v!r} does not match its "
                    f"advertised public key (corrupt shares)"
                )
            keys[v] = key
        seeds: dict[str, bytes] = {}
        for u in sorted(u3):
            secret = combine_shares(seed_shares[u], threshold=t, prime=SHAMIR_PRIME)
            if secret >> 256:
                raise self._fail(f"the self-mask seed recovered for {u!r} is not 32 bytes")
            seeds[u] = secret.to_bytes(32, "big")
        self._recovered = (keys, seeds)

    def finalize(self) -> np.ndarray:
        """Remove the masks that do not cancel; return the survivors' sum mod 2^bits.

        Returns:
            ``config.length`` residues in the ring's dtype (uint32 at b = 32; sums wrap
            mod its width, a multiple of 2^b): the sum of x_u over :attr:`survivors`.

        Raises:
            RoundFailed: as :meth:`recover`.
        """
        self.recover()
        assert self._recovered is not None
        keys, seeds = self._recovered
        u3 = set(self._u3)
        terms: list[tuple[int, bytes]] = [(1, seeds[u]) for u in sorted(u3)]
        for v, key in keys.items():
            for u in self._graph[v]:
                if u in u3:
                    secret = key.exchange(
                        X25519PublicKey.from_public_bytes(self._adverts[u].mask_key)
                    )
                    terms.append(
                        (mask_sign(u, v), derive_pairwise_seed(secret, context=self._digest))
                    )
        total = unmask(self._sum, bits=self._cfg.bits, terms=terms)
        self._stage = ServerStage.DONE
        return total

    def finalize_dense(self, coordinates: np.ndarray, dim: int) -> np.ndarray:
        """Sparse round: :meth:`finalize` scattered back to the rand-k set omega in [0, dim)."""
        return compress.desparsify(self.finalize(), np.asarray(coordinates), dim)

    def mask_count(self) -> int:
        """How many masks :meth:`finalize` expands: one self mask per survivor plus one
        pairwise mask per (dropped device, surviving neighbour) pair in U2."""
        u3 = set(self._u3)
        dropped = [v for v in self._u2 - u3]
        return len(u3) + sum(sum(u in u3 for u in self._graph[v]) for v in dropped)


_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def _usable_x25519(public: bytes) -> bool:
    # low-order points give the all-zero secret for every (clamped) scalar; cryptography
    # refuses that exchange with ValueError
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


def _x25519_from_int(secret: int) -> X25519PrivateKey | None:
    if secret >> 256:
        return None
    return X25519PrivateKey.from_private_bytes(secret.to_bytes(32, "big"))


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# --------------------------------------------------------------------------- amortized


class AmortizedSecAggServer(_Base):
    """The aggregator's side of the amortized variant (zCDP paper Fig. 2, eq. (9)).

    ``receive(MaskedPart)`` from the cohort; ``close_masked_input()`` returns reveal
    requests for survivors with dropped neighbours (empty when nobody dropped);
    ``receive(RevealResponse)``; ``finalize()``. Every survivor asked must answer: only
    the two endpoints know a pairwise round seed, so there is no threshold redundancy.
    """

    def __init__(
        self, *, identity: AggregatorIdentity, registry: Registry, config: RoundConfig
    ) -> None:
        if not config.amortized:
            raise ValueError("config.amortized is False: use SecAggServer")
        super().__init__(identity=identity, registry=registry, config=config)
        self._stage = ServerStage.COLLECT_MASKED
        self._sum = np.zeros(config.length, dtype=Ring(bits=config.bits).dtype)
        self._u3: list[str] = []
        self._requests: dict[str, RevealRequest] = {}
        self._responses: dict[str, RevealResponse] = {}

    @property
    def survivors(self) -> tuple[str, ...]:
        return tuple(sorted(self._u3))

    def pending(self) -> frozenset[str]:
        """The devices the open stage still waits for: the cohort's uploads, then the
        survivors asked to reveal. Empty once the round is done or failed."""
        if self._stage is ServerStage.COLLECT_MASKED:
            return frozenset(self._cfg.cohort) - set(self._u3) - self._spoiled.keys()
        if self._stage is ServerStage.COLLECT_UNMASK:
            return frozenset(self._requests) - self._responses.keys()
        return frozenset()

    def close_stage(self) -> dict[str, SecAggDown]:
        """Close the upload stage (:meth:`close_masked_input`): the reveal requests, by
        recipient (none when nobody dropped: :meth:`finalize` may follow at once).

        Raises:
            RoundFailed: as :meth:`close_masked_input`.
            LocalProtocolError: not in the upload stage.
        """
        if self._stage is not ServerStage.COLLECT_MASKED:
            raise LocalProtocolError(f"close_stage() called in stage {self._stage.value}")
        return dict(self.close_masked_input())

    def receive(self, msg: SecAggUp) -> None:
        """Accept one device message, or raise (RemoteProtocolError) and change nothing."""
        if isinstance(msg, MaskedPart):
            self._admit(msg, ServerStage.COLLECT_MASKED, self._cfg.cohort)
            y = self._take_part(msg)
            if y is not None:
                np.add(self._sum, y, out=self._sum)
                self._u3.append(msg.sender)
        elif isinstance(msg, RevealResponse):
            self._admit(msg, ServerStage.COLLECT_UNMASK, self._requests)
            if [p for p, _ in msg.seeds] != list(self._requests[msg.sender].dropped):
                raise RemoteProtocolError(
                    f"reveal_response from {msg.sender!r} does not answer its request"
                )
            self._responses[msg.sender] = msg
        else:
            raise RemoteProtocolError(f"the aggregator does not accept {type(msg).__name__}")
        self._seen[_seen_key(msg)] = msg

    def close_masked_input(self) -> dict[str, RevealRequest]:
        """Fix the survivors; ask those with dropped neighbours for this round's seeds.

        Raises:
            RoundFailed: nobody uploaded, or a survivor would keep fewer than t masked
                neighbours (it would refuse to reveal).
        """
        self._require(ServerStage.COLLECT_MASKED, "close_masked_input()")
        u3 = set(self._u3)
        if not u3:
            raise self._fail("no device uploaded a masked input")
        t = self._cfg.threshold
        requests = {}
        for u in sorted(u3):
            gone = tuple(v for v in self._graph[u] if v not in u3)
            if len(self._graph[u]) - len(gone) < t:
                raise self._fail(
                    f"survivor {u!r} has {len(self._graph[u]) - len(gone)} "
                    f"surviving neighbours, below the threshold {t}"
                )
            if gone:
                requests[u] = self._sign(
                    RevealRequest(round_id=self._cfg.round_id, recipient=u, dropped=gone)
                )
        self._requests = requests
        self._stage = ServerStage.COLLECT_UNMASK
        return dict(requests)

    def finalize(self) -> np.ndarray:
        """The survivors' sum mod 2^bits.

        Raises:
            RoundFailed: a survivor asked to reveal did not answer.
        """
        self._require(ServerStage.COLLECT_UNMASK, "finalize()")
        missing = sorted(set(self._requests) - set(self._responses))
        if missing:
            raise self._fail(
                f"survivors {missing} did not reveal their seeds; without them "
                f"their masks toward dropped devices cannot be removed"
            )
        terms = [
            (mask_sign(u, v), seed)
            for u, resp in sorted(self._responses.items())
            for v, seed in resp.seeds
        ]
        total = unmask(self._sum, bits=self._cfg.bits, terms=terms)
        self._stage = ServerStage.DONE
        return total


# --------------------------------------------------------------------------- in memory

DropStage: TypeAlias = Literal["advertise", "share_keys", "masked_input", "unmask"]
"""The first message a dropped device fails to send."""

_STAGES: tuple[DropStage, ...] = ("advertise", "share_keys", "masked_input", "unmask")


def _decode_up(data: bytes) -> SecAggUp:
    return schema.decode(data, SECAGG_UP)  # type: ignore[return-value]


def _hop(msg: SecAggDown) -> SecAggDown:
    """One trip over the (in-memory) wire: encode, then decode and validate."""
    return schema.decode(schema.encode(msg), SECAGG_DOWN)  # type: ignore[return-value]


def _hop_up(msg: SecAggUp) -> SecAggUp:
    return _decode_up(schema.encode(msg))


def run_round(
    *,
    server: SecAggServer,
    clients: Mapping[str, SecAggClient],
    inputs: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
    dropouts: Mapping[str, DropStage] | None = None,
    on_message: Callable[[str, bytes], None] | None = None,
) -> np.ndarray:
    """Drive one SecAgg(+) round between the server and the clients, in memory.

    Every message crosses the wire as msgpack bytes. ``dropouts[d] = stage`` makes device
    d vanish before it sends that stage's message (and everything after it).

    Args:
        server: a fresh :class:`SecAggServer`.
        clients: {device: fresh SecAggClient}, one per cohort member that takes part.
        inputs: each device's residues (a mapping, or a function called once per device
            when it masks, so that a large cohort needs no memory for all inputs).
        dropouts: {device: the stage at which it vanishes}.
        on_message: called with (sender, bytes) for every message a device sends.

    Returns:
        The unmasked sum mod 2^bits of :attr:`SecAggServer.survivors`' inputs.

    Raises:
        RoundFailed: too few devices left.
    """
    drops = dict(dropouts or {})
    bad = {d: s for d, s in drops.items() if s not in _STAGES}
    if bad:
        raise ValueError(f"dropout stages must be among {_STAGES}, got {bad}")
    get = inputs if callable(inputs) else inputs.__getitem__

    def alive(dev: str, stage: DropStage) -> bool:
        s = drops.get(dev)
        return s is None or _STAGES.index(s) > _STAGES.index(stage)

    def send(dev: str, msgs: SecAggUp | tuple[MaskedPart, ...]) -> None:
        for msg in msgs if isinstance(msgs, tuple) else (msgs,):
            data = schema.encode(msg)
            if on_message is not None:
                on_message(dev, data)
            server.receive(_decode_up(data))

    for dev, c in sorted(clients.items()):
        if alive(dev, "advertise"):
            send(dev, c.advertise())
    for dev, m in server.close_advertise().items():
        if dev in clients and alive(dev, "share_keys"):
            send(dev, clients[dev].share_keys(_hop(m)))  # type: ignore[arg-type]
    for dev, m in server.close_share_keys().items():
        if dev in clients and alive(dev, "masked_input"):
            send(dev, clients[dev].mask_input(_hop(m), get(dev)))  # type: ignore[arg-type]
    for dev, m in server.close_masked_input().items():
        if dev in clients and alive(dev, "unmask"):
            send(dev, clients[dev].unmask(_hop(m)))  # type: ignore[arg-type]
    return server.finalize()


def run_amortized_round(
    *,
    server: AmortizedSecAggServer,
    clients: Mapping[str, AmortizedSecAggClient],
    inputs: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
    dropouts: Mapping[str, Literal["masked_input", "unmask"]] | None = None,
) -> np.ndarray:
    """Drive one amortized round in memory (as :func:`run_round`; the stages are
    ``"masked_input"``: never uploads, and ``"unmask"``: uploads, then ignores the reveal
    request)."""
    drops = dict(dropouts or {})
    get = inputs if callable(inputs) else inputs.__getitem__
    for dev, c in sorted(clients.items()):
        if drops.get(dev) != "masked_input":
            for part in c.mask_input(get(dev)):
                server.receive(_hop_up(part))
    for dev, m in server.close_masked_input().items():
        if dev in clients and drops.get(dev) is None:
            server.receive(_hop_up(clients[dev].reveal(_hop(m))))  # type: ignore[arg-type]
    return server.finalize()
