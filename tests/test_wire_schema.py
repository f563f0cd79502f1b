"""edge_sdk.wire.schema, the declarative wire (plan15 step D1): round trips of random
messages of a few test kinds; every truncated prefix, wrong types, huge lengths, NaN/inf,
unknown kinds, other versions, extra and missing fields refused with a named WireError;
signed bytes that change with every field and signatures that fail on any bit flip; peek on
envelopes and on garbage; the decorator's own rules."""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.errors import RemoteProtocolError
from edge_sdk.wire import WireError
from edge_sdk.wire.schema import (
    AGGREGATOR,
    DEVICE,
    LIMITS,
    PROTOCOL_VERSION,
    ROUND_HI,
    SIGNING_LABEL,
    Bytes,
    Float,
    From,
    Header,
    Int,
    Limits,
    ListOf,
    Map,
    Message,
    Name,
    Names,
    Optional,
    ParamsOf,
    Record,
    Round,
    Sig,
    Str,
    Struct,
    To,
    catalog,
    decode,
    encode,
    message,
    peek,
    record,
    sign,
    signer_of,
    verify,
)

# ------------------------------------------------------------------- the test kinds


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class GaussParams(Record):
    clip: float = Float(0.0, open_lo=True)
    noise: float = Float(0.0)


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class RandKParams(Record):
    keep: int = Int(1, 1000)
    seed: bytes = Bytes(32)


PARAMS: dict[str, type[Record]] = {"gauss": GaussParams, "randk": RandKParams}
_ITEM = {"<u4": 4, "<f8": 8}


@record
@dataclass(frozen=True, slots=True, kw_only=True)
class Vec(Record):
    dtype: str = Str(choices=tuple(_ITEM))
    count: int = Int(0, "max_array_elements")
    data: bytes = Bytes(max="max_upload_bytes")

    def __post_init__(self) -> None:
        if len(self.data) != self.count * _ITEM.get(self.dtype, 0):
            raise ValueError(f"{self.count} values of {self.dtype} are not {len(self.data)} "
                             f"bytes")


@message(kind="ping", signer=DEVICE)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ping(Message):
    round_id: int = Round()
    sender: str = From()
    count: int = Int(0, 1 << 40)
    ratio: float = Float(0.0, 1.0, open_lo=True)
    note: str = Str()
    tag: str = Name()
    blob: bytes = Bytes(max=64)
    digest: bytes = Bytes(32)
    peers: tuple[str, ...] = Names(max=8, sorted_unique=True)
    extra: int | None = Optional(Int(-5, 5))
    sig: bytes = Sig()


@message(kind="plan", signer=AGGREGATOR)
@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(Message):
    round_id: int = Round(1)
    recipient: str = To()
    mechanism: str = Name()
    params: Record = ParamsOf("mechanism", PARAMS)
    shares: tuple[tuple[str, bytes], ...] = Map(Name(), Bytes(4), max=8)
    cohort: tuple[str, ...] = Names(max="max_cohort", min=1, sorted_unique=True)
    sig: bytes = Sig()

    def __post_init__(self) -> None:
        if self.recipient not in self.cohort:
            raise ValueError(f"recipient {self.recipient!r} is not in the cohort")


@message(kind="bundle", signer=AGGREGATOR, party=None)
@dataclass(frozen=True, slots=True, kw_only=True)
class Bundle(Message):
    round_id: int = Round()
    pings: tuple[Ping, ...] = ListOf(Struct(Ping), max=4)
    vecs: tuple[Vec, ...] = ListOf(Struct(Vec), max="max_arrays")
    sig: bytes = Sig()

    def wire_check(self, limits: Limits) -> None:
        total = sum(v.count for v in self.vecs)
        if total > limits.max_array_elements:
            raise ValueError(f"{total} values in all, above {limits.max_array_elements}")


@message(kind="shares", signer=DEVICE, party="both", context_bytes=32)
@dataclass(frozen=True, slots=True, kw_only=True)
class Shares(Message):
    round_id: int = Round()
    sender: str = From()
    recipient: str = To()
    data: bytes = Bytes(max=128)
    sig: bytes = Sig()


@message(kind="chunk", signer=None, party="from")
@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk(Message):
    round_id: int = Round()
    sender: str = From()
    index: int = Int(0, 9)
    data: bytes = Bytes(min=1, max=64)


KINDS = catalog(Ping, Plan, Bundle, Shares, Chunk)
SIGNED = (Ping, Plan, Bundle, Shares)


def _key(label: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(label.encode()).digest())


DEVICE_KEY, AGGREGATOR_KEY, OTHER_KEY = _key("device"), _key("aggregator"), _key("other")
CONTEXT = hashlib.sha256(b"round config").digest()


def context_of(msg: Message) -> bytes:
    return CONTEXT if msg.CONTEXT_BYTES else b""


def signed(msg: Any) -> Any:
    """``msg`` signed by its role's test key (unsigned kinds unchanged)."""
    if msg.SIGNER is None:
        return msg
    key = DEVICE_KEY if msg.SIGNER is DEVICE else AGGREGATOR_KEY
    return sign(msg, key, context=context_of(msg))


def public_key(msg: Message) -> Any:
    return (DEVICE_KEY if msg.SIGNER is DEVICE else AGGREGATOR_KEY).public_key()


# ------------------------------------------------------------------- strategies

names = st.text(alphabet=string.ascii_letters + string.digits + "_.-", min_size=1,
                max_size=64)
sorted_names = st.lists(names, max_size=8, unique=True).map(lambda x: tuple(sorted(x)))


def unsigned_pings() -> st.SearchStrategy[Ping]:
    return st.builds(
        Ping, round_id=st.integers(0, ROUND_HI), sender=names,
        count=st.integers(0, 1 << 40), ratio=st.floats(0.0, 1.0, exclude_min=True),
        note=st.text(max_size=256), tag=names, blob=st.binary(max_size=64),
        digest=st.binary(min_size=32, max_size=32), peers=sorted_names,
        extra=st.none() | st.integers(-5, 5))


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    mechanism = draw(st.sampled_from(sorted(PARAMS)))
    params: Record
    if mechanism == "gauss":
        params = GaussParams(clip=draw(st.floats(0.0, 1e6, exclude_min=True)),
                             noise=draw(st.floats(0.0, 1e6)))
    else:
        params = RandKParams(keep=draw(st.integers(1, 1000)),
                             seed=draw(st.binary(min_size=32, max_size=32)))
    cohort = draw(st.lists(names, min_size=1, max_size=12, unique=True))
    shares = draw(st.lists(st.tuples(names, st.binary(min_size=4, max_size=4)), max_size=8,
                           unique_by=lambda p: p[0]))
    return Plan(round_id=draw(st.integers(1, ROUND_HI)), recipient=draw(st.sampled_from(cohort)),
                mechanism=mechanism, params=params, shares=tuple(shares),
                cohort=tuple(sorted(cohort)))


@st.composite
def vecs(draw: st.DrawFn) -> Vec:
    dtype = draw(st.sampled_from(sorted(_ITEM)))
    count = draw(st.integers(0, 16))
    return Vec(dtype=dtype, count=count,
               data=draw(st.binary(min_size=count * _ITEM[dtype], max_size=count * _ITEM[dtype])))


@st.composite
def bundles(draw: st.DrawFn) -> Bundle:
    pings = draw(st.lists(unsigned_pings().map(signed), max_size=4))
    return Bundle(round_id=draw(st.integers(0, ROUND_HI)), pings=tuple(pings),
                  vecs=tuple(draw(st.lists(vecs(), max_size=4))))


def shares() -> st.SearchStrategy[Shares]:
    return st.builds(Shares, round_id=st.integers(0, ROUND_HI), sender=names,
                     recipient=names, data=st.binary(max_size=128))


def chunks() -> st.SearchStrategy[Chunk]:
    return st.builds(Chunk, round_id=st.integers(0, ROUND_HI), sender=names,
                     index=st.integers(0, 9), data=st.binary(min_size=1, max_size=64))


STRATEGIES = {Ping: unsigned_pings(), Plan: plans(), Bundle: bundles(), Shares: shares(),
              Chunk: chunks()}
messages = st.one_of(*STRATEGIES.values()).map(signed)


def example(cls: type[Message]) -> Any:
    """One fixed, valid, signed message of each kind."""
    ping = Ping(round_id=3, sender="dev-a", count=7, ratio=0.25, note="hello", tag="t1",
                blob=b"\x01\x02", digest=bytes(range(32)), peers=("dev-b", "dev-c"), extra=-2)
    out = {
        Ping: ping,
        Plan: Plan(round_id=5, recipient="dev-a", mechanism="randk",
                   params=RandKParams(keep=3, seed=bytes(32)),
                   shares=(("dev-b", b"abcd"), ("dev-c", b"efgh")),
                   cohort=("dev-a", "dev-b", "dev-c")),
        Bundle: Bundle(round_id=5, pings=(signed(ping),),
                       vecs=(Vec(dtype="<u4", count=2, data=bytes(8)),
                             Vec(dtype="<f8", count=1, data=bytes(8)))),
        Shares: Shares(round_id=9, sender="dev-b", recipient="dev-c", data=b"secret shares"),
        Chunk: Chunk(round_id=9, sender="dev-b", index=1, data=b"part"),
    }[cls]
    return signed(out)


# ------------------------------------------------------------------- round trips


@given(msg=messages)
@settings(max_examples=150, deadline=None)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    back = decode(data, KINDS)
    assert back == msg and type(back) is type(msg)
    assert encode(back) == data  # canonical: one encoding per message
    assert list(msgpack.unpackb(data)) == sorted(msgpack.unpackb(data))
    head = peek(data, KINDS)
    assert head == Header(kind=msg.KIND, round=msg.round_id,
                          sender=getattr(msg, "sender", None),
                          recipient=getattr(msg, "recipient", None))
    if msg.SIGNER is not None:
        verify(back, public_key(msg), context=context_of(msg))
        assert signer_of(back) == (msg.sender if msg.SIGNER is DEVICE else None)


@given(msg=messages)
@settings(max_examples=40, deadline=None)
def test_every_truncated_prefix_is_a_wire_error(msg: Message) -> None:
    data = encode(msg)
    for i in range(len(data)):
        with pytest.raises(WireError):
            decode(data[:i], KINDS)
        with pytest.raises(WireError):
            peek(data[:i], KINDS)


def test_key_order_on_the_wire_does_not_matter() -> None:
    for cls in KINDS.values():
        msg = example(cls)
        obj = msgpack.unpackb(encode(msg))
        reordered = msgpack.packb(dict(reversed(list(obj.items()))), use_bin_type=True)
        assert reordered != encode(msg)
        assert decode(reordered, KINDS) == msg


def test_the_envelope_of_each_kind() -> None:
    wire = {c.KIND: set(msgpack.unpackb(encode(example(c)))) for c in KINDS.values()}
    env = {"v", "kind", "round"}
    assert env | {"from", "sig"} <= wire["ping"] and "to" not in wire["ping"]
    assert env | {"to", "sig"} <= wire["plan"] and "from" not in wire["plan"]
    assert env | {"sig"} <= wire["bundle"] and not {"from", "to"} & wire["bundle"]
    assert env | {"from"} <= wire["chunk"] and not {"to", "sig"} & wire["chunk"]
    assert env | {"from", "to", "sig"} <= wire["shares"]
    assert all(msgpack.unpackb(encode(example(c)))["v"] == PROTOCOL_VERSION
               for c in KINDS.values())


# ------------------------------------------------------------------- refusals, named


def _obj(cls: type[Message]) -> dict[str, Any]:
    return msgpack.unpackb(encode(example(cls)))


def _refused(obj: object, *needles: str) -> str:
    data = msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(WireError) as e:
        decode(data, KINDS)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


_POOL: tuple[object, ...] = (None, True, False, 0, 1, -1, 2**64 - 1, 1.5, "x", "+", b"x",
                             bytes(32), [], ["x"], {}, {"a": 1})


@pytest.mark.parametrize("cls", list(KINDS.values()), ids=lambda c: c.KIND)
def test_wrong_types_are_named(cls: type[Message]) -> None:
    base = _obj(cls)
    for key in base:
        if key in ("v", "kind"):
            continue
        refused = 0
        for bad in _POOL:
            obj = {**base, key: bad}
            try:
                back = decode(msgpack.packb(obj, use_bin_type=True), KINDS)
            except WireError as e:
                # a value of the right type may still break a check across fields
                across = cls is Plan and "is not in the cohort" in str(e)
                assert f"field {key!r}" in str(e) or across, str(e)
                refused += 1
            else:  # taken only as itself (an int as an int, None where None is allowed)
                got = back.to_wire()[key]
                assert got == bad and type(got) is type(bad), (key, bad)
        assert refused >= len(_POOL) // 2, f"{cls.KIND}.{key} took almost anything"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1, 2.0, -1e-9])
def test_nan_inf_and_out_of_range_floats_are_named(bad: object) -> None:
    msg = _refused({**_obj(Ping), "ratio": bad}, "ping", "field 'ratio'", repr(bad))
    assert "float" in msg
    if bad != 2.0:  # inside a nested record too (clip may be 2.0)
        p = {**_obj(Plan), "mechanism": "gauss", "params": {"clip": bad, "noise": 0.0}}
        _refused(p, "plan: field 'params' is invalid: GaussParams: field 'clip'", repr(bad))


def test_unknown_kind_and_other_versions() -> None:
    base = _obj(Ping)
    _refused({**base, "kind": "pong"}, "unknown message kind 'pong'")
    _refused({**base, "kind": 3}, "unknown message kind 3")
    for v in (None, 0, 2, 3, 4, 5, 6, 7, 9, True, "8", 8.0):
        obj = {**base, "v": v} if v is not None else {k: x for k, x in base.items() if k != "v"}
        _refused(obj, f"protocol version must be {PROTOCOL_VERSION}", f"got {v!r}")


def test_extra_and_missing_fields_are_named() -> None:
    base = _obj(Ping)
    _refused({**base, "pad": b"x"}, "ping", "unexpected [\"'pad'\"]", "missing []")
    _refused({k: v for k, v in base.items() if k != "count"}, "missing ['count']")
    _refused({k: v for k, v in base.items() if k != "sig"}, "missing ['sig']")
    _refused({k: v for k, v in base.items() if k != "from"}, "missing ['from']")
    # a nested message keeps its own envelope and fields
    bundle = _obj(Bundle)
    bundle["pings"][0].pop("tag")
    _refused(bundle, "bundle: field 'pings' item 0 is invalid: ping", "missing ['tag']")


def test_values_that_do_not_fit_together_are_named() -> None:
    plan = _obj(Plan)
    _refused({**plan, "to": "dev-z"}, "plan: recipient 'dev-z' is not in the cohort")
    _refused({**plan, "mechanism": "gauss"}, "field 'params'", "'clip'")
    _refused({**plan, "mechanism": "nope"},
             "plan: field 'mechanism' names no known parameter schema, got 'nope'")
    _refused({**plan, "cohort": ["dev-b", "dev-a"]}, "field 'cohort'", "sorted order")
    _refused({**plan, "cohort": []}, "field 'cohort' must have at least 1 items, got 0")
    _refused({**plan, "shares": [["dev-b", b"abcd"], ["dev-b", b"efgh"]]},
             "field 'shares'", "'dev-b' twice")
    _refused({**plan, "shares": [["dev-b", b"abc"]]}, "field 'shares' item 0",
             "must be 4 bytes, got 3")
    bundle = _obj(Bundle)
    bundle["vecs"][0]["count"] = 3
    _refused(bundle, "field 'vecs' item 0 is invalid: Vec", "3 values of <u4 are not 8 bytes")
    _refused({**_obj(Chunk), "data": b""}, "field 'data' must be at least 1 bytes, got 0")


def test_huge_lengths_are_refused_without_allocating() -> None:
    base = _obj(Ping)
    # msgpack headers that announce 4 GiB of bin, str, array and map entries
    for head in (b"\xc6", b"\xdb", b"\xdd", b"\xdf"):
        data = b"\x81\xa4blob" + head + b"\xff\xff\xff\xff" + b"\x00" * 16
        with pytest.raises(WireError, match="malformed message bytes"):
            decode(data, KINDS)
    _refused({**base, "blob": b"x" * 65}, "field 'blob' must be at most 64 bytes, got 65")
    _refused({**base, "note": "n" * 257}, "field 'note' must be at most 256 characters")
    _refused({**base, "peers": [f"d{i:02}" for i in range(9)]},
             "field 'peers' must have at most 8 items, got 9")
    plan = _obj(Plan)
    data = msgpack.packb(plan, use_bin_type=True)
    with pytest.raises(WireError, match="field 'cohort' must have at most 2 items, got 3"):
        decode(data, KINDS, limits=Limits(max_cohort=2))
    with pytest.raises(WireError, match=f"message of {len(data)} bytes exceeds 64"):
        decode(data, KINDS, limits=Limits(max_message_bytes=64))
    bundle = msgpack.packb(_obj(Bundle), use_bin_type=True)
    with pytest.raises(WireError, match="bundle: 3 values in all, above 2"):
        decode(bundle, KINDS, limits=Limits(max_array_elements=2))


def test_errors_show_a_peers_value_briefly() -> None:
    base = _obj(Ping)
    msg = _refused({**base, "from": "x" * 100_000}, "field 'from' must be 1-64 characters",
                   "... (100000 characters)")
    assert len(msg) < 300
    msg = _refused({**base, "count": ["x"] * 100_000}, "a list of 100000 items")
    assert len(msg) < 300
    msg = _refused({**base, **{f"k{i}": 0 for i in range(500)}}, "and more")
    assert len(msg) < 600


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x80\x00",  # never-used byte; trailing bytes after a whole map
    msgpack.packb(msgpack.ExtType(1, b"x")), msgpack.packb({1: 2}),
    b"\x81\xa1v\xa2\xff\xfe",  # a string that is not UTF-8
    b"\x91" * 5000,  # nesting deeper than the unpacker goes
    msgpack.packb([PROTOCOL_VERSION, "ping"]), msgpack.packb(5), msgpack.packb(None),
])
def test_foreign_msgpack_errors_become_wire_errors(data: bytes) -> None:
    with pytest.raises(WireError):
        decode(data, KINDS)
    with pytest.raises(WireError):
        peek(data, KINDS)


def test_not_bytes_is_refused() -> None:
    for bad in (None, "text", 3, [1]):
        with pytest.raises(WireError, match="a message must be bytes"):
            decode(bad, KINDS)  # type: ignore[arg-type]
    msg = example(Ping)
    assert decode(memoryview(encode(msg)), KINDS) == msg
    assert decode(bytearray(encode(msg)), KINDS) == msg


def test_decode_only_knows_its_catalog() -> None:
    data = encode(example(Chunk))
    with pytest.raises(WireError, match="unknown message kind 'chunk'"):
        decode(data, catalog(Ping))
    with pytest.raises(WireError, match="unknown message kind 'chunk'"):
        peek(data, catalog(Ping))


# ------------------------------------------------------------------- signatures

# another valid value for every field but sig, per kind: each must change the signed bytes
ALTERNATIVES: dict[type[Message], dict[str, Any]] = {
    Ping: {"round_id": 4, "sender": "dev-b", "count": 8, "ratio": 0.5, "note": "hellO",
           "tag": "t2", "blob": b"\x01\x03", "digest": bytes(range(1, 33)),
           "peers": ("dev-b",), "extra": None},
    Plan: {"round_id": 6, "recipient": "dev-b", "mechanism": "gauss",
           "params": RandKParams(keep=4, seed=bytes(32)),
           "shares": (("dev-b", b"abcd"),), "cohort": ("dev-a", "dev-b", "dev-c", "dev-d")},
    Bundle: {"round_id": 6, "pings": (),
             "vecs": (Vec(dtype="<u4", count=2, data=bytes(7) + b"\x01"),)},
    Shares: {"round_id": 10, "sender": "dev-c", "recipient": "dev-a",
             "data": b"secret shareS"},
}


def test_alternatives_cover_every_field() -> None:
    for cls in SIGNED:
        assert set(ALTERNATIVES[cls]) == {f.name for f in fields(cls)} - {"sig"}, cls


@pytest.mark.parametrize("cls", SIGNED, ids=lambda c: c.KIND)
def test_signed_bytes_change_with_every_field(cls: type[Message]) -> None:
    msg = example(cls)
    ctx = context_of(msg)
    base = msg.signing_bytes(ctx)
    assert base.startswith(SIGNING_LABEL + ctx)
    for attr, value in ALTERNATIVES[cls].items():
        other = replace(msg, **{attr: value})
        if cls is Plan and attr == "mechanism":  # the params must follow the mechanism
            other = replace(other, params=GaussParams(clip=1.0, noise=0.0))
        assert other.signing_bytes(ctx) != base, attr
        with pytest.raises(RemoteProtocolError, match="bad signature"):
            verify(other, public_key(msg), context=ctx)
    assert replace(msg, sig=bytes(64)).signing_bytes(ctx) == base  # sig is not covered


@given(cls=st.sampled_from(SIGNED), data=st.data())
@settings(max_examples=150, deadline=None)
def test_distinct_messages_sign_distinct_bytes(cls: type[Message], data: st.DataObject) -> None:
    a, b = (signed(data.draw(STRATEGIES[cls])) for _ in range(2))
    ctx = context_of(a)
    if replace(a, sig=b.sig) != b:
        assert a.signing_bytes(ctx) != b.signing_bytes(ctx)


@pytest.mark.parametrize("cls", SIGNED, ids=lambda c: c.KIND)
def test_any_bit_flip_is_refused_or_fails_verification(cls: type[Message]) -> None:
    msg = example(cls)
    ctx = context_of(msg)
    data = encode(msg)
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                back = decode(bytes(flipped), KINDS)
            except WireError:
                continue
            with pytest.raises(RemoteProtocolError, match="bad signature"):
                verify(back, public_key(msg), context=ctx)


def test_verify_refuses_another_key_and_another_context() -> None:
    ping, shares_msg = example(Ping), example(Shares)
    with pytest.raises(RemoteProtocolError, match="ping: bad signature from 'dev-a'"):
        verify(ping, OTHER_KEY.public_key())
    with pytest.raises(RemoteProtocolError, match="plan: bad signature from the aggregator"):
        verify(example(Plan), DEVICE_KEY.public_key())
    with pytest.raises(RemoteProtocolError, match="shares: bad signature"):
        verify(shares_msg, DEVICE_KEY.public_key(), context=hashlib.sha256(b"x").digest())
    raw = DEVICE_KEY.public_key().public_bytes_raw()
    verify(shares_msg, raw, context=CONTEXT)
    with pytest.raises(ValueError, match="context of 32 bytes, got 0"):
        verify(shares_msg, raw)
    with pytest.raises(ValueError, match="context of 0 bytes, got 32"):
        verify(ping, raw, context=CONTEXT)
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        verify(ping, raw[:31])


def test_sign_and_encode_refuse_what_would_not_decode() -> None:
    ping = example(Ping)
    with pytest.raises(ValueError, match="ping must be signed before it is encoded"):
        encode(replace(ping, sig=b""))
    with pytest.raises(ValueError, match=r"ping: field 'count' must be an integer in \[0, "):
        sign(replace(ping, count=-1), DEVICE_KEY)
    with pytest.raises(ValueError, match="ping: field 'count' must be an integer, got str"):
        encode(replace(ping, count="7"))
    with pytest.raises(ValueError, match="field 'peers' must list distinct items in sorted"):
        encode(replace(ping, peers=("b", "a")))
    with pytest.raises(ValueError, match="chunk messages are not signed"):
        sign(example(Chunk), DEVICE_KEY)
    with pytest.raises(ValueError, match="not a wire message"):
        encode(RandKParams(keep=1, seed=bytes(32)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plan: field 'params' must be a RandKParams"):
        encode(replace(example(Plan), params=GaussParams(clip=1.0, noise=0.0)))
    # an int where a float belongs is sent as a float (one encoding per value)
    assert decode(encode(signed(replace(ping, ratio=1))), KINDS).ratio == 1.0


# ------------------------------------------------------------------- peek


def test_peek_reads_the_envelope_only() -> None:
    obj = {**_obj(Ping), "count": -5}  # a body decode refuses
    data = msgpack.packb(obj, use_bin_type=True)
    assert peek(data, KINDS) == Header(kind="ping", round=3, sender="dev-a", recipient=None)
    with pytest.raises(WireError, match="field 'count'"):
        decode(data, KINDS)
    assert peek(encode(example(Plan)), KINDS) == Header(kind="plan", round=5, sender=None,
                                                        recipient="dev-a")
    assert peek(encode(example(Bundle)), KINDS) == Header(kind="bundle", round=5, sender=None,
                                                          recipient=None)


@pytest.mark.parametrize("change, needle", [
    ({"round": -1}, "field 'round' must be an integer in [0, "),
    ({"round": 2**63}, "field 'round'"),
    ({"round": "3"}, "field 'round'"),
    ({"from": "a/b"}, "field 'from' must be 1-64 characters"),
    ({"from": None}, "field 'from'"),
    ({"kind": "pong"}, "unknown message kind"),
    ({"v": 7}, "protocol version must be 8"),
])
def test_peek_refuses_a_bad_envelope(change: dict[str, Any], needle: str) -> None:
    data = msgpack.packb({**_obj(Ping), **change}, use_bin_type=True)
    with pytest.raises(WireError) as e:
        peek(data, KINDS)
    assert needle in str(e.value)
    missing = {k: v for k, v in _obj(Ping).items() if k != "from"}
    with pytest.raises(WireError, match="ping: missing field 'from'"):
        peek(msgpack.packb(missing, use_bin_type=True), KINDS)


@given(data=st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_peek_and_decode_refuse_garbage(data: bytes) -> None:
    # random bytes are never an envelope: it needs "v": 6, a known kind and a round
    with pytest.raises(WireError):
        peek(data, KINDS)
    with pytest.raises(WireError):
        decode(data, KINDS)


# ------------------------------------------------------------------- the schema's rules


def test_limits_are_todays_wire_caps() -> None:
    assert LIMITS == Limits(
        max_message_bytes=64 * 1024 * 1024, max_string=256, max_cohort=4096, max_arrays=64,
        max_ndim=8, max_array_elements=1 << 26, max_chunks=4096,
        max_upload_bytes=256 * 1024 * 1024, max_secagg_bytes=4 * 1024 * 1024)
    with pytest.raises(ValueError, match="Limits.max_cohort must be an integer >= 1, got 0"):
        Limits(max_cohort=0)


def test_the_decorator_refuses_classes_that_break_the_rules() -> None:
    def declare(cls: type, **kw: Any) -> None:
        message(kind=kw.pop("kind", "k"), signer=kw.pop("signer", DEVICE), **kw)(cls)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class NoSig(Message):
        round_id: int = Round()
        sender: str = From()

    with pytest.raises(TypeError, match="needs the envelope field sig"):
        declare(NoSig)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class NoRound(Message):
        sender: str = From()
        sig: bytes = Sig()

    with pytest.raises(TypeError, match="needs the envelope field round_id"):
        declare(NoRound)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class WrongParty(Message):
        round_id: int = Round()
        recipient: str = To()
        sig: bytes = Sig()

    with pytest.raises(TypeError, match="needs the envelope field sender"):
        declare(WrongParty)
    declare(WrongParty, signer=AGGREGATOR)  # the aggregator's kind: fine

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Untyped(Message):
        round_id: int = Round()
        sender: str = From()
        count: int = 0
        sig: bytes = Sig()

    with pytest.raises(TypeError, match="Untyped.count has no wire type"):
        declare(Untyped)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Twice(Message):
        round_id: int = Round()
        sender: str = From()
        a: int = Int(0, 1, key="b")
        b: int = Int(0, 1)
        sig: bytes = Sig()

    with pytest.raises(TypeError, match="uses a wire key twice"):
        declare(Twice)

    @dataclass(frozen=True, kw_only=True)
    class NoSlots(Message):
        round_id: int = Round()
        sender: str = From()
        sig: bytes = Sig()

    with pytest.raises(TypeError, match="frozen=True, slots=True"):
        declare(NoSlots)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class NotAMessage:
        round_id: int = Round()

    with pytest.raises(TypeError, match="must subclass schema.Message"):
        declare(NotAMessage)
    with pytest.raises(TypeError, match="must subclass schema.Record"):
        record(NotAMessage)
    with pytest.raises(TypeError, match="NoSig is a Message: declare it with @message"):
        record(NoSig)
    with pytest.raises(ValueError, match="kind must be 1-64 characters"):
        message(kind="a/b", signer=DEVICE)
    with pytest.raises(ValueError, match="a device-signed kind names its device"):
        message(kind="k", signer=DEVICE, party="to")
    with pytest.raises(ValueError, match="an unsigned kind must say its party"):
        message(kind="k", signer=None)
    with pytest.raises(ValueError, match="context_bytes must be 0, or 32 for a signed kind"):
        message(kind="k", signer=None, party="from", context_bytes=32)
    with pytest.raises(ValueError, match="names no Limits field: 'max_nothing'"):
        Int(0, "max_nothing")
    with pytest.raises(ValueError, match="only lists of scalars"):
        ListOf(Struct(Vec), max=3, distinct=True)
    with pytest.raises(ValueError, match="kind 'ping' is declared twice"):
        catalog(Ping, Ping)
    with pytest.raises(ValueError, match="not a @message class"):
        catalog(Vec)  # type: ignore[arg-type]
