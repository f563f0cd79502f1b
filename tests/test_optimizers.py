"""Server optimizers: torch.optim as the oracle where it computes the same rule, hand-computed
values where it does not (torch's Adam always bias-corrects; Reddi et al.'s FedAdam does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregator.optimizers import OPTIMIZERS, fedadagrad, fedadam, fedavgm, fedyogi

pytestmark = pytest.mark.reference


def _deltas(rounds: int, shapes: list[tuple[int, ...]], seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(rounds)]


def _run(opt, params, deltas):
    state = opt.init(params)
    for d in deltas:
        params, state = opt.update(d, state, params)
    return params


def _run_torch(make, params, deltas):
    ts = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params]
    o = make(ts)
    for d in deltas:
        for t, di in zip(ts, d, strict=True):
            t.grad = torch.tensor(-di, dtype=torch.float64)  # Delta is a descent direction
        o.step()
    return [t.detach().numpy() for t in ts]


SHAPES = [(3, 4), (4,)]


def test_fedavgm_is_sgd_with_momentum_on_minus_delta() -> None:
    params = [np.zeros(s, np.float32) for s in SHAPES]
    deltas = _deltas(6, SHAPES)
    ours = _run(fedavgm(server_lr=0.5, momentum=0.8), params, deltas)
    ref = _run_torch(lambda ts: torch.optim.SGD(ts, lr=0.5, momentum=0.8), params, deltas)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fedadagrad_without_momentum_is_torch_adagrad() -> None:
    tau = 1e-2
    params = [np.ones(s, np.float32) for s in SHAPES]
    deltas = _deltas(6, SHAPES, seed=1)
    ours = _run(fedadagrad(server_lr=0.1, beta1=0.0, tau=tau), params, deltas)
    ref = _run_torch(
        lambda ts: torch.optim.Adagrad(ts, lr=0.1, initial_accumulator_value=tau**2, eps=tau),
        params, deltas,
    )
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fedadam_and_fedyogi_by_hand() -> None:
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    d1, d2 = 2.0, -1.0
    # FedAdam, two rounds from theta = 0, v_{-1} = tau^2
    m, v, theta = 0.0, tau**2, 0.0
    for d in (d1, d2):
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        theta += lr * m / (np.sqrt(v) + tau)
    got = _run(fedadam(lr, b1, b2, tau), [np.zeros(1, np.float32)],
               [[np.array([d1], np.float32)], [np.array([d2], np.float32)]])
    np.testing.assert_allclose(got[0][0], theta, rtol=1e-5)
    # FedYogi: v moves toward Delta^2 by (1 - b2) Delta^2 in the direction of the sign
    m, v, theta = 0.0, tau**2, 0.0
    for d in (d1, d2):
        m = b1 * m + (1 - b1) * d
        v = v - (1 - b2) * d * d * np.sign(v - d * d)
        theta += lr * m / (np.sqrt(v) + tau)
    got = _run(fedyogi(lr, b1, b2, tau), [np.zeros(1, np.float32)],
               [[np.array([d1], np.float32)], [np.array([d2], np.float32)]])
    np.testing.assert_allclose(got[0][0], theta, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_is_pure_and_keeps_dtype(name: str) -> None:
    opt = OPTIMIZERS[name](server_lr=0.1)
    params = [np.ones(s, np.float32) for s in SHAPES]
    before = [p.copy() for p in params]
    state = opt.init(params)
    delta = _deltas(1, SHAPES)[0]
    new, _ = opt.update(delta, state, params)
    for p, b in zip(params, before, strict=True):
        np.testing.assert_array_equal(p, b)  # inputs untouched: state is a value
    assert all(n.dtype == np.float32 and n.shape == p.shape for n, p in zip(new, params,
                                                                             strict=True))
    # Moving along Delta: the first step has the sign of Delta everywhere (all rules).
    for n, p, d in zip(new, params, delta, strict=True):
        assert np.all(np.sign(n - p)[d != 0] == np.sign(d)[d != 0])


@pytest.mark.parametrize("bad", [
    lambda: fedavgm(server_lr=0), lambda: fedavgm(momentum=1.0),
    lambda: fedadam(tau=0), lambda: fedyogi(beta2=1.0), lambda: fedadagrad(beta1=-0.1),
])
def test_bad_hyperparameters_name_the_value(bad) -> None:
    with pytest.raises(ValueError, match="must be"):
        bad()
