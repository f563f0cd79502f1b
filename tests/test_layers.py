"""Issue 17's wider layer set: per-sample gradients against torch.func, for the torch graph
module (eager, hypothesis over shapes), the numpy engine, and the exported ONNX graph (one
fixed model per layer family); one DP-SGD step per family against Opacus. torch is allowed
here: these are reference tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, jacrev, vmap

from edge_sdk.engine import GradResult, NumpyEngine, load_engine
from edge_sdk.model import (
    Flatten,
    Gelu,
    Hardswish,
    LeakyRelu,
    Linear,
    ModelSpec,
    Sigmoid,
    Tanh,
    UnsupportedLayer,
    init_params,
)
from edge_sdk.train import dp_sgd_step
from models.export import export_variant
from models.persample import PerSampleGrad
from models.zoo import build_module, spec_from_module

pytestmark = pytest.mark.reference

# derandomize: the same 20 examples on every run, so the default suite is deterministic (a
# point found by a random run is pinned with @example where it matters)
HYPO = settings(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class TorchGraph:
    """The per-sample graph module run eagerly, with the engine's contract."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def clipped_grad_sum(self, params, x, y, clip, masks=None) -> GradResult:
        graph = PerSampleGrad(self.spec, masked=masks is not None)
        ts = [torch.tensor(p) for p in params]
        ms = [] if masks is None else [torch.tensor(m) for m in masks]
        with torch.no_grad():
            out = graph(*ts, *ms, torch.tensor(x), torch.tensor(y),
                        torch.tensor(clip, dtype=torch.float32))
        return GradResult(out[0].numpy(), out[1].numpy(), [g.numpy() for g in out[2:]])


def _torch_per_sample(spec: ModelSpec, params, x, y, dtype=torch.float32) -> np.ndarray:
    """torch.func's per-sample gradients of the float32 ``params`` at ``x``, computed in
    ``dtype`` (float64: the reference the float32 engines are judged against)."""
    module = build_module(spec, params).to(dtype)
    names = [n for n, _ in module.named_parameters()]
    weights = {n: p.detach() for n, p in module.named_parameters()}

    def loss(w, xi, yi):
        out = functional_call(module, w, (xi[None],))
        return torch.nn.functional.cross_entropy(out, yi[None])

    ids = np.issubdtype(np.asarray(x).dtype, np.integer)  # an Embedding's input stays integer
    xt = torch.tensor(x) if ids else torch.tensor(x, dtype=dtype)
    g = vmap(grad(loss), in_dims=(None, 0, 0))(weights, xt, torch.tensor(y))
    return torch.cat([g[n].reshape(len(y), -1) for n in names], dim=1).numpy()


U32 = 2.0**-24  # float32's unit roundoff
ROUNDINGS = 8  # roundings per value within one layer (a few ops, short reductions): headroom


def _norm_tapped(layer: torch.nn.Module, x: torch.Tensor, tap) -> torch.Tensor:
    """LayerNorm/GroupNorm as the engines compute it (centre, variance, rsqrt, scale, affine),
    each intermediate through ``tap``: its rounding is what an ill-conditioned norm amplifies."""
    if isinstance(layer, torch.nn.LayerNorm):
        n = len(layer.normalized_shape)
        xg = x.reshape(*x.shape[: x.dim() - n], -1)
        wshape = layer.normalized_shape
    else:
        xg = x.reshape(x.shape[0], layer.num_groups, -1)
        wshape = (layer.num_channels, *([1] * (x.dim() - 2)))
    xc = tap(xg - xg.mean(dim=-1, keepdim=True))
    rstd = tap(torch.rsqrt(tap((xc * xc).mean(dim=-1, keepdim=True)) + layer.eps))
    xhat = tap(xc * rstd).reshape(x.shape)
    return xhat * layer.weight.reshape(wshape) + layer.bias.reshape(wshape)


class _Tapped(torch.nn.Module):
    """``inner`` with every layer output (and a norm's intermediates) passed through
    ``tap(k, h)``, k counting the taps in order."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.tap = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = iter(range(1 << 30))

        def tap(h):
            return self.tap(next(count), h)

        layers = getattr(self.inner, "layers", self.inner)  # a SpecGraph, or a Sequential
        inputs = getattr(self.inner, "inputs", [(i - 1,) for i in range(len(layers))])
        outs: list[torch.Tensor] = []
        for layer, srcs in zip(layers, inputs, strict=True):
            ins = [x if j < 0 else outs[j] for j in srcs]
            if isinstance(layer, torch.nn.LayerNorm | torch.nn.GroupNorm):
                outs.append(tap(_norm_tapped(layer, ins[0], tap)))
            else:
                outs.append(tap(layer(*ins)))
        return outs[-1]


def _rounding_bound(spec: ModelSpec, params, x, y) -> np.ndarray:
    """[B, d]: the first-order bound on how far each per-sample gradient entry moves when
    every float32 value the computation holds carries a relative rounding error of up to
    ROUNDINGS * U32: each parameter, each float input, each layer's output and each
    intermediate of a norm (forward), the gradient flowing back into each of those
    (backward, which every gradient upstream of it is computed from), plus the gradient
    entry's own final rounding. Exact, not sampled: u * sum_j |dg_i / dt_j| over the
    relative perturbations t_j, from torch.func Jacobians in float64 (a forward perturbation
    of value h_k moves g by dg/dh_k * h_k; a backward one of its gradient d_k moves g_i by
    sum_j (dh_k/dtheta_i)_j d_k,j t_j). Conservative to first order: each float32 op's
    result is the exact result of its inputs perturbed by < u relative (IEEE), and between
    two tapped values there are at most ROUNDINGS such ops along any path. Not covered, so
    left to the absolute term of the caller: the cancellation in d = softmax - onehot (an
    absolute, not relative, error)."""
    module = _Tapped(build_module(spec, params).to(torch.float64))
    ints = np.issubdtype(np.asarray(x).dtype, np.integer)
    rows = []
    for i in range(len(y)):
        xi = torch.tensor(x[i : i + 1]) if ints else torch.tensor(x[i : i + 1], dtype=torch.float64)
        rows.append(_sample_bound(module, xi, torch.tensor(y[i : i + 1]), ints))
    module.tap = None
    return np.stack(rows)


def _sample_bound(module: _Tapped, xi: torch.Tensor, yi: torch.Tensor, ints: bool) -> np.ndarray:
    """:func:`_rounding_bound` of one sample ``xi`` [1, ...] with label ``yi`` [1]."""
    names = [n for n, _ in module.named_parameters()]
    theta = {n: p.detach() for n, p in module.named_parameters()}
    ce = torch.nn.functional.cross_entropy

    def run(w, tap, xin=xi):
        module.tap = tap
        return functional_call(module, w, (xin,))

    def per_sample(tp, tx, ta):
        def loss(w):
            xin = xi if ints else xi * (1 + tx)
            return ce(run(w, lambda k, h: h * (1 + ta[k]), xin), yi)

        g = grad(loss)({n: theta[n] * (1 + tp[n]) for n in names})
        return torch.cat([g[n].reshape(-1) for n in names])

    def outputs(w):  # every tapped value h_k, concatenated
        hs: list = []
        run(w, lambda k, h: hs.append(h) or h)
        return torch.cat([h.reshape(-1) for h in hs])

    tp = {n: torch.zeros_like(theta[n]) for n in names}
    tx = torch.zeros(xi.shape[1:], dtype=torch.float64)
    seen: list = []
    run(theta, lambda k, h: seen.append(h) or h)
    zeros = [torch.zeros_like(h) for h in seen]
    g0 = per_sample(tp, tx, zeros)
    jac = jacrev(per_sample, argnums=(0, 1, 2))(tp, tx, zeros)
    pieces = [*jac[0].values(), *([] if ints else [jac[1]]), *jac[2]]
    total = sum(j.abs().reshape(len(g0), -1).sum(dim=1) for j in pieces)
    d = grad(lambda e: ce(run(theta, lambda k, h: h + e[k]), yi))(zeros)
    dflat = torch.cat([dk.reshape(-1) for dk in d]).abs()
    dh = jacrev(outputs)(theta)  # name -> [sum_k |h_k|, *param shape]
    back = torch.cat([dflat @ dh[n].abs().reshape(len(dflat), -1) for n in names])
    return (ROUNDINGS * U32 * (total + back) + U32 * g0.abs()).numpy()


def _batch(spec: ModelSpec, b: int, rng: np.random.Generator):
    if spec.input_dtype == "int64":  # ids for a leading Embedding, repeats likely
        x = rng.integers(0, spec.layers[0].num_embeddings, (b, *spec.input_shape))
    else:
        x = (2.0 * rng.standard_normal((b, *spec.input_shape))).astype(np.float32)
    return x, rng.integers(0, spec.num_classes, b)


def check_against_torch_func(spec: ModelSpec, engines, *, b: int, seed: int,
                             params=None, x=None, y=None) -> None:
    """Per-sample gradients (numpy engine), norms and clipped sums (every engine, with and
    without a rand-k mask) equal torch.func's to float32 tolerance."""
    rng = np.random.default_rng(seed)
    params = init_params(spec, rng) if params is None else params
    if x is None:
        x, y = _batch(spec, b, rng)
    b = len(y)
    # The reference is torch.func in float64 from the same float32 parameters and inputs.
    ref = _torch_per_sample(spec, params, x, y, torch.float64)
    # float32: relative 1e-5 of the largest entry, plus 2e-6 absolute for confident
    # predictions, where d = softmax - onehot cancels (|d| ~ 1e-3 carries ~1e-7 of rounding,
    # times activations of a few units); or, at an ill-conditioned point (a norm over two
    # nearly equal values: 1/sqrt(var + eps) amplifies every rounding), the first-order bound
    # on what float32 rounding can do there (see _rounding_bound). Hypothesis found such
    # points: a GroupNorm of two-value groups where torch.func in float32 erred by 1.4e-3 of
    # 9.0, and an Embedding -> LayerNorm of a one-row table (seed 2: 8.7e-6 of 0.22 where the
    # older sampled estimate allowed 5.1e-6).
    base = 1e-5 * float(np.abs(ref).max()) + 2e-6
    bound = _rounding_bound(spec, params, x, y)  # [B, d]
    tol = max(base, float(bound.max()))
    # a norm moves by at most ||dg||_2; a clipped sample g*s by at most |dg_i| + ||dg||_2 (s
    # <= 1 and ds/s <= ||dg||/||g||), and the samples' errors may all point the same way (one
    # shared ill-conditioned layer): the sum's bound is the sum of theirs
    vec = np.linalg.norm(bound, axis=1)
    norm_tol = max(tol, float(vec.max()))
    sum_tol = max(base * max(1, b / 8), float((bound + vec[:, None]).sum(axis=0).max()))
    logits = build_module(spec, params)(torch.tensor(x)).detach().numpy()
    for engine in engines:
        if not isinstance(engine, TorchGraph):  # the inference graph / numpy forward
            np.testing.assert_allclose(engine.logits(params, x), logits, rtol=1e-5,
                                       atol=1e-5 * max(1.0, float(np.abs(logits).max())))
        if isinstance(engine, NumpyEngine):
            np.testing.assert_allclose(engine.per_sample_grads(params, x, y), ref,
                                       rtol=0, atol=tol)
    masks = [(rng.random(p.shape) < 0.4).astype(np.float32) for p in params]
    keep = np.concatenate([m.ravel() for m in masks]).astype(bool)
    for mask in (None, masks):
        sel = ref if mask is None else ref[:, keep]
        ref_norms = np.linalg.norm(sel.astype(np.float64), axis=1)
        for clip in (np.inf, 0.5 * float(np.median(ref_norms)) + 1e-3):
            factor = np.minimum(1.0, clip / np.maximum(ref_norms, 1e-30))
            ref_sum = (sel * factor[:, None]).sum(axis=0)
            for engine in engines:
                res = engine.clipped_grad_sum(params, x, y, clip, masks=mask)
                np.testing.assert_allclose(res.norms, ref_norms, rtol=1e-5, atol=norm_tol)
                got = np.concatenate([g.ravel() for g in res.clipped_sum])
                if mask is not None:
                    assert not got[~keep].any()
                    got = got[keep]
                np.testing.assert_allclose(got, ref_sum, rtol=0, atol=sum_tol)


def check_opacus_step(spec: ModelSpec, engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """One noisy DP-SGD step through ``engine`` equals Opacus' (same injected noise)."""
    import opacus.optimizers.optimizer as opt_mod
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    rng = np.random.default_rng(3)
    params = init_params(spec, rng)
    b, clip, z, lr = 16, 0.7, 1.3, 0.1
    x, y = _batch(spec, b, rng)
    noise = [rng.normal(0, z * clip, size=p.shape).astype(np.float32) for p in params]
    theta = [p.copy() for p in params]
    dp_sgd_step(engine, theta, x, y, clip=clip, noise=noise, lr=lr, denom=b)

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


def both(spec: ModelSpec) -> tuple:
    return TorchGraph(spec), NumpyEngine(spec)


# --- 1. activations -------------------------------------------------------------------------

ACTS = st.one_of(
    st.builds(Tanh), st.builds(Sigmoid), st.builds(Hardswish),
    st.sampled_from(["none", "tanh"]).map(lambda a: Gelu(approximate=a)),
    st.floats(0.0, 0.5, width=32).map(lambda s: LeakyRelu(negative_slope=s)),
)


def _act_spec(d: int, hidden: int, classes: int, acts) -> ModelSpec:
    layers: list = [Linear(in_features=d, out_features=hidden)]
    for act in acts:
        layers += [act, Linear(in_features=hidden, out_features=hidden)]
    layers[-1] = Linear(in_features=hidden, out_features=classes)
    return ModelSpec(name="acts", input_shape=(d,), num_classes=classes, layers=tuple(layers))


@HYPO
@given(acts=st.lists(ACTS, min_size=1, max_size=3), d=st.integers(1, 7),
       hidden=st.integers(1, 9), classes=st.integers(2, 4), b=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_activations_match_torch_func(acts, d, hidden, classes, b, seed) -> None:
    spec = _act_spec(d, hidden, classes, acts)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


@pytest.mark.parametrize("act", [Hardswish(), LeakyRelu(negative_slope=0.2),
                                 Gelu(), Gelu(approximate="tanh"), Sigmoid(), Tanh()],
                         ids=lambda a: f"{a.kind}")
def test_activation_gradients_at_the_kinks_follow_torch(act) -> None:
    """Pre-activations exactly at -3, 0, 3 (Hardswish's and LeakyReLU's kinks)."""
    spec = ModelSpec(name="kinks", input_shape=(4,), num_classes=3, layers=(
        Linear(in_features=4, out_features=5), act, Linear(in_features=5, out_features=3)))
    rng = np.random.default_rng(0)
    params = init_params(spec, rng)
    params[0][:] = 0.0
    params[1][:] = np.array([-3.0, 0.0, 3.0, -1.0, 1.5], dtype=np.float32)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1])
    check_against_torch_func(spec, both(spec), b=5, seed=1, params=params, x=x, y=y)


ACT_MODEL = _act_spec(6, 8, 3, [Tanh(), Sigmoid(), Gelu(), Gelu(approximate="tanh"),
                                LeakyRelu(negative_slope=0.2), Hardswish()])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """Export a spec once per module; returns its ONNX engine."""
    done: dict[str, object] = {}
    root: Path = tmp_path_factory.mktemp("onnx")

    def get(spec: ModelSpec):
        key = repr(spec)
        if key not in done:
            out = root / f"m{len(done)}"
            done[key] = load_engine(export_variant(spec, out))
        return done[key]

    return get


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("b", [1, 9])
def test_activation_model_onnx_graph_matches_torch_func(exported, b: int) -> None:
    check_against_torch_func(ACT_MODEL, (exported(ACT_MODEL),), b=b, seed=b)


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
def test_activation_model_step_matches_opacus(exported, monkeypatch) -> None:
    check_opacus_step(ACT_MODEL, exported(ACT_MODEL), monkeypatch)


def test_activation_modules_export_and_dropout_is_refused_with_a_reason() -> None:
    from torch import nn

    module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(),
                           nn.Linear(8, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 8),
                           nn.LeakyReLU(0.2), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8),
                           nn.Hardswish(), nn.Linear(8, 3))
    spec = spec_from_module(module, (6,), 3)
    assert [layer.kind for layer in spec.layers[1::2]] == [
        "tanh", "gelu", "gelu", "leakyrelu", "sigmoid", "hardswish"]
    assert spec.layers[5] == Gelu(approximate="tanh") and spec.layers[3] == Gelu()
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(UnsupportedLayer, match=r"layer 1 \(Dropout.*no dropout-mask input"):
        spec_from_module(nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.Linear(8, 3)),
                         (6,), 3)
    data = spec.to_dict()
    data["layers"].insert(1, {"kind": "dropout", "p": 0.1})
    with pytest.raises(UnsupportedLayer, match="'dropout'.*no dropout-mask input"):
        ModelSpec.from_dict(data)
    with pytest.raises(UnsupportedLayer, match="approximate"):
        Gelu(approximate="fast")


def test_flatten_first_then_activation_spec_is_fine() -> None:
    spec = ModelSpec(name="f", input_shape=(2, 3), num_classes=2, layers=(
        Flatten(), Tanh(), Linear(in_features=6, out_features=2)))
    check_against_torch_func(spec, both(spec), b=3, seed=0)


# --- 2. convolutions: stride, padding, dilation; Conv1d -------------------------------------

GEOM = st.fixed_dictionaries({"kernel": st.integers(1, 4), "stride": st.integers(1, 3),
                              "padding": st.integers(0, 2), "dilation": st.integers(1, 3)})


def _conv_spec(cls, c0: int, c1: int, c2: int, spatial: tuple[int, ...], g1, g2, act,
               classes: int) -> ModelSpec | None:
    """conv -> act -> conv -> flatten -> linear, or None if the geometry does not fit."""
    from edge_sdk.model import _out_shape

    first = cls(in_channels=c0, out_channels=c1, **g1)
    second = cls(in_channels=c1, out_channels=c2, **g2)
    try:
        shape = _out_shape(second, _out_shape(first, (c0, *spatial), 0), 2)
    except ValueError:
        return None
    n = int(np.prod(shape))
    return ModelSpec(name="conv", input_shape=(c0, *spatial), num_classes=classes, layers=(
        first, act, second, Flatten(), Linear(in_features=n, out_features=classes)))


@HYPO
@given(c=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       hw=st.tuples(st.integers(1, 10), st.integers(1, 10)), g1=GEOM, g2=GEOM, act=ACTS,
       b=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_conv2d_stride_padding_dilation_match_torch_func(c, hw, g1, g2, act, b, seed) -> None:
    from hypothesis import assume

    from edge_sdk.model import Conv2d

    spec = _conv_spec(Conv2d, *c, hw, g1, g2, act, 3)
    assume(spec is not None)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


@HYPO
@given(c=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3)),
       length=st.integers(1, 24), g1=GEOM, g2=GEOM, act=ACTS, b=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_conv1d_match_torch_func(c, length, g1, g2, act, b, seed) -> None:
    from hypothesis import assume

    from edge_sdk.model import Conv1d

    spec = _conv_spec(Conv1d, *c, (length,), g1, g2, act, 2)
    assume(spec is not None)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


def _conv_models() -> dict[str, ModelSpec]:
    from edge_sdk.model import Conv1d, Conv2d, Relu

    c2 = _conv_spec(Conv2d, 2, 4, 3, (9, 8), dict(kernel=3, stride=2, padding=1),
                    dict(kernel=2, stride=1, padding=2, dilation=2), Relu(), 4)
    c1 = _conv_spec(Conv1d, 3, 4, 4, (17,), dict(kernel=5, stride=2, padding=2),
                    dict(kernel=3, stride=3, padding=1, dilation=2), Gelu(), 3)
    return {"conv2d": c2, "conv1d": c1}


CONV_MODELS = _conv_models()


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("which", sorted(CONV_MODELS))
@pytest.mark.parametrize("b", [1, 9])
def test_conv_models_onnx_graph_matches_torch_func(exported, which: str, b: int) -> None:
    spec = CONV_MODELS[which]
    check_against_torch_func(spec, (exported(spec),), b=b, seed=b)


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("which", sorted(CONV_MODELS))
def test_conv_models_step_matches_opacus(exported, which: str, monkeypatch) -> None:
    check_opacus_step(CONV_MODELS[which], exported(CONV_MODELS[which]), monkeypatch)


def test_conv_modules_export_and_the_rest_is_named() -> None:
    from torch import nn

    from edge_sdk.model import Conv1d, Conv2d

    module = nn.Sequential(nn.Conv1d(3, 4, 5, stride=2, padding=2), nn.ReLU(),
                           nn.Conv1d(4, 2, 3, dilation=2), nn.Flatten(), nn.Linear(10, 2))
    spec = spec_from_module(module, (3, 17), 2)
    assert spec.layers[0] == Conv1d(in_channels=3, out_channels=4, kernel=5, stride=2,
                                    padding=2)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    strided = spec_from_module(nn.Sequential(nn.Conv2d(1, 2, 3, stride=2, padding=1,
                                                       dilation=2), nn.Flatten(),
                                             nn.Linear(2 * 13 * 13, 3)), (1, 28, 28), 3)
    assert strided.layers[0] == Conv2d(in_channels=1, out_channels=2, kernel=3, stride=2,
                                       padding=1, dilation=2)
    for bad in (nn.Conv2d(4, 4, 3, padding_mode="reflect"), nn.Conv2d(1, 4, (3, 5)),
                nn.Conv2d(1, 4, 3, stride=(1, 2)), nn.Conv2d(1, 4, 3, padding="same"),
                nn.Conv2d(1, 4, 3, bias=False)):
        with pytest.raises(UnsupportedLayer, match=r"layer 0 \(Conv2d"):
            spec_from_module(nn.Sequential(bad), (bad.in_channels, 12, 12), 3)
    with pytest.raises(ValueError, match="stride must be an int >= 1"):
        Conv1d(in_channels=1, out_channels=1, kernel=3, stride=0)
    with pytest.raises(ValueError, match=r"kernel 5 \(dilation 2, padding 0\) larger"):
        ModelSpec(name="x", input_shape=(1, 8), num_classes=2, layers=(
            Conv1d(in_channels=1, out_channels=2, kernel=5, dilation=2),))


# --- 2b. grouped and depthwise-separable convolutions -----------------------------------

def _grouped_spec(cls, groups: int, per_in: int, mult: int, c2: int, spatial: tuple[int, ...],
                  geom, groups2: int, act, classes: int) -> ModelSpec | None:
    """grouped conv (groups x per_in -> groups x mult channels) -> act -> conv with groups2
    (1x1 when groups2 = 1: depthwise-separable when per_in = 1) -> flatten -> linear."""
    from edge_sdk.model import _out_shape

    c0, c1 = groups * per_in, groups * mult
    if c1 % groups2:
        return None
    first = cls(in_channels=c0, out_channels=c1, groups=groups, **geom)
    second = cls(in_channels=c1, out_channels=c2 * groups2, kernel=1, groups=groups2)
    try:
        shape = _out_shape(second, _out_shape(first, (c0, *spatial), 0), 2)
    except ValueError:
        return None
    n = int(np.prod(shape))
    return ModelSpec(name="grouped", input_shape=(c0, *spatial), num_classes=classes, layers=(
        first, act, second, Flatten(), Linear(in_features=n, out_features=classes)))


@HYPO
@given(dims=st.sampled_from([1, 2]), groups=st.integers(1, 4), per_in=st.integers(1, 2),
       mult=st.integers(1, 3), c2=st.integers(1, 3), groups2=st.integers(1, 3),
       spatial=st.tuples(st.integers(1, 9), st.integers(1, 9)), geom=GEOM, act=ACTS,
       b=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_grouped_convs_match_torch_func(dims, groups, per_in, mult, c2, groups2, spatial, geom,
                                        act, b, seed) -> None:
    from hypothesis import assume

    from edge_sdk.model import Conv1d, Conv2d

    cls = Conv2d if dims == 2 else Conv1d
    spec = _grouped_spec(cls, groups, per_in, mult, c2, spatial[:dims], geom, groups2, act, 3)
    assume(spec is not None)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


def _ds_cnn(dims: int) -> ModelSpec:
    """A DS-CNN in the style of "Hello Edge" (Zhang et al. 2017): a strided conv, then
    depthwise (groups = channels) + pointwise (1x1) blocks, global average pooling."""
    from edge_sdk.model import Conv1d, Conv2d, GlobalAvgPool, Relu

    conv = Conv2d if dims == 2 else Conv1d
    spatial = (10, 8) if dims == 2 else (24,)
    return ModelSpec(name=f"dscnn{dims}d", input_shape=(1, *spatial), num_classes=4, layers=(
        conv(in_channels=1, out_channels=6, kernel=3, stride=2, padding=1), Relu(),
        conv(in_channels=6, out_channels=6, kernel=3, padding=1, groups=6), Relu(),
        conv(in_channels=6, out_channels=8, kernel=1), Relu(),
        conv(in_channels=8, out_channels=8, kernel=3, padding=2, dilation=2, groups=8),
        Relu(), conv(in_channels=8, out_channels=8, kernel=1, groups=2), Relu(),
        GlobalAvgPool(dims=dims), Flatten(), Linear(in_features=8, out_features=4)))


DS_MODELS = {"dscnn2d": _ds_cnn(2), "dscnn1d": _ds_cnn(1)}


@pytest.mark.parametrize("which", sorted(DS_MODELS))
def test_ds_cnn_numpy_and_graph_match_torch_func(which: str) -> None:
    spec = DS_MODELS[which]
    for b in (1, 7):
        check_against_torch_func(spec, both(spec), b=b, seed=b)


def test_ds_cnn_onnx_graphs_match_torch_func_and_opacus(exported, monkeypatch) -> None:
    spec = DS_MODELS["dscnn2d"]
    engine = exported(spec)
    for b in (1, 9):
        check_against_torch_func(spec, (engine,), b=b, seed=b)
    check_opacus_step(spec, engine, monkeypatch)


@pytest.mark.slow  # the 2-D DS-CNN runs by default
def test_ds_cnn_1d_onnx_graphs_match_torch_func_and_opacus(exported, monkeypatch) -> None:
    spec = DS_MODELS["dscnn1d"]
    engine = exported(spec)
    for b in (1, 9):
        check_against_torch_func(spec, (engine,), b=b, seed=b)
    check_opacus_step(spec, engine, monkeypatch)


def test_grouped_conv_modules_export_and_bad_groups_are_named() -> None:
    from torch import nn

    from edge_sdk.model import Conv1d, Conv2d

    module = nn.Sequential(nn.Conv1d(4, 8, 3, groups=4), nn.ReLU(), nn.Conv1d(8, 6, 1),
                           nn.Flatten(), nn.Linear(6 * 8, 2))
    spec = spec_from_module(module, (4, 10), 2)
    assert spec.layers[0] == Conv1d(in_channels=4, out_channels=8, kernel=3, groups=4)
    assert spec.param_shapes()[0] == ("l0.weight", (8, 1, 3))
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    image = spec_from_module(nn.Sequential(nn.Conv2d(6, 6, 3, groups=3), nn.Flatten(),
                                           nn.Linear(6 * 4 * 4, 3)), (6, 6, 6), 3)
    assert image.layers[0] == Conv2d(in_channels=6, out_channels=6, kernel=3, groups=3)
    assert image.param_shapes()[0] == ("l0.weight", (6, 2, 3, 3))
    with pytest.raises(ValueError, match="groups must divide in_channels and out_channels"):
        Conv2d(in_channels=4, out_channels=6, kernel=3, groups=4)
    with pytest.raises(ValueError, match="groups must be an int >= 1"):
        Conv1d(in_channels=4, out_channels=4, kernel=3, groups=0)


# --- 3. average pooling and global average pooling ------------------------------------------

def _pool_spec(dims: int, c: tuple[int, int, int], spatial: tuple[int, ...], pool_k: int,
               pool_s: int, k2: int, global_pool: bool, act, classes: int) -> ModelSpec | None:
    """conv -> act -> avgpool -> conv -> (global avg pool) -> flatten -> linear, or None if
    the shapes do not fit."""
    from edge_sdk.model import (
        AvgPool1d,
        AvgPool2d,
        Conv1d,
        Conv2d,
        GlobalAvgPool,
        _out_shape,
    )

    conv, pool = (Conv2d, AvgPool2d) if dims == 2 else (Conv1d, AvgPool1d)
    layers = [conv(in_channels=c[0], out_channels=c[1], kernel=2, padding=1), act,
              pool(kernel=pool_k, stride=pool_s),
              conv(in_channels=c[1], out_channels=c[2], kernel=k2)]
    if global_pool:
        layers.append(GlobalAvgPool(dims=dims))
    shape = (c[0], *spatial)
    try:
        for i, layer in enumerate(layers):
            shape = _out_shape(layer, shape, i)
    except ValueError:
        return None
    layers += [Flatten(), Linear(in_features=int(np.prod(shape)), out_features=classes)]
    return ModelSpec(name="pool", input_shape=(c[0], *spatial), num_classes=classes,
                     layers=tuple(layers))


@HYPO
@given(dims=st.sampled_from([1, 2]),
       c=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       spatial=st.tuples(st.integers(1, 12), st.integers(1, 12)), pool_k=st.integers(1, 3),
       pool_s=st.integers(1, 3), k2=st.integers(1, 2), global_pool=st.booleans(), act=ACTS,
       b=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_average_pooling_matches_torch_func(dims, c, spatial, pool_k, pool_s, k2, global_pool,
                                            act, b, seed) -> None:
    from hypothesis import assume

    spec = _pool_spec(dims, c, spatial[:dims], pool_k, pool_s, k2, global_pool, act, 3)
    assume(spec is not None)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


POOL_MODELS = {
    "avgpool2d": _pool_spec(2, (2, 4, 3), (11, 9), 3, 2, 2, True, Tanh(), 4),
    "avgpool1d": _pool_spec(1, (3, 4, 4), (19,), 2, 3, 1, True, Hardswish(), 3),
}


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("which", sorted(POOL_MODELS))
@pytest.mark.parametrize("b", [1, 9])
def test_pool_models_onnx_graph_matches_torch_func(exported, which: str, b: int) -> None:
    spec = POOL_MODELS[which]
    check_against_torch_func(spec, (exported(spec),), b=b, seed=b)


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("which", sorted(POOL_MODELS))
def test_pool_models_step_matches_opacus(exported, which: str, monkeypatch) -> None:
    check_opacus_step(POOL_MODELS[which], exported(POOL_MODELS[which]), monkeypatch)


def test_pool_modules_export_and_the_rest_is_named() -> None:
    from torch import nn

    from edge_sdk.model import AvgPool1d, AvgPool2d, GlobalAvgPool

    module = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.AvgPool1d(2), nn.Conv1d(4, 4, 3),
                           nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 2))
    spec = spec_from_module(module, (3, 20), 2)
    assert spec.layers[2] == AvgPool1d(kernel=2, stride=2)
    assert spec.layers[4] == GlobalAvgPool(dims=1)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    image = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AvgPool2d(3, stride=2),
                          nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(2, 3))
    spec = spec_from_module(image, (1, 12, 12), 3)
    assert spec.layers[1:3] == (AvgPool2d(kernel=3, stride=2), GlobalAvgPool(dims=2))
    for bad in (nn.AvgPool2d(2, padding=1), nn.AvgPool2d(2, ceil_mode=True),
                nn.AvgPool2d((2, 3)), nn.AvgPool2d(2, divisor_override=3),
                nn.AdaptiveAvgPool2d(2)):
        with pytest.raises(UnsupportedLayer, match=r"layer 0 \((Adaptive)?AvgPool2d"):
            spec_from_module(nn.Sequential(bad), (1, 8, 8), 3)
    with pytest.raises(ValueError, match=r"dims=2\) expects a rank-3"):
        ModelSpec(name="x", input_shape=(2, 8), num_classes=2, layers=(GlobalAvgPool(),))


# --- 3b. max pooling of any kernel and stride ------------------------------------------

def _max_spec(dims: int, c: tuple[int, int], spatial: tuple[int, ...], k: int, s: int,
              act, classes: int) -> ModelSpec | None:
    """conv -> act -> maxpool(k, s) -> flatten -> linear, or None if the shapes do not fit."""
    from edge_sdk.model import Conv1d, Conv2d, MaxPool1d, MaxPool2d, _out_shape

    conv, pool = (Conv2d, MaxPool2d) if dims == 2 else (Conv1d, MaxPool1d)
    layers = [conv(in_channels=c[0], out_channels=c[1], kernel=2, padding=1), act,
              pool(kernel=k, stride=s)]
    shape = (c[0], *spatial)
    try:
        for i, layer in enumerate(layers):
            shape = _out_shape(layer, shape, i)
    except ValueError:
        return None
    layers += [Flatten(), Linear(in_features=int(np.prod(shape)), out_features=classes)]
    return ModelSpec(name="maxpool", input_shape=(c[0], *spatial), num_classes=classes,
                     layers=tuple(layers))


@HYPO
@given(dims=st.sampled_from([1, 2]), c=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       spatial=st.tuples(st.integers(1, 10), st.integers(1, 10)), k=st.integers(1, 4),
       s=st.integers(1, 4), act=ACTS, b=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_max_pooling_matches_torch_func(dims, c, spatial, k, s, act, b, seed) -> None:
    from hypothesis import assume

    spec = _max_spec(dims, c, spatial[:dims], k, s, act, 3)
    assume(spec is not None)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("k,s", [(2, 2), (3, 1), (3, 2), (2, 3)])
def test_max_pool_ties_follow_torch(dims: int, k: int, s: int) -> None:
    """A 1x1 conv with integer weights over integer inputs gives exact integer outputs, so most
    windows hold tied maxima (overlapping windows too): the conv's per-sample gradients show
    that each window's gradient goes to the input torch sends it to."""
    from edge_sdk.model import Conv1d, Conv2d, MaxPool1d, MaxPool2d, _out_shape

    conv = Conv2d if dims == 2 else Conv1d
    pool = MaxPool2d(kernel=k, stride=s) if dims == 2 else MaxPool1d(kernel=k, stride=s)
    spatial = (7, 6) if dims == 2 else (11,)
    out = _out_shape(pool, (3, *spatial), 1)
    spec = ModelSpec(name="ties", input_shape=(2, *spatial), num_classes=3, layers=(
        conv(in_channels=2, out_channels=3, kernel=1), pool, Flatten(),
        Linear(in_features=int(np.prod(out)), out_features=3)))
    rng = np.random.default_rng(k * 10 + s)
    x = rng.integers(-1, 2, size=(6, 2, *spatial)).astype(np.float32)
    y = rng.integers(0, 3, 6)
    params = init_params(spec, rng)
    params[0] = rng.integers(-1, 2, size=params[0].shape).astype(np.float32)
    check_against_torch_func(spec, both(spec), b=6, seed=0, params=params, x=x, y=y)


MAX_MODELS = {
    "maxpool2d": _max_spec(2, (2, 3), (9, 8), 3, 2, Tanh(), 4),
    "maxpool1d": _max_spec(1, (3, 4), (17,), 4, 3, Gelu(), 3),
}


def test_max_pool_onnx_graphs_match_torch_func_and_opacus(exported, monkeypatch) -> None:
    spec = MAX_MODELS["maxpool2d"]
    engine = exported(spec)
    for b in (1, 9):
        check_against_torch_func(spec, (engine,), b=b, seed=b)
    check_opacus_step(spec, engine, monkeypatch)


@pytest.mark.slow  # the 2-D max pool model runs by default
def test_max_pool_1d_onnx_graphs_match_torch_func_and_opacus(exported, monkeypatch) -> None:
    spec = MAX_MODELS["maxpool1d"]
    engine = exported(spec)
    for b in (1, 9):
        check_against_torch_func(spec, (engine,), b=b, seed=b)
    check_opacus_step(spec, engine, monkeypatch)


def test_max_pool_modules_export_and_the_rest_is_named() -> None:
    from torch import nn

    from edge_sdk.model import MaxPool1d, MaxPool2d

    module = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.MaxPool1d(3, stride=2),
                           nn.Flatten(), nn.Linear(4 * 8, 2))
    spec = spec_from_module(module, (3, 20), 2)
    assert spec.layers[2] == MaxPool1d(kernel=3, stride=2)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    image = spec_from_module(nn.Sequential(nn.MaxPool2d(3), nn.Flatten(), nn.Linear(8, 3)),
                             (2, 7, 6), 3)
    assert image.layers[0] == MaxPool2d(kernel=3, stride=3)
    # the zoo's manifests keep their form: a 2x2 pool is written without a stride
    assert {"kind": "maxpool2d", "kernel": 2} in ModelSpec(
        name="z", input_shape=(1, 4, 4), num_classes=4,
        layers=(MaxPool2d(), Flatten())).to_dict()["layers"]
    for bad in (nn.MaxPool2d(2, padding=1), nn.MaxPool2d(2, ceil_mode=True),
                nn.MaxPool2d((2, 3)), nn.MaxPool2d(2, dilation=2),
                nn.MaxPool2d(2, return_indices=True)):
        with pytest.raises(UnsupportedLayer, match=r"layer 0 \(MaxPool2d"):
            spec_from_module(nn.Sequential(bad), (1, 8, 8), 3)
    with pytest.raises(ValueError, match="MaxPool1d stride must be an int >= 1"):
        MaxPool1d(kernel=2, stride=0)
    with pytest.raises(ValueError, match=r"kernel 5 larger than input"):
        ModelSpec(name="x", input_shape=(1, 4), num_classes=2, layers=(MaxPool1d(kernel=5),))


# --- 4. LayerNorm / GroupNorm; BatchNorm refused --------------------------------------------

def _norm_spec(variant: str, groups: int, per_group: int, size: int, first: bool, act,
               classes: int) -> ModelSpec:
    """A norm layer between parameter layers (or first, when ``first``), over the shapes the
    variant names: 'ln-vec' [F], 'ln-seq' [C, L] over (C, L), 'ln-last' [C, L] over (L,),
    'gn-img' [C, H, W], 'gn-seq' [C, L], 'gn-vec' [C]."""
    from edge_sdk.model import Conv1d, Conv2d, GroupNorm, LayerNorm

    c = groups * per_group
    if variant == "ln-vec":
        body, shape, norm = [Linear(in_features=3, out_features=c)], (3,), LayerNorm(
            normalized_shape=(c,))
        out = (c,)
    elif variant in ("ln-seq", "ln-last", "gn-seq"):
        body, shape = [Conv1d(in_channels=2, out_channels=c, kernel=2)], (2, size + 1)
        out = (c, size)
        norm = {"ln-seq": LayerNorm(normalized_shape=out),
                "ln-last": LayerNorm(normalized_shape=(size,), eps=1e-3),
                "gn-seq": GroupNorm(num_groups=groups, num_channels=c)}[variant]
    elif variant == "gn-img":
        body, shape = [Conv2d(in_channels=2, out_channels=c, kernel=2)], (2, size + 1, size)
        out, norm = (c, size, size - 1), GroupNorm(num_groups=groups, num_channels=c, eps=1e-4)
    else:  # gn-vec
        body, shape, out = [Linear(in_features=3, out_features=c)], (3,), (c,)
        norm = GroupNorm(num_groups=groups, num_channels=c)
    if first:
        body, shape = [], out
    n = int(np.prod(out))
    tail = [Flatten()] if len(out) > 1 else []
    layers = (*body, norm, act, *tail, Linear(in_features=n, out_features=classes))
    return ModelSpec(name="norm", input_shape=shape, num_classes=classes, layers=layers)


NORM_VARIANTS = ["ln-vec", "ln-seq", "ln-last", "gn-img", "gn-seq", "gn-vec"]


def _perturbed(spec: ModelSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """init_params, with the norms' identity affine maps moved off 1 and 0."""
    return [p + rng.normal(0, 0.3, p.shape).astype(np.float32) for p in init_params(spec, rng)]


@HYPO
@given(variant=st.sampled_from(NORM_VARIANTS), groups=st.integers(1, 3),
       per_group=st.integers(1, 3), size=st.integers(2, 6), first=st.booleans(), act=ACTS,
       b=st.integers(1, 5), seed=st.integers(0, 2**16))
# an ill-conditioned GroupNorm (groups of two values) hypothesis once found: float32 cannot
# match float64 to 1e-5 there, torch.func included (see check_against_torch_func's tol)
@example(variant="gn-vec", groups=3, per_group=2, size=2, first=False, act=Tanh(), b=1,
         seed=88)
@example(variant="ln-vec", groups=1, per_group=2, size=2, first=False, act=Tanh(), b=3,
         seed=7)  # the same over a LayerNorm of two features
def test_norms_match_torch_func(variant, groups, per_group, size, first, act, b, seed) -> None:
    from hypothesis import assume

    assume(variant != "gn-vec" or per_group > 1)  # groups of one value are refused
    spec = _norm_spec(variant, groups, per_group, size, first, act, 3)
    rng = np.random.default_rng(seed)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, b, rng)
    check_against_torch_func(spec, both(spec), b=b, seed=seed, params=params, x=x, y=y)


def _norm_models() -> dict[str, ModelSpec]:
    from edge_sdk.model import Relu

    return {"layernorm": _norm_spec("ln-seq", 2, 2, 6, False, Gelu(), 3),
            "groupnorm": _norm_spec("gn-img", 2, 2, 5, False, Relu(), 4)}


NORM_MODELS = _norm_models()


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("which", sorted(NORM_MODELS))
@pytest.mark.parametrize("b", [1, 9])
def test_norm_models_onnx_graph_matches_torch_func(exported, which: str, b: int) -> None:
    spec = NORM_MODELS[which]
    rng = np.random.default_rng(b)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, b, rng)
    check_against_torch_func(spec, (exported(spec),), b=b, seed=b, params=params, x=x, y=y)


@pytest.mark.slow  # one export per family; ALL_MODELS covers each kind by default
@pytest.mark.parametrize("which", sorted(NORM_MODELS))
def test_norm_models_step_matches_opacus(exported, which: str, monkeypatch) -> None:
    check_opacus_step(NORM_MODELS[which], exported(NORM_MODELS[which]), monkeypatch)


def test_norm_modules_export_and_batchnorm_is_refused_with_why_and_what_instead() -> None:
    from torch import nn

    from edge_sdk.model import GroupNorm, LayerNorm

    module = nn.Sequential(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(),
                           nn.LayerNorm(8, eps=1e-3), nn.Flatten(), nn.Linear(32, 2))
    spec = spec_from_module(module, (2, 10), 2)
    assert spec.layers[1] == GroupNorm(num_groups=2, num_channels=4)
    assert spec.layers[3] == LayerNorm(normalized_shape=(8,), eps=1e-3)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert [s for _, s in spec.param_shapes()][2:6] == [(4,), (4,), (8,), (8,)]
    params = init_params(spec, np.random.default_rng(0))
    assert (params[2] == 1).all() and (params[3] == 0).all() and (params[4] == 1).all()
    for bad, name in ((nn.BatchNorm1d(4), "BatchNorm1d"), (nn.BatchNorm2d(4), "BatchNorm2d")):
        with pytest.raises(UnsupportedLayer, match=rf"layer 1 \({name}.*other samples.*"
                                                  r"Use GroupNorm.*or LayerNorm"):
            spec_from_module(nn.Sequential(nn.Conv2d(1, 4, 3), bad), (1, 8, 8), 2)
    data = spec.to_dict()
    data["layers"][1] = {"kind": "batchnorm2d", "num_features": 4}
    with pytest.raises(UnsupportedLayer, match="batchnorm2d.*per-sample gradients"):
        ModelSpec.from_dict(data)
    for bad in (nn.LayerNorm(8, elementwise_affine=False), nn.GroupNorm(2, 4, affine=False)):
        with pytest.raises(UnsupportedLayer, match=r"layer 0 \((Layer|Group)Norm"):
            spec_from_module(nn.Sequential(bad), (4, 8), 2)
    with pytest.raises(ValueError, match="groups of one value"):
        _norm_spec("gn-vec", 3, 1, 2, False, Tanh(), 2)
    with pytest.raises(ValueError, match="num_groups >= 1 dividing num_channels"):
        GroupNorm(num_groups=3, num_channels=4)


# --- every new kind in two exported models (the default suite's ONNX coverage) --------------

def _all_models() -> dict[str, ModelSpec]:
    from edge_sdk.model import (
        AvgPool1d,
        AvgPool2d,
        Conv1d,
        Conv2d,
        GlobalAvgPool,
        GroupNorm,
        LayerNorm,
    )

    seq = ModelSpec(name="seq", input_shape=(3, 20), num_classes=3, layers=(
        Conv1d(in_channels=3, out_channels=4, kernel=5, stride=2, padding=2),   # 4 x 10
        GroupNorm(num_groups=2, num_channels=4), Gelu(), AvgPool1d(kernel=2),   # 4 x 5
        Conv1d(in_channels=4, out_channels=4, kernel=3, padding=1, dilation=2),  # 4 x 3
        LayerNorm(normalized_shape=(4, 3)), Hardswish(), GlobalAvgPool(dims=1), Flatten(),
        Linear(in_features=4, out_features=6), LeakyRelu(negative_slope=0.1),
        Linear(in_features=6, out_features=3)))
    img = ModelSpec(name="img", input_shape=(2, 11, 9), num_classes=4, layers=(
        Conv2d(in_channels=2, out_channels=4, kernel=3, stride=2, padding=1),   # 4 x 6 x 5
        LayerNorm(normalized_shape=(5,)), Tanh(), AvgPool2d(kernel=2, stride=1),  # 4 x 5 x 4
        Conv2d(in_channels=4, out_channels=3, kernel=2, padding=1, dilation=2),  # 3 x 4 x 3
        GroupNorm(num_groups=3, num_channels=3), Sigmoid(), GlobalAvgPool(dims=2), Flatten(),
        Linear(in_features=3, out_features=5), Gelu(approximate="tanh"),
        Linear(in_features=5, out_features=4)))
    return {"seq": seq, "img": img}


ALL_MODELS = _all_models()


@pytest.mark.parametrize("which", sorted(ALL_MODELS))
def test_every_new_kind_onnx_graphs_match_torch_func_and_opacus(exported, which: str,
                                                                 monkeypatch) -> None:
    spec = ALL_MODELS[which]
    engine = exported(spec)
    for b in (1, 9):
        rng = np.random.default_rng(b)
        params = _perturbed(spec, rng)
        x, y = _batch(spec, b, rng)
        check_against_torch_func(spec, (engine, NumpyEngine(spec)), b=b, seed=b,
                                 params=params, x=x, y=y)
    check_opacus_step(spec, engine, monkeypatch)


# --- 5. Embedding: integer ids in, per-sample gradient rows of the table --------------------

def _embed_spec(rows: int, dim: int, length: int, tail: str, act, classes: int) -> ModelSpec:
    """Embedding -> (act | LayerNorm | Conv1d over the ids as channels | nothing) -> flatten
    -> linear."""
    from edge_sdk.model import Conv1d, Embedding, LayerNorm

    mid: list = {"act": [act], "layernorm": [LayerNorm(normalized_shape=(dim,)), act],
                 "conv": [Conv1d(in_channels=length, out_channels=2, kernel=1), act],
                 "none": []}[tail]
    width = 2 * dim if tail == "conv" else length * dim
    return ModelSpec(name="embed", input_shape=(length,), num_classes=classes, layers=(
        Embedding(num_embeddings=rows, embedding_dim=dim), *mid, Flatten(),
        Linear(in_features=width, out_features=classes)))


@HYPO
@given(rows=st.integers(1, 6), dim=st.integers(1, 4), length=st.integers(1, 5),
       tail=st.sampled_from(["act", "layernorm", "conv", "none"]), act=ACTS,
       b=st.integers(1, 5), seed=st.integers(0, 2**16))
# a one-row table into a LayerNorm of two features: every position the same ill-conditioned
# norm, so the errors add (8.7e-6 of 0.056; the sampled tolerance this replaced allowed 5.1e-6)
@example(rows=1, dim=2, length=3, tail="layernorm", act=Tanh(), b=1, seed=2)
def test_embedding_matches_torch_func(rows, dim, length, tail, act, b, seed) -> None:
    spec = _embed_spec(rows, dim, length, tail, act, 3)
    rng = np.random.default_rng(seed)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, b, rng)
    check_against_torch_func(spec, both(spec), b=b, seed=seed, params=params, x=x, y=y)


EMBED_MODEL = _embed_spec(7, 3, 5, "layernorm", Gelu(), 4)


def test_embedding_onnx_graphs_match_torch_func_and_opacus(exported, monkeypatch) -> None:
    spec = EMBED_MODEL
    engine = exported(spec)
    for b in (1, 9):
        rng = np.random.default_rng(b)
        params = _perturbed(spec, rng)
        x, y = _batch(spec, b, rng)
        check_against_torch_func(spec, (engine,), b=b, seed=b, params=params, x=x, y=y)
    check_opacus_step(spec, engine, monkeypatch)


def test_embedding_manifest_declares_integer_input_and_bad_ids_are_refused(tmp_path) -> None:
    import json

    from torch import nn

    from edge_sdk.model import Embedding

    spec = EMBED_MODEL
    assert spec.input_dtype == "int64" and ALL_MODELS["seq"].input_dtype == "float32"
    path = export_variant(spec, tmp_path)
    manifest = json.loads(path.read_text())
    assert manifest["input_dtype"] == "int64"
    engine = load_engine(path)
    params = init_params(spec, np.random.default_rng(0))
    y = np.zeros(2, dtype=np.int64)
    for eng in (engine, NumpyEngine(spec)):
        with pytest.raises(ValueError, match="reads integer ids.*dtype float32"):
            eng.clipped_grad_sum(params, np.zeros((2, 5), np.float32), y, 1.0)
        with pytest.raises(ValueError, match=r"ids must be in \[0, 7\).*got 0\.\.7"):
            eng.logits(params, np.array([[0, 1, 2, 3, 7]] * 2))
        assert eng.logits(params, np.array([[0, 1, 2, 3, 6]] * 2, dtype=np.int32)).shape == (2, 4)
    del manifest["input_dtype"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="input_dtype 'float32' does not match.*'int64'"):
        load_engine(path)
    module = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    got = spec_from_module(module, (3,), 2)
    assert got.layers[0] == Embedding(num_embeddings=10, embedding_dim=4)
    assert got.param_shapes()[0] == ("l0.weight", (10, 4))
    assert ModelSpec.from_dict(got.to_dict()) == got
    for bad in (nn.Embedding(10, 4, padding_idx=0), nn.Embedding(10, 4, max_norm=1.0),
                nn.Embedding(10, 4, scale_grad_by_freq=True)):
        with pytest.raises(UnsupportedLayer, match=r"layer 0 \(Embedding"):
            spec_from_module(nn.Sequential(bad), (3,), 2)
    with pytest.raises(UnsupportedLayer, match="must be the first layer"):
        ModelSpec(name="x", input_shape=(3,), num_classes=2, layers=(
            Linear(in_features=3, out_features=3),
            Embedding(num_embeddings=3, embedding_dim=2)))
    with pytest.raises(ValueError, match="embedding_dim must be an int >= 1"):
        Embedding(num_embeddings=3, embedding_dim=0)


class _Injected:
    """``engine`` with ``err`` added to one entry of every gradient it returns."""

    def __init__(self, engine, err: float) -> None:
        self.engine, self.err, self.spec = engine, err, engine.spec

    def logits(self, params, x):
        return self.engine.logits(params, x)

    def per_sample_grads(self, params, x, y):
        g = self.engine.per_sample_grads(params, x, y).copy()
        g[:, -1] += self.err
        return g

    def clipped_grad_sum(self, params, x, y, clip, masks=None) -> GradResult:
        res = self.engine.clipped_grad_sum(params, x, y, clip, masks=masks)
        last = res.clipped_sum[-1].copy()
        last.reshape(-1)[-1] += self.err
        return GradResult(res.norms, res.losses, [*res.clipped_sum[:-1], last])


def _tolerance_cases():
    norm = {kw["variant"]: kw for kw in (
        dict(variant="gn-vec", groups=3, per_group=2, size=2, b=1, seed=88),
        dict(variant="ln-vec", groups=1, per_group=2, size=2, b=3, seed=7))}
    cases = []
    for kw in norm.values():
        spec = _norm_spec(kw["variant"], kw["groups"], kw["per_group"], kw["size"], False,
                          Tanh(), 3)
        cases.append((spec, kw["b"], kw["seed"]))
    cases.append((_embed_spec(1, 2, 3, "layernorm", Tanh(), 3), 1, 2))
    cases.append((_act_spec(4, 5, 3, [Tanh()]), 4, 0))
    return cases


@pytest.mark.parametrize("case,rel", [(0, 1e-2), (1, 1e-3), (2, 1e-3), (3, 1e-3)])
def test_the_tolerance_still_catches_an_injected_error(case: int, rel: float) -> None:
    """The ill-conditioned points above (and a well-conditioned one) pass as they are and fail
    once one gradient entry is off by ``rel`` of the gradients' scale (max(1, max |g|)): the
    rounding bound allows for float32, not for a wrong formula. 1e-3, except at the GroupNorm
    of two-value groups (case 0, |g| <= 9.0), where float32 itself cannot do that well:
    torch.func in float32 errs there by 1.4e-3 (ours 3.0e-4, the bound 1.3e-2), so 1e-2."""
    spec, b, seed = _tolerance_cases()[case]
    rng = np.random.default_rng(seed)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, b, rng)
    engine = NumpyEngine(spec)
    check_against_torch_func(spec, (engine,), b=b, seed=seed, params=params, x=x, y=y)
    scale = max(1.0, float(np.abs(engine.per_sample_grads(params, x, y)).max()))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_against_torch_func(spec, (_Injected(engine, rel * scale),), b=b, seed=seed,
                                 params=params, x=x, y=y)


# --- 6. graphs: residual addition and channel concatenation ----------------------------------

def _res_spec(dims: int, stem: bool, c: int, groups: int, spatial: tuple[int, ...], k: int,
              act, classes: int) -> ModelSpec:
    """[stem conv ->] conv(k, same padding) -> GroupNorm -> act -> conv -> + skip -> act ->
    global average -> linear: a ResNet-style block (the skip from the stem, or from x)."""
    from edge_sdk.model import Add, Conv1d, Conv2d, GlobalAvgPool, GroupNorm

    conv = Conv2d if dims == 2 else Conv1d
    same = dict(kernel=k, padding=k // 2)
    layers: list = [conv(in_channels=c, out_channels=c, kernel=1)] if stem else []
    s0 = len(layers) - 1  # the skip's source: the stem, or the input (-1)
    layers += [conv(in_channels=c, out_channels=c, **same),
               GroupNorm(num_groups=groups, num_channels=c), act,
               conv(in_channels=c, out_channels=c, **same), Add(), act,
               GlobalAvgPool(dims=dims), Flatten(), Linear(in_features=c, out_features=classes)]
    inputs = [(i - 1,) for i in range(len(layers))]
    add = len(layers) - 5
    inputs[add] = (add - 1, s0)
    return ModelSpec(name="res", input_shape=(c, *spatial), num_classes=classes,
                     layers=tuple(layers), inputs=tuple(inputs))


def _cat_spec(dims: int, stem: bool, c: tuple[int, int, int], spatial: tuple[int, ...], act,
              classes: int) -> ModelSpec:
    """[stem ->] two branches (conv 1 | conv 3 same padding -> act) -> concat -> act ->
    flatten -> linear (the branches read the stem, or x)."""
    from edge_sdk.model import Concat, Conv1d, Conv2d

    conv = Conv2d if dims == 2 else Conv1d
    c0, c1, c2 = c
    layers: list = [conv(in_channels=c0, out_channels=c0, kernel=1), act] if stem else []
    src = len(layers) - 1
    a = len(layers)
    layers += [conv(in_channels=c0, out_channels=c1, kernel=1),
               conv(in_channels=c0, out_channels=c2, kernel=3, padding=1), act, Concat(), act,
               Flatten(),
               Linear(in_features=(c1 + c2) * int(np.prod(spatial)), out_features=classes)]
    inputs = [(i - 1,) for i in range(len(layers))]
    inputs[a], inputs[a + 1], inputs[a + 3] = (src,), (src,), (a, a + 2)
    return ModelSpec(name="cat", input_shape=(c0, *spatial), num_classes=classes,
                     layers=tuple(layers), inputs=tuple(inputs))


@HYPO
@given(dims=st.sampled_from([1, 2]), stem=st.booleans(), groups=st.integers(1, 2),
       per_group=st.integers(1, 2), spatial=st.tuples(st.integers(2, 5), st.integers(2, 5)),
       k=st.sampled_from([1, 3]), act=ACTS, b=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_residual_block_matches_torch_func(dims, stem, groups, per_group, spatial, k, act, b,
                                           seed) -> None:
    spec = _res_spec(dims, stem, groups * per_group, groups, spatial[:dims], k, act, 3)
    rng = np.random.default_rng(seed)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, b, rng)
    check_against_torch_func(spec, both(spec), b=b, seed=seed, params=params, x=x, y=y)


@HYPO
@given(dims=st.sampled_from([1, 2]), stem=st.booleans(),
       c=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       spatial=st.tuples(st.integers(1, 4), st.integers(1, 4)), act=ACTS, b=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_concat_of_two_branches_matches_torch_func(dims, stem, c, spatial, act, b, seed) -> None:
    spec = _cat_spec(dims, stem, c, spatial[:dims], act, 3)
    check_against_torch_func(spec, both(spec), b=b, seed=seed)


GRAPH_MODELS = {"residual": _res_spec(2, True, 4, 2, (5, 4), 3, Tanh(), 3),
                "concat": _cat_spec(1, True, (2, 3, 2), (6,), Gelu(), 3)}


@pytest.mark.parametrize("which", sorted(GRAPH_MODELS))
def test_graph_onnx_graphs_match_torch_func_and_opacus(exported, which: str,
                                                       monkeypatch) -> None:
    spec = GRAPH_MODELS[which]
    engine = exported(spec)
    for b in (1, 9):
        rng = np.random.default_rng(b)
        params = _perturbed(spec, rng)
        x, y = _batch(spec, b, rng)
        check_against_torch_func(spec, (engine,), b=b, seed=b, params=params, x=x, y=y)
    check_opacus_step(spec, engine, monkeypatch)


def test_graph_specs_round_trip_and_bad_graphs_are_named() -> None:
    from edge_sdk.model import Add, Concat

    spec = GRAPH_MODELS["residual"]
    d = spec.to_dict()
    assert [e.get("inputs") for e in d["layers"]].count(None) == len(spec.layers) - 1
    assert d["layers"][5]["inputs"] == ["l4", "l0"]
    assert ModelSpec.from_dict(d) == spec
    chain = ModelSpec(name="c", input_shape=(3,), num_classes=2,
                      layers=(Linear(in_features=3, out_features=2),), inputs=((-1,),))
    assert chain.inputs is None and "inputs" not in str(chain.to_dict())
    lin = Linear(in_features=3, out_features=3)
    out = Linear(in_features=3, out_features=2)
    with pytest.raises(ValueError, match=r"layer 1 \(add\) adds inputs of different shapes"):
        ModelSpec(name="g", input_shape=(3,), num_classes=2,
                  layers=(Linear(in_features=3, out_features=4), Add(), out),
                  inputs=((-1,), (0, -1), (1,)))
    with pytest.raises(ValueError, match=r"layer 1 \(concat\) reads \[0\], expected two"):
        ModelSpec(name="g", input_shape=(3,), num_classes=2, layers=(lin, Concat(), out),
                  inputs=((-1,), (0,), (1,)))
    with pytest.raises(ValueError, match=r"inputs must be earlier nodes"):
        ModelSpec(name="g", input_shape=(3,), num_classes=2, layers=(lin, lin, out),
                  inputs=((-1,), (2,), (1,)))
    with pytest.raises(ValueError, match=r"nodes \['l0'\] are never read"):
        ModelSpec(name="g", input_shape=(3,), num_classes=2, layers=(lin, lin, out),
                  inputs=((-1,), (-1,), (1,)))
    with pytest.raises(ValueError, match="'y1' is not a node name"):
        ModelSpec.from_dict({**d, "layers": [{**d["layers"][0], "inputs": ["y1"]},
                                             *d["layers"][1:]]})


# --- 7. plain (unclipped) gradient graphs for the device-level mode --------------------------

def _autograd_sum(spec: ModelSpec, params, x, y) -> np.ndarray:
    """torch autograd of the batch's summed loss, in float64: the reference plain sum."""
    module = build_module(spec, params).to(torch.float64)
    ids = np.issubdtype(np.asarray(x).dtype, np.integer)
    xt = torch.tensor(x) if ids else torch.tensor(x, dtype=torch.float64)
    torch.nn.functional.cross_entropy(module(xt), torch.tensor(y), reduction="sum").backward()
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).numpy()


def check_plain_sum(spec: ModelSpec, engines, *, b: int, seed: int) -> None:
    """Each engine's plain summed gradient and losses equal torch autograd of the batch loss
    (float32 tolerance: the samples' rounding bounds added, see check_against_torch_func)."""
    rng = np.random.default_rng(seed)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, b, rng)
    ref = _autograd_sum(spec, params, x, y)
    bound = _rounding_bound(spec, params, x, y).sum(axis=0).max()
    tol = max((1e-5 * float(np.abs(ref).max()) + 2e-6) * max(1, b / 8), float(bound))
    losses = torch.nn.functional.cross_entropy(
        build_module(spec, params)(torch.tensor(x)), torch.tensor(y), reduction="none")
    for engine in engines:
        res = engine.grad_sum(params, x, y)
        assert [g.shape for g in res.grad_sum] == [s for _, s in spec.param_shapes()]
        np.testing.assert_allclose(np.concatenate([g.ravel() for g in res.grad_sum]), ref,
                                   rtol=0, atol=tol)
        np.testing.assert_allclose(res.losses, losses.detach().numpy(), rtol=1e-5, atol=1e-6)


class TorchPlainGraph:
    """The plain graph module run eagerly, with the engine's contract."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def grad_sum(self, params, x, y):
        from edge_sdk.engine import SumResult

        with torch.no_grad():
            out = PerSampleGrad(self.spec, plain=True)(
                *(torch.tensor(p) for p in params), torch.tensor(x), torch.tensor(y))
        return SumResult(out[0].numpy(), [g.numpy() for g in out[1:]])


def _plain_models() -> dict[str, ModelSpec]:
    from edge_sdk.model import Conv1d, Conv2d, Relu

    dilated = {}  # the plain graph's conv-of-the-batch weight gradient: padding and dilation
    for conv, shape, width in ((Conv2d, (2, 7, 6), 2 * 7 * 6), (Conv1d, (2, 9), 2 * 9)):
        dilated[conv.__name__] = ModelSpec(name="dil", input_shape=shape, num_classes=3, layers=(
            conv(in_channels=2, out_channels=3, kernel=1), Relu(),
            conv(in_channels=3, out_channels=2, kernel=3, padding=2, dilation=2), Relu(),
            Flatten(), Linear(in_features=width, out_features=3)))
    return {**GRAPH_MODELS, "embed": EMBED_MODEL, "ds-cnn": DS_MODELS["dscnn2d"], **dilated,
            **{f"all-{k}": v for k, v in ALL_MODELS.items()}}


@pytest.mark.parametrize("which", sorted(_plain_models()))
def test_plain_grad_sum_equals_torch_autograd(which: str) -> None:
    spec = _plain_models()[which]
    for b in (1, 7):
        check_plain_sum(spec, (TorchPlainGraph(spec), NumpyEngine(spec)), b=b, seed=b)


def test_plain_graph_is_exported_beside_and_used_for_unclipped_steps(tmp_path) -> None:
    """The exported plain graph equals torch autograd; the manifest records it; a step
    without per-sample clipping (clip = inf) goes through it, and a manifest without one
    (every model exported before it) gets the same sum from the per-sample graph."""
    import json

    spec = GRAPH_MODELS["residual"]
    path = export_variant(spec, tmp_path, plain=True)
    manifest = json.loads(path.read_text())
    assert manifest["plain_grad_graph"] == "res-4x5x4-3.plaingrad.onnx"
    engine = load_engine(path)
    check_plain_sum(spec, (engine,), b=9, seed=4)

    rng = np.random.default_rng(5)
    params = _perturbed(spec, rng)
    x, y = _batch(spec, 6, rng)
    calls = []
    plain_run = engine._plain().run
    engine._plain = lambda: type("S", (), {"run": lambda s, *a: calls.append(1) or plain_run(*a)})()
    theta = [p.copy() for p in params]
    dp_sgd_step(engine, theta, x, y, clip=np.inf, noise=None, lr=0.1, denom=6)
    assert calls == [1]
    del manifest["plain_grad_graph"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(manifest))
    fallback = load_engine(older)
    theta2 = [p.copy() for p in params]
    dp_sgd_step(fallback, theta2, x, y, clip=np.inf, noise=None, lr=0.1, denom=6)
    for a, b2 in zip(theta, theta2, strict=True):
        np.testing.assert_allclose(a, b2, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="a plain gradient graph has no masks"):
        PerSampleGrad(spec, plain=True, masked=True)
