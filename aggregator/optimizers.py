"""Server optimizers as optax-style (init, update) pairs over explicit state.

``update(pseudo_gradient, state, params) -> (new_params, new_state)`` where the
pseudo-gradient is the cohort's aggregated update theta_local - theta_global (a descent
direction already, so FedAvg adds it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

Params = list[np.ndarray]
State = Any

__all__ = [
    "OPTIMIZERS",
    "AdaptiveState",
    "FedSpaState",
    "ServerOptimizer",
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fedspa",
    "fedyogi",
    "state_leaves",
    "state_rebuild",
]


class ServerOptimizer(NamedTuple):
    init: Callable[[Params], State]
    update: Callable[[Params, State, Params], tuple[Params, State]]


def fedavg(server_lr: float = 1.0) -> ServerOptimizer:
    """FedAvg (McMahan et al. 2017): theta <- theta + server_lr * mean update."""
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0, got {server_lr!r}")

    def init(params: Params) -> State:
        return ()

    def update(delta: Params, state: State, params: Params) -> tuple[Params, State]:
        lr = np.float32(server_lr)
        return [p + lr * d for p, d in zip(params, delta, strict=True)], state

    return ServerOptimizer(init, update)


class FedSpaState(NamedTuple):
    u: Params  # first moment of the aggregated update
    v: Params  # second moment


def fedspa(
    server_lr: float = 1.0, beta1: float = 0.9, beta2: float = 0.99, kappa: float = 1e-3
) -> ServerOptimizer:
    """The Fed-SPA adaptive server update, Hu-Gong-Guo eq. (6):

    u_t = b1 u_{t-1} + (1 - b1) mean(Delta); v_t = b2 v_{t-1} + (1 - b2) u_t^2;
    theta_{t+1} = theta_t + eta_g u_t / (sqrt(v_t) + kappa), with v_{-1} = kappa^2.

    The paper's Algorithm 1 writes the denominator sqrt(v_t + kappa) while its text says
    sqrt(v_t) + kappa; we follow the text (the FedAdam form, Reddi et al. 2021). Pure
    post-processing of the aggregate: no privacy cost.
    """
    if not server_lr > 0 or not kappa > 0:
        raise ValueError(f"server_lr and kappa must be > 0, got {server_lr!r}, {kappa!r}")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"beta1, beta2 must be in [0, 1), got {beta1!r}, {beta2!r}")

    def init(params: Params) -> FedSpaState:
        return FedSpaState(
            [np.zeros_like(p) for p in params],
            [np.full_like(p, kappa**2) for p in params],
        )

    def update(delta: Params, state: FedSpaState, params: Params) -> tuple[Params, FedSpaState]:
        u = [beta1 * ui + (1 - beta1) * d for ui, d in zip(state.u, delta, strict=True)]
        v = [beta2 * vi + (1 - beta2) * ui * ui for vi, ui in zip(state.v, u, strict=True)]
        new = [
            (p + server_lr * ui / (np.sqrt(vi) + kappa)).astype(np.float32)
            for p, ui, vi in zip(params, u, v, strict=True)
        ]
        return new, FedSpaState(u, v)

    return ServerOptimizer(init, update)


def fedavgm(server_lr: float = 1.0, momentum: float = 0.9) -> ServerOptimizer:
    """FedAvg with server momentum (Hsu, Qi, Brown 2019): m <- beta m + Delta; theta += lr m.

    The state is the momentum buffer m (zeros at init), one array per parameter.
    """
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0, got {server_lr!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")

    def init(params: Params) -> Params:
        return [np.zeros_like(p) for p in params]

    def update(delta: Params, state: Params, params: Params) -> tuple[Params, Params]:
        m = [(momentum * mi + d).astype(p.dtype) for mi, d, p in zip(state, delta, params,
                                                                     strict=True)]
        return [(p + server_lr * mi).astype(p.dtype) for p, mi in zip(params, m, strict=True)], m

    return ServerOptimizer(init, update)


class AdaptiveState(NamedTuple):
    m: Params  # first moment of the pseudo-gradient
    v: Params  # second-moment accumulator (its rule is what tells the three apart)


def _adaptive(
    name: str,
    second_moment: Callable[[np.ndarray, np.ndarray], np.ndarray],
    server_lr: float,
    beta1: float,
    tau: float,
) -> ServerOptimizer:
    """Reddi et al. 2021 ("Adaptive Federated Optimization"), Algorithm 2, one of its rules.

    m_t = b1 m_{t-1} + (1 - b1) Delta_t;  v_t = rule(v_{t-1}, Delta_t^2);
    theta_{t+1} = theta_t + lr * m_t / (sqrt(v_t) + tau);  m_{-1} = 0, v_{-1} = tau^2.
    No bias correction, as in the paper. Pure post-processing of the aggregate.
    """
    if not server_lr > 0 or not tau > 0:
        raise ValueError(f"{name}: server_lr and tau must be > 0, got {server_lr!r}, {tau!r}")
    if not 0 <= beta1 < 1:
        raise ValueError(f"{name}: beta1 must be in [0, 1), got {beta1!r}")

    def init(params: Params) -> AdaptiveState:
        return AdaptiveState([np.zeros_like(p) for p in params],
                             [np.full_like(p, tau * tau) for p in params])

    def update(delta: Params, state: AdaptiveState, params: Params
               ) -> tuple[Params, AdaptiveState]:
        m = [beta1 * mi + (1 - beta1) * d for mi, d in zip(state.m, delta, strict=True)]
        v = [second_moment(vi, d * d) for vi, d in zip(state.v, delta, strict=True)]
        new = [
            (p + server_lr * mi / (np.sqrt(vi) + tau)).astype(p.dtype)
            for p, mi, vi in zip(params, m, v, strict=True)
        ]
        return new, AdaptiveState(m, v)

    return ServerOptimizer(init, update)


def _check_beta2(beta2: float) -> None:
    if not 0 <= beta2 < 1:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2!r}")


def fedadam(server_lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99,
            tau: float = 1e-3) -> ServerOptimizer:
    """FedAdam (Reddi et al. 2021, Alg. 2): v_t = b2 v_{t-1} + (1 - b2) Delta_t^2."""
    _check_beta2(beta2)
    return _adaptive("fedadam", lambda v, g2: beta2 * v + (1 - beta2) * g2, server_lr, beta1, tau)


def fedyogi(server_lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99,
            tau: float = 1e-3) -> ServerOptimizer:
    """FedYogi (Reddi et al. 2021, Alg. 2): v_t = v_{t-1} - (1 - b2) Delta^2 sign(v - Delta^2)."""
    _check_beta2(beta2)
    return _adaptive("fedyogi", lambda v, g2: v - (1 - beta2) * g2 * np.sign(v - g2),
                     server_lr, beta1, tau)


def fedadagrad(server_lr: float = 1e-2, beta1: float = 0.0, tau: float = 1e-3
               ) -> ServerOptimizer:
    """FedAdagrad (Reddi et al. 2021, Alg. 2): v_t = v_{t-1} + Delta_t^2.

    beta1 defaults to 0 (plain Adagrad on the pseudo-gradient); the paper allows momentum.
    """
    return _adaptive("fedadagrad", lambda v, g2: v + g2, server_lr, beta1, tau)


#: Server optimizers by the name ``--server-opt`` takes; each factory's first argument is
#: the server learning rate.
OPTIMIZERS: dict[str, Callable[..., ServerOptimizer]] = {
    "fedavg": fedavg,
    "fedavgm": fedavgm,
    "fedadam": fedadam,
    "fedyogi": fedyogi,
    "fedadagrad": fedadagrad,
    "fedspa": fedspa,
}


def state_leaves(tree: Any) -> list[np.ndarray]:
    """An optimizer state's arrays, depth first (what a snapshot stores).

    Raises:
        ValueError: a leaf that is not an array.
    """
    if isinstance(tree, np.ndarray):
        return [tree]
    if isinstance(tree, tuple | list):
        return [leaf for item in tree for leaf in state_leaves(item)]
    raise ValueError(f"optimizer state leaves must be arrays, got {type(tree).__name__}")


def state_rebuild(template: Any, leaves: list[np.ndarray]) -> Any:
    """The state of ``template``'s shape (an ``init`` result) from ``leaves`` (consumed
    from the front; :func:`state_leaves` order).

    Raises:
        ValueError: a leaf of another shape than the template's, or too few leaves.
    """
    if isinstance(template, np.ndarray):
        if not leaves:
            raise ValueError("optimizer state has fewer leaves than the optimizer")
        leaf = leaves.pop(0)
        if leaf.shape != template.shape:
            raise ValueError(f"optimizer state leaf of shape {leaf.shape}, the model "
                             f"needs {template.shape}")
        return leaf
    items = [state_rebuild(t, leaves) for t in template]
    if hasattr(template, "_fields"):  # NamedTuple
        return type(template)(*items)
    return type(template)(items)
