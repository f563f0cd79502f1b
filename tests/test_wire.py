"""The round's wire messages: round trips, golden vectors, truncations, garbage, chunking."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk import secagg, wire
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.wire import (
    CheckIn,
    Decline,
    ErrorNotice,
    ModelUpdate,
    Reassembler,
    RoundPlan,
    SecAggPacket,
    WireArray,
    WireError,
    decode,
    encode,
    split_upload,
)

GOLDEN = Path(__file__).parent / "golden" / "wire_vectors.json"


def _fixed_bytes(label: str):
    counter = [0]

    def random_bytes(n: int) -> bytes:
        out = b""
        while len(out) < n:
            out += hashlib.sha256(f"{label}/{counter[0]}".encode()).digest()
            counter[0] += 1
        return out[:n]

    return random_bytes


def _identities():
    agg = secagg.AggregatorIdentity.generate(random_bytes=_fixed_bytes("agg"))
    devs = [secagg.DeviceIdentity.generate(f"dev-{c}", random_bytes=_fixed_bytes(c))
            for c in "abc"]
    return agg, devs, secagg.Registry.of(agg, devs)


def golden_messages() -> dict[str, wire.WireMessage]:
    """The fixed messages whose encodings ``tests/golden/wire_vectors.json`` pins."""
    agg, devs, _ = _identities()
    cfg = secagg.RoundConfig.for_cohort(round_id=7, nonce=bytes(range(32)),
                                        cohort=[d.device for d in devs], bits=32, length=5)
    client = secagg.SecAggClient(identity=devs[0], registry=secagg.Registry.of(agg, devs),
                                 config=cfg, random_bytes=_fixed_bytes("client"))
    plan = RoundPlan(
        round_id=7, model_version=3, cohort=cfg.cohort, steps=10, batch_size=16, lr=0.5,
        sampling="poisson", clip=1.0, noise_multiplier=0.8, sparsity=0.5,
        round_seed=bytes(range(32, 64)), quant_levels=0, scale=2.0**16, value_bound=8.0,
        bits=32, length=5, nonce=cfg.nonce, degree=cfg.degree, threshold=cfg.threshold,
        min_survivors=2, max_colluders=1, stage_timeout=30.0)
    return {
        "checkin": wire.sign(CheckIn(device="dev-a", data_size=72, remaining_epsilon=7.5,
                                     model_version=3), devs[0]),
        "plan": wire.sign(plan, agg),
        "decline": wire.sign(Decline(round_id=7, device="dev-b", reason="budget",
                                     detail="eps 9.1 > 8"), devs[1]),
        "secagg_advertise": SecAggPacket.wrap(client.advertise()),
        "chunk": split_upload(round_id=7, device="dev-a", data=bytes(range(200)) * 5,
                              max_packet=600)[1],
        "model": wire.sign(ModelUpdate.of(version=4, round_id=7, params=[
            np.arange(6, dtype=np.float32).reshape(2, 3) / 4, np.array([-1.5], np.float32)]),
            agg),
        "error": wire.sign(ErrorNotice(round_id=7, device="dev-c", code="round_failed",
                                       detail="2 of 3 survived, need 3"), agg),
    }


def write_golden() -> None:
    GOLDEN.write_text(json.dumps({k: encode(m).hex() for k, m in golden_messages().items()},
                                 indent=1) + "\n")


@pytest.fixture(scope="module")
def messages() -> dict[str, wire.WireMessage]:
    return golden_messages()


def test_golden_vectors_encode_and_decode(messages) -> None:
    vectors = json.loads(GOLDEN.read_text())
    assert sorted(vectors) == sorted(messages)
    for name, msg in messages.items():
        assert encode(msg).hex() == vectors[name], name
        assert decode(bytes.fromhex(vectors[name])) == msg, name


def test_signatures_verify_and_bind_every_field(messages) -> None:
    _, _, reg = _identities()
    wire.verify(messages["checkin"], reg, "dev-a")
    wire.verify(messages["plan"], reg, None)
    with pytest.raises(RemoteProtocolError, match="bad signature"):
        wire.verify(messages["checkin"], reg, "dev-b")
    from dataclasses import replace
    forged = replace(messages["plan"], noise_multiplier=0.0)
    with pytest.raises(RemoteProtocolError, match="bad signature from the aggregator"):
        wire.verify(forged, reg, None)


@pytest.mark.parametrize("name", ["checkin", "plan", "decline", "secagg_advertise", "chunk",
                                  "model", "error"])
def test_every_truncated_prefix_is_rejected(messages, name: str) -> None:
    raw = encode(messages[name])
    for n in range(len(raw)):
        with pytest.raises(WireError):
            decode(raw[:n])
    with pytest.raises(WireError, match="malformed"):
        decode(raw + b"\x00")  # trailing bytes


def test_arrays_round_trip_bit_for_bit_and_reject_non_finite() -> None:
    a = np.array([[1.0, -0.0], [np.float32(1e-45), 3.5]], dtype=np.float32)
    w = WireArray.of(a.astype(">f4"))  # big-endian input travels little-endian
    assert w.dtype == "<f4" and w.to_numpy().tobytes() == a.tobytes()
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="only finite"):
            WireArray.of(np.array([0.0, bad]))
    m = ModelUpdate(version=1, round_id=1, arrays=(w,), sig=bytes(64))
    obj = m.to_wire()
    obj["arrays"][0]["data"] = np.array([0, np.nan, 0, 0], "<f4").tobytes()
    with pytest.raises(WireError, match=r"nan.*flat index 1"):
        decode(msgpack.packb(obj, use_bin_type=True))


def _mutate(msg: wire.WireMessage, **changes) -> bytes:
    obj = msg.to_wire()
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(("name", "changes", "match"), [
    ("checkin", {"v": 2}, "protocol version must be 3"),  # protocol 2 is refused
    ("checkin", {"v": True}, "protocol version"),
    ("checkin", {"kind": "nope"}, "unknown message kind"),
    ("checkin", {"device": "a/+"}, "field 'device'"),
    ("checkin", {"remaining_epsilon": float("nan")}, "remaining_epsilon"),
    ("checkin", {"data_size": -1}, "data_size"),
    ("checkin", {"extra": 1}, "unexpected"),
    ("plan", {"clip": float("inf")}, "'clip' must be finite"),
    ("plan", {"sparsity": 1.5}, "sparsity"),
    ("plan", {"threshold": 1}, "secagg parameters"),
    ("plan", {"cohort": ["dev-b", "dev-a", "dev-c"]}, "sorted"),
    ("plan", {"sampling": "x" * 1000}, "at most 256"),
    ("plan", {"min_survivors": 3000}, "min_survivors"),
    ("plan", {"round_seed": b"short"}, "round_seed"),
    ("decline", {"detail": 5}, "detail"),
    ("chunk", {"index": 5}, "index"),
    ("chunk", {"data": b"x" * 2000}, "at most"),
    ("model", {"arrays": []}, "arrays"),
    ("model", {"arrays": [{"dtype": "<f4", "shape": [1 << 40], "data": b""}]}, "array sizes"),
    ("model", {"arrays": [{"dtype": "object", "shape": [1], "data": b""}]}, "dtype"),
    ("model", {"arrays": [{"dtype": "<f4", "shape": [3], "data": b"\0" * 8}]}, "takes 12"),
    ("secagg_advertise", {"round_id": 8}, "round 7"),
    ("secagg_advertise", {"data": b"\x80"}, "secagg"),
])
def test_bad_fields_are_named(messages, name, changes, match) -> None:
    with pytest.raises(WireError, match=match):
        decode(_mutate(messages[name], **changes))


def test_limits_are_enforced() -> None:
    big = msgpack.packb({"v": wire.PROTOCOL_VERSION, "kind": "checkin", "pad": b"x" * 100})
    with pytest.raises(WireError, match="exceeds"):
        decode(big, limits=wire.Limits(max_message_bytes=64))
    # a length prefix claiming 4 GiB of bin data in a 10-byte message
    with pytest.raises(WireError, match="malformed"):
        decode(b"\x81\xa1v\xc6\xff\xff\xff\xff\x00\x00")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_never_crashes(data: bytes) -> None:
    try:
        decode(data)
    except WireError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                  st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=40))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["checkin", "plan", "decline", "chunk", "model", "error", "secagg"]),
       st.dictionaries(st.text(max_size=12), st.recursive(
           _leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                      max_size=4),
           max_leaves=10), max_size=8))
def test_structured_garbage_never_crashes(kind: str, fields: dict) -> None:
    obj = {**fields, "v": wire.PROTOCOL_VERSION, "kind": kind}
    try:
        decode(msgpack.packb(obj, use_bin_type=True))
    except WireError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["checkin", "plan", "decline", "secagg_advertise", "chunk", "model",
                        "error"]), st.data())
def test_field_deletion_and_retyping_is_rejected(name: str, data) -> None:
    obj = golden_messages()[name].to_wire()
    key = data.draw(st.sampled_from(sorted(k for k in obj if k not in ("v", "kind"))))
    if data.draw(st.booleans()):
        del obj[key]
    else:
        obj[key] = data.draw(_leaf.filter(lambda v: type(v) is not type(obj[key])))
    with pytest.raises(WireError):
        decode(msgpack.packb(obj, use_bin_type=True))


def test_encode_refuses_unsigned() -> None:
    with pytest.raises(ValueError, match="signed before"):
        encode(CheckIn(device="d", data_size=1, remaining_epsilon=1.0, model_version=0))


# ----------------------------------------------------------------------- chunking


@pytest.mark.parametrize("max_packet", [512, 4096, wire.DEFAULT_MAX_PACKET])
def test_chunks_fit_the_packet_and_reassemble(max_packet: int) -> None:
    data = np.random.default_rng(1).bytes(70_000)
    chunks = split_upload(round_id=3, device="d" * 64, data=data, max_packet=max_packet)
    assert all(len(encode(c)) <= max_packet for c in chunks)
    r = Reassembler()
    order = np.random.default_rng(2).permutation(len(chunks))
    got = [r.add(decode(encode(chunks[i]))) for i in order]
    assert got[-1] == data and all(g is None for g in got[:-1])
    assert r.bytes_held == 0
    # duplicates, also after completion, are ignored
    assert r.add(chunks[0]) is None


def test_reassembler_rejects_conflicts_and_bounds_memory() -> None:
    data = bytes(range(256)) * 10
    chunks = split_upload(round_id=1, device="a", data=data, max_packet=1024)
    r = Reassembler(max_pending=1, max_bytes=1500)
    assert r.add(chunks[0]) is None
    assert r.add(chunks[0]) is None  # exact duplicate
    from dataclasses import replace
    with pytest.raises(WireError, match="different bytes"):
        r.add(replace(chunks[0], data=b"\x00" * len(chunks[0].data)))
    with pytest.raises(WireError, match="another upload"):
        r.add(replace(chunks[1], digest=bytes(32)))
    other = split_upload(round_id=1, device="b", data=b"xy", max_packet=1024)[0]
    with pytest.raises(WireError, match="too many uploads"):
        r.add(other)
    with pytest.raises(WireError, match="buffer full"):
        r.add(chunks[1])
    held = r.to_state()
    r2 = Reassembler()
    r2.load_state(held)
    assert r2.bytes_held == r.bytes_held == len(chunks[0].data)
    for c in chunks[1:]:
        out = r2.add(c)
    assert out == data


def test_reassembler_drops_an_upload_with_a_wrong_digest() -> None:
    chunks = split_upload(round_id=1, device="a", data=b"abcdef" * 200, max_packet=1024)
    from dataclasses import replace
    forged = [replace(c, digest=hashlib.sha256(b"x").digest()) for c in chunks]
    r = Reassembler()
    r.add(forged[0])
    with pytest.raises(WireError, match="digest"):
        r.add(forged[1])
    assert r.bytes_held == 0


if __name__ == "__main__":  # regenerate the golden vectors (review the diff!)
    write_golden()
    print(f"wrote {GOLDEN}")
