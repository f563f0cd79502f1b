"""Per-sample gradients of every zoo model against torch.func, and one DP-SGD step
against Opacus (the oracles). torch is allowed here: these are reference tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap

from edge_sdk.engine import NumpyEngine, load_engine, load_manifest
from edge_sdk.model import ZOO, init_params
from edge_sdk.train import dp_sgd_step
from models import ONNX_DIR
from models.zoo import build_module

pytestmark = pytest.mark.reference

MANIFESTS = sorted(ONNX_DIR.glob("*.json"))
ENGINES = {p.stem: (load_engine(p), NumpyEngine(load_manifest(p).spec)) for p in MANIFESTS}


def test_every_zoo_variant_is_exported() -> None:
    archs = {load_manifest(p).spec.name for p in MANIFESTS}
    assert archs == set(ZOO)  # the example models of issue 17 included


def _batch(spec, b: int, rng: np.random.Generator, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((b, *spec.input_shape)).astype(np.float32)
    if ties:
        # Constant regions (like Fashion-MNIST's background) make conv outputs equal
        # inside pooling windows: max-pool ties. Integer levels make ties elsewhere too.
        x = np.round(x).astype(np.float32)
        if x.ndim == 4:
            x[:, :, :14, :] = 0.0
    y = rng.integers(0, spec.num_classes, b)
    return x, y


def _torch_per_sample(spec, params, x, y) -> np.ndarray:
    module = build_module(spec, params)
    names = [n for n, _ in module.named_parameters()]
    weights = {n: p.detach() for n, p in module.named_parameters()}

    def loss(w, xi, yi):
        out = functional_call(module, w, (xi[None],))
        return torch.nn.functional.cross_entropy(out, yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(weights, torch.tensor(x), torch.tensor(y))
    return torch.cat([g[n].reshape(len(y), -1) for n in names], dim=1).numpy()


@pytest.mark.parametrize("name", sorted(ENGINES))
@pytest.mark.parametrize("b", [1, 10, 64])
@pytest.mark.parametrize("ties", [False, True])
def test_per_sample_gradients_match_torch_func(name: str, b: int, ties: bool) -> None:
    onnx_engine, np_engine = ENGINES[name]
    spec = onnx_engine.spec
    rng = np.random.default_rng(b + 7 * ties)
    params = init_params(spec, rng)
    x, y = _batch(spec, b, rng, ties)
    ref = _torch_per_sample(spec, params, x, y)
    scale = np.abs(ref).max()
    tol = 1e-5 * scale

    np.testing.assert_allclose(np_engine.per_sample_grads(params, x, y), ref, rtol=0, atol=tol)
    ref_norms = np.linalg.norm(ref.astype(np.float64), axis=1)
    for clip in (np.inf, 0.5 * float(np.median(ref_norms)) + 1e-3):
        factor = np.minimum(1.0, clip / np.maximum(ref_norms, 1e-30))
        ref_sum = (ref * factor[:, None]).sum(axis=0)
        for engine in (onnx_engine, np_engine):
            res = engine.clipped_grad_sum(params, x, y, clip)
            np.testing.assert_allclose(res.norms, ref_norms, rtol=1e-5, atol=tol)
            got = np.concatenate([g.ravel() for g in res.clipped_sum])
            np.testing.assert_allclose(got, ref_sum, rtol=0, atol=tol * max(1, b / 8))


def test_zero_gradient_is_not_nan() -> None:
    onnx_engine, np_engine = ENGINES["logreg-30-2"]
    params = [np.zeros_like(p) for p in init_params(onnx_engine.spec, np.random.default_rng(0))]
    x = np.zeros((3, 30), dtype=np.float32)
    y = np.array([0, 1, 0])
    for engine in (onnx_engine, np_engine):
        res = engine.clipped_grad_sum(params, x, y, 1.0)
        assert all(np.isfinite(g).all() for g in res.clipped_sum)


@pytest.mark.parametrize("name", ["cnn-1x28x28-10", "mlp-1x28x28-10", "logreg-64-10"])
def test_one_noisy_step_matches_opacus(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import opacus.optimizers.optimizer as opt_mod
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    onnx_engine, _ = ENGINES[name]
    spec = onnx_engine.spec
    rng = np.random.default_rng(3)
    params = init_params(spec, rng)
    b, clip, z, lr = 16, 0.7, 1.3, 0.1
    x, y = _batch(spec, b, rng, ties=False)
    noise = [rng.normal(0, z * clip, size=p.shape).astype(np.float32) for p in params]

    theta = [p.copy() for p in params]
    dp_sgd_step(onnx_engine, theta, x, y, clip=clip, noise=noise, lr=lr, denom=b)

    injected = iter(noise)
    monkeypatch.setattr(
        opt_mod, "_generate_noise",
        lambda std, reference, generator=None, secure_mode=False: torch.tensor(next(injected)),
    )
    module = GradSampleModule(build_module(spec, params), loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(module.parameters(), lr=lr), noise_multiplier=z,
                      max_grad_norm=clip, expected_batch_size=b, loss_reduction="mean")
    opt.zero_grad()
    torch.nn.functional.cross_entropy(module(torch.tensor(x)), torch.tensor(y)).backward()
    opt.step()
    for mine, ref in zip(theta, module.parameters(), strict=True):
        r = ref.detach().numpy()
        np.testing.assert_allclose(mine, r, rtol=0, atol=1e-5 * max(1.0, np.abs(r).max()))


@pytest.mark.parametrize("name", sorted(ENGINES))
@pytest.mark.parametrize("b", [1, 10, 64])
def test_masked_gradients_match_torch_func_restricted(name: str, b: int) -> None:
    """Norms, clipping and sums over a rand-k coordinate set (Fed-SPA), against torch.func."""
    onnx_engine, np_engine = ENGINES[name]
    spec = onnx_engine.spec
    rng = np.random.default_rng(100 + b)
    params = init_params(spec, rng)
    x, y = _batch(spec, b, rng, ties=True)
    masks = [(rng.random(p.shape) < 0.3).astype(np.float32) for p in params]
    flat_mask = np.concatenate([m.ravel() for m in masks]).astype(bool)
    ref = _torch_per_sample(spec, params, x, y)[:, flat_mask]
    ref_norms = np.linalg.norm(ref.astype(np.float64), axis=1)
    tol = 1e-5 * np.abs(ref).max()
    clip = 0.5 * float(np.median(ref_norms)) + 1e-3
    factor = np.minimum(1.0, clip / np.maximum(ref_norms, 1e-30))
    ref_sum = (ref * factor[:, None]).sum(axis=0)
    for engine in (onnx_engine, np_engine):
        res = engine.clipped_grad_sum(params, x, y, clip, masks=masks)
        np.testing.assert_allclose(res.norms, ref_norms, rtol=1e-5, atol=tol)
        got = np.concatenate([g.ravel() for g in res.clipped_sum])
        assert not got[~flat_mask].any()
        np.testing.assert_allclose(got[flat_mask], ref_sum, rtol=0, atol=tol * max(1, b / 8))
