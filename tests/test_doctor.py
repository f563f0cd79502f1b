"""``fedge doctor`` (issue 20): a good device directory passes every check against a real
mosquitto (TLS, a password per device, ACLs) and a running ``fedge aggregator``; each
broken one fails the check it breaks, named, with the fix."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_sdk import wire
from models import ONNX_DIR
from tests.mqtt_support import Recorder, client, new_loop, run_all
from tools.broker import Broker
from tools.cli import main
from tools.doctor import Finding, clock_finding, disk_finding, doctor
from tools.enroll import enroll

REPO = Path(__file__).resolve().parent.parent
FLEET = "doc"
NAMES = ["dev-0000", "dev-0001", "dev-0002"]
TIMEOUT = 30.0  # generous: the broker waits are conditions, this only bounds a failure


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A broker, an enrolled fleet and its aggregator (which publishes the retained model)."""
    tmp = tmp_path_factory.mktemp("doctor")
    broker = Broker(devices=NAMES, fleet=FLEET, directory=tmp / "broker")
    broker.start()
    agg = None
    err = open(tmp / "aggregator.err", "wb")  # noqa: SIM115 (closed below)
    try:
        done = enroll(tmp / "fleet", devices=NAMES, fleet=FLEET, broker_config=broker.config,
                      model="logreg-64-10", metrics_port=0, policy={"cohort_size": 3})
        agg = subprocess.Popen([sys.executable, "-m", "tools.cli", "aggregator", "--config",
                                str(done.aggregator_config)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        # wait (a condition, not a sleep) until the retained model is on the broker
        loop = new_loop(broker)
        rec = Recorder([wire.model_topic(FLEET)])
        loop.add(client(broker, "dev-0001", status=False), rec)
        ok = run_all([loop], lambda: bool(rec.payloads()) or agg.poll() is not None, 120.0)
        loop.close(timeout=1.0)
        assert ok and agg.poll() is None, (tmp / "aggregator.err").read_text()[-2000:]
        yield {"tmp": tmp, "broker": broker, "enrolled": done}
    finally:
        if agg is not None:
            agg.kill()
            agg.wait(10)
        err.close()
        broker.stop()


def _case(fleet: dict[str, Any], name: str, device: str = "dev-0001") -> Path:
    """A copy of ``device``'s directory beside it (its TOML's relative paths still hold)."""
    src = fleet["enrolled"].device_configs[device].parent
    dst = src.parent / name
    shutil.copytree(src, dst)
    return dst


def _by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


def _doctor(config: Path, **kw: Any) -> list[Finding]:
    """The checks as ``fedge doctor`` runs them (models looked up in the repository's zoo)."""
    return doctor(config, zoo_dir=ONNX_DIR, timeout=TIMEOUT, **kw)


def _run_cli(config: Path, *extra: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["doctor", "--config", str(config), "--timeout", str(TIMEOUT), *extra])
    return rc, out.getvalue() + err.getvalue()


def test_good_device_passes_every_check(fleet: dict[str, Any]) -> None:
    rc, text = _run_cli(fleet["enrolled"].device_configs["dev-0000"])
    assert rc == 0, text
    for check in ("config", "disk", "ledger", "clock", "broker", "model"):
        assert f"ok   {check}: " in text, (check, text)
    assert "FAIL" not in text and "all checks passed" in text
    assert "password accepted, status publish acknowledged, the retained model arrived" in text
    assert "signed by the registry's aggregator key, fits logreg-64-10" in text
    assert "broker's certificate's validity" in text  # the served certificate bounded it


def _only_failed(findings: list[Finding], *failed: str) -> dict[str, Finding]:
    by = _by_check(findings)
    assert {c for c, f in by.items() if not f.ok} == set(failed), findings
    for c in failed:
        assert by[c].fix, by[c]
    return by


def test_wrong_password_is_named(fleet: dict[str, Any]) -> None:
    d = _case(fleet, "wrong-password")
    (d / "password").write_text("not-the-password\n")
    rc, text = _run_cli(d / "device.toml")
    assert rc == 1
    assert "FAIL broker: " in text and "refused user 'dev-0001'" in text, text
    assert "fix: the password in" in text
    by = _only_failed(_doctor(d / "device.toml"), "broker", "model")
    assert "Bad user name or password" in by["broker"].message or \
           "Not authorized" in by["broker"].message, by["broker"]


def test_missing_ledger_is_named(fleet: dict[str, Any]) -> None:
    d = _case(fleet, "missing-ledger")
    (d / "ledger.db").unlink()
    by = _only_failed(_doctor(d / "device.toml"), "ledger")
    assert "no ledger file" in by["ledger"].message
    assert "restore" in by["ledger"].fix and "never trained" in by["ledger"].fix


def test_corrupted_ledger_byte_is_named(fleet: dict[str, Any]) -> None:
    d = _case(fleet, "corrupted-ledger")
    data = bytearray((d / "ledger.db").read_bytes())
    at = data.find(b'"epsilon":10.0')
    assert at >= 0, "the budget is in the main file"
    data[at + 11] ^= 0x01  # 10.0 -> 11.0: the budget in the metadata row
    (d / "ledger.db").write_bytes(bytes(data))
    rc, text = _run_cli(d / "device.toml")
    assert rc == 1 and "FAIL ledger: ledger failed its audit" in text, text
    assert "Never delete or recreate" in text
    by = _only_failed(_doctor(d / "device.toml"), "ledger")
    assert "fedge ledger verify" in by["ledger"].fix


def test_wrong_model_file_is_named(fleet: dict[str, Any]) -> None:
    d = _case(fleet, "wrong-model")
    toml = d / "device.toml"
    toml.write_text(toml.read_text().replace('model = "logreg-64-10"', 'model = "mlp-64-10"'))
    by = _only_failed(_doctor(toml),
                      "model")
    assert "does not fit this device's model mlp-64-10" in by["model"].message, by["model"]
    assert "aggregator.toml" in by["model"].fix


def test_damaged_model_graph_is_named(fleet: dict[str, Any]) -> None:
    d = _case(fleet, "damaged-graph")
    models = d / "models"
    shutil.copytree(REPO / "models" / "onnx", models,
                    ignore=lambda _d, names: [n for n in names if not n.startswith("logreg-64")])
    graph = models / "logreg-64-10.grad.onnx"
    graph.write_bytes(graph.read_bytes()[:100])
    toml = d / "device.toml"
    toml.write_text(toml.read_text().replace('model = "logreg-64-10"',
                                             'manifest = "models/logreg-64-10.json"'))
    by = _only_failed(_doctor(toml), "model")
    assert "the device's model files" in by["model"].message, by["model"]


def test_clock_outside_the_certificates_is_named(fleet: dict[str, Any]) -> None:
    d = fleet["enrolled"].device_configs["dev-0000"]
    behind = time.time() - 3 * 365 * 86400
    by = _by_check(_doctor(d, clock=lambda: behind))
    assert not by["clock"].ok and "behind by at least" in by["clock"].message, by["clock"]
    assert "timedatectl set-ntp true" in by["clock"].fix


def test_clock_finding_bounds() -> None:
    year = 365 * 86400.0
    windows = [("broker's certificate", 1000.0 * year, 1001.0 * year)]
    assert clock_finding(1000.5 * year, windows=windows, last_write=None).ok
    ahead = clock_finding(1002.0 * year, windows=windows, last_write=None)
    assert not ahead.ok and "expiry" in ahead.message and "renew" in ahead.fix
    back = clock_finding(1000.5 * year, windows=windows, last_write=1000.5 * year + 3600)
    assert not back.ok and "set back" in back.message
    # a write a little ahead (another process's clock read) is within tolerance
    assert clock_finding(1000.5 * year, windows=windows, last_write=1000.5 * year + 10).ok


def test_disk_finding_threshold() -> None:
    ok = disk_finding(Path("/var/lib/fedge"), free_bytes=65 * 2**20, need_bytes=64 * 2**20)
    assert ok.ok
    full = disk_finding(Path("/var/lib/fedge"), free_bytes=2**20, need_bytes=64 * 2**20)
    assert not full.ok and "only 1.0 MiB free" in full.message and "never delete" in full.fix


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root and a mount namespace that allows it)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; test_disk_finding_threshold covers the rule")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); "
                    f"test_disk_finding_threshold covers the rule")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_is_named(fleet: dict[str, Any], tiny_tmpfs: Path) -> None:
    d = _case(fleet, "full-disk")
    shutil.copy(d / "ledger.db", tiny_tmpfs / "ledger.db")
    toml = d / "device.toml"
    toml.write_text(toml.read_text().replace('ledger = "ledger.db"',
                                             f'ledger = "{tiny_tmpfs / "ledger.db"}"'))
    by = _only_failed(_doctor(toml), "disk")  # under 1 MiB left, 64 MiB needed
    assert "MiB free on" in by["disk"].message and str(tiny_tmpfs) in by["disk"].message
    with open(tiny_tmpfs / "filler", "wb") as f:  # now fill it: nothing left at all
        with contextlib.suppress(OSError):
            f.write(b"\0" * 2**20)
    by = _by_check(_doctor(toml))
    assert "only 0.0 MiB free" in by["disk"].message, by["disk"]
    # sqlite cannot open its WAL either: the ledger check fails, and points at the disk
    assert not by["ledger"].ok and by["ledger"].fix.startswith("first free space"), by["ledger"]


def test_acl_denial_is_named(fleet: dict[str, Any]) -> None:
    """Another device's credentials: the password is accepted, but the ACL refuses the
    publish to this device's status topic."""
    d = _case(fleet, "other-user")
    other = fleet["enrolled"].device_configs["dev-0002"].parent
    shutil.copy(other / "password", d / "password")
    toml = d / "device.toml"
    toml.write_text(toml.read_text().replace("[broker]\n", '[broker]\nusername = "dev-0002"\n'))
    by = _only_failed(_doctor(toml), "broker")
    assert "refused its publish to its own status topic" in by["broker"].message, by["broker"]
    assert "ACL" in by["broker"].fix


def test_doctor_consumes_nothing_queued_for_the_device(fleet: dict[str, Any]) -> None:
    """A message queued for the (stopped) device while the doctor connects as it reaches the
    device when it reconnects: the doctor resumes the session and never acknowledges."""
    broker, device = fleet["broker"], "dev-0002"
    down = wire.device_down_topic(FLEET, device, "plan")
    dev_loop = new_loop(broker, seed=1)
    dev = Recorder([down])
    dev_loop.add(client(broker, device), dev)
    assert run_all([dev_loop], lambda: dev_loop.is_ready(device), TIMEOUT)
    dev_loop.close(timeout=5.0)  # the broker keeps its session and subscription
    agg_loop = new_loop(broker, seed=2)
    agg = Recorder()
    agg_loop.add(client(broker, "aggregator"), agg)
    agg.outbox.append(wire.Publish(down, b"queued for the device"))
    assert run_all([agg_loop], lambda: agg_loop.stats.acked >= 1, TIMEOUT)
    agg_loop.close(timeout=5.0)
    by = _by_check(_doctor(fleet["enrolled"].device_configs[device]))
    assert by["broker"].ok, by["broker"]
    back_loop = new_loop(broker, seed=3)
    back = Recorder([down])
    back_loop.add(client(broker, device), back)
    try:
        assert run_all([back_loop], lambda: b"queued for the device" in back.payloads(down),
                       TIMEOUT), back.got
    finally:
        back_loop.close(timeout=5.0)


def test_doctor_needs_only_the_device_dependencies(fleet: dict[str, Any]) -> None:
    """`fedge doctor` runs on a device installed without extras: no sklearn, torch, scipy,
    matplotlib, prometheus_client, nor the aggregator package is imported."""
    config = fleet["enrolled"].device_configs["dev-0000"]
    code = ("import sys\nfrom tools.cli import main\n"
            f"rc = main(['doctor', '--config', {str(config)!r}, '--timeout', '{TIMEOUT}'])\n"
            "tops = {m.split('.')[0] for m in sys.modules}\n"
            "print(rc, sorted(tops & {'torch', 'sklearn', 'scipy', 'matplotlib', "
            "'prometheus_client', 'aggregator', 'opacus', 'onnx'}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.strip().splitlines()[-1] == "0 []", r.stdout + r.stderr
