"""``fedge export --module pkg.mod:factory`` (issue 17): a user's torch module traced with
torch.fx and exported as it is; the first unsupported operation named with its reason; the
manifest's graph digests bind the graphs to the spec (a device refuses a graph that does not
match). torch is allowed here: the exporter is a development tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_sdk.engine import NumpyEngine, load_engine
from edge_sdk.model import Add, Concat, GroupNorm, UnsupportedLayer
from models.trace import spec_from_traced

ROOT = Path(__file__).resolve().parents[1]

USER_PACKAGE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.norm(self.conv1(x)))))


class Net(nn.Module):
    def __init__(self, norm=None):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 1)
        self.block = Block(4)
        self.side = nn.Conv2d(4, 2, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(6, 3)
        self.norm = norm

    def forward(self, x):
        h = self.stem(x)
        if self.norm is not None:
            h = self.norm(h)
        h = torch.cat([self.block(h), self.side(h)], dim=1)
        return self.head(torch.flatten(self.pool(h), 1))


def residual():
    return Net()


def with_batchnorm():
    return Net(norm=nn.BatchNorm2d(4))
'''


def _fedge(*args: str, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def user_pkg(tmp_path: Path) -> Path:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(USER_PACKAGE)
    return tmp_path


def _load(user_pkg: Path, factory: str) -> torch.nn.Module:
    sys.path.insert(0, str(user_pkg))
    try:
        from models.trace import load_factory

        return load_factory(f"userpkg.nets:{factory}")
    finally:
        sys.path.remove(str(user_pkg))


def test_traced_residual_module_is_the_same_function(user_pkg: Path) -> None:
    """The spec traced from the module, loaded with the module's own weights, gives the
    module's logits (the graph's wiring is the module's)."""
    module = _load(user_pkg, "residual")
    spec = spec_from_traced(module, (1, 6, 5), 3)
    kinds = [type(layer) for layer in spec.layers]
    assert Add in kinds and Concat in kinds and GroupNorm in kinds
    add = kinds.index(Add)
    assert len(spec.node_inputs(add)) == 2
    # the module's parameters in spec order: each spec layer's torch module, in order
    gm = torch.fx.symbolic_trace(module)
    owners = [gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    params = [p.detach().numpy().copy() for m in owners for p in m.parameters(recurse=False)]
    assert [p.shape for p in params] == [s for _, s in spec.param_shapes()]
    x = np.random.default_rng(0).standard_normal((4, 1, 6, 5)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.tensor(x)).numpy()
    np.testing.assert_allclose(NumpyEngine(spec).logits(params, x), want, rtol=1e-5, atol=1e-5)


def test_batchnorm_in_a_traced_module_is_refused_and_named(user_pkg: Path) -> None:
    with pytest.raises(UnsupportedLayer, match=r"node norm \(BatchNorm2d.*mixes samples|"
                                               r"node norm \(BatchNorm2d.*GroupNorm"):
        spec_from_traced(_load(user_pkg, "with_batchnorm"), (1, 6, 5), 3)


def test_fedge_export_module_cli(user_pkg: Path, tmp_path: Path) -> None:
    """Via the CLI: the residual module exported (graphs + manifest with digests, a device
    loads it and trains through it), the BatchNorm one refused naming the node and why, and a
    tampered graph refused by the device."""
    out = tmp_path / "out"
    done = _fedge("export", "--module", "userpkg.nets:residual", "--input-shape", "1,6,5",
                  "--out", str(out), pythonpath=user_pkg)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    manifest = json.loads(path.read_text())
    assert path.name == "residual-1x6x5-3.json" and manifest["spec"]["num_classes"] == 3
    assert sorted(manifest["graph_sha256"]) == ["grad_graph", "infer_graph",
                                                "masked_grad_graph", "plain_grad_graph"]
    assert any("inputs" in layer for layer in manifest["spec"]["layers"])
    engine = load_engine(path)
    spec = engine.spec
    from edge_sdk.model import init_params

    params = init_params(spec, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 1, 6, 5)).astype(np.float32)
    y = rng.integers(0, 3, 5)
    res, ref = engine.clipped_grad_sum(params, x, y, 0.5), NumpyEngine(spec).clipped_grad_sum(
        params, x, y, 0.5)
    for a, b in zip(res.clipped_sum, ref.clipped_sum, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    plain, plain_ref = engine.grad_sum(params, x, y), NumpyEngine(spec).grad_sum(params, x, y)
    for a, b in zip(plain.grad_sum, plain_ref.grad_sum, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    grad = out / manifest["grad_graph"]
    grad.write_bytes(grad.read_bytes() + b"\0")
    with pytest.raises(ValueError, match=r"residual-1x6x5-3.grad.onnx has sha256 .* refusing"):
        load_engine(path)

    bad = _fedge("export", "--module", "userpkg.nets:with_batchnorm", "--input-shape", "1,6,5",
                 "--out", str(tmp_path / "bn"), pythonpath=user_pkg)
    assert bad.returncode == 2
    assert "node norm (BatchNorm2d" in bad.stderr
    assert "mixes samples" in bad.stderr or "other samples" in bad.stderr
    assert "Use GroupNorm" in bad.stderr
    assert not (tmp_path / "bn").exists() or not any((tmp_path / "bn").iterdir())
    usage = _fedge("export", "--module", "userpkg.nets:residual", pythonpath=user_pkg)
    assert usage.returncode == 2 and "--module needs --input-shape" in usage.stderr
