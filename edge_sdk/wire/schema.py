"""The declarative wire schema: one envelope, one naming rule, one decoder with caps, one
signature rule, from which every message's encode, decode, validation and signed bytes are
generated (issue 15, plan15 §3.4); :mod:`edge_sdk.wire.messages` declares every kind on it.

A message is a frozen, keyword-only, slotted dataclass that subclasses :class:`Message`,
whose fields are declared with the field types below, under :func:`message`::

    @message(kind="checkin", signer=DEVICE)
    @dataclass(frozen=True, slots=True, kw_only=True)
    class CheckIn(Message):
        round_id: int = Round()
        sender: str = From()
        data_size: int = Int(0, 1 << 40)
        remaining_epsilon: float = Float(0.0)
        sig: bytes = Sig()

The envelope. Every message is one msgpack map
``{"v": PROTOCOL_VERSION, "kind", "round", "from" | "to", ...fields, "sig"?}``:

* ``"round"`` (attribute ``round_id``) in every kind;
* ``"from"`` (attribute ``sender``) when a device sends it, ``"to"`` (attribute
  ``recipient``) when the aggregator sends it to one device, both when one device sends it
  to another through the aggregator (``party="both"``: a sealed share), neither when the
  aggregator sends it to everyone (``party=None``);
* ``"sig"`` (attribute ``sig``, 64 bytes, Ed25519) when the kind has a ``signer``.

The encoding is canonical: maps are emitted with their keys in sorted order, floats as
float64, integers in their shortest form, bytes as msgpack ``bin``; so :func:`encode` of a
message is one byte string, and ``decode(encode(m)) == m``.

Decoding (:func:`decode`) is the one place msgpack meets bytes from a peer: the unpacker
runs with today's caps (no length prefix can allocate more than the message holds, no
extension types, at most 1024 map entries), every msgpack error becomes a
:class:`WireError`, and every field is checked by its type (its kind, size,
range, finiteness, the :class:`Limits` on every length); an error names the kind, the field,
the bad value and what was expected. Every truncated prefix of a valid message fails that
way. :func:`peek` reads only the envelope (kind, round, sender or recipient), for routing.

Signatures. :func:`sign` and :func:`verify` cover
``SIGNING_LABEL + context + canonical msgpack of the map without "sig"``. The context is
empty, or for kinds declared with ``context_bytes=32`` the 32-byte digest of the round's
``RoundConfig`` (what the SecAgg messages bind today), so a message cannot be replayed
into another round configuration. Decoding checks structure only; the endpoint that knows
the keys checks signatures.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, TypeVar

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_sdk._validate import NAME_PATTERN
from edge_sdk.errors import RemoteProtocolError

__all__ = [
    "AGGREGATOR",
    "DEVICE",
    "LIMITS",
    "NAME_PATTERN",
    "PROTOCOL_VERSION",
    "ROUND_HI",
    "SIGNING_LABEL",
    "SIG_BYTES",
    "Bytes",
    "Float",
    "From",
    "Header",
    "Int",
    "Limits",
    "ListOf",
    "Map",
    "Message",
    "Name",
    "Names",
    "Optional",
    "ParamsOf",
    "Record",
    "Role",
    "Round",
    "Sig",
    "Signer",
    "Str",
    "Struct",
    "To",
    "WireError",
    "catalog",
    "decode",
    "encode",
    "message",
    "peek",
    "record",
    "sign",
    "signer_of",
    "verify",
]

PROTOCOL_VERSION = 8
"""The envelope's ``"v"``: the one protocol version of every message (4: issue 15's one
schema; 5: a check-in states the device's budget and spent epsilon, issue 20; 6: device-dp's
plan states adaptive clipping's indicator scale, issue 16; 7: and the self-sampling rate,
issue 16; 8: a round plan names its secure-aggregation protocol, SecAgg+ or the amortized
variant, issue 18). Devices and the aggregator are upgraded together."""
SIGNING_LABEL = b"fedge/wire/v4/sig"
"""Prefix of every signed byte string (domain separation from every other Ed25519 use).
Its ``v4`` names the signing rule, unchanged since protocol 4; the protocol version is
signed anyway, as the envelope's ``"v"``."""
SIG_BYTES = 64
ROUND_HI = (1 << 63) - 1
"""Largest round id (rounds are unique per fleet in [0, 2^63))."""

class WireError(RemoteProtocolError):
    """Bytes from a peer that are not a valid message: truncated, malformed, too large,
    of an unknown kind or version, or with a field of the wrong type, size or value.

    A :class:`edge_sdk.errors.RemoteProtocolError` (the peer is to blame), so endpoints
    catch one type for every inbound problem.
    """


_META = "fedge.wire.schema"  # the key of a field's type in dataclasses.Field.metadata


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Upper bounds enforced while decoding (each a count or a byte length); the caps of
    today's ``wire.decode``. Field types name them (``Int(1, "max_cohort")``) so one
    ``Limits`` tightens every message at once."""

    max_message_bytes: int = 64 * 1024 * 1024
    max_string: int = 256
    max_cohort: int = 4096
    max_arrays: int = 64
    max_ndim: int = 8
    max_array_elements: int = 1 << 26
    max_chunks: int = 4096
    max_upload_bytes: int = 256 * 1024 * 1024
    max_secagg_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Limits.{f.name} must be an integer >= 1, got {v!r}")


LIMITS = Limits()
_LIMIT_NAMES = frozenset(f.name for f in fields(Limits))


class Role(enum.Enum):
    """Who signs a kind: its verifying key is the sender's (a device) or the aggregator's."""

    DEVICE = "device"
    AGGREGATOR = "aggregator"


DEVICE = Role.DEVICE
AGGREGATOR = Role.AGGREGATOR


class Signer(Protocol):
    """Anything that signs with Ed25519: ``secagg.DeviceIdentity``, ``AggregatorIdentity``,
    or a ``cryptography`` ``Ed25519PrivateKey``."""

    def sign(self, data: bytes) -> bytes: ...


# =========================================================================== field types
#
# A field type turns a Python value into its msgpack form (dump) and checks and converts
# msgpack from a peer back (load). Both raise _Bad with the tail of a sentence that starts
# "field 'x' ", so every message reads "kind: field 'x' must be ..., got ...". Bounds given
# as a string name a Limits attribute and are read at decode time.


class _Bad(Exception):
    """A field's problem: the rest of a sentence after "field 'name' "."""


_Bound = int | str


def _limit(bound: _Bound, limits: Limits) -> int:
    return bound if isinstance(bound, int) else int(getattr(limits, bound))


def _check_bound(bound: object, what: str) -> None:
    if isinstance(bound, str):
        if bound not in _LIMIT_NAMES:
            raise ValueError(f"{what} names no Limits field: {bound!r} (one of "
                             f"{sorted(_LIMIT_NAMES)})")
    elif isinstance(bound, bool) or not isinstance(bound, int):
        raise ValueError(f"{what} must be an integer or a Limits field name, got {bound!r}")


def _type_name(v: object) -> str:
    return type(v).__name__


def _show(v: object, width: int = 80) -> str:
    """A peer's value for an error message, short whatever the peer sent."""
    if isinstance(v, str | bytes) and len(v) > width:
        return f"{v[:width]!r}... ({len(v)} {'characters' if isinstance(v, str) else 'bytes'})"
    if isinstance(v, list | dict | tuple) and len(v) > 8:
        return f"a {_type_name(v)} of {len(v)} items"
    r = repr(v)
    return r if len(r) <= width else r[:width] + "..."


class _Type:
    """One field type; subclasses define ``dump`` and ``load``."""

    __slots__ = ()
    hashable: ClassVar[bool] = False  # values can be checked for distinctness and order

    def dump(self, value: Any) -> Any:
        raise NotImplementedError

    def load(self, raw: Any, limits: Limits) -> Any:
        raise NotImplementedError


class _Int(_Type):
    __slots__ = ("hi", "lo")
    hashable = True

    def __init__(self, lo: _Bound, hi: _Bound) -> None:
        _check_bound(lo, "Int lo")
        _check_bound(hi, "Int hi")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            raise ValueError(f"Int needs lo <= hi, got [{lo}, {hi}]")
        self.lo, self.hi = lo, hi

    def dump(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _Bad(f"must be an integer, got {_type_name(value)} {_show(value)}")
        return int(value)

    def load(self, raw: Any, limits: Limits) -> int:
        lo, hi = _limit(self.lo, limits), _limit(self.hi, limits)
        if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
            raise _Bad(f"must be an integer in [{lo}, {hi}], got {_show(raw)}")
        return raw


class _Float(_Type):
    __slots__ = ("hi", "lo", "open_hi", "open_lo")
    hashable = True

    def __init__(self, lo: float, hi: float, open_lo: bool, open_hi: bool) -> None:
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            raise ValueError(f"Float needs lo <= hi, got [{lo}, {hi}]")
        self.lo, self.hi, self.open_lo, self.open_hi = float(lo), float(hi), open_lo, open_hi

    def dump(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _Bad(f"must be a float, got {_type_name(value)} {_show(value)}")
        return float(value)  # one encoding per value: always float64

    def load(self, raw: Any, limits: Limits) -> float:
        if not isinstance(raw, float):  # an int where a float belongs is refused
            raise _Bad(f"must be a float, got {_type_name(raw)} {_show(raw)}")
        lo, hi = self.lo, self.hi
        if (not math.isfinite(raw) or raw < lo or raw > hi
                or (self.open_lo and raw == lo) or (self.open_hi and raw == hi)):
            bound = f"{'(' if self.open_lo else '['}{lo}, {hi}{')' if self.open_hi else ']'}"
            raise _Bad(f"must be a finite float in {bound}, got {_show(raw)}")
        return raw


class _Bytes(_Type):
    __slots__ = ("max", "min", "size")
    hashable = True

    def __init__(self, size: int | None, lo: int, hi: _Bound | None) -> None:
        if (size is None) == (hi is None):
            raise ValueError("Bytes needs exactly one of an exact size or a max")
        if size is not None:
            _check_bound(size, "Bytes size")
        if hi is not None:
            _check_bound(hi, "Bytes max")
        _check_bound(lo, "Bytes min")
        self.size, self.min, self.max = size, lo, hi

    def dump(self, value: Any) -> Any:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise _Bad(f"must be bytes, got {_type_name(value)}")
        return bytes(value)

    def load(self, raw: Any, limits: Limits) -> bytes:
        if not isinstance(raw, bytes):
            raise _Bad(f"must be bytes, got {_type_name(raw)}")
        if self.size is not None and len(raw) != self.size:
            raise _Bad(f"must be {self.size} bytes, got {len(raw)}")
        if self.max is not None and len(raw) > _limit(self.max, limits):
            raise _Bad(f"must be at most {_limit(self.max, limits)} bytes, got {len(raw)}")
        if len(raw) < _limit(self.min, limits):
            raise _Bad(f"must be at least {_limit(self.min, limits)} bytes, got {len(raw)}")
        return raw


class _Str(_Type):
    __slots__ = ("choices", "max")
    hashable = True

    def __init__(self, hi: _Bound, choices: tuple[str, ...] | None) -> None:
        _check_bound(hi, "Str max")
        self.max, self.choices = hi, choices

    def dump(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise _Bad(f"must be a string, got {_type_name(value)}")
        return value

    def load(self, raw: Any, limits: Limits) -> str:
        if not isinstance(raw, str):
            raise _Bad(f"must be a string, got {_type_name(raw)}")
        hi = _limit(self.max, limits)
        if len(raw) > hi:
            raise _Bad(f"must be at most {hi} characters, got {len(raw)}")
        if self.choices is not None and raw not in self.choices:
            raise _Bad(f"must be one of {self.choices}, got {_show(raw)}")
        return raw


class _Name(_Type):
    __slots__ = ()
    hashable = True

    def dump(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise _Bad(f"must be a name (a string), got {_type_name(value)}")
        return value

    def load(self, raw: Any, limits: Limits) -> str:
        if not isinstance(raw, str) or not NAME_PATTERN.fullmatch(raw):
            raise _Bad(f"must be 1-64 characters of [A-Za-z0-9_.-], got {_show(raw)}")
        return raw


class _List(_Type):
    __slots__ = ("distinct", "item", "max", "min", "sorted_unique")

    def __init__(self, item: _Type, lo: int, hi: _Bound, distinct: bool,
                 sorted_unique: bool) -> None:
        _check_bound(lo, "ListOf min")
        _check_bound(hi, "ListOf max")
        self.min = lo
        if (distinct or sorted_unique) and not item.hashable:
            raise ValueError(f"only lists of scalars can be distinct or sorted, not of "
                             f"{type(item).__name__.lstrip('_')}")
        self.item, self.max, self.distinct, self.sorted_unique = item, hi, distinct, sorted_unique

    def dump(self, value: Any) -> Any:
        if not isinstance(value, tuple | list):
            raise _Bad(f"must be a tuple, got {_type_name(value)}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(self.item.dump(v))
            except _Bad as e:
                raise _Bad(f"item {i} {e}") from None
        return out

    def load(self, raw: Any, limits: Limits) -> tuple[Any, ...]:
        if not isinstance(raw, list):
            raise _Bad(f"must be a list, got {_type_name(raw)}")
        hi = _limit(self.max, limits)
        if len(raw) > hi:
            raise _Bad(f"must have at most {hi} items, got {len(raw)}")
        if len(raw) < _limit(self.min, limits):
            raise _Bad(f"must have at least {_limit(self.min, limits)} items, got {len(raw)}")
        out = []
        for i, v in enumerate(raw):
            try:
                out.append(self.item.load(v, limits))
            except _Bad as e:
                raise _Bad(f"item {i} {e}") from None
        if self.sorted_unique and out != sorted(set(out)):
            raise _Bad("must list distinct items in sorted order")
        if self.distinct and len(set(out)) != len(out):
            twice = next(x for i, x in enumerate(out) if x in out[:i])
            raise _Bad(f"must list distinct items, got {_show(twice)} twice")
        return tuple(out)


class _Map(_Type):
    """Pairs with distinct keys, as a list of ``[key, value]`` lists: not a msgpack map,
    whose entries the unpacker caps at 1024 (a share per cohort member can be more)."""

    __slots__ = ("key", "max", "value")

    def __init__(self, key: _Type, value: _Type, hi: _Bound) -> None:
        _check_bound(hi, "Map max")
        if not key.hashable:
            raise ValueError(f"Map keys must be scalars, not {type(key).__name__.lstrip('_')}")
        self.key, self.value, self.max = key, value, hi

    def dump(self, value: Any) -> Any:
        if not isinstance(value, tuple | list):
            raise _Bad(f"must be a tuple of (key, value) pairs, got {_type_name(value)}")
        out = []
        for i, pair in enumerate(value):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise _Bad(f"item {i} must be a (key, value) pair, got {_show(pair)}")
            try:
                out.append([self.key.dump(pair[0]), self.value.dump(pair[1])])
            except _Bad as e:
                raise _Bad(f"item {i} {e}") from None
        return out

    def load(self, raw: Any, limits: Limits) -> tuple[tuple[Any, Any], ...]:
        if not isinstance(raw, list):
            raise _Bad(f"must be a list of [key, value] pairs, got {_type_name(raw)}")
        hi = _limit(self.max, limits)
        if len(raw) > hi:
            raise _Bad(f"must have at most {hi} pairs, got {len(raw)}")
        out: list[tuple[Any, Any]] = []
        seen: set[Any] = set()
        for i, pair in enumerate(raw):
            if not isinstance(pair, list) or len(pair) != 2:
                raise _Bad(f"item {i} must be a [key, value] pair")
            try:
                k = self.key.load(pair[0], limits)
                v = self.value.load(pair[1], limits)
            except _Bad as e:
                raise _Bad(f"item {i} {e}") from None
            if k in seen:
                raise _Bad(f"must name each key once, got {_show(k)} twice")
            seen.add(k)
            out.append((k, v))
        return tuple(out)


class _Optional(_Type):
    __slots__ = ("inner",)

    def __init__(self, inner: _Type) -> None:
        self.inner = inner

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)

    def load(self, raw: Any, limits: Limits) -> Any:
        return None if raw is None else self.inner.load(raw, limits)


class _Struct(_Type):
    __slots__ = ("cls",)

    def __init__(self, cls: type[Record]) -> None:
        if not isinstance(cls, type) or "__wire__" not in cls.__dict__:
            raise ValueError(f"Struct needs a @message or @record class, got {cls!r}")
        self.cls = cls

    def dump(self, value: Any) -> Any:
        if not isinstance(value, self.cls):
            raise _Bad(f"must be a {self.cls.__name__}, got {_type_name(value)}")
        try:
            return value.to_wire()
        except ValueError as e:
            raise _Bad(f"is invalid: {e}") from None

    def load(self, raw: Any, limits: Limits) -> Any:
        try:
            return self.cls.from_wire(raw, limits)
        except WireError as e:
            raise _Bad(f"is invalid: {e}") from None


class _ParamsOf(_Type):
    """A record whose schema another field's value chooses (a mechanism's parameters);
    ``Record.to_wire``/``from_wire`` dump and load it as the ``Struct`` of the chosen class."""

    __slots__ = ("by", "lookup")

    def __init__(self, by: str, lookup: Callable[[Any], type[Record] | None]) -> None:
        self.by, self.lookup = by, lookup

    def schema_for(self, chooser: Any) -> type[Record]:
        """The record class for the chooser's value; _Bad (about the chooser) if none."""
        try:
            cls = self.lookup(chooser)
        except TypeError:  # an unhashable value (a caller's bug) chooses nothing
            cls = None
        if cls is None:
            raise _Bad(f"names no known parameter schema, got {_show(chooser)}")
        if not isinstance(cls, type) or "__wire__" not in cls.__dict__:
            raise TypeError(f"ParamsOf lookup gave {cls!r} for {chooser!r}, not a @record")
        return cls



def _type_of(spec: Any) -> _Type:
    """The field type inside a field declaration (or the type itself)."""
    if isinstance(spec, _Type):
        return spec
    if isinstance(spec, Field) and _META in spec.metadata:
        return spec.metadata[_META]  # type: ignore[no-any-return]
    raise TypeError(f"expected a field type such as Int(...), got {spec!r}")


def _declare(t: _Type, key: str | None, default: Any) -> Any:
    if key is not None and not isinstance(key, str):
        raise TypeError(f"a field's key must be a string, got {key!r}")
    return field(default=default, metadata={_META: t, _META + ".key": key})


# --------------------------------------------------------------------- the public types
#
# Each returns a dataclasses.Field, so ``x: int = Int(0, 9)`` declares a dataclass field
# (required unless ``default`` is given) that carries its wire type; ``key`` is its name
# in the msgpack map when that is not the attribute's name.


def Int(lo: _Bound, hi: _Bound, *, key: str | None = None, default: Any = MISSING) -> Any:
    """An integer in ``[lo, hi]`` (never a bool); a bound may name a :class:`Limits` field."""
    return _declare(_Int(lo, hi), key, default)


def Float(
    lo: float = -math.inf, hi: float = math.inf, *, open_lo: bool = False,
    open_hi: bool = False, key: str | None = None, default: Any = MISSING,
) -> Any:
    """A finite float64 in ``[lo, hi]`` (open ends on request); NaN and inf are refused, and
    so is an integer on the wire (one encoding per value)."""
    return _declare(_Float(lo, hi, open_lo, open_hi), key, default)


def Bytes(
    size: int | None = None, *, min: int = 0, max: _Bound | None = None,
    key: str | None = None, default: Any = MISSING,
) -> Any:
    """Bytes of exactly ``size``, or of ``min`` to ``max`` (a :class:`Limits` field name
    allowed) bytes."""
    return _declare(_Bytes(size, min, max), key, default)


def Str(
    *, max: _Bound = "max_string", choices: tuple[str, ...] | None = None,
    key: str | None = None, default: Any = MISSING,
) -> Any:
    """Free text of at most ``max`` characters, or one of ``choices``."""
    return _declare(_Str(max, tuple(choices) if choices is not None else None), key, default)


def Name(*, key: str | None = None, default: Any = MISSING) -> Any:
    """A fleet, device, kind or code name: 1-64 of ``[A-Za-z0-9_.-]`` (:data:`NAME_PATTERN`)."""
    return _declare(_Name(), key, default)


def ListOf(
    item: Any, *, max: _Bound, min: int = 0, distinct: bool = False,
    sorted_unique: bool = False, key: str | None = None, default: Any = MISSING,
) -> Any:
    """A list of ``min`` to ``max`` items of type ``item`` (a tuple in Python);
    ``distinct`` refuses repeats, ``sorted_unique`` also demands ascending order (one form
    per set)."""
    return _declare(_List(_type_of(item), min, max, distinct, sorted_unique), key, default)


def Names(
    *, max: _Bound = "max_cohort", min: int = 0, distinct: bool = True,
    sorted_unique: bool = False, key: str | None = None, default: Any = MISSING,
) -> Any:
    """A list of distinct :func:`Name` s (a cohort, the dropped devices)."""
    return _declare(_List(_Name(), min, max, distinct, sorted_unique), key, default)


def Map(
    key_type: Any, value_type: Any, *, max: _Bound, key: str | None = None,
    default: Any = MISSING,
) -> Any:
    """Pairs with distinct keys: ``((key, value), ...)`` in Python, a list of ``[key,
    value]`` lists on the wire (msgpack maps are capped at 1024 entries by the unpacker)."""
    return _declare(_Map(_type_of(key_type), _type_of(value_type), max), key, default)


def Optional(inner: Any, *, key: str | None = None, default: Any = None) -> Any:
    """``inner`` or None (msgpack nil); defaults to None."""
    return _declare(_Optional(_type_of(inner)), key, default)


def Struct(cls: type[Record], *, key: str | None = None, default: Any = MISSING) -> Any:
    """A nested :func:`record`, or a whole nested :func:`message` (envelope and signature
    included: a signed message forwarded by the aggregator stays verifiable)."""
    return _declare(_Struct(cls), key, default)


def ParamsOf(
    by: str, lookup: Mapping[Any, type[Record]] | Callable[[Any], type[Record] | None], *,
    key: str | None = None, default: Any = MISSING,
) -> Any:
    """A :func:`record` whose class the value of field ``by`` chooses through ``lookup``
    (a mapping, or a function called at each encode and decode, so a registry filled
    later is seen): e.g. a round plan's mechanism parameters, chosen by its mechanism."""
    fn = lookup.get if isinstance(lookup, Mapping) else lookup
    if not callable(fn):
        raise TypeError(f"ParamsOf lookup must be a mapping or a function, got {lookup!r}")
    return _declare(_ParamsOf(by, fn), key, default)


def Round(lo: int = 0) -> Any:
    """The envelope's ``"round"`` (attribute ``round_id``): an integer in [lo, 2^63)."""
    return _declare(_Int(lo, ROUND_HI), "round", MISSING)


def From() -> Any:
    """The envelope's ``"from"`` (attribute ``sender``): the sending device's name."""
    return _declare(_Name(), "from", MISSING)


def To() -> Any:
    """The envelope's ``"to"`` (attribute ``recipient``): the receiving device's name."""
    return _declare(_Name(), "to", MISSING)


def Sig() -> Any:
    """The envelope's ``"sig"``: 64 bytes of Ed25519; empty until :func:`sign`."""
    return _declare(_Bytes(SIG_BYTES, 0, None), "sig", b"")


# =========================================================================== messages


@dataclass(frozen=True, slots=True, kw_only=True)
class _Slot:
    attr: str
    key: str
    type: _Type


@dataclass(frozen=True, slots=True, kw_only=True)
class _Schema:
    name: str  # the kind, or the record's class name (for errors)
    kind: str | None  # None: a record (no envelope)
    signer: Role | None
    party: str | None  # "from", "to", "both" or None
    context_bytes: int
    slots: tuple[_Slot, ...]  # declaration order (errors report in it)
    order: tuple[_Slot, ...]  # wire order: sorted by key (canonical)
    keys: frozenset[str]  # every key of the map, "v" and "kind" included
    by_attr: Mapping[str, _Slot]


R = TypeVar("R", bound="Record")
M = TypeVar("M", bound="Message")


class Record:
    """Base of the schema's dataclasses; :func:`record` and :func:`message` fill in the
    schema its methods follow."""

    __slots__ = ()
    __wire__: ClassVar[_Schema]

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able map (keys sorted: the canonical form).

        Raises:
            ValueError: a field holds a value of the wrong type (the caller's bug).
        """
        sch = type(self).__wire__
        out: dict[str, Any] = {}
        head = {"v": PROTOCOL_VERSION, "kind": sch.kind} if sch.kind is not None else {}
        for s in sch.order:
            t = s.type
            if isinstance(t, _ParamsOf):
                by = sch.by_attr[t.by]
                try:
                    t = _Struct(t.schema_for(getattr(self, by.attr)))
                except _Bad as e:
                    raise ValueError(f"{sch.name}: field {by.key!r} {e}") from None
            try:
                out[s.key] = t.dump(getattr(self, s.attr))
            except _Bad as e:
                raise ValueError(f"{sch.name}: field {s.key!r} {e}") from None
        return dict(sorted({**head, **out}.items()))

    @classmethod
    def from_wire(cls: type[R], obj: object, limits: Limits = LIMITS) -> R:
        """Check a decoded msgpack object against the schema and build the dataclass.

        Raises:
            WireError: not a map, another version or kind, missing or unexpected keys, a
                field of the wrong type, size or value, or values that do not fit together
                (the class's ``__post_init__`` or ``wire_check``); the message names it.
        """
        sch = cls.__wire__
        if not isinstance(obj, dict):
            raise WireError(f"{sch.name}: must be a map, got {_type_name(obj)}")
        if sch.kind is not None:
            v = obj.get("v")
            if type(v) is not int or v != PROTOCOL_VERSION:  # not True, not 5.0
                raise WireError(f"{sch.name}: protocol version must be {PROTOCOL_VERSION}, "
                                f"got {_show(v)}")
            kind = obj.get("kind")
            if kind != sch.kind:
                raise WireError(f"expected a {sch.kind} message, got kind {_show(kind)}")
        got = set(obj)
        if got != sch.keys:
            extra = sorted(map(_show, got - sch.keys))
            raise WireError(f"{sch.name}: must have exactly the fields {sorted(sch.keys)}; "
                            f"missing {sorted(sch.keys - got)}, unexpected "
                            f"{extra[:8]}{' and more' if len(extra) > 8 else ''}")
        values: dict[str, Any] = {}
        later = []
        for s in sch.slots:
            if isinstance(s.type, _ParamsOf):
                later.append(s)  # its schema depends on a sibling, loaded first
                continue
            try:
                values[s.attr] = s.type.load(obj[s.key], limits)
            except _Bad as e:
                raise WireError(f"{sch.name}: field {s.key!r} {e}") from None
        for s in later:
            assert isinstance(s.type, _ParamsOf)
            by = sch.by_attr[s.type.by]
            try:
                chosen = _Struct(s.type.schema_for(values[by.attr]))
            except _Bad as e:
                raise WireError(f"{sch.name}: field {by.key!r} {e}") from None
            try:
                values[s.attr] = chosen.load(obj[s.key], limits)
            except _Bad as e:
                raise WireError(f"{sch.name}: field {s.key!r} {e}") from None
        try:
            out = cls(**values)
            check = getattr(out, "wire_check", None)
            if check is not None:
                check(limits)
        except (ValueError, TypeError) as e:
            raise WireError(f"{sch.name}: {e}") from None
        return out

    def validate(self, limits: Limits = LIMITS) -> None:
        """Check this value as a receiver would (what validates here decodes there).

        Raises:
            ValueError: the first problem, named as :meth:`from_wire` names it.
        """
        self._checked_wire(limits)

    def _checked_wire(self, limits: Limits) -> dict[str, Any]:
        """:meth:`to_wire`, after :meth:`from_wire` accepted it (ValueError otherwise)."""
        wire = self.to_wire()
        try:
            type(self).from_wire(wire, limits)
        except WireError as e:
            raise ValueError(str(e)) from None
        return wire


class Message(Record):
    """Base of the wire's message kinds (declare them with :func:`message`)."""

    __slots__ = ()
    KIND: ClassVar[str]
    SIGNER: ClassVar[Role | None]
    PARTY: ClassVar[str | None]
    CONTEXT_BYTES: ClassVar[int]

    def signing_bytes(self, context: bytes = b"") -> bytes:
        """What the signature covers: :data:`SIGNING_LABEL`, ``context`` (the round
        configuration's digest for kinds declared with ``context_bytes=32``, else empty)
        and the canonical msgpack of the map without ``"sig"``.

        Raises:
            ValueError: the kind is not signed, ``context`` has the wrong length, or a field
                holds a value of the wrong type.
        """
        return self._signed(self.to_wire(), context)

    def _signed(self, wire: dict[str, Any], context: bytes) -> bytes:
        cls = type(self)
        if cls.SIGNER is None:
            raise ValueError(f"{cls.KIND} messages are not signed")
        if not isinstance(context, bytes) or len(context) != cls.CONTEXT_BYTES:
            got = len(context) if isinstance(context, bytes) else _type_name(context)
            raise ValueError(f"{cls.KIND} is signed with a context of {cls.CONTEXT_BYTES} "
                             f"bytes, got {got}")
        return SIGNING_LABEL + context + _pack({k: v for k, v in wire.items() if k != "sig"})


def _build_schema(cls: type, kind: str | None, signer: Role | None, party: str | None,
                  context_bytes: int) -> _Schema:
    where = f"{cls.__name__}"
    base = Message if kind is not None else Record
    if not isinstance(cls, type) or not issubclass(cls, base):
        raise TypeError(f"{where} must subclass schema.{base.__name__}")
    if not is_dataclass(cls):
        raise TypeError(f"{where} must be a dataclass (put @dataclass under the decorator)")
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    if not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{where} must be @dataclass(frozen=True, slots=True, kw_only=True)")
    slots = []
    for f in fields(cls):
        if not f.kw_only:
            raise TypeError(f"{where}.{f.name} must be keyword-only (kw_only=True)")
        if _META not in f.metadata:
            raise TypeError(f"{where}.{f.name} has no wire type (declare it with Int(...), "
                            f"Name(), ...)")
        key = f.metadata.get(_META + ".key") or f.name
        slots.append(_Slot(attr=f.name, key=key, type=f.metadata[_META]))
    keys = [s.key for s in slots]
    if len(set(keys)) != len(keys):
        raise TypeError(f"{where} uses a wire key twice: {sorted(keys)}")
    by_key = {s.key: s for s in slots}
    reserved = {"v", "kind"} if kind is not None else set()
    if reserved & set(keys):
        raise TypeError(f"{where} may not declare the envelope keys {sorted(reserved)}")
    attrs = {s.attr for s in slots}
    for s in slots:
        if isinstance(s.type, _ParamsOf) and (
            s.type.by not in attrs or isinstance(next(
                t.type for t in slots if t.attr == s.type.by), _ParamsOf)):
            raise TypeError(f"{where}.{s.attr}: ParamsOf needs a sibling field "
                            f"{s.type.by!r} that is not ParamsOf itself")
    if kind is not None:
        # the envelope: each key at its fixed attribute, present exactly when it must be
        need = {"round": "round_id"}
        if party in ("from", "both"):
            need["from"] = "sender"
        if party in ("to", "both"):
            need["to"] = "recipient"
        if signer is not None:
            need["sig"] = "sig"
        for k in ("round", "from", "to", "sig"):
            s = by_key.get(k)
            if k in need and (s is None or s.attr != need[k]):
                raise TypeError(f"{where} needs the envelope field {need[k]} (key {k!r}); "
                                f"declare it with {_HELPERS[k]}")
            if k not in need and s is not None:
                raise TypeError(f"{where} may not have the envelope key {k!r} (party "
                                f"{party!r}, signer {signer})")
        sig = by_key.get("sig")
        if sig is not None and not (isinstance(sig.type, _Bytes)
                                    and sig.type.size == SIG_BYTES):
            raise TypeError(f"{where}.sig must be declared with Sig()")
    name = kind if kind is not None else cls.__name__
    all_keys = frozenset(keys) | reserved
    return _Schema(name=name, kind=kind, signer=signer, party=party,
                   context_bytes=context_bytes, slots=tuple(slots),
                   order=tuple(sorted(slots, key=lambda s: s.key)), keys=all_keys,
                   by_attr=MappingProxyType({s.attr: s for s in slots}))


_HELPERS = {"round": "Round()", "from": "From()", "to": "To()", "sig": "Sig()"}
_UNSET: Any = object()


def record(cls: type[R]) -> type[R]:
    """Class decorator: a :class:`Record` dataclass becomes a nested wire structure (a map of
    its fields, no envelope), for :func:`Struct` and :func:`ParamsOf`.

    A record (or message) may define ``wire_check(self, limits)`` raising ``ValueError``
    for checks across fields that depend on :class:`Limits`; ``__post_init__`` does the
    others.

    Raises:
        TypeError: the class is a :class:`Message` (declare it with :func:`message`) or
            breaks the rules :func:`message` names.
    """
    if isinstance(cls, type) and issubclass(cls, Message):
        raise TypeError(f"{cls.__name__} is a Message: declare it with @message(kind=...)")
    cls.__wire__ = _build_schema(cls, None, None, None, 0)
    return cls


def message(
    *, kind: str, signer: Role | None, party: str | None = _UNSET, context_bytes: int = 0,
) -> Callable[[type[M]], type[M]]:
    """Class decorator: a :class:`Message` dataclass becomes the wire kind ``kind``.

    Args:
        kind: the envelope's ``"kind"`` (a :func:`Name`: it is also a topic's last level).
        signer: :data:`DEVICE` (the sender signs), :data:`AGGREGATOR`, or None (unsigned).
        party: ``"from"`` (a device sends it), ``"to"`` (the aggregator sends it to one
            device), ``"both"`` (a device sends it to another device, the aggregator
            relaying) or None (the aggregator, to every device); by default ``"from"`` for
            device-signed kinds and ``"to"`` for aggregator-signed ones.
        context_bytes: 32 for kinds whose signature binds the round configuration's digest,
            0 otherwise.

    Raises:
        ValueError: a bad argument (a kind that is not a name, an unknown party, a device
            kind without its device, a context for an unsigned kind).
        TypeError: the class breaks the schema's rules (not a frozen, slotted, keyword-only
            dataclass of :class:`Message`; a field without a wire type; the envelope
            fields missing or extra).
    """
    if not isinstance(kind, str) or not NAME_PATTERN.fullmatch(kind):
        raise ValueError(f"kind must be 1-64 characters of [A-Za-z0-9_.-], got {kind!r}")
    if signer is not None and not isinstance(signer, Role):
        raise ValueError(f"signer must be DEVICE, AGGREGATOR or None, got {signer!r}")
    if party is _UNSET:
        if signer is None:
            raise ValueError(f"{kind}: an unsigned kind must say its party ('from', 'to' "
                             f"or None)")
        party = "from" if signer is DEVICE else "to"
    if party not in ("from", "to", "both", None):
        raise ValueError(f"party must be 'from', 'to', 'both' or None, got {party!r}")
    if signer is DEVICE and party not in ("from", "both"):
        raise ValueError(f"{kind}: a device-signed kind names its device ('from' or 'both')")
    if context_bytes not in (0, 32) or (context_bytes and signer is None):
        raise ValueError(f"context_bytes must be 0, or 32 for a signed kind, got "
                         f"{context_bytes!r}")

    def decorate(cls: type[M]) -> type[M]:
        cls.__wire__ = _build_schema(cls, kind, signer, party, context_bytes)
        cls.KIND, cls.SIGNER, cls.PARTY = kind, signer, party
        cls.CONTEXT_BYTES = context_bytes
        return cls

    return decorate


# =========================================================================== bytes


def _pack(obj: Any) -> bytes:
    # maps come from to_wire with sorted keys, so this is the canonical form
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def catalog(*classes: type[Message]) -> Mapping[str, type[Message]]:
    """The kinds one endpoint accepts, ``{kind: class}``, for :func:`decode` and :func:`peek`.

    Raises:
        ValueError: a class is not a :func:`message`, or two share a kind.
    """
    out: dict[str, type[Message]] = {}
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, Message) and "__wire__" in c.__dict__):
            raise ValueError(f"not a @message class: {c!r}")
        if c.KIND in out:
            raise ValueError(f"kind {c.KIND!r} is declared twice ({out[c.KIND].__name__}, "
                             f"{c.__name__})")
        out[c.KIND] = c
    return MappingProxyType(out)


def encode(msg: Message, *, limits: Limits = LIMITS) -> bytes:
    """The canonical msgpack bytes of ``msg``, checked first as the receiver will check them.

    Raises:
        ValueError: not a message, a signed kind without its signature (:func:`sign` first),
            a field that would not decode, or more than ``limits.max_message_bytes``.
    """
    if not isinstance(msg, Message) or "__wire__" not in type(msg).__dict__:
        raise ValueError(f"not a wire message: {_type_name(msg)}")
    if msg.SIGNER is not None and len(getattr(msg, "sig", b"")) != SIG_BYTES:
        raise ValueError(f"{msg.KIND} must be signed before it is encoded (see schema.sign)")
    data = _pack(msg._checked_wire(limits))
    if len(data) > limits.max_message_bytes:
        raise ValueError(f"{msg.KIND} of {len(data)} bytes exceeds "
                         f"{limits.max_message_bytes}")
    return data


def _unpack(data: object, limits: Limits) -> dict[str, Any]:
    """The msgpack map in ``data``, with the unpacker capped by the input's own size."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"a message must be bytes, got {_type_name(data)}")
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
        raise WireError(f"malformed message bytes ({_type_name(e)}: {e})") from None
    if not isinstance(obj, dict):
        raise WireError(f"a message must be a map, got {_type_name(obj)}")
    v = obj.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # not True, not 5.0
        raise WireError(f"protocol version must be {PROTOCOL_VERSION}, got {_show(v)}")
    return obj


def _class_of(obj: Mapping[str, Any], kinds: Mapping[str, type[Message]]) -> type[Message]:
    kind = obj.get("kind")
    cls = kinds.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message kind {_show(kind)}")
    return cls


def decode(
    data: bytes | bytearray | memoryview, kinds: Mapping[str, type[Message]], *,
    limits: Limits = LIMITS,
) -> Message:
    """Parse and validate one message of one of ``kinds`` (not its signature).

    Raises:
        WireError: anything wrong, named: not bytes, above ``limits.max_message_bytes``,
            malformed or truncated msgpack, trailing bytes, a length above the unpacker's
            caps, not a map, another protocol version, an unknown kind, or a bad field.
    """
    obj = _unpack(data, limits)
    return _class_of(obj, kinds).from_wire(obj, limits)


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """A message's envelope, read by :func:`peek` without checking the rest.

    Attributes:
        kind: the message kind; round: its round id.
        sender: the device that sent it (None: the aggregator did).
        recipient: the one device it is for (None: for the aggregator, or for everyone).
    """

    kind: str
    round: int
    sender: str | None
    recipient: str | None


def peek(
    data: bytes | bytearray | memoryview, kinds: Mapping[str, type[Message]], *,
    limits: Limits = LIMITS,
) -> Header:
    """The envelope of ``data`` (kind, round, sender or recipient), for routing; the other
    fields are not checked: :func:`decode` before trusting anything else.

    Raises:
        WireError: not an envelope of a known kind and version, with a valid round and
            party.
    """
    obj = _unpack(data, limits)
    cls = _class_of(obj, kinds)
    sch = cls.__wire__
    found: dict[str, Any] = {}
    for s in sch.slots:
        if s.key in ("round", "from", "to"):
            if s.key not in obj:
                raise WireError(f"{cls.KIND}: missing field {s.key!r}")
            try:
                found[s.key] = s.type.load(obj[s.key], limits)
            except _Bad as e:
                raise WireError(f"{cls.KIND}: field {s.key!r} {e}") from None
    return Header(kind=cls.KIND, round=found["round"], sender=found.get("from"),
                  recipient=found.get("to"))


# =========================================================================== signatures


def signer_of(msg: Message) -> str | None:
    """The device whose key verifies ``msg`` (None: the aggregator's).

    Raises:
        ValueError: the kind is not signed.
    """
    if msg.SIGNER is None:
        raise ValueError(f"{msg.KIND} messages are not signed")
    return msg.sender if msg.SIGNER is DEVICE else None  # type: ignore[attr-defined,no-any-return]


def sign(msg: M, signer: Signer, *, context: bytes = b"", limits: Limits = LIMITS) -> M:
    """``msg`` with its signature by ``signer`` (Ed25519 is deterministic: one signature per
    message and key), after checking every other field as a receiver would.

    Raises:
        ValueError: the kind is not signed, the context has the wrong length, a field would
            not decode, or ``signer`` did not return 64 bytes.
    """
    if msg.SIGNER is None:
        raise ValueError(f"{msg.KIND} messages are not signed")
    probe = replace(msg, sig=bytes(SIG_BYTES))  # type: ignore[type-var]
    sig = signer.sign(probe._signed(probe._checked_wire(limits), context))
    if not isinstance(sig, bytes) or len(sig) != SIG_BYTES:
        raise ValueError(f"a signer must return {SIG_BYTES} bytes of Ed25519, got {sig!r:.40}")
    return replace(msg, sig=sig)  # type: ignore[type-var]


def verify(msg: Message, key: bytes | Ed25519PublicKey, *, context: bytes = b"") -> None:
    """Check ``msg``'s signature with the signer's public key (raw 32 bytes or a key object;
    the caller looks it up by :func:`signer_of`).

    Raises:
        RemoteProtocolError: the signature does not verify (the peer is to blame).
        ValueError: the kind is not signed, a bad key or context (the caller's bug).
    """
    data = msg.signing_bytes(context)
    if isinstance(key, bytes):
        if len(key) != 32:
            raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(key)}")
        key = Ed25519PublicKey.from_public_bytes(key)
    elif not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"key must be 32 raw bytes or an Ed25519PublicKey, got "
                         f"{_type_name(key)}")
    who = signer_of(msg)
    try:
        key.verify(msg.sig, data)  # type: ignore[attr-defined]
    except InvalidSignature:
        by = "the aggregator" if who is None else repr(who)
        raise RemoteProtocolError(f"{msg.KIND}: bad signature from {by}") from None
