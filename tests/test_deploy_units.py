"""The systemd units of deploy/systemd pass ``systemd-analyze verify`` (issue 20).

``verify`` checks that every ExecStart binary exists, so the test renders the units with the
installed ``fedge`` of this checkout's virtualenv in place of ``/opt/fedge/venv/bin/fedge``;
every other line is verified as shipped. The mosquitto drop-in is verified on top of the
Debian package's mosquitto.service (tools/setup.sh installs mosquitto and systemd)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "deploy" / "systemd"
INSTALLED_FEDGE = "/opt/fedge/venv/bin/fedge"
DEBIAN_MOSQUITTO_UNIT = Path("/lib/systemd/system/mosquitto.service")


def _analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.fail("systemd-analyze is missing: run tools/setup.sh (Debian package systemd)")
    return exe


def _fedge() -> Path:
    exe = Path(sys.executable).parent / "fedge"
    assert exe.exists(), f"{exe}: the fedge entry point of this virtualenv is missing"
    return exe


def _verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_analyze(), "verify", *map(str, paths)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("unit", ["fedge-device.service", "fedge-aggregator.service"])
def test_unit_verifies_clean(unit: str, tmp_path: Path) -> None:
    text = (UNITS / unit).read_text()
    assert INSTALLED_FEDGE in text
    rendered = tmp_path / unit
    rendered.write_text(text.replace(INSTALLED_FEDGE, str(_fedge())))
    # the gateway unit orders itself after mosquitto: give verify the real one
    if DEBIAN_MOSQUITTO_UNIT.exists():
        shutil.copy(DEBIAN_MOSQUITTO_UNIT, tmp_path)
    r = _verify([rendered])
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "", r.stderr + r.stdout


def test_mosquitto_dropin_verifies_clean(tmp_path: Path) -> None:
    if not DEBIAN_MOSQUITTO_UNIT.exists():
        pytest.fail(f"{DEBIAN_MOSQUITTO_UNIT} missing: run tools/setup.sh (Debian mosquitto)")
    shutil.copy(DEBIAN_MOSQUITTO_UNIT, tmp_path)
    shutil.copytree(UNITS / "mosquitto.service.d", tmp_path / "mosquitto.service.d")
    r = _verify([tmp_path / "mosquitto.service"])
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "", r.stderr + r.stdout


def test_verify_sees_a_broken_unit(tmp_path: Path) -> None:
    """The verification above can fail: a misspelt key is reported."""
    text = (UNITS / "fedge-device.service").read_text().replace(INSTALLED_FEDGE,
                                                                  str(_fedge()))
    bad = tmp_path / "fedge-device.service"
    bad.write_text(text.replace("[Service]\n", "[Service]\nRestartSecs=3\n", 1))
    r = _verify([bad])
    assert "Unknown key 'RestartSecs'" in r.stderr


def test_units_keep_state_private_and_hardened() -> None:
    for unit in ("fedge-device.service", "fedge-aggregator.service"):
        lines = set((UNITS / unit).read_text().splitlines())
        for want in ("User=fedge", "Restart=on-failure", "StateDirectoryMode=0700",
                     "ConfigurationDirectoryMode=0700", "UMask=0077", "ProtectSystem=strict",
                     "NoNewPrivileges=yes", "PrivateTmp=yes", "After=network-online.target "
                     + ("time-sync.target" if unit == "fedge-device.service"
                        else "mosquitto.service")):
            assert want in lines, (unit, want)


def test_enroll_host_names_the_gateway(tmp_path: Path) -> None:
    """`fedge enroll --host` (a gateway serving a network): the broker listens there, its
    certificate names it, and the device configs connect to it."""
    from cryptography import x509

    from tools.cli import main

    assert main(["enroll", "--devices", "3", "--fleet", "lab", "--out", str(tmp_path / "f"),
                 "--host", "gateway.lan"]) == 0
    assert "listener 8883 gateway.lan" in (tmp_path / "f/broker/mosquitto.conf").read_text()
    assert 'host = "gateway.lan"' in (tmp_path / "f/devices/dev-0000/device.toml").read_text()
    cert = x509.load_pem_x509_certificate((tmp_path / "f/broker/server.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gateway.lan" in names.get_values_for_type(x509.DNSName)
