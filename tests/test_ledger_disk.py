"""The ledger on a full or read-only disk fails closed (issue 13): the device declines,
nothing of its update leaves, and the ledger stays verifiable (``Ledger.verify`` and
``fedge ledger verify``).

Real file systems, no fakes: a small tmpfs filled to the last block, and a read-only bind
mount. Both need root (``mount``); without it the tests skip, saying so. Some devices of an
in-memory fleet (tests/test_session_rounds.py's ``Fleet``: real sessions, real aggregator)
keep their ledgers there; the others keep theirs on an ordinary disk, so the rounds go on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_session_rounds import Fleet, _check_sums

from edge_sdk import wire
from edge_sdk.ledger import Budget, Ledger, LedgerError, Plan
from edge_sdk.privacy import Gaussian

REPO = Path(__file__).resolve().parents[1]
VICTIMS = ["d00", "d01", "d02"]




def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {r.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, timeout=30)


def _can_mount() -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs or a read-only bind mount"
    if shutil.which("mount") is None:
        return "no mount command"
    return None


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (skips when mounting is not permitted)."""
    why = _can_mount()
    if why:
        pytest.skip(why)
    d = tmp_path / "tmpfs"
    d.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(d))
    except OSError as e:
        pytest.skip(f"mounting a tmpfs is not permitted here: {e}")
    yield d
    _umount(d)


@contextlib.contextmanager
def read_only_view(source: Path, target: Path) -> Iterator[Path]:
    """``source`` bind-mounted read-only at ``target``."""
    target.mkdir()
    _mount("--bind", str(source), str(target))
    try:
        _mount("-o", "remount,ro,bind", str(target))
        yield target
    finally:
        _umount(target)


def fill(directory: Path) -> Path:
    """Write a file until the file system has no block left; returns it."""
    big = directory / "filler"
    fd = os.open(big, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\xff" * size)
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # really full
        (directory / "probe").write_bytes(b"x" * 4096)
    return big


def move_ledgers(fleet: Fleet, names: list[str], where: Path) -> None:
    """Restart ``names`` with their ledgers (closed, copied) under ``where``."""
    home = fleet.tmp
    for name in names:
        fleet.ledgers[name].close()
        if not (where / f"{name}.db").exists():
            shutil.copy2(home / f"{name}.db", where / f"{name}.db")
    fleet.tmp = where  # start_device opens tmp/<name>.db
    try:
        for name in names:
            fleet.start_device(name)
    finally:
        fleet.tmp = home


def sent_by(fleet: Fleet, names: list[str], since: int = 0) -> list[tuple[str, str, bytes]]:
    return [(s, t, p) for s, t, p in fleet.broker.sent[since:] if s in names]


def cli_verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cli", "ledger", "verify", "--path",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=120)


def _plan(i: int) -> Plan:
    return Plan(round_id=f"x/{i}", model_id="0", event=Gaussian(noise_multiplier=50.0),
                cohort_size=3, secagg_threshold=None)


def test_full_disk_the_device_declines_nothing_leaves_the_ledger_verifies(
        tmp_path: Path, tmpfs: Path, digits: Any, engine: Any) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=2, policy={"cohort_size": 20})
    try:
        move_ledgers(fleet, VICTIMS, tmpfs)
        before = {n: fleet.ledgers[n].head() for n in VICTIMS}
        filler = fill(tmpfs)
        on_full_disk: list[Any] = []

        def drop(name: str, topic: str, payload: bytes) -> bool:
            # round 1 ran on the full disk; before round 2's plan arrives, look, then free it
            if "/down/plan" in topic and not on_full_disk and \
                    wire.decode(payload, wire.ALL_KINDS).round_id == 2:  # type: ignore[union-attr]
                for n in VICTIMS:  # nothing recorded, the file intact, verifiable while full
                    led = fleet.ledgers[n]
                    assert led.reservations() == () and led.head() == before[n]
                    led.verify()
                on_full_disk.append(cli_verify(tmpfs / f"{VICTIMS[0]}.db"))
                filler.unlink()
            return False

        fleet.broker.drop = drop
        fleet.settle(until=lambda: len(fleet.machine.history) >= 2
                     and fleet.machine.stage == "idle")
        assert on_full_disk and on_full_disk[0].returncode == 0, on_full_disk
        o1, o2 = fleet.machine.history
        # round 1 went on without them: each declined, for the ledger, after training
        assert o1.completed and set(o1.survivors) == set(fleet.sessions) - set(VICTIMS)
        mine = [(t, wire.decode(p, wire.ALL_KINDS)) for _, t, p in sent_by(fleet, VICTIMS)
                if "/up/" in t]
        declines = [m for t, m in mine if t.endswith("/up/decline")]
        assert sorted(d.sender for d in declines) == VICTIMS  # type: ignore[union-attr]
        assert all(d.round_id == 1 and d.reason == "ledger"  # type: ignore[union-attr]
                   and "disk is full" in d.detail for d in declines), declines  # type: ignore[union-attr]
        chunks = [m for t, m in mine if t.endswith("/up/masked_part")]
        assert {c.round_id for c in chunks} == {2}  # type: ignore[union-attr]  # none in round 1
        # space again: round 2 took them, each reservation recorded once
        assert o2.completed and set(VICTIMS) <= set(o2.survivors)
        _check_sums(fleet)
        for n in VICTIMS:
            assert fleet.sessions[n].encoded_input(1) is None
            assert [r.plan.round_id for r in fleet.ledgers[n].reservations()] == ["lab/2"]
            fleet.ledgers[n].verify()
    finally:
        fleet.close()


def test_a_reserve_that_meets_a_full_disk_records_nothing(tmpfs: Path) -> None:
    path = tmpfs / "ledger.db"
    with Ledger.open(path, budget=Budget(epsilon=100.0, delta=1e-5), device_id="d",
                     create=True) as led:
        for i in range(5):
            led.commit(led.reserve(_plan(i)))
        head = led.head()
        filler = fill(tmpfs)
        with pytest.raises(LedgerError, match="disk is full"):
            led.reserve(_plan(5))
        assert len(led.reservations()) == 5 and led.head() == head
        led.verify()
        filler.unlink()
        led.reserve(_plan(5))  # the same ledger works again once there is space
        assert len(led.reservations()) == 6
    with Ledger.open(path, create=False) as led:
        assert [r.plan.round_id for r in led.reservations()] == [f"x/{i}" for i in range(6)]


def test_read_only_disk_the_device_declines_before_training_and_the_ledger_verifies(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    why = _can_mount()
    if why:
        pytest.skip(why)
    (tmp_path / "fleet").mkdir()
    fleet = Fleet(tmp_path / "fleet", digits, engine, rounds=1, policy={"cohort_size": 20})
    src = tmp_path / "src"
    src.mkdir()
    with contextlib.ExitStack() as stack:
        stack.callback(fleet.close)
        for n in VICTIMS:
            fleet.ledgers[n].close()
            shutil.copy2(fleet.tmp / f"{n}.db", src / f"{n}.db")
        try:
            ro = stack.enter_context(read_only_view(src, tmp_path / "ro"))
        except OSError as e:
            pytest.skip(f"a read-only bind mount is not permitted here: {e}")
        stack.callback(lambda: [fleet.ledgers[n].close() for n in VICTIMS])
        move_ledgers(fleet, VICTIMS, ro)
        for n in VICTIMS:
            assert "read-only file system" in (fleet.ledgers[n].read_only or "")
            with pytest.raises(LedgerError, match="read-only"):
                fleet.ledgers[n].reserve(_plan(0))
        mark = len(fleet.broker.sent)
        fleet.settle(until=lambda: len(fleet.machine.history) >= 1
                     and fleet.machine.stage == "idle")
        o = fleet.machine.history[0]
        assert o.completed and set(o.survivors) == set(fleet.sessions) - set(VICTIMS)
        mine = sent_by(fleet, VICTIMS, mark)
        # a decline is all they sent for the round: no keys, no shares, no update
        kinds = [t.rsplit("/", 1)[1] for _, t, _ in mine if "/up/" in t]
        assert sorted(k for k in kinds if k != "checkin") == ["decline"] * len(VICTIMS)
        reasons = {msgpack.unpackb(p)["reason"] for _, t, p in mine
                   if t.endswith("/up/decline")}
        assert reasons == {"ledger"}
        _check_sums(fleet)
        for n in VICTIMS:
            fleet.ledgers[n].verify()
            assert fleet.ledgers[n].reservations() == ()
        r = cli_verify(ro / f"{VICTIMS[0]}.db")
        assert r.returncode == 0, r.stdout + r.stderr
        # nothing was written next to them (no WAL, no shared-memory file)
        assert sorted(p.name for p in ro.iterdir()) == [f"{n}.db" for n in VICTIMS]
