"""Long-term keys of secure aggregation: device and aggregator identities, the registry.

Each device holds an Ed25519 signing key and an X25519 agreement key (the latter only for
the amortized variant's pairwise seeds); the aggregator holds an Ed25519 key. The
:class:`Registry` is the enrolled public keys as every party knows them (a trusted PKI,
written at enrollment by ``tools.enroll``) and verifies signatures.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)

from edge_sdk._validate import check_bytes as _check_bytes
from edge_sdk._validate import check_device_id as _check_id
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.hazmat.shamir import RandomBytes
from edge_sdk.wire.schema import Message, signer_of

__all__ = ["AggregatorIdentity", "DeviceIdentity", "Enrollment", "Registry"]

_KEY_BYTES = 32
_VERIFIERS = 8192  # verifier objects a Registry keeps (recently heard-from devices)


def _raw_public(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Enrollment:
    """A device's public record, registered once at enrollment (a trusted PKI).

    Attributes:
        device: the device id.
        sign_key: raw Ed25519 public key (32 bytes) that verifies its messages.
        agree_key: raw long-term X25519 public key (32 bytes), used only by the amortized
            variant to agree pairwise seeds without interaction.
    """

    device: str
    sign_key: bytes
    agree_key: bytes

    def __post_init__(self) -> None:
        _check_id("device", self.device)
        _check_bytes("sign_key", self.sign_key, _KEY_BYTES)
        _check_bytes("agree_key", self.agree_key, _KEY_BYTES)


class DeviceIdentity:
    """A device's long-term private keys (Ed25519 signing, X25519 agreement).

    Not a dataclass: it holds secrets, so it has no field-revealing repr or equality.
    """

    __slots__ = ("_agree", "_device", "_sign")

    def __init__(
        self, device: str, *, sign_key: Ed25519PrivateKey, agree_key: X25519PrivateKey
    ) -> None:
        self._device = _check_id("device", device)
        self._sign = sign_key
        self._agree = agree_key

    @classmethod
    def generate(cls, device: str, *, random_bytes: RandomBytes = os.urandom) -> DeviceIdentity:
        """Fresh keys from ``random_bytes`` (``os.urandom``; a seeded source in tests)."""
        return cls(
            device,
            sign_key=Ed25519PrivateKey.from_private_bytes(random_bytes(32)),
            agree_key=X25519PrivateKey.from_private_bytes(random_bytes(32)),
        )

    @property
    def device(self) -> str:
        return self._device

    def private_bytes(self) -> bytes:
        """The 64 secret bytes: raw Ed25519 private key (seed) || raw X25519 private key.

        For the key file written at enrollment (``tools.enroll``); keep them secret.
        """
        sign = self._sign.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())
        return sign + _raw_private(self._agree)

    @classmethod
    def from_private_bytes(cls, device: str, raw: bytes) -> DeviceIdentity:
        """Inverse of :meth:`private_bytes`."""
        _check_bytes("raw", raw, 2 * _KEY_BYTES)
        return cls(device, sign_key=Ed25519PrivateKey.from_private_bytes(raw[:_KEY_BYTES]),
                   agree_key=X25519PrivateKey.from_private_bytes(raw[_KEY_BYTES:]))

    def enrollment(self) -> Enrollment:
        """The public record to register."""
        return Enrollment(
            device=self._device,
            sign_key=_raw_public(self._sign),
            agree_key=_raw_public(self._agree),
        )

    def sign(self, data: bytes) -> bytes:
        return self._sign.sign(data)

    def agree(self, peer_public: bytes) -> bytes:
        """X25519 with the long-term agreement key (amortized variant only)."""
        return self._agree.exchange(X25519PublicKey.from_public_bytes(peer_public))

    def __repr__(self) -> str:
        return f"DeviceIdentity({self._device!r})"


class AggregatorIdentity:
    """The aggregator's long-term Ed25519 signing key (its messages are signed too)."""

    __slots__ = ("_sign",)

    def __init__(self, *, sign_key: Ed25519PrivateKey) -> None:
        self._sign = sign_key

    @classmethod
    def generate(cls, *, random_bytes: RandomBytes = os.urandom) -> AggregatorIdentity:
        return cls(sign_key=Ed25519PrivateKey.from_private_bytes(random_bytes(32)))

    @property
    def public_key(self) -> bytes:
        return _raw_public(self._sign)

    def private_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 private key (seed); keep it secret."""
        return self._sign.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> AggregatorIdentity:
        """Inverse of :meth:`private_bytes`."""
        _check_bytes("raw", raw, _KEY_BYTES)
        return cls(sign_key=Ed25519PrivateKey.from_private_bytes(raw))

    def sign(self, data: bytes) -> bytes:
        return self._sign.sign(data)

    def __repr__(self) -> str:
        return "AggregatorIdentity()"


@dataclass(frozen=True, slots=True, kw_only=True)
class Registry:
    """The enrolled devices and the aggregator's public key, as every party knows them.

    Attributes:
        aggregator_key: raw Ed25519 public key of the aggregator.
        devices: {device id: Enrollment}; becomes read-only.
    """

    aggregator_key: bytes
    devices: Mapping[str, Enrollment]
    _verifiers: dict[str, Ed25519PublicKey] | None = field(
        init=False, repr=False, compare=False, default=None
    )
    _aggregator_verifier: Ed25519PublicKey | None = field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        key = _check_bytes("aggregator_key", self.aggregator_key, _KEY_BYTES)
        devices = dict(self.devices)
        for name, enr in devices.items():
            if not isinstance(enr, Enrollment) or enr.device != name:
                raise ValueError(f"devices[{name!r}] must be the Enrollment of {name!r}")
        for e in devices.values():  # every key parses now; the objects are made on use
            Ed25519PublicKey.from_public_bytes(e.sign_key)
        object.__setattr__(self, "devices", MappingProxyType(devices))
        # verifier objects of the devices heard from lately, at most _VERIFIERS of them: a
        # registry of 100,000 enrolled devices holds their raw keys, not 100,000 objects
        object.__setattr__(self, "_verifiers", {})
        object.__setattr__(self, "_aggregator_verifier", Ed25519PublicKey.from_public_bytes(key))

    @classmethod
    def of(cls, aggregator: AggregatorIdentity, devices: Iterable[DeviceIdentity]) -> Registry:
        """Registry of the given identities (tests, simulations)."""
        return cls(
            aggregator_key=aggregator.public_key,
            devices={d.device: d.enrollment() for d in devices},
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able document of the public keys (hex): ``{"aggregator_key": ...,
        "devices": {name: {"sign_key": ..., "agree_key": ...}}}``."""
        return {
            "aggregator_key": self.aggregator_key.hex(),
            "devices": {n: {"sign_key": e.sign_key.hex(), "agree_key": e.agree_key.hex()}
                        for n, e in sorted(self.devices.items())},
        }

    @classmethod
    def from_json(cls, doc: object) -> Registry:
        """Inverse of :meth:`to_json`; ValueError naming what is wrong."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("devices"), Mapping):
            raise ValueError("a registry must be a map with 'aggregator_key' and 'devices'")

        def key(value: object, what: str) -> bytes:
            if not isinstance(value, str):
                raise ValueError(f"{what} must be a hex string, got {type(value).__name__}")
            try:
                return bytes.fromhex(value)
            except ValueError:
                raise ValueError(f"{what} is not hex: {value[:16]!r}...") from None

        devices = {}
        for name, enr in doc["devices"].items():
            if not isinstance(enr, Mapping):
                raise ValueError(f"devices[{name!r}] must be a map of sign_key and agree_key")
            devices[name] = Enrollment(device=name,
                                       sign_key=key(enr.get("sign_key"), f"{name}.sign_key"),
                                       agree_key=key(enr.get("agree_key"), f"{name}.agree_key"))
        return cls(aggregator_key=key(doc.get("aggregator_key"), "aggregator_key"),
                   devices=devices)

    def verify_message(self, msg: Message, *, context: bytes = b"") -> None:
        """Check a signed wire message's signature by its signer (the device it is from, or
        the aggregator: ``wire.signer_of``), over its signing bytes with ``context`` (the
        round configuration's digest for the SecAgg kinds).

        Raises:
            RemoteProtocolError: the signer is not enrolled, or the signature is bad.
        """
        self.verify(signer_of(msg), msg.sig, msg.signing_bytes(context),  # type: ignore[attr-defined]
                    msg.KIND)

    def _verifier(self, device: str) -> Ed25519PublicKey | None:
        cache = self._verifiers
        assert cache is not None
        key = cache.get(device)
        if key is None:
            enr = self.devices.get(device)
            if enr is None:
                return None
            if len(cache) >= _VERIFIERS:  # the oldest first (dicts keep insertion order)
                for old in list(cache)[:_VERIFIERS // 2]:
                    del cache[old]
            key = cache[device] = Ed25519PublicKey.from_public_bytes(enr.sign_key)
        return key

    def verify(self, signer: str | None, sig: bytes, data: bytes, what: str) -> None:
        """Check a signature by ``signer`` (None: the aggregator); RemoteProtocolError if bad."""
        key = self._aggregator_verifier if signer is None else self._verifier(signer)
        who = "the aggregator" if signer is None else repr(signer)
        if key is None:
            raise RemoteProtocolError(f"{what}: signer {who} is not enrolled")
        try:
            key.verify(sig, data)
        except InvalidSignature:
            raise RemoteProtocolError(f"{what}: bad signature from {who}") from None
