"""The masked vector of secure aggregation in parts below the packet size, and back.

A device's masked vector is ``count`` residues packed at ``bits`` (``hazmat.ring.Ring.pack``).
:func:`split_masked` cuts those raw bytes into :class:`~edge_sdk.wire.messages.MaskedPart`
messages of at most ``max_packet`` encoded bytes each (the caller signs each part);
:class:`Reassembler` joins the raw bytes again, so nothing is msgpack inside msgpack.
:func:`upload_sizes` counts the bytes of such an upload by encoding a real one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from edge_sdk.wire.messages import MaskedPart
from edge_sdk.wire.schema import SIG_BYTES, WireError, encode
from edge_sdk.wire.topics import check_name, device_up_topic, mqtt_publish_size

__all__ = [
    "DEFAULT_MAX_PACKET",
    "PART_FRAMING",
    "MaskedVector",
    "Reassembler",
    "SpoiledUpload",
    "split_masked",
    "upload_sizes",
]

DEFAULT_MAX_PACKET = 256 * 1024
"""Default largest payload of one MQTT message (bytes): uploads are cut below it."""
PART_FRAMING = 384
"""Bytes of a ``masked_part`` around its data, at most: the envelope's keys, a 64-character
device name, five integers (<= 9 bytes each), the 32-byte digest, the 64-byte signature and
the bin header come to about 270; the rest is margin (tests check every part fits)."""


class SpoiledUpload(WireError):
    """A device's parts, each consistent with the others, joined into bytes that do not match
    their own announced digest: the device signed an inconsistent upload. Unlike the other
    :class:`Reassembler` errors, the state has changed: the upload is dropped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskedVector:
    """A device's whole masked vector, joined from its parts (not a wire message: its parts
    are, each signed).

    Attributes:
        round_id, sender: whose; bits, count: ``count`` residues packed at ``bits``;
        data: the packed bytes (``ceil(count * bits / 8)``).
    """

    round_id: int
    sender: str
    bits: int
    count: int
    data: bytes


def split_masked(
    *, round_id: int, sender: str, bits: int, count: int, data: bytes,
    max_packet: int = DEFAULT_MAX_PACKET,
) -> list[MaskedPart]:
    """The unsigned parts of one masked vector, each of at most ``max_packet`` bytes once
    signed and encoded.

    Raises:
        ValueError: ``max_packet`` below 1024, or ``data`` not ``ceil(count * bits / 8)``
            bytes.
    """
    if isinstance(max_packet, bool) or not isinstance(max_packet, int) or max_packet < 1024:
        raise ValueError(f"max_packet must be an integer >= 1024 bytes, got {max_packet!r}")
    check_name("device", sender)
    want = (count * bits + 7) // 8
    if not isinstance(data, bytes) or len(data) != want or not data:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise ValueError(f"{count} residues of {bits} bits pack into {want} bytes, got {got}")
    room = max_packet - PART_FRAMING
    parts = -(-len(data) // room)
    digest = hashlib.sha256(data).digest()
    return [MaskedPart(round_id=round_id, sender=sender, part=i, parts=parts, bits=bits,
                       count=count, digest=digest, data=data[i * room:(i + 1) * room])
            for i in range(parts)]


def upload_sizes(
    count: int, bits: int, *, max_packet: int = DEFAULT_MAX_PACKET, fleet: str = "sim",
    device: str = "d0",
) -> tuple[int, int]:
    """(payload, framing) bytes of one masked upload of ``count`` values at ``bits`` each:
    the packed residues, and everything else on the wire (each part's msgpack envelope and
    signature, and its MQTT v5 PUBLISH header). Counted on real encoded messages (all-zero
    residues, a zero signature: the sizes do not depend on the values)."""
    data = bytes((count * bits + 7) // 8)
    topic = device_up_topic(fleet, device, MaskedPart.KIND)
    total = 0
    for part in split_masked(round_id=1, sender=device, bits=bits, count=count, data=data,
                             max_packet=max_packet):
        total += mqtt_publish_size(topic, len(encode(replace(part, sig=bytes(SIG_BYTES)))))
    return len(data), total - len(data)


@dataclass(slots=True)
class _Pending:
    parts: int
    bits: int
    count: int
    digest: bytes
    held: dict[int, bytes] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.held.values())


class Reassembler:
    """Joins masked parts, idempotently by (round, device, part index).

    An exact duplicate of a held or already-completed part is ignored; a part that
    contradicts what is held (another parts/bits/count/digest, or other bytes) is rejected,
    as is a joined vector whose length or digest does not match. Memory is bounded: at most
    ``max_pending`` uploads and ``max_bytes`` bytes in flight; beyond them a new upload is
    rejected (the caller decides; nothing held is evicted). Signatures are the caller's:
    check each part before :meth:`add`.
    """

    def __init__(self, *, max_pending: int = 1024, max_bytes: int = 512 * 1024 * 1024) -> None:
        self._max_pending = max_pending
        self._max_bytes = max_bytes
        self._pending: dict[tuple[int, str], _Pending] = {}
        self._done: dict[tuple[int, str], bytes] = {}  # key -> digest of the completed upload
        self._bytes = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def add(self, part: MaskedPart) -> MaskedVector | None:
        """Take one part; return the whole vector the first time it completes, else None.

        Raises:
            SpoiledUpload: the part completes a vector whose digest is wrong (the upload
                is dropped).
            WireError: the part conflicts with what is held, or would exceed the memory
                bounds; nothing changes.
        """
        key = (part.round_id, part.sender)
        who = f"part {part.part} of {part.sender!r} round {part.round_id}"
        done = self._done.get(key)
        if done is not None:
            if part.digest != done:
                raise WireError(f"{who} contradicts its completed upload")
            return None
        p = self._pending.get(key)
        if p is not None and (p.parts, p.bits, p.count, p.digest) != (
                part.parts, part.bits, part.count, part.digest):
            raise WireError(f"{who} announces another upload (parts/bits/count/digest) than "
                            f"earlier parts")
        if p is not None and part.part in p.held:
            if p.held[part.part] != part.data:
                raise WireError(f"{who} arrived twice with different bytes")
            return None
        if p is None and len(self._pending) >= self._max_pending:
            raise WireError(f"too many uploads in flight ({self._max_pending}); {who} dropped")
        if self._bytes + len(part.data) > self._max_bytes:
            raise WireError(f"reassembly buffer full ({self._max_bytes} bytes); {who} dropped")
        held = (p.size if p is not None else 0) + len(part.data)
        if held > part.total_bytes:
            raise WireError(f"parts of {part.sender!r} round {part.round_id} exceed the "
                            f"announced {part.total_bytes} bytes")
        if p is None:
            p = self._pending[key] = _Pending(part.parts, part.bits, part.count, part.digest)
        p.held[part.part] = part.data
        self._bytes += len(part.data)
        if len(p.held) < p.parts:
            return None
        del self._pending[key]
        self._bytes -= p.size
        data = b"".join(p.held[i] for i in range(p.parts))
        if len(data) != (p.count * p.bits + 7) // 8 or hashlib.sha256(data).digest() != p.digest:
            raise SpoiledUpload(f"upload of {part.sender!r} round {part.round_id} does not match "
                            f"its announced size/digest; dropped")
        self._done[key] = p.digest
        return MaskedVector(round_id=part.round_id, sender=part.sender, bits=p.bits,
                            count=p.count, data=data)

    def forget(self, round_id: int, device: str) -> None:
        """Drop all trace of one upload (held parts, or the mark that it completed)."""
        p = self._pending.pop((round_id, device), None)
        if p is not None:
            self._bytes -= p.size
        self._done.pop((round_id, device), None)

    def discard_round(self, round_id: int) -> None:
        """Forget everything about uploads of ``round_id`` and earlier."""
        for store in (self._pending, self._done):
            for key in [k for k in store if k[0] <= round_id]:
                item = store.pop(key)
                if isinstance(item, _Pending):
                    self._bytes -= item.size

    def to_state(self) -> dict[str, Any]:
        """A msgpack-able copy of the buffers (for checkpoints)."""
        return {
            "pending": [[r, d, p.parts, p.bits, p.count, p.digest, sorted(p.held.items())]
                        for (r, d), p in sorted(self._pending.items())],
            "done": [[r, d, dig] for (r, d), dig in sorted(self._done.items())],
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`to_state` (replaces the buffers)."""
        self._pending, self._done, self._bytes = {}, {}, 0
        for r, d, parts, bits, count, digest, held in state["pending"]:
            p = _Pending(parts, bits, count, bytes(digest), {int(i): bytes(b) for i, b in held})
            self._pending[(r, d)] = p
            self._bytes += p.size
        for r, d, dig in state["done"]:
            self._done[(r, d)] = bytes(dig)
