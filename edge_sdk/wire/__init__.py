"""The bytes both sides agree on: topics, the round's message set, validation, chunking.

Every message travels as a msgpack map with the protocol version ``"v"`` and its
``"kind"``; arrays as raw little-endian bytes + dtype + shape (never pickle); published
over MQTT v5 with QoS 1. :func:`decode` validates everything it returns (types, sizes,
ranges, finite floats, limits on every length, see :class:`Limits`) and raises
:class:`WireError` naming the problem otherwise; every truncated prefix of a valid
message fails that way. Secure-aggregation messages keep ``edge_sdk.secagg``'s own
encoding and are only wrapped (:class:`SecAggPacket`); the masked upload is cut into
:class:`UploadChunk` s below the packet size (:func:`split_upload`) and joined again by a
:class:`Reassembler`. ``tests/golden/wire_vectors.json`` pins the encoding.

:func:`encode_update` and :func:`mqtt_publish_size` are the simulator's byte counts.

Errors (the whole tree: :mod:`edge_sdk.errors`)::

    errors.RemoteProtocolError
     +-- WireError          bytes from a peer that are not a valid message
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeAlias

import msgpack
import numpy as np

from edge_sdk import secagg
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.secagg import messages

__all__ = [
    "DEFAULT_MAX_PACKET",
    "LIMITS",
    "PROTOCOL_VERSION",
    "colluder_problem",
    "WIRE_SIGNATURE_LABEL",
    "CheckIn",
    "Decline",
    "ErrorNotice",
    "Limits",
    "ModelUpdate",
    "Publish",
    "Reassembler",
    "RoundPlan",
    "SecAggPacket",
    "UploadChunk",
    "WireArray",
    "WireError",
    "WireMessage",
    "decode",
    "encode",
    "sign",
    "split_upload",
    "verify",
    "check_name",
    "device_down_topic",
    "device_up_topic",
    "encode_update",
    "fleet_topic",
    "model_topic",
    "mqtt_publish_size",
    "status_topic",
    "update_topic",
]

PROTOCOL_VERSION = 2  # 2: RoundPlan.max_colluders, secagg v2 (unmask survivor_count)

# Topic layout (the broker's ACLs are written from the same functions, tools/broker.py):
#
#   fedge/<fleet>/dev/<device>/up/<kind>     device -> aggregator; only <device> may publish
#   fedge/<fleet>/dev/<device>/down/<kind>   aggregator -> device; only <device> may read
#   fedge/<fleet>/status/<device>            the device's online/offline (last will)
#   fedge/<fleet>/model                      the global model, retained; only the aggregator
#   fedge/<fleet>/round                      round announcements; only the aggregator
#
# Fleet and device names are restricted so that they can never contain MQTT wildcards or
# separators (a device named "+" would otherwise widen its own ACL pattern).
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_name(kind: str, value: object) -> str:
    """``value`` if it is a valid fleet/device/kind name (1-64 of ``[A-Za-z0-9_.-]``)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{kind} must be 1-64 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


def fleet_topic(fleet: str) -> str:
    """Root of a fleet's topics: ``fedge/<fleet>``."""
    return f"fedge/{check_name('fleet', fleet)}"


def device_up_topic(fleet: str, device: str, kind: str) -> str:
    """A device's message to the aggregator: ``fedge/<fleet>/dev/<device>/up/<kind>``."""
    return f"{fleet_topic(fleet)}/dev/{check_name('device', device)}/up/{check_name('kind', kind)}"


def device_down_topic(fleet: str, device: str, kind: str) -> str:
    """The aggregator's message to one device: ``fedge/<fleet>/dev/<device>/down/<kind>``."""
    return (
        f"{fleet_topic(fleet)}/dev/{check_name('device', device)}/down/{check_name('kind', kind)}"
    )


def status_topic(fleet: str, device: str) -> str:
    """A device's online/offline status (its last will): ``fedge/<fleet>/status/<device>``."""
    return f"{fleet_topic(fleet)}/status/{check_name('device', device)}"


def model_topic(fleet: str) -> str:
    """The retained global model: ``fedge/<fleet>/model``."""
    return f"{fleet_topic(fleet)}/model"


def update_topic(fleet: str, device: str) -> str:
    """Topic of a device's update upload: ``fedge/<fleet>/dev/<device>/up/update``."""
    return device_up_topic(fleet, device, "update")


@dataclass(frozen=True, slots=True)
class Publish:
    """What a sans-I/O endpoint (device session, aggregator rounds) asks its adapter to send.

    QoS is always 1. ``retain`` only for the global model.
    """

    topic: str
    payload: bytes
    retain: bool = False


def encode_update(
    *, round_id: int, device: str, encoding: str, count: int, payload: bytes
) -> bytes:
    """msgpack bytes of one update: version, round, device, encoding name, value count,
    payload (raw little-endian bytes or a packed quantized vector)."""
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": "update", "round": round_id, "device": device,
         "enc": encoding, "n": count, "payload": payload},
        use_bin_type=True,
    )


def _varint_len(n: int) -> int:
    size = 1
    while n >= 128:
        n >>= 7
        size += 1
    return size


def mqtt_publish_size(topic: str, payload_len: int, *, qos: int = 1,
                      properties_len: int = 0) -> int:
    """Bytes on the wire of one MQTT v5 PUBLISH packet (MQTT 5.0 spec, sec. 3.3).

    Fixed header (1 byte + remaining-length varint) + topic (2 + UTF-8 length) + packet
    identifier (2, QoS > 0) + properties (varint length + properties) + payload.
    """
    if qos not in (0, 1, 2):
        raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
    variable = 2 + len(topic.encode()) + (2 if qos else 0)
    variable += _varint_len(properties_len) + properties_len
    remaining = variable + payload_len
    return 1 + _varint_len(remaining) + remaining


# =========================================================================== round messages
#
# Everything below is the message set of one round over MQTT (issue 6). Each message is a
# frozen, keyword-only dataclass with ``to_wire``/``from_wire``; :func:`encode` and
# :func:`decode` turn them into and out of msgpack maps carrying ``"v"`` (the protocol
# version) and ``"kind"``. Topics (``device_up_topic``/``device_down_topic`` kinds):
#
#   kind        direction                 topic kind    signed by
#   checkin     device -> aggregator      up/checkin    the device (Ed25519)
#   decline     device -> aggregator      up/decline    the device
#   secagg      device -> aggregator      up/secagg     (the wrapped secagg message is)
#   chunk       device -> aggregator      up/chunk      (the reassembled MaskedInput is)
#   plan        aggregator -> device      down/plan     the aggregator
#   secagg      aggregator -> device      down/secagg   (the wrapped secagg message is)
#   error       aggregator -> device      down/error    the aggregator
#   model       aggregator -> everyone    model         the aggregator (retained)
#
# Signatures cover ``WIRE_SIGNATURE_LABEL + msgpack(map without "sig")``; decoding checks
# structure only, the receiving endpoint (which knows the registry) checks signatures.
# Chunks are not signed one by one: the message they reassemble into is, and a chunk that
# contradicts an earlier one is rejected (the broker's ACLs keep others off the topic).


WIRE_SIGNATURE_LABEL = b"fedge/wire/v1/sig"
DEFAULT_MAX_PACKET = 256 * 1024
"""Default largest payload of one MQTT message (bytes): uploads are chunked below it."""


class WireError(RemoteProtocolError):
    """Bytes from a peer that are not a valid message: truncated, malformed, too large,
    of an unknown kind or version, or with a field of the wrong type, size or value.

    A :class:`edge_sdk.errors.RemoteProtocolError` (the peer is to blame), so endpoints
    catch one type for every inbound problem.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Upper bounds enforced while decoding (each a count or a byte length)."""

    max_message_bytes: int = 64 * 1024 * 1024
    max_string: int = 256
    max_cohort: int = 4096
    max_arrays: int = 64
    max_ndim: int = 8
    max_array_elements: int = 1 << 26
    max_chunks: int = 4096
    max_upload_bytes: int = 256 * 1024 * 1024
    max_secagg_bytes: int = 4 * 1024 * 1024


LIMITS = Limits()

_ROUND_HI = (1 << 63) - 1
_DTYPES = ("<f4", "<f8", "<i4", "<i8", "<u4", "<u8", "|u1")
_SAMPLING = ("poisson", "shuffle")


# ----------------------------------------------------------------------- field checks


def _fail(kind: str, what: str) -> WireError:
    return WireError(f"{kind}: {what}")


def _int(kind: str, d: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _fail(kind, f"field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(
    kind: str, d: Mapping[str, Any], key: str, lo: float, hi: float = math.inf,
    *, open_lo: bool = False,
) -> float:
    v = d[key]
    if not isinstance(v, float):  # floats only: one encoding per message
        raise _fail(kind, f"field {key!r} must be a float, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or f < lo or f > hi or (open_lo and f == lo):
        bound = f"{'(' if open_lo else '['}{lo}, {hi}]"
        raise _fail(kind, f"field {key!r} must be finite in {bound}, got {v!r}")
    return f


def _str(kind: str, d: Mapping[str, Any], key: str, limits: Limits) -> str:
    v = d[key]
    if not isinstance(v, str):
        raise _fail(kind, f"field {key!r} must be a string, got {type(v).__name__}")
    if len(v) > limits.max_string:
        raise _fail(kind, f"field {key!r} must be at most {limits.max_string} characters, "
                          f"got {len(v)}")
    return v


def _name(kind: str, d: Mapping[str, Any], key: str) -> str:
    v = d[key]
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise _fail(kind, f"field {key!r} must be 1-64 characters of [A-Za-z0-9_.-], got {v!r}")
    return v


def _bin(kind: str, d: Mapping[str, Any], key: str, *, size: int | None = None,
         max_size: int | None = None) -> bytes:
    v = d[key]
    if not isinstance(v, bytes):
        raise _fail(kind, f"field {key!r} must be bytes, got {type(v).__name__}")
    if size is not None and len(v) != size:
        raise _fail(kind, f"field {key!r} must be {size} bytes, got {len(v)}")
    if max_size is not None and len(v) > max_size:
        raise _fail(kind, f"field {key!r} must be at most {max_size} bytes, got {len(v)}")
    return v


def _names(kind: str, d: Mapping[str, Any], key: str, limits: Limits) -> tuple[str, ...]:
    v = d[key]
    if not isinstance(v, list):
        raise _fail(kind, f"field {key!r} must be a list, got {type(v).__name__}")
    if len(v) > limits.max_cohort:
        raise _fail(kind, f"field {key!r} must have at most {limits.max_cohort} items, "
                          f"got {len(v)}")
    out = tuple(_name(kind, {key: x}, key) for x in v)
    if list(out) != sorted(set(out)):
        raise _fail(kind, f"field {key!r} must list distinct names in sorted order")
    return out


def _check_fields(kind: str, obj: Mapping[str, Any], keys: Iterable[str]) -> None:
    want = set(keys) | {"v", "kind"}
    got = set(obj)
    if got != want:
        raise _fail(kind, f"must have exactly the fields {sorted(want)}; missing "
                          f"{sorted(want - got)}, unexpected {sorted(map(repr, got - want))}")


# ----------------------------------------------------------------------- arrays


@dataclass(frozen=True, slots=True, kw_only=True)
class WireArray:
    """A numpy array on the wire: raw little-endian bytes, dtype string and shape.

    Float arrays must be finite (checked on construction, so on decode too).
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.shape, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.shape
        ):
            raise ValueError(f"shape must be a tuple of integers >= 0, got {self.shape!r}")
        want = math.prod(self.shape) * np.dtype(self.dtype).itemsize
        if not isinstance(self.data, bytes) or len(self.data) != want:
            got = len(self.data) if isinstance(self.data, bytes) else type(self.data).__name__
            raise ValueError(f"an array of dtype {self.dtype} and shape {self.shape} takes "
                             f"{want} bytes, got {got}")
        if self.dtype[1] == "f":
            a = np.frombuffer(self.data, dtype=self.dtype)
            if not np.isfinite(a).all():
                bad = int(np.flatnonzero(~np.isfinite(a))[0])
                raise ValueError(f"float array holds {a[bad]!r} at flat index {bad}; "
                                 f"only finite values are allowed")

    @classmethod
    def of(cls, array: np.ndarray) -> WireArray:
        """The wire form of ``array`` (converted to little-endian)."""
        a = np.asarray(array)
        dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
        code = dt.str
        if code not in _DTYPES:
            raise ValueError(f"arrays of dtype {a.dtype} cannot travel; use one of {_DTYPES}")
        return cls(dtype=code, shape=tuple(int(n) for n in a.shape),
                   data=np.ascontiguousarray(a, dtype=dt).tobytes())

    def to_numpy(self) -> np.ndarray:
        """A fresh, writable array in native byte order."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape).astype(
            np.dtype(self.dtype).newbyteorder("="))

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, kind: str, obj: object, limits: Limits) -> WireArray:
        if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
            raise _fail(kind, "an array must be a map of exactly dtype, shape and data")
        dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise _fail(kind, f"array dtype must be one of {_DTYPES}, got {dtype!r}")
        if not isinstance(shape, list) or len(shape) > limits.max_ndim:
            raise _fail(kind, f"array shape must be a list of at most {limits.max_ndim} "
                              f"sizes, got {shape!r}")
        dims = []
        for n in shape:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= (
                limits.max_array_elements
            ):
                raise _fail(kind, f"array sizes must be integers in "
                                  f"[0, {limits.max_array_elements}], got {n!r}")
            dims.append(n)
        if math.prod(dims) > limits.max_array_elements:
            raise _fail(kind, f"array of shape {dims} exceeds {limits.max_array_elements} "
                              f"elements")
        if not isinstance(data, bytes):
            raise _fail(kind, f"array data must be bytes, got {type(data).__name__}")
        try:
            return cls(dtype=dtype, shape=tuple(dims), data=data)
        except ValueError as e:
            raise _fail(kind, str(e)) from None


# ----------------------------------------------------------------------- messages


class _Wire:
    """Shared behaviour: ``payload()`` is the map without the signature."""

    __slots__ = ()
    KIND: ClassVar[str]
    SIGNED: ClassVar[bool] = False

    def payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        out = {"v": PROTOCOL_VERSION, "kind": self.KIND, **self.payload()}
        if self.SIGNED:
            out["sig"] = self.sig  # type: ignore[attr-defined]
        return out

    def signing_bytes(self) -> bytes:
        body = {"v": PROTOCOL_VERSION, "kind": self.KIND, **self.payload()}
        return WIRE_SIGNATURE_LABEL + msgpack.packb(body, use_bin_type=True)


def _sig(kind: str, d: Mapping[str, Any]) -> bytes:
    return _bin(kind, d, "sig", size=64)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckIn(_Wire):
    """Device -> aggregator: "I am available" (DESIGN, one round, step 1).

    Attributes:
        device: the sender (must match the topic's device).
        data_size: number of local training samples.
        remaining_epsilon: local epsilon left in the device's budget (its ledger's figure).
        model_version: the global model version the device holds (-1: none yet).
    """

    KIND: ClassVar[str] = "checkin"
    SIGNED: ClassVar[bool] = True
    device: str
    data_size: int
    remaining_epsilon: float
    model_version: int
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {"device": self.device, "data_size": self.data_size,
                "remaining_epsilon": float(self.remaining_epsilon),
                "model_version": self.model_version}

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> CheckIn:
        k = cls.KIND
        _check_fields(k, d, ("device", "data_size", "remaining_epsilon", "model_version", "sig"))
        return cls(device=_name(k, d, "device"), data_size=_int(k, d, "data_size", 0, 1 << 40),
                   remaining_epsilon=_float(k, d, "remaining_epsilon", 0.0),
                   model_version=_int(k, d, "model_version", -1, _ROUND_HI), sig=_sig(k, d))


def colluder_problem(max_colluders: int, *, threshold: int, min_survivors: int) -> str | None:
    """Why ``max_colluders`` cannot go with this threshold and survivor floor (None: it can).

    Colluding members plus the aggregator must stay below the Shamir threshold t (with t
    or more shares among them they could unmask an honest device's input without it), and
    every unmasked sum must keep at least one honest member's noise
    (``min_survivors - max_colluders >= 1``).
    """
    if isinstance(max_colluders, bool) or not isinstance(max_colluders, int) \
            or max_colluders < 0:
        return f"max_colluders must be an integer >= 0, got {max_colluders!r}"
    if max_colluders >= threshold:
        return (f"max_colluders must be below the secagg threshold {threshold} (colluders "
                f"holding t shares unmask an honest device), got {max_colluders}")
    if min_survivors - max_colluders < 1:
        return (f"min_survivors {min_survivors} - max_colluders {max_colluders} must leave "
                f"at least one honest member in every sum")
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan(_Wire):
    """Aggregator -> each cohort member: everything a device needs for one round.

    Attributes:
        round_id: the round, unique and increasing per fleet, >= 1.
        model_version: the global model version to train from.
        cohort: the selected devices, sorted (also the secagg cohort).
        steps, batch_size, lr, sampling: the local round (``edge_sdk.train.LocalTraining``;
            Poisson rate q = batch_size / m).
        clip: per-sample L2 bound C; noise_multiplier: z (noise std z*C).
        sparsity: rand-k kept fraction p (1: dense); round_seed: the 32-byte seed of the
            round's coordinate set (``compress.coordinate_set``).
        quant_levels: QSGD levels s applied to the kept values before encoding (0: none).
        scale, value_bound, bits: fixed-point encoding (``fixedpoint.FixedPoint``); each value
            is clamped to [-value_bound, value_bound] first so the cohort's sum cannot wrap.
        length: values summed by secure aggregation (k = kept_count(d, p)).
        nonce, degree, threshold: the rest of ``secagg.RoundConfig``.
        min_survivors: the fewest uploads the aggregator will ever unmask (the ledger's
            aggregate-view ``cohort_size``); a device refuses an unmask request for fewer.
        max_colluders: how many cohort members the fleet's policy assumes may collude with
            the aggregator (each knows, and can subtract, its own noise), so the sum is
            accounted on ``min_survivors - max_colluders`` honest members' noise. Valid
            plans have ``0 <= max_colluders < threshold`` (below the threshold, colluders
            together with the aggregator hold fewer than t shares of any honest device's
            secrets, so they cannot unmask it alone) and
            ``min_survivors - max_colluders >= 1`` (at least one honest member's noise is
            in every unmasked sum).
        stage_timeout: seconds the aggregator waits per stage (a device gives up on the
            round after several of these without news).
    """

    KIND: ClassVar[str] = "plan"
    SIGNED: ClassVar[bool] = True
    round_id: int
    model_version: int
    cohort: tuple[str, ...]
    steps: int
    batch_size: int
    lr: float
    sampling: str
    clip: float
    noise_multiplier: float
    sparsity: float
    round_seed: bytes
    quant_levels: int
    scale: float
    value_bound: float
    bits: int
    length: int
    nonce: bytes
    degree: int
    threshold: int
    min_survivors: int
    max_colluders: int
    stage_timeout: float
    sig: bytes = b""

    _KEYS: ClassVar[tuple[str, ...]] = (
        "round_id", "model_version", "cohort", "steps", "batch_size", "lr", "sampling", "clip",
        "noise_multiplier", "sparsity", "round_seed", "quant_levels", "scale", "value_bound",
        "bits", "length", "nonce", "degree", "threshold", "min_survivors", "max_colluders",
        "stage_timeout",
    )

    def payload(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self._KEYS}
        out["cohort"] = list(self.cohort)
        for k in ("lr", "clip", "noise_multiplier", "sparsity", "scale", "value_bound",
                  "stage_timeout"):
            out[k] = float(out[k])
        return out

    def round_config(self) -> secagg.RoundConfig:
        """The secure-aggregation parameters of this round.

        Raises:
            WireError: they do not form a valid RoundConfig.
        """
        try:
            return secagg.RoundConfig(
                round_id=self.round_id, nonce=self.nonce, cohort=self.cohort, bits=self.bits,
                length=self.length, degree=self.degree, threshold=self.threshold)
        except ValueError as e:
            raise _fail(self.KIND, f"secagg parameters: {e}") from None

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> RoundPlan:
        k = cls.KIND
        _check_fields(k, d, (*cls._KEYS, "sig"))
        sampling = _str(k, d, "sampling", limits)
        if sampling not in _SAMPLING:
            raise _fail(k, f"field 'sampling' must be one of {_SAMPLING}, got {sampling!r}")
        plan = cls(
            round_id=_int(k, d, "round_id", 1, _ROUND_HI),
            model_version=_int(k, d, "model_version", 0, _ROUND_HI),
            cohort=_names(k, d, "cohort", limits),
            steps=_int(k, d, "steps", 1, 1 << 20),
            batch_size=_int(k, d, "batch_size", 1, 1 << 24),
            lr=_float(k, d, "lr", 0.0, open_lo=True),
            sampling=sampling,
            clip=_float(k, d, "clip", 0.0, open_lo=True),
            noise_multiplier=_float(k, d, "noise_multiplier", 0.0),
            sparsity=_float(k, d, "sparsity", 0.0, 1.0, open_lo=True),
            round_seed=_bin(k, d, "round_seed", size=32),
            quant_levels=_int(k, d, "quant_levels", 0, (1 << 31) - 1),
            scale=_float(k, d, "scale", 0.0, open_lo=True),
            value_bound=_float(k, d, "value_bound", 0.0, open_lo=True),
            bits=_int(k, d, "bits", 2, 64),
            length=_int(k, d, "length", 1, limits.max_array_elements),
            nonce=_bin(k, d, "nonce", size=32),
            degree=_int(k, d, "degree", 2, limits.max_cohort),
            threshold=_int(k, d, "threshold", 1, limits.max_cohort),
            min_survivors=_int(k, d, "min_survivors", 1, limits.max_cohort),
            max_colluders=_int(k, d, "max_colluders", 0, limits.max_cohort),
            stage_timeout=_float(k, d, "stage_timeout", 0.0, 86400.0, open_lo=True),
            sig=_sig(k, d),
        )
        plan.round_config()  # the secagg parameters must be consistent
        if not plan.threshold <= plan.min_survivors <= len(plan.cohort):
            raise _fail(k, f"min_survivors must be in [threshold={plan.threshold}, "
                           f"cohort size={len(plan.cohort)}], got {plan.min_survivors}")
        problem = colluder_problem(plan.max_colluders, threshold=plan.threshold,
                                   min_survivors=plan.min_survivors)
        if problem:
            raise _fail(k, problem)
        return plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Decline(_Wire):
    """Device -> aggregator: the device will not take part in the round.

    Attributes:
        round_id: the round declined; device: the sender.
        reason: a short machine-readable code (``"budget"``, ``"stale_model"``,
            ``"already_committed"``, ``"no_data"``, ...).
        detail: human-readable explanation.
    """

    KIND: ClassVar[str] = "decline"
    SIGNED: ClassVar[bool] = True
    round_id: int
    device: str
    reason: str
    detail: str = ""
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "device": self.device, "reason": self.reason,
                "detail": self.detail}

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> Decline:
        k = cls.KIND
        _check_fields(k, d, ("round_id", "device", "reason", "detail", "sig"))
        return cls(round_id=_int(k, d, "round_id", 0, _ROUND_HI), device=_name(k, d, "device"),
                   reason=_name(k, d, "reason"), detail=_str(k, d, "detail", limits),
                   sig=_sig(k, d))


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggPacket(_Wire):
    """A secure-aggregation message (``secagg.messages.encode_message`` bytes) in either direction.

    ``device`` is the sender for device messages and the recipient for the aggregator's;
    decoding checks that the wrapped message agrees with ``round_id`` and ``device``.
    """

    KIND: ClassVar[str] = "secagg"
    round_id: int
    device: str
    data: bytes

    def payload(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "device": self.device, "data": self.data}

    def message(self) -> messages.Message:
        """The wrapped message (structure checked; signatures are the endpoint's job)."""
        return messages.decode_message(self.data)

    @classmethod
    def wrap(cls, msg: messages.Message) -> SecAggPacket:
        device = getattr(msg, "sender", None) or msg.recipient  # type: ignore[union-attr]
        return cls(round_id=msg.round_id, device=device, data=messages.encode_message(msg))

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> SecAggPacket:
        k = cls.KIND
        _check_fields(k, d, ("round_id", "device", "data"))
        pkt = cls(round_id=_int(k, d, "round_id", 0, _ROUND_HI), device=_name(k, d, "device"),
                  data=_bin(k, d, "data", max_size=limits.max_secagg_bytes))
        inner = pkt.message()  # RemoteProtocolError when malformed
        who = getattr(inner, "sender", None) or getattr(inner, "recipient", None)
        if inner.round_id != pkt.round_id or who != pkt.device:
            raise _fail(k, f"wrapped {inner.KIND} is for round {inner.round_id} and device "
                           f"{who!r}, the packet says round {pkt.round_id}, {pkt.device!r}")
        return pkt


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadChunk(_Wire):
    """Device -> aggregator: one piece of a large upload (the encoded masked input).

    Attributes:
        round_id, device: whose upload; index: 0-based chunk number of ``total``;
        size: bytes of the whole upload; digest: its SHA-256; data: this chunk's bytes.
    """

    KIND: ClassVar[str] = "chunk"
    round_id: int
    device: str
    index: int
    total: int
    size: int
    digest: bytes
    data: bytes

    def payload(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "device": self.device, "index": self.index,
                "total": self.total, "size": self.size, "digest": self.digest,
                "data": self.data}

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> UploadChunk:
        k = cls.KIND
        _check_fields(k, d, ("round_id", "device", "index", "total", "size", "digest", "data"))
        total = _int(k, d, "total", 1, limits.max_chunks)
        size = _int(k, d, "size", 1, limits.max_upload_bytes)
        index = _int(k, d, "index", 0, total - 1)
        data = _bin(k, d, "data", max_size=size)
        if not data:
            raise _fail(k, "field 'data' must not be empty")
        return cls(round_id=_int(k, d, "round_id", 0, _ROUND_HI), device=_name(k, d, "device"),
                   index=index, total=total, size=size, digest=_bin(k, d, "digest", size=32),
                   data=data)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelUpdate(_Wire):
    """Aggregator -> everyone (retained): the global model.

    Attributes:
        version: model version (0: the initial model; +1 per completed round).
        round_id: the round that produced it (0 for the initial model).
        arrays: the parameters in graph order.
    """

    KIND: ClassVar[str] = "model"
    SIGNED: ClassVar[bool] = True
    version: int
    round_id: int
    arrays: tuple[WireArray, ...]
    sig: bytes = b""

    @classmethod
    def of(cls, *, version: int, round_id: int, params: Iterable[np.ndarray]) -> ModelUpdate:
        return cls(version=version, round_id=round_id,
                   arrays=tuple(WireArray.of(p) for p in params))

    def params(self) -> list[np.ndarray]:
        return [a.to_numpy() for a in self.arrays]

    def payload(self) -> dict[str, Any]:
        return {"version": self.version, "round_id": self.round_id,
                "arrays": [a.to_wire() for a in self.arrays]}

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> ModelUpdate:
        k = cls.KIND
        _check_fields(k, d, ("version", "round_id", "arrays", "sig"))
        arrays = d["arrays"]
        if not isinstance(arrays, list) or not 1 <= len(arrays) <= limits.max_arrays:
            raise _fail(k, f"field 'arrays' must be a list of 1 to {limits.max_arrays} arrays")
        out = tuple(WireArray.from_wire(k, a, limits) for a in arrays)
        total = sum(math.prod(a.shape) for a in out)
        if total > limits.max_array_elements:
            raise _fail(k, f"the model has {total} values, above {limits.max_array_elements}")
        return cls(version=_int(k, d, "version", 0, _ROUND_HI),
                   round_id=_int(k, d, "round_id", 0, _ROUND_HI), arrays=out, sig=_sig(k, d))


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorNotice(_Wire):
    """Aggregator -> device: a round ended without the device (``"round_failed"``), or a
    message of the device's was rejected (``"rejected"``).

    Attributes:
        round_id: the round concerned (0: none); device: the recipient;
        code: machine-readable; detail: human-readable.
    """

    KIND: ClassVar[str] = "error"
    SIGNED: ClassVar[bool] = True
    round_id: int
    device: str
    code: str
    detail: str = ""
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "device": self.device, "code": self.code,
                "detail": self.detail}

    @classmethod
    def from_wire(cls, d: dict[str, Any], limits: Limits) -> ErrorNotice:
        k = cls.KIND
        _check_fields(k, d, ("round_id", "device", "code", "detail", "sig"))
        return cls(round_id=_int(k, d, "round_id", 0, _ROUND_HI), device=_name(k, d, "device"),
                   code=_name(k, d, "code"), detail=_str(k, d, "detail", limits),
                   sig=_sig(k, d))


WireMessage: TypeAlias = (
    CheckIn | RoundPlan | Decline | SecAggPacket | UploadChunk | ModelUpdate | ErrorNotice
)
_KINDS: dict[str, Any] = {
    c.KIND: c
    for c in (CheckIn, RoundPlan, Decline, SecAggPacket, UploadChunk, ModelUpdate, ErrorNotice)
}


def encode(msg: WireMessage) -> bytes:
    """msgpack bytes of a message (signed ones must carry their signature already)."""
    if type(msg) not in _KINDS.values():
        raise ValueError(f"not a wire message: {type(msg).__name__}")
    if msg.SIGNED and len(msg.sig) != 64:  # type: ignore[union-attr]
        raise ValueError(f"{msg.KIND} must be signed before it is encoded (see wire.sign)")
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def decode(data: bytes | bytearray | memoryview, *, limits: Limits = LIMITS) -> WireMessage:
    """Parse and validate one message (structure, sizes, ranges, finiteness; not signatures).

    Raises:
        WireError: anything wrong, named; a truncated message, trailing bytes, a length
            above ``limits``, an unknown kind or version, or a bad field.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"a message must be bytes, got {type(data).__name__}")
    raw = bytes(data)
    if len(raw) > limits.max_message_bytes:
        raise WireError(f"message of {len(raw)} bytes exceeds {limits.max_message_bytes}")
    try:
        # the unpacker's own caps keep a forged length prefix from allocating
        obj = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=len(raw), max_str_len=min(len(raw), 1 << 20),
            max_array_len=min(len(raw), 1 << 20), max_map_len=min(len(raw), 1024),
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"malformed message bytes ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise WireError(f"a message must be a map, got {type(obj).__name__}")
    v = obj.get("v")
    if isinstance(v, bool) or v != PROTOCOL_VERSION:
        raise WireError(f"protocol version must be {PROTOCOL_VERSION}, got {v!r}")
    kind = obj.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message kind {kind!r}")
    try:
        return cls.from_wire(obj, limits)  # type: ignore[no-any-return]
    except WireError:
        raise
    except RemoteProtocolError as e:
        raise WireError(f"{kind}: {e}") from None


def sign(msg: Any, signer: secagg.DeviceIdentity | secagg.AggregatorIdentity) -> Any:
    """``msg`` with its signature by ``signer`` (deterministic: Ed25519)."""
    if not msg.SIGNED:
        raise ValueError(f"{msg.KIND} messages are not signed")
    return replace(msg, sig=signer.sign(msg.signing_bytes()))


def verify(msg: Any, registry: secagg.Registry, signer: str | None) -> None:
    """Check ``msg``'s signature by ``signer`` (None: the aggregator).

    Raises:
        RemoteProtocolError: unknown signer or bad signature.
    """
    registry.verify(signer, msg.sig, msg.signing_bytes(), msg.KIND)


# ----------------------------------------------------------------------- chunking


def split_upload(
    *, round_id: int, device: str, data: bytes, max_packet: int = DEFAULT_MAX_PACKET
) -> list[UploadChunk]:
    """Cut ``data`` into chunks whose encoded messages are at most ``max_packet`` bytes."""
    if isinstance(max_packet, bool) or not isinstance(max_packet, int) or max_packet < 512:
        raise ValueError(f"max_packet must be an integer >= 512 bytes, got {max_packet!r}")
    if not data:
        raise ValueError("an upload must not be empty")
    check_name("device", device)
    # Room left for the map around the data: keys, ints (<= 9 bytes each), the 32-byte
    # digest and the bin header; 256 bytes covers a 64-character device name with margin.
    room = max_packet - 256
    total = -(-len(data) // room)
    digest = hashlib.sha256(data).digest()
    chunks = [
        UploadChunk(round_id=round_id, device=device, index=i, total=total, size=len(data),
                    digest=digest, data=data[i * room : (i + 1) * room])
        for i in range(total)
    ]
    return chunks


@dataclass(slots=True)
class _Pending:
    total: int
    size: int
    digest: bytes
    parts: dict[int, bytes] = field(default_factory=dict)

    @property
    def held(self) -> int:
        return sum(len(p) for p in self.parts.values())


class Reassembler:
    """Joins upload chunks, idempotently by (round, device, chunk index).

    An exact duplicate of a held or already-completed chunk is ignored; a chunk that
    contradicts what is held (another total, size, digest or bytes) is rejected, as is a
    reassembled upload whose digest does not match. Memory is bounded: at most
    ``max_pending`` uploads and ``max_bytes`` bytes in flight; beyond them a new upload is
    rejected (the caller decides; nothing held is evicted).
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

    def add(self, chunk: UploadChunk) -> bytes | None:
        """Take one chunk; return the whole upload the first time it completes, else None.

        Raises:
            WireError: the chunk conflicts with what is held, completes an upload whose
                digest is wrong (the upload is dropped), or would exceed the memory bounds.
                Nothing changes in any case but the digest mismatch.
        """
        key = (chunk.round_id, chunk.device)
        done = self._done.get(key)
        if done is not None:
            if chunk.digest != done:
                raise WireError(f"chunk {chunk.index} of {chunk.device!r} round "
                                f"{chunk.round_id} contradicts its completed upload")
            return None
        p = self._pending.get(key)
        if p is not None and (p.total, p.size, p.digest) != (chunk.total, chunk.size,
                                                             chunk.digest):
            raise WireError(f"chunk {chunk.index} of {chunk.device!r} round {chunk.round_id} "
                            f"announces another upload (total/size/digest) than earlier chunks")
        if p is not None and chunk.index in p.parts:
            if p.parts[chunk.index] != chunk.data:
                raise WireError(f"chunk {chunk.index} of {chunk.device!r} round "
                                f"{chunk.round_id} arrived twice with different bytes")
            return None
        if p is None and len(self._pending) >= self._max_pending:
            raise WireError(f"too many uploads in flight ({self._max_pending}); chunk of "
                            f"{chunk.device!r} round {chunk.round_id} dropped")
        if self._bytes + len(chunk.data) > self._max_bytes:
            raise WireError(f"reassembly buffer full ({self._max_bytes} bytes); chunk of "
                            f"{chunk.device!r} round {chunk.round_id} dropped")
        held = (p.held if p is not None else 0) + len(chunk.data)
        if held > chunk.size:
            raise WireError(f"chunks of {chunk.device!r} round {chunk.round_id} exceed the "
                            f"announced {chunk.size} bytes")
        if p is None:
            p = self._pending[key] = _Pending(chunk.total, chunk.size, chunk.digest)
        p.parts[chunk.index] = chunk.data
        self._bytes += len(chunk.data)
        if len(p.parts) < p.total:
            return None
        del self._pending[key]
        self._bytes -= p.held
        data = b"".join(p.parts[i] for i in range(p.total))
        if len(data) != p.size or hashlib.sha256(data).digest() != p.digest:
            raise WireError(f"upload of {chunk.device!r} round {chunk.round_id} does not match "
                            f"its announced size/digest; dropped")
        self._done[key] = p.digest
        return data

    def forget(self, round_id: int, device: str) -> None:
        """Drop all trace of one upload (held chunks, or the mark that it completed)."""
        p = self._pending.pop((round_id, device), None)
        if p is not None:
            self._bytes -= p.held
        self._done.pop((round_id, device), None)

    def discard_round(self, round_id: int) -> None:
        """Forget everything about uploads of ``round_id`` and earlier."""
        for store in (self._pending, self._done):
            for key in [k for k in store if k[0] <= round_id]:
                item = store.pop(key)
                if isinstance(item, _Pending):
                    self._bytes -= item.held

    def to_state(self) -> dict[str, Any]:
        """A msgpack-able copy of the buffers (for checkpoints)."""
        return {
            "pending": [[r, d, p.total, p.size, p.digest, sorted(p.parts.items())]
                        for (r, d), p in sorted(self._pending.items())],
            "done": [[r, d, dig] for (r, d), dig in sorted(self._done.items())],
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`to_state` (replaces the buffers)."""
        self._pending, self._done, self._bytes = {}, {}, 0
        for r, d, total, size, digest, parts in state["pending"]:
            p = _Pending(total, size, digest, {int(i): bytes(b) for i, b in parts})
            self._pending[(r, d)] = p
            self._bytes += p.held
        for r, d, dig in state["done"]:
            self._done[(r, d)] = bytes(dig)
