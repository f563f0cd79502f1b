"""The local round and FedAvg: contracts, validation, randomness only from the rng."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aggregator.optimizers import fedavg
from aggregator.round_core import select_cohort
from edge_sdk.engine import NumpyEngine, load_engine
from edge_sdk.model import build_spec, init_params
from edge_sdk.privacy.events import Gaussian, PoissonSubsampledGaussian
from edge_sdk.train import LocalTraining, dp_sgd_step, local_round, round_event
from models import manifest_path

SPEC = build_spec("logreg", (30,), 2)
ENGINE = load_engine(manifest_path("logreg", (30,), 2))


def _data(m: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, 30)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def test_round_is_deterministic_given_the_rng() -> None:
    x, y = _data(100)
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=5, batch_size=10, lr=0.1, clip=1.0, noise_multiplier=1.0)
    a = local_round(ENGINE, params, x, y, cfg, np.random.default_rng(7))
    b = local_round(ENGINE, params, x, y, cfg, np.random.default_rng(7))
    for u, v in zip(a.update, b.update, strict=True):
        np.testing.assert_array_equal(u, v)


def test_round_does_not_modify_the_global_model() -> None:
    x, y = _data(50)
    params = init_params(SPEC, np.random.default_rng(0))
    before = [p.copy() for p in params]
    local_round(ENGINE, params, x, y, LocalTraining(steps=3, batch_size=8, lr=0.5),
                np.random.default_rng(1))
    for p, q in zip(params, before, strict=True):
        np.testing.assert_array_equal(p, q)


def test_noiseless_round_reduces_training_loss() -> None:
    x, y = _data(200)
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=50, batch_size=20, lr=0.5, sampling="shuffle")
    res = local_round(ENGINE, params, x, y, cfg, np.random.default_rng(1))
    after = [p + u for p, u in zip(params, res.update, strict=True)]
    loss0 = ENGINE.clipped_grad_sum(params, x, y, math.inf).losses.mean()
    loss1 = ENGINE.clipped_grad_sum(after, x, y, math.inf).losses.mean()
    assert loss1 < 0.5 * loss0


def test_update_of_one_step_is_bounded_by_clip_plus_noise() -> None:
    # With clipping to C and no noise, one step moves theta by at most lr * C * |B| / B.
    x, y = _data(64)
    params = init_params(SPEC, np.random.default_rng(0))
    theta = [p.copy() for p in params]
    dp_sgd_step(ENGINE, theta, x * 100, y, clip=0.25, noise=None, lr=1.0, denom=64)
    moved = np.sqrt(sum(float(((t - p) ** 2).sum()) for t, p in zip(theta, params, strict=True)))
    assert moved <= 0.25 * (1 + 1e-5)


def test_empty_poisson_batch_still_adds_noise() -> None:
    theta = [np.zeros(s, dtype=np.float32) for _, s in SPEC.param_shapes()]
    noise = [np.ones(s, dtype=np.float32) for _, s in SPEC.param_shapes()]
    x = np.zeros((0, 30), dtype=np.float32)
    dp_sgd_step(ENGINE, theta, x, np.zeros(0, dtype=np.int64), clip=1.0, noise=noise,
                lr=0.5, denom=2.0)
    assert all(np.allclose(t, -0.25) for t in theta)


def _round_with(threads: int, sparsity: float = 1.0) -> list[np.ndarray]:
    x, y = _data(200)
    engine = load_engine(manifest_path("logreg", (30,), 2), threads=threads)
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=6, batch_size=20, lr=0.1, clip=0.5, noise_multiplier=1.0,
                        sparsity=sparsity)
    coords = None if sparsity == 1.0 else np.arange(0, 62, 3)
    return local_round(engine, params, x, y, cfg, np.random.default_rng(3), coords).update


@pytest.mark.parametrize("sparsity", [1.0, 21 / 62])
def test_noise_drawn_beside_the_graph_gives_the_same_round(sparsity: float) -> None:
    # with 2 threads the draw overlaps the graph on a second thread; the rng's stream and
    # the sums are as with 1 thread, so the update is bitwise the same
    for u, v in zip(_round_with(1, sparsity), _round_with(2, sparsity), strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("threads", [1, 2])
def test_noise_draw_runs_once_and_on_this_thread_with_one_thread(threads: int) -> None:
    import threading

    engine = load_engine(manifest_path("logreg", (30,), 2), threads=threads)
    x, y = _data(16)
    params = init_params(SPEC, np.random.default_rng(0))
    noise = [np.full(s, 0.5, dtype=np.float32) for _, s in SPEC.param_shapes()]
    seen: list[threading.Thread] = []

    def draw() -> list[np.ndarray]:
        seen.append(threading.current_thread())
        return noise

    drawn, given = [p.copy() for p in params], [p.copy() for p in params]
    dp_sgd_step(engine, drawn, x, y, clip=1.0, noise=draw, lr=0.1, denom=16)
    dp_sgd_step(engine, given, x, y, clip=1.0, noise=noise, lr=0.1, denom=16)
    assert len(seen) == 1
    # one thread: no other thread is started (a device pinned to one core stays on it)
    assert (seen[0] is threading.current_thread()) == (threads == 1)
    for a, b in zip(drawn, given, strict=True):
        np.testing.assert_array_equal(a, b)


def test_noise_draw_finishes_before_a_failing_graph_raises() -> None:
    import threading

    engine = load_engine(manifest_path("logreg", (30,), 2), threads=2)
    params = init_params(SPEC, np.random.default_rng(0))
    done = threading.Event()

    def draw() -> list[np.ndarray]:
        done.wait(0.05)
        done.set()
        return [np.zeros(s, dtype=np.float32) for _, s in SPEC.param_shapes()]

    x, y = _data(4)
    with pytest.raises(ValueError, match="labels"):
        dp_sgd_step(engine, params, x, y + 5, clip=1.0, noise=draw, lr=0.1, denom=4)
    assert done.is_set()  # the caller's rng is not in use once the step returns or raises


def test_events_released() -> None:
    cfg = LocalTraining(steps=20, batch_size=32, lr=0.1, clip=1.0, noise_multiplier=1.1)
    assert round_event(640, cfg) == PoissonSubsampledGaussian(
        noise_multiplier=1.1, sample_rate=0.05, steps=20)
    shuffled = LocalTraining(steps=25, batch_size=32, lr=0.1, clip=1.0, noise_multiplier=1.1,
                             sampling="shuffle")
    # 640 / 32 = 20 batches per epoch: 25 steps touch 2 epochs; substitution: z / 2.
    assert round_event(640, shuffled) == Gaussian(noise_multiplier=0.55, steps=2,
                                                  adjacency="substitution")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps"),
        ({"batch_size": 0}, "batch_size"),
        ({"lr": -1.0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"clip": 0.0}, "clip"),
        ({"noise_multiplier": 1.0}, "finite clip"),
        ({"noise_multiplier": -0.1, "clip": 1.0}, "noise_multiplier"),
        ({"sampling": "bogus"}, "sampling"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, match: str) -> None:
    base = {"steps": 1, "batch_size": 1, "lr": 0.1}
    with pytest.raises(ValueError, match=match):
        LocalTraining(**{**base, **kwargs})


def test_bad_data_is_rejected() -> None:
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=1, batch_size=4, lr=0.1)
    x, y = _data(10)
    with pytest.raises(ValueError, match="non-empty"):
        local_round(ENGINE, params, x[:0], y[:0], cfg, np.random.default_rng(0))
    with pytest.raises(ValueError, match="expected"):
        local_round(ENGINE, params, x[:, :5], y, cfg, np.random.default_rng(0))
    with pytest.raises(ValueError, match="labels"):
        local_round(ENGINE, params, x, y + 5, cfg, np.random.default_rng(0))


def test_onnx_and_numpy_rounds_agree() -> None:
    x, y = _data(100)
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=5, batch_size=10, lr=0.1, clip=1.0, noise_multiplier=0.5)
    a = local_round(ENGINE, params, x, y, cfg, np.random.default_rng(3))
    b = local_round(NumpyEngine(SPEC), params, x, y, cfg, np.random.default_rng(3))
    for u, v in zip(a.update, b.update, strict=True):
        np.testing.assert_allclose(u, v, atol=1e-5)


def test_select_cohort_is_uniform_without_replacement() -> None:
    names = [f"dev-{i:04d}" for i in range(10)]
    counts = dict.fromkeys(names, 0)
    for round_id in range(1, 2001):
        c = select_cohort(names, 3, seed=0, round_id=round_id)
        assert len(set(c)) == 3 and list(c) == sorted(c) and set(c) <= set(names)
        for n in c:
            counts[n] += 1
    # Each device is picked with probability 3/10: 600 of 2000, sd ~ 20.5.
    assert all(abs(v - 600) < 5 * 20.5 for v in counts.values())
    # a function of (seed, round, the set of names): not of their order
    assert (select_cohort(names[::-1], 3, seed=4, round_id=9)
            == select_cohort(names, 3, seed=4, round_id=9))
    with pytest.raises(ValueError, match="cohort size"):
        select_cohort(names[:5], 6, seed=0, round_id=1)
    with pytest.raises(ValueError, match="distinct"):
        select_cohort(["a", "a", "b"], 2, seed=0, round_id=1)


def test_fedavg_applies_the_mean_update_times_its_rate() -> None:
    opt = fedavg(server_lr=0.5)
    mean = [np.array([2.0, 3.0], dtype=np.float32)]
    params, state = opt.update(mean, opt.init([np.zeros(2, np.float32)]),
                               [np.zeros(2, np.float32)])
    np.testing.assert_allclose(params[0], [1.0, 1.5])


def test_sparse_round_moves_only_kept_coordinates_and_charges_reduced_sensitivity() -> None:
    x, y = _data(100)
    params = init_params(SPEC, np.random.default_rng(0))
    d = SPEC.num_params
    coords = np.sort(np.random.default_rng(5).choice(d, size=d // 4, replace=False))
    cfg = LocalTraining(steps=5, batch_size=10, lr=0.1, clip=1.0, noise_multiplier=1.0,
                        sparsity=0.25)
    res = local_round(ENGINE, params, x, y, cfg, np.random.default_rng(1), coords=coords)
    flat = np.concatenate([u.ravel() for u in res.update])
    outside = np.setdiff1d(np.arange(d), coords)
    assert not flat[outside].any() and flat[coords].any()
    p = len(coords) / d
    assert res.event == PoissonSubsampledGaussian(
        noise_multiplier=1.0 / math.sqrt(p), sample_rate=0.1, steps=5)


def test_sparse_step_clips_kept_values_to_sqrt_p_times_c() -> None:
    # One noiseless step on one sample with a huge gradient: its kept part is clipped to
    # sqrt(p) C exactly, then scaled by 1/p: movement = lr * sqrt(p) C / p.
    x, y = _data(1)
    params = init_params(SPEC, np.random.default_rng(0))
    d = SPEC.num_params
    coords = np.arange(0, d, 3)
    p = len(coords) / d
    cfg = LocalTraining(steps=1, batch_size=1, lr=0.5, clip=0.25, sparsity=p,
                        sampling="shuffle")
    wrong = 1 - y  # a confidently wrong label keeps the gradient large
    res = local_round(ENGINE, params, x * 100, wrong, cfg, np.random.default_rng(0),
                      coords=coords)
    moved = np.sqrt(sum(float((u**2).sum()) for u in res.update))
    assert moved == pytest.approx(0.5 * math.sqrt(p) * 0.25 / p, rel=1e-5)


def test_sparsity_needs_a_coordinate_set() -> None:
    x, y = _data(20)
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=1, batch_size=4, lr=0.1, sparsity=0.5)
    with pytest.raises(ValueError, match="coordinate set"):
        local_round(ENGINE, params, x, y, cfg, np.random.default_rng(0))
    with pytest.raises(ValueError, match="repeated"):
        local_round(ENGINE, params, x, y, cfg, np.random.default_rng(0),
                    coords=np.array([1, 1, 2]))


def test_fedspa_server_update_by_hand() -> None:
    from aggregator.optimizers import fedspa

    opt = fedspa(server_lr=0.1, beta1=0.5, beta2=0.5, kappa=0.01)
    theta = [np.zeros(2, dtype=np.float32)]
    state = opt.init(theta)
    np.testing.assert_allclose(state.v[0], [1e-4, 1e-4])
    theta, state = opt.update([np.array([1.0, -2.0], dtype=np.float32)], state, theta)
    u = np.array([0.5, -1.0])
    v = 0.5 * 1e-4 + 0.5 * u**2
    np.testing.assert_allclose(state.u[0], u)
    np.testing.assert_allclose(state.v[0], v, rtol=1e-6)
    np.testing.assert_allclose(theta[0], 0.1 * u / (np.sqrt(v) + 0.01), rtol=1e-5)


def test_update_noise_round_clips_the_update_and_reports_wor_event() -> None:
    from edge_sdk.privacy.events import SampledWithoutReplacementGaussian
    from edge_sdk.train import local_round_update_noise

    x, y = _data(200)
    params = init_params(SPEC, np.random.default_rng(0))
    cfg = LocalTraining(steps=4, batch_size=10, lr=0.5, clip=1.0)
    res = local_round_update_noise(ENGINE, params, x * 50, y, cfg, np.random.default_rng(1),
                                   update_clip=0.05)
    norm = np.sqrt(sum(float((u**2).sum()) for u in res.update))
    assert norm <= 0.05 * (1 + 1e-5)
    assert res.event == SampledWithoutReplacementGaussian(
        noise_multiplier=0.0, sample_size=40, dataset_size=200)
    noisy = LocalTraining(steps=4, batch_size=10, lr=0.5, clip=1.0, noise_multiplier=2.0)
    res = local_round_update_noise(ENGINE, params, x, y, noisy, np.random.default_rng(1))
    # default S = E * lr * C = 2; noise std z * S = 4 per coordinate
    flat = np.concatenate([u.ravel() for u in res.update])
    assert 3.0 < flat.std() < 5.0
    assert res.event.noise_multiplier == 1.0


def test_sample_grad_rows_onnx_and_numpy_agree_and_restrict_to_coords() -> None:
    from edge_sdk.train import sample_grad_rows

    x, y = _data(20)
    params = init_params(SPEC, np.random.default_rng(0))
    coords = np.array([0, 5, 61])
    a, la = sample_grad_rows(ENGINE, params, x, y)
    b, lb = sample_grad_rows(NumpyEngine(SPEC), params, x, y, coords)
    assert a.shape == (20, SPEC.num_params) and b.shape == (20, 3)
    np.testing.assert_allclose(a[:, coords], b, atol=1e-5)
    np.testing.assert_allclose(la, lb, atol=1e-5)
    # the rows sum to the engine's own (unclipped) gradient sum
    total = np.concatenate([g.ravel() for g in ENGINE.clipped_grad_sum(
        params, x, y, math.inf).clipped_sum])
    np.testing.assert_allclose(a.sum(axis=0), total, atol=1e-4)


def test_ddg_round_bad_data_and_divergence() -> None:
    from edge_sdk.train import TrainingDiverged, local_round_ddg

    x, y = _data(10)
    params = init_params(SPEC, np.random.default_rng(0))
    kw = dict(clip=1.0, gamma=1 / 1024, sigma=10.0, bits=24)
    with pytest.raises(ValueError, match="non-empty"):
        local_round_ddg(ENGINE, params, x[:0], y[:0], np.random.default_rng(0), **kw)
    bad = [np.full_like(p, np.nan) for p in params]
    with pytest.raises(TrainingDiverged, match="not finite"):
        local_round_ddg(ENGINE, bad, x, y, np.random.default_rng(0), **kw)
    res = local_round_ddg(ENGINE, params, x, y, np.random.default_rng(0), **kw)
    assert res.residues.dtype == np.uint64 and int(res.residues.max()) < 2**24
