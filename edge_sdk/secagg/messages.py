"""The wire messages of secure aggregation: schemas, validation, signed bytes.

Every message is a frozen, keyword-only dataclass with a ``KIND``, travels as a msgpack map
``{"v": PROTOCOL_VERSION, "kind", "round", ...fields, "sig"}`` and is signed with the
sender's long-term Ed25519 key (the aggregator's own messages with its key) over
``b"fedge/secagg/v1/sig" + digest + msgpack(message without "sig")``, ``digest`` being the
round's ``RoundConfig.digest()``. Binding the config digest means a message from another
round, or built on a different view of the round, fails verification. Wire formats, pinned
by ``tests/golden/secagg_vectors.json``. :func:`decode_message` validates every field;
signatures are checked by the receiving endpoint, which knows the keys and the round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

import msgpack

from edge_sdk._validate import device_id_problem as _id_problem
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.hazmat.masking import SEED_BYTES
from edge_sdk.hazmat.shamir import SHARE_BYTES
from edge_sdk.secagg.identity import AggregatorIdentity, DeviceIdentity

__all__ = [
    "PROTOCOL_VERSION",
    "SIGNATURE_LABEL",
    "AdvertiseKeys",
    "EncryptedShare",
    "ForwardedShares",
    "MaskedInput",
    "Message",
    "NeighbourKeys",
    "RevealRequest",
    "RevealResponse",
    "ShareKeys",
    "UnmaskRequest",
    "UnmaskResponse",
    "decode_message",
    "encode_message",
]

PROTOCOL_VERSION = 3
"""Version carried by every message; a new value is a new wire format (2: the unmask
request states the survivor count; 3: the mask PRG at the ring's width, fedge/secagg/v2)."""

SIGNATURE_LABEL = b"fedge/secagg/v1/sig"

_KEY_BYTES = 32
_SIG_BYTES = 64
_NONCE_BYTES = 12
_MAX_COHORT = 1 << 16
_MAX_LENGTH = 1 << 31


def _expect_map(obj: object, kind: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"{kind} must be a map, got {type(obj).__name__}")
    want = keys | {"v", "kind"}
    got = set(obj)
    if got != want:
        extra, missing = sorted(map(repr, got - want)), sorted(want - got)
        raise RemoteProtocolError(
            f"{kind} must have exactly the fields {sorted(want)}; missing {missing}, "
            f"unexpected {extra}"
        )
    if obj["v"] != PROTOCOL_VERSION or isinstance(obj["v"], bool):
        raise RemoteProtocolError(
            f"{kind}: protocol version must be {PROTOCOL_VERSION}, got {obj['v']!r}"
        )
    if obj["kind"] != kind:
        raise RemoteProtocolError(f"expected a {kind} message, got kind {obj['kind']!r}")
    return obj


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RemoteProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _bin(
    d: dict[str, Any], key: str, size: int | None = None, max_size: int = _MAX_LENGTH
) -> bytes:
    v = d[key]
    if not isinstance(v, bytes):
        raise RemoteProtocolError(f"field {key!r} must be bytes, got {type(v).__name__}")
    if size is not None and len(v) != size:
        raise RemoteProtocolError(f"field {key!r} must be {size} bytes, got {len(v)}")
    if len(v) > max_size:
        raise RemoteProtocolError(f"field {key!r} must be at most {max_size} bytes, got {len(v)}")
    return v


def _wire_id(v: object, what: str) -> str:
    problem = _id_problem(v)
    if problem:
        raise RemoteProtocolError(f"{what} {v!r} {problem}")
    return v  # type: ignore[return-value]


def _id(d: dict[str, Any], key: str) -> str:
    return _wire_id(d[key], f"field {key!r}")


def _list(d: dict[str, Any], key: str, max_len: int = _MAX_COHORT) -> list[Any]:
    v = d[key]
    if not isinstance(v, list):
        raise RemoteProtocolError(f"field {key!r} must be a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise RemoteProtocolError(f"field {key!r} must have at most {max_len} items, got {len(v)}")
    return v


def _ids(d: dict[str, Any], key: str) -> tuple[str, ...]:
    items = tuple(_wire_id(v, f"item of {key!r}") for v in _list(d, key))
    if len(set(items)) != len(items):
        raise RemoteProtocolError(f"field {key!r} must list distinct devices, got {items}")
    return items


def _id_bytes_pairs(d: dict[str, Any], key: str, size: int) -> tuple[tuple[str, bytes], ...]:
    out = []
    for item in _list(d, key):
        if not (isinstance(item, list) and len(item) == 2):
            raise RemoteProtocolError(f"items of {key!r} must be [device, bytes] pairs")
        dev = _wire_id(item[0], f"device in {key!r}")
        blob = item[1]
        if not isinstance(blob, bytes) or len(blob) != size:
            raise RemoteProtocolError(f"{key!r}[{dev!r}] must be {size} bytes")
        out.append((dev, blob))
    owners = [o for o, _ in out]
    if len(set(owners)) != len(owners):
        raise RemoteProtocolError(f"field {key!r} must name each device once, got {owners}")
    return tuple(out)


# --------------------------------------------------------------------------- messages


class _Message:
    """Shared behaviour of the wire messages (each a frozen, keyword-only dataclass)."""

    __slots__ = ()
    KIND: ClassVar[str]
    sig: bytes

    def payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able map of this message, signature included."""
        return {**self.payload(), "sig": self.sig}

    def signing_bytes(self, digest: bytes) -> bytes:
        """What the signature covers: label, round digest, msgpack of the unsigned map."""
        return SIGNATURE_LABEL + digest + msgpack.packb(self.payload(), use_bin_type=True)


def _sign_with(msg: Any, signer: DeviceIdentity | AggregatorIdentity, digest: bytes) -> Any:
    return replace(msg, sig=signer.sign(msg.signing_bytes(digest)))


def _head(kind: str, round_id: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "kind": kind, "round": round_id}


_ROUND_HI = (1 << 63) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvertiseKeys(_Message):
    """Device -> aggregator -> neighbours: this round's two X25519 public keys
    (Bonawitz et al. Fig. 4, round 0 "AdvertiseKeys")."""

    KIND: ClassVar[str] = "advertise_keys"
    round_id: int
    sender: str
    mask_key: bytes
    enc_key: bytes
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "mask_key": self.mask_key,
            "enc_key": self.enc_key,
        }

    @classmethod
    def from_wire(cls, obj: object) -> AdvertiseKeys:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "mask_key", "enc_key", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            mask_key=_bin(d, "mask_key", _KEY_BYTES),
            enc_key=_bin(d, "enc_key", _KEY_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class NeighbourKeys(_Message):
    """Aggregator -> device: the signed advertisements of its neighbours that advertised."""

    KIND: ClassVar[str] = "neighbour_keys"
    round_id: int
    recipient: str
    adverts: tuple[AdvertiseKeys, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "adverts": [a.to_wire() for a in self.adverts],
        }

    @classmethod
    def from_wire(cls, obj: object) -> NeighbourKeys:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "adverts", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            adverts=tuple(AdvertiseKeys.from_wire(a) for a in _list(d, "adverts")),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EncryptedShare(_Message):
    """One owner's two shares for one holder, sealed with ChaCha20-Poly1305.

    Plaintext: mask-key share (66 bytes) || self-mask-seed share (66 bytes). Associated
    data: ``b"fedge/secagg/v1/share" + digest + lp(sender) + lp(recipient)``.
    """

    KIND: ClassVar[str] = "encrypted_share"
    round_id: int
    sender: str
    recipient: str
    nonce: bytes
    ciphertext: bytes
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "recipient": self.recipient,
            "nonce": self.nonce,
            "ciphertext": self.ciphertext,
        }

    @classmethod
    def from_wire(cls, obj: object) -> EncryptedShare:
        d = _expect_map(
            obj, cls.KIND, {"round", "sender", "recipient", "nonce", "ciphertext", "sig"}
        )
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            recipient=_id(d, "recipient"),
            nonce=_bin(d, "nonce", _NONCE_BYTES),
            ciphertext=_bin(d, "ciphertext", _SHARE_CT_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


_SHARE_CT_BYTES = 2 * SHARE_BYTES + 16


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareKeys(_Message):
    """Device -> aggregator: its encrypted shares, one per neighbour (round 1 "ShareKeys")."""

    KIND: ClassVar[str] = "share_keys"
    round_id: int
    sender: str
    shares: tuple[EncryptedShare, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "shares": [s.to_wire() for s in self.shares],
        }

    @classmethod
    def from_wire(cls, obj: object) -> ShareKeys:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "shares", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            shares=tuple(EncryptedShare.from_wire(s) for s in _list(d, "shares")),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardedShares(_Message):
    """Aggregator -> device: the shares its neighbours sealed for it."""

    KIND: ClassVar[str] = "forwarded_shares"
    round_id: int
    recipient: str
    shares: tuple[EncryptedShare, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "shares": [s.to_wire() for s in self.shares],
        }

    @classmethod
    def from_wire(cls, obj: object) -> ForwardedShares:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "shares", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            shares=tuple(EncryptedShare.from_wire(s) for s in _list(d, "shares")),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskedInput(_Message):
    """Device -> aggregator: the masked vector y_u, ``count`` residues packed at ``bits``
    (:meth:`edge_sdk.hazmat.ring.Ring.pack`): exactly ``ceil(count * bits / 8)`` payload bytes."""

    KIND: ClassVar[str] = "masked_input"
    round_id: int
    sender: str
    bits: int
    count: int
    payload_bytes: bytes
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "bits": self.bits,
            "count": self.count,
            "data": self.payload_bytes,
        }

    @classmethod
    def from_wire(cls, obj: object) -> MaskedInput:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "bits", "count", "data", "sig"})
        bits, count = _int(d, "bits", 1, 64), _int(d, "count", 1, _MAX_LENGTH)
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            bits=bits,
            count=count,
            payload_bytes=_bin(d, "data", (count * bits + 7) // 8),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UnmaskRequest(_Message):
    """Aggregator -> surviving device: which of its neighbours dropped (reveal their
    mask-key shares) and which survived (reveal their self-mask shares), and how many
    uploads in all (``survivor_count`` = |U3|, the recipient included) the unmasked sum
    will contain: a device whose accounting assumes a minimum checks it before answering
    (``edge_sdk.session``). With the complete graph the device can verify it (its
    surviving neighbours plus itself); with SecAgg+ neighbourhoods it is the
    aggregator's word (the aggregator is assumed semi-honest, see :mod:`edge_sdk.secagg`)."""

    KIND: ClassVar[str] = "unmask_request"
    round_id: int
    recipient: str
    dropped: tuple[str, ...]
    survivors: tuple[str, ...]
    survivor_count: int
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "dropped": list(self.dropped),
            "survivors": list(self.survivors),
            "survivor_count": self.survivor_count,
        }

    @classmethod
    def from_wire(cls, obj: object) -> UnmaskRequest:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "dropped", "survivors",
                                         "survivor_count", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            dropped=_ids(d, "dropped"),
            survivors=_ids(d, "survivors"),
            survivor_count=_int(d, "survivor_count", 1, _MAX_COHORT),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UnmaskResponse(_Message):
    """Device -> aggregator: the requested shares, as (owner, 66-byte share) pairs."""

    KIND: ClassVar[str] = "unmask_response"
    round_id: int
    sender: str
    mask_key_shares: tuple[tuple[str, bytes], ...]
    self_seed_shares: tuple[tuple[str, bytes], ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "mask_key_shares": [[o, s] for o, s in self.mask_key_shares],
            "self_seed_shares": [[o, s] for o, s in self.self_seed_shares],
        }

    @classmethod
    def from_wire(cls, obj: object) -> UnmaskResponse:
        d = _expect_map(
            obj, cls.KIND, {"round", "sender", "mask_key_shares", "self_seed_shares", "sig"}
        )
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            mask_key_shares=_id_bytes_pairs(d, "mask_key_shares", SHARE_BYTES),
            self_seed_shares=_id_bytes_pairs(d, "self_seed_shares", SHARE_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RevealRequest(_Message):
    """Amortized variant, aggregator -> survivor: these neighbours of yours dropped."""

    KIND: ClassVar[str] = "reveal_request"
    round_id: int
    recipient: str
    dropped: tuple[str, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "dropped": list(self.dropped),
        }

    @classmethod
    def from_wire(cls, obj: object) -> RevealRequest:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "dropped", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            dropped=_ids(d, "dropped"),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RevealResponse(_Message):
    """Amortized variant, survivor -> aggregator: this round's pairwise seeds toward the
    dropped neighbours, as (peer, 32-byte round seed) pairs."""

    KIND: ClassVar[str] = "reveal_response"
    round_id: int
    sender: str
    seeds: tuple[tuple[str, bytes], ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "seeds": [[p, s] for p, s in self.seeds],
        }

    @classmethod
    def from_wire(cls, obj: object) -> RevealResponse:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "seeds", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            seeds=_id_bytes_pairs(d, "seeds", SEED_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


Message: TypeAlias = (
    AdvertiseKeys
    | NeighbourKeys
    | EncryptedShare
    | ShareKeys
    | ForwardedShares
    | MaskedInput
    | UnmaskRequest
    | UnmaskResponse
    | RevealRequest
    | RevealResponse
)
_KINDS: Mapping[str, Any] = MappingProxyType(
    {
        c.KIND: c
        for c in (
            AdvertiseKeys,
            NeighbourKeys,
            EncryptedShare,
            ShareKeys,
            ForwardedShares,
            MaskedInput,
            UnmaskRequest,
            UnmaskResponse,
            RevealRequest,
            RevealResponse,
        )
    }
)


def encode_message(msg: Message) -> bytes:
    """msgpack bytes of a message (its :meth:`to_wire` map)."""
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def decode_message(data: bytes) -> Message:
    """Parse and validate msgpack bytes into a message (signatures are checked by the
    receiving endpoint, which knows the keys and the round).

    Raises:
        RemoteProtocolError: truncated or malformed bytes, unknown kind or version, a field
            of the wrong type or size.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RemoteProtocolError(f"a message must be bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RemoteProtocolError(f"malformed message bytes: {e}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"a message must be a map, got {type(obj).__name__}")
    kind = obj.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message kind {obj.get('kind')!r}")
    return cls.from_wire(obj)  # type: ignore[no-any-return]
