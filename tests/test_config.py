"""edge_sdk.config: the shared file readers are light, and a zoo name is found only through
an injected ``zoo_dir`` (the SDK never imports the ``models`` package)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator.service import AggregatorConfig, AggregatorService
from edge_sdk.config import ConfigError, resolve_manifest
from edge_sdk.device import Device, DeviceConfig
from edge_sdk.engine import load_manifest
from models import ONNX_DIR
from tools.enroll import enroll

REPO = Path(__file__).resolve().parents[1]
MODEL = "logreg-64-10"

# Imports a fresh interpreter, resolves a zoo name the way the device does, and reports
# which heavy or cyclic modules each step pulled in.
_PROBE = r"""
import json, sys
from pathlib import Path

def loaded(names):
    return sorted(n for n in names
                  if any(m == n or m.startswith(n + ".") for m in sys.modules))

heavy = ("paho", "edge_sdk.mqtt", "edge_sdk.device", "models", "onnxruntime", "torch")
import edge_sdk.config
edge_sdk.config.resolve_manifest("m", None, zoo_dir=Path(sys.argv[1]))
config = loaded(heavy)
import aggregator.service
service = loaded(("edge_sdk.device", "models", "onnxruntime", "torch"))
print(json.dumps({"config": config, "service": service}))
"""


def test_config_and_service_import_neither_models_nor_the_device_agent(tmp_path) -> None:
    # aggregator.service still imports paho, through edge_sdk.mqtt: it runs its own MQTT
    # client. What it must not pull in is the device agent (edge_sdk.device) or the zoo.
    (tmp_path / "m.json").write_text("{}")
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(r.stdout) == {"config": [], "service": []}, r.stdout


def test_resolve_manifest_looks_a_zoo_name_up_in_zoo_dir_only(tmp_path) -> None:
    (tmp_path / "a.json").write_text("{}")
    given = tmp_path / "elsewhere.json"
    assert resolve_manifest("a", None, zoo_dir=tmp_path) == tmp_path / "a.json"
    assert resolve_manifest(None, given, zoo_dir=None) == given
    assert resolve_manifest(None, given, zoo_dir=tmp_path) == given
    with pytest.raises(ConfigError, match="'a' is a zoo name, but no zoo directory"):
        resolve_manifest("a", None, zoo_dir=None)
    with pytest.raises(ConfigError, match=r"no exported model 'b' in .*exported: \['a'\]"):
        resolve_manifest("b", None, zoo_dir=tmp_path)
    for model, manifest in (("a", given), (None, None)):
        with pytest.raises(ConfigError, match="exactly one of 'model'"):
            resolve_manifest(model, manifest, zoo_dir=tmp_path)


@pytest.fixture
def enrolled(tmp_path):
    return enroll(tmp_path / "fleet", devices=["dev-0000", "dev-0001", "dev-0002"],
                  fleet="lab", tls=False, port=1883, model=MODEL, metrics_port=None)


def test_device_toml_model_name_needs_the_injected_zoo_dir(enrolled) -> None:
    path = enrolled.device_configs["dev-0000"]
    assert f'model = "{MODEL}"' in path.read_text()
    data = (np.zeros((1, 64), np.float32), np.zeros(1, np.int64))
    bare = DeviceConfig.from_toml(path)
    assert (bare.model, bare.manifest, bare.zoo_dir) == (MODEL, None, None)
    with pytest.raises(ConfigError, match=f"'{MODEL}' is a zoo name.*zoo_dir"):
        Device(bare, data=data)
    config = DeviceConfig.from_toml(path, zoo_dir=str(ONNX_DIR))
    assert config.zoo_dir == ONNX_DIR
    with Device(config, data=data) as device:
        assert device.model_version == -1
    # a manifest path needs no zoo
    direct = DeviceConfig.from_toml(path, model=None, manifest=ONNX_DIR / f"{MODEL}.json")
    Device(direct, data=data).close()


def test_aggregator_toml_model_name_needs_the_injected_zoo_dir(enrolled) -> None:
    path = enrolled.aggregator_config
    bare = AggregatorConfig.from_toml(path)
    assert (bare.model, bare.zoo_dir) == (MODEL, None)
    with pytest.raises(ConfigError, match=f"'{MODEL}' is a zoo name.*zoo_dir"):
        AggregatorService(bare, out=io.StringIO())
    assert not bare.checkpoint.exists()  # refused before anything was written
    spec = load_manifest(ONNX_DIR / f"{MODEL}.json").spec
    service = AggregatorService(AggregatorConfig.from_toml(path, zoo_dir=ONNX_DIR),
                                out=io.StringIO())
    try:
        assert [p.shape for p in service.machine.params] == [s for _, s in spec.param_shapes()]
    finally:
        service.close(timeout=0.5)


def test_aggregator_toml_refuses_a_mechanism_it_does_not_have(enrolled) -> None:
    path = enrolled.aggregator_config
    text = path.read_text()
    assert "[policy]" in text
    path.write_text(text.replace("[policy]", '[policy]\nmechanism = "no-such"', 1))
    with pytest.raises(ConfigError, match=r"mechanism must be one of \['binomial', 'ddg', "
                       r"'device-dp', 'gaussian', 'update-noise'\].*'no-such'"):
        AggregatorConfig.from_toml(path)
    path.write_text(text.replace("[policy]", '[policy]\nmechanism = "gaussian"', 1))
    assert AggregatorConfig.from_toml(path).policy.mechanism == "gaussian"


def test_aggregator_toml_plans_update_noise_and_ddg(enrolled) -> None:
    path = enrolled.aggregator_config
    text = path.read_text()

    def policy(lines: str) -> Any:
        path.write_text(text.replace("[policy]", "[policy]\n" + lines, 1))
        return AggregatorConfig.from_toml(path).policy

    p = policy('mechanism = "ddg"\ngamma = 0.001\nmax_local_samples = 500\n'
               'nominal_samples = 120.0\nwrap_probability = 1e-8')
    assert (p.mechanism, p.gamma, p.max_local_samples, p.nominal_samples,
            p.wrap_probability) == ("ddg", 0.001, 500, 120.0, 1e-8)
    p = policy('mechanism = "update-noise"\nupdate_clip = 0.5\nclamp_probability = 1e-6')
    assert (p.mechanism, p.update_clip, p.clamp_probability) == ("update-noise", 0.5, 1e-6)
    with pytest.raises(ConfigError, match="mechanism 'ddg' needs max_local_samples"):
        policy('mechanism = "ddg"\ngamma = 0.001\nnominal_samples = 120.0')
    with pytest.raises(ConfigError, match="mechanism 'update-noise' is dense: sparsity must "
                                          "be 1, got 0.5"):
        policy('mechanism = "update-noise"\nsparsity = 0.5')


def test_device_toml_budget_on_the_device_unit(enrolled, tmp_path) -> None:
    """``[budget] device_epsilon`` (issue 16) reaches the ledger at provisioning; a device
    config without it opens that ledger only if it says the same (fixed at creation)."""
    from edge_sdk.ledger import Budget, Ledger, LedgerError

    path = enrolled.device_configs["dev-0001"]
    text = path.read_text()
    assert "[budget]" in text
    path.write_text(text.replace("[budget]", "[budget]\ndevice_epsilon = 4.0", 1))
    config = DeviceConfig.from_toml(path, ledger=tmp_path / "dev1.db")
    assert config.device_budget_epsilon == 4.0
    assert config.budget == Budget(epsilon=config.budget_epsilon, delta=config.budget_delta,
                                   device_epsilon=4.0)
    Device.provision(config)
    with Ledger.open(config.ledger) as led:
        assert led.budget.device_epsilon == 4.0
    plain = DeviceConfig.from_toml(path, ledger=tmp_path / "dev1.db",
                                   device_budget_epsilon=None)
    with pytest.raises(LedgerError, match="differs from the stored"):
        Ledger.open(plain.ledger, budget=plain.budget)
    with pytest.raises(ConfigError, match="device_epsilon"):
        DeviceConfig.from_toml(path, device_budget_epsilon=0.0)
