"""Per-sample gradients and predictions on the device: onnxruntime, with a numpy fallback.

An exported model is a manifest (JSON: the :class:`~edge_sdk.model.ModelSpec`, parameter
names and shapes) beside two ONNX graphs whose inputs are the weights:

* the gradient graph ``(*params, x, y, clip) -> (norms, losses, *clipped_grad_sums)``;
* the inference graph ``(*params, x) -> logits``;
* the masked gradient graph ``(*params, *masks, x, y, clip) -> (...)``: the same, restricted
  to the coordinates where the 0/1 masks are 1 (norms, clipping and sums over those only),
  for rand-k sparsified training (Fed-SPA);
* optionally the plain gradient graph ``(*params, x, y) -> (losses, *grad_sums)``: the
  batch's unclipped summed gradient (device-level mode; without it ``grad_sum`` uses the
  per-sample graph with clip = inf).

A manifest may record each graph's sha256 (``graph_sha256``, written by ``fedge export
--module``); :func:`load_manifest` then refuses a graph file that does not match, so a
device never runs a graph other than the one its spec was exported with.

:class:`NumpyEngine` computes the same formulas in numpy from the spec alone. It is the
torch-free reference and the fallback when onnxruntime is unavailable, and it can also
return the full [B, d] per-sample gradients. Both engines clip with the factor
``min(1, C / max(norm, tiny))``: zero gradients stay zero, ``C = inf`` disables clipping.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_sdk.model import (
    ACTIVATIONS,
    Add,
    AvgPool1d,
    AvgPool2d,
    Concat,
    Conv1d,
    Conv2d,
    Embedding,
    Flatten,
    Gelu,
    GlobalAvgPool,
    GroupNorm,
    Hardswish,
    LayerNorm,
    LeakyRelu,
    Linear,
    MaxPool1d,
    MaxPool2d,
    ModelSpec,
    Relu,
    Sigmoid,
    Tanh,
    conv_geometry,
    pool_geometry,
)

__all__ = [
    "Engine",
    "GradResult",
    "Manifest",
    "NumpyEngine",
    "OnnxEngine",
    "SumResult",
    "load_engine",
    "load_manifest",
]

_TINY = np.finfo(np.float32).tiny


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What the device knows about an exported model."""

    name: str
    spec: ModelSpec
    grad_graph: Path
    infer_graph: Path
    masked_grad_graph: Path | None = None
    plain_grad_graph: Path | None = None


def load_manifest(path: str | Path) -> Manifest:
    """Read a manifest written by ``fedge export``; checks it against its own spec."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        spec = ModelSpec.from_dict(data["spec"])
        listed = [(p["name"], tuple(p["shape"])) for p in data["params"]]
        grad_graph, infer_graph = data["grad_graph"], data["infer_graph"]
        masked = data.get("masked_grad_graph")
        plain = data.get("plain_grad_graph")
        declared = data.get("input_dtype", "float32")  # absent in float models' manifests
        digests = data.get("graph_sha256", {})  # absent in the zoo's manifests
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a valid fedge model manifest ({exc})") from exc
    if listed != spec.param_shapes():
        raise ValueError(f"{path}: parameter list {listed} does not match the spec's")
    if declared != spec.input_dtype:
        # the graphs' x input has the declared dtype; a spec that disagrees cannot feed it
        raise ValueError(f"{path}: input_dtype {declared!r} does not match the spec's "
                         f"{spec.input_dtype!r} (an Embedding first reads int64 ids)")
    for key, want in dict(digests).items():
        if key not in data:
            raise ValueError(f"{path}: graph_sha256 names {key!r}, which the manifest lacks")
        graph = path.parent / data[key]
        try:
            got = hashlib.sha256(graph.read_bytes()).hexdigest()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read {graph.name} ({exc})") from exc
        if got != want:
            # the graph would compute something other than the spec this manifest declares
            raise ValueError(f"{path}: {graph.name} has sha256 {got}, but the manifest "
                             f"records {want} for it: refusing a graph that does not match "
                             "its manifest (re-export the model)")
    return Manifest(
        name=str(data["name"]),
        spec=spec,
        grad_graph=path.parent / grad_graph,
        infer_graph=path.parent / infer_graph,
        masked_grad_graph=None if masked is None else path.parent / masked,
        plain_grad_graph=None if plain is None else path.parent / plain,
    )


@dataclass(frozen=True, slots=True)
class GradResult:
    """One batch: per-sample norms [B] (before clipping), per-sample losses [B], and the
    sum over the batch of the clipped per-sample gradients (one array per parameter)."""

    norms: np.ndarray
    losses: np.ndarray
    clipped_sum: list[np.ndarray]


@dataclass(frozen=True, slots=True)
class SumResult:
    """One batch without clipping: per-sample losses [B] and the batch's summed gradient
    (one array per parameter), for the device-level mode (the whole update is clipped)."""

    losses: np.ndarray
    grad_sum: list[np.ndarray]


class Engine(Protocol):
    spec: ModelSpec

    def grad_sum(self, params: Sequence[np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> SumResult: ...

    def clipped_grad_sum(
        self,
        params: Sequence[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        clip: float,
        masks: Sequence[np.ndarray] | None = None,
    ) -> GradResult: ...

    def logits(self, params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray: ...


def _inputs(spec: ModelSpec, x: Any) -> np.ndarray:
    """``x`` as the graph's input dtype: float32, or int64 ids for a model that starts with
    an Embedding (integer arrays only, each id in [0, num_embeddings))."""
    if spec.input_dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"model {spec.name!r} reads integer ids (its first layer is an "
                         f"Embedding); x has dtype {x.dtype}, expected an integer dtype")
    rows = spec.layers[0].num_embeddings
    if x.size and (x.min() < 0 or x.max() >= rows):
        raise ValueError(f"ids must be in [0, {rows}) (the Embedding's num_embeddings), "
                         f"got {x.min()}..{x.max()}")
    return np.ascontiguousarray(x, dtype=np.int64)


def _check_batch(spec: ModelSpec, x: np.ndarray, y: np.ndarray | None = None) -> None:
    if x.ndim < 1 or tuple(x.shape[1:]) != spec.input_shape:
        want = ", ".join(map(str, spec.input_shape))
        raise ValueError(f"x has shape {x.shape}, expected (B, {want})")
    if x.shape[0] == 0:
        raise ValueError("empty batch: B must be >= 1")
    if y is not None:
        if y.shape != (x.shape[0],):
            raise ValueError(f"y has shape {y.shape}, expected ({x.shape[0]},)")
        if y.size and (y.min() < 0 or y.max() >= spec.num_classes):
            raise ValueError(f"labels must be in [0, {spec.num_classes}), got {y.min()}..{y.max()}")


def _check_params(spec: ModelSpec, params: Sequence[np.ndarray]) -> list[np.ndarray]:
    shapes = spec.param_shapes()
    if len(params) != len(shapes):
        raise ValueError(f"got {len(params)} parameter arrays, expected {len(shapes)}")
    out = []
    for p, (name, shape) in zip(params, shapes, strict=True):
        if tuple(p.shape) != shape:
            raise ValueError(f"parameter {name} has shape {tuple(p.shape)}, expected {shape}")
        out.append(np.ascontiguousarray(p, dtype=np.float32))
    return out


class OnnxEngine:
    """onnxruntime sessions for one exported model.

    Args:
        manifest: the model's manifest (see :func:`load_manifest`).
        threads: intra-op threads. Default 1: a device shares its cores with its real job,
            and spinning threads would burn them; with more than 1, spinning is turned off.
            Kept as ``threads``: :func:`edge_sdk.train.dp_sgd_step` draws a step's noise on
            a second thread while the graph runs only when it is >= 2.
    """

    def __init__(self, manifest: Manifest, *, threads: int = 1) -> None:
        import onnxruntime as ort  # adapter-only import: keeps edge_sdk importable without it

        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads!r}")
        self.spec = manifest.spec
        self.threads = threads
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Memory patterns pre-plan one block per input shape; Poisson batches change shape
        # every step, so the plan only adds a resident block (CNN b64: 104 -> 89 MiB peak,
        # same speed, measured with the bench's child).
        opts.enable_mem_pattern = False
        if threads > 1:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]

        def session(path: object) -> Callable[[], Any]:
            # Built on first use: each session holds its own arena, and a device that only
            # trains never needs the inference or masked graphs in memory (Pi-class RSS).
            made: list[Any] = []

            def get() -> Any:
                if not made:
                    made.append(ort.InferenceSession(str(path), opts, providers=providers))
                return made[0]

            return get

        self._grad = session(manifest.grad_graph)
        self._infer = session(manifest.infer_graph)
        self._masked = (None if manifest.masked_grad_graph is None
                        else session(manifest.masked_grad_graph))
        self._plain = (None if manifest.plain_grad_graph is None
                       else session(manifest.plain_grad_graph))
        self._grad()  # fail early on a missing or broken per-sample-gradient graph
        self._names = [n for n, _ in self.spec.param_shapes()]

    def clipped_grad_sum(
        self,
        params: Sequence[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        clip: float,
        masks: Sequence[np.ndarray] | None = None,
    ) -> GradResult:
        """Per-sample norms, losses and the clipped gradient sum of a batch.

        Args:
            params: weights in graph order (``spec.param_shapes()``).
            x: inputs [B, *input_shape]; y: int labels [B].
            clip: L2 clip bound C per sample (``inf`` for none).
            masks: optional 0/1 float arrays shaped like ``params``: norms, clipping and
                sums then cover only the coordinates where the mask is 1.
        """
        x = _inputs(self.spec, x)
        y = np.ascontiguousarray(y, dtype=np.int64)
        _check_batch(self.spec, x, y)
        feeds = dict(zip(self._names, _check_params(self.spec, params), strict=True))
        feeds.update(x=x, y=y, clip=np.asarray(clip, dtype=np.float32))
        session = self._grad()
        if masks is not None:
            if self._masked is None:
                raise ValueError("this model was exported without a masked gradient graph; "
                                 "re-run `fedge export`")
            checked = _check_params(self.spec, masks)
            feeds.update({f"mask.{n}": m for n, m in zip(self._names, checked, strict=True)})
            session = self._masked()
        out = session.run(None, feeds)
        return GradResult(out[0], out[1], list(out[2:]))

    def grad_sum(self, params: Sequence[np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> SumResult:
        """Per-sample losses and the batch's summed gradient, unclipped (plain SGD, for the
        device-level mode), from the plain gradient graph: no per-sample norms or
        gradients. A model exported without one (older manifests) gets the same sum from
        the per-sample graph with ``clip = inf`` (clip factor 1 for every sample)."""
        if self._plain is None:
            res = self.clipped_grad_sum(params, x, y, math.inf)
            return SumResult(res.losses, res.clipped_sum)
        x = _inputs(self.spec, x)
        y = np.ascontiguousarray(y, dtype=np.int64)
        _check_batch(self.spec, x, y)
        feeds = dict(zip(self._names, _check_params(self.spec, params), strict=True))
        feeds.update(x=x, y=y)
        out = self._plain().run(None, feeds)
        return SumResult(out[0], list(out[1:]))

    def logits(self, params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
        """Logits [B, num_classes] of a batch."""
        x = _inputs(self.spec, x)
        _check_batch(self.spec, x)
        feeds = dict(zip(self._names, _check_params(self.spec, params), strict=True))
        feeds["x"] = x
        return self._infer().run(None, feeds)[0]


def _erf(x: np.ndarray) -> np.ndarray:
    """Element-wise erf, computed by ``math.erf`` in float64 (numpy has none, and scipy is
    not a device dependency); float32 out."""
    return _ERF(x.astype(np.float64)).astype(np.float32)


_ERF = np.frompyfunc(math.erf, 1, 1)


def _activation(layer: Any, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(f(h), f'(h)) of an element-wise activation other than Relu, the formulas of
    ``models.persample.activation`` (torch's, including its choices at the kinks)."""
    if isinstance(layer, Tanh):
        t = np.tanh(h)
        return t, 1.0 - t * t
    if isinstance(layer, Sigmoid):
        s = 0.5 * (1.0 + np.tanh(0.5 * h))  # overflow-free logistic
        return s, s * (1.0 - s)
    if isinstance(layer, Gelu):
        if layer.approximate == "tanh":
            k = np.float32(math.sqrt(2.0 / math.pi))
            c = np.float32(0.044715)
            t = np.tanh(k * (h + c * h * h * h))
            deriv = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * k * (1.0 + 3 * c * h * h)
            return 0.5 * h * (1.0 + t), deriv
        cdf = 0.5 * (1.0 + _erf(h * np.float32(1.0 / math.sqrt(2.0))))
        pdf = np.exp(-0.5 * h * h) * np.float32(1.0 / math.sqrt(2.0 * math.pi))
        return h * cdf, cdf + h * pdf
    if isinstance(layer, LeakyRelu):
        pos = h > 0
        slope = np.float32(layer.negative_slope)
        return np.where(pos, h, h * slope), np.where(pos, np.float32(1.0), slope)
    if isinstance(layer, Hardswish):
        deriv = np.where(h <= -3.0, 0.0, np.where(h < 3.0, h / 3.0 + 0.5, 1.0))
        return h * np.clip(h + 3.0, 0.0, 6.0) / 6.0, deriv.astype(np.float32)
    raise TypeError(f"not an activation: {layer!r}")


def _im2col(x: np.ndarray, k: int) -> np.ndarray:
    b, c, h, w = x.shape
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))  # B,C,Ho,Wo,k,k
    return win.transpose(0, 1, 4, 5, 2, 3).reshape(b, c * k * k, (h - k + 1) * (w - k + 1))


def _plain(layer: Any) -> bool:
    """A stride-1, unpadded, undilated Conv2d: the zoo's conv, with its own (older) code."""
    return (isinstance(layer, Conv2d) and layer.stride == 1 and layer.padding == 0
            and layer.dilation == 1 and layer.groups == 1)


def _conv_cols(x: np.ndarray, layer: Conv2d | Conv1d) -> np.ndarray:
    """im2col of a conv seen as 2-D, x [B, C, H, W] (Conv1d: H = 1) -> [B, C*kh*kw, Ho*Wo]."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv_geometry(layer)
    if ph or pw:
        x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    b, c = x.shape[:2]
    span = (dh * (kh - 1) + 1, dw * (kw - 1) + 1)
    win = np.lib.stride_tricks.sliding_window_view(x, span, axis=(2, 3))
    win = win[:, :, ::sh, ::sw, ::dh, ::dw]  # B, C, Ho, Wo, kh, kw
    ho, wo = win.shape[2], win.shape[3]
    return win.transpose(0, 1, 4, 5, 2, 3).reshape(b, c * kh * kw, ho * wo)


def _grouped(a: np.ndarray, groups: int) -> np.ndarray:
    """[B, R, N] -> [B, G, R/G, N]: rows split into the channel groups' blocks."""
    return a.reshape(a.shape[0], groups, -1, a.shape[2])


def _conv_apply(w: np.ndarray, cols: np.ndarray, groups: int) -> np.ndarray:
    """Conv output [B, out, Ho*Wo] from columns [B, C*kh*kw, Ho*Wo], one MatMul per group."""
    wg = w.reshape(groups, w.shape[0] // groups, -1)
    return np.matmul(wg, _grouped(cols, groups)).reshape(cols.shape[0], w.shape[0], -1)


def _conv_weight_grad(dflat: np.ndarray, cols: np.ndarray, groups: int) -> np.ndarray:
    """Per-sample weight gradients [B, out, (C/G)*kh*kw]: a group sees only its channels."""
    gw = np.matmul(_grouped(dflat, groups), _grouped(cols, groups).transpose(0, 1, 3, 2))
    return gw.reshape(dflat.shape[0], dflat.shape[1], -1)


def _conv_cols_grad(w: np.ndarray, dflat: np.ndarray, groups: int) -> np.ndarray:
    """Gradient w.r.t. the columns [B, C*kh*kw, Ho*Wo] (then col2im gives the input's)."""
    wg = w.reshape(groups, w.shape[0] // groups, -1).transpose(0, 2, 1)
    return np.matmul(wg, _grouped(dflat, groups)).reshape(dflat.shape[0], -1, dflat.shape[2])


def _conv_col2im(dcols: np.ndarray, in_shape: tuple[int, ...], layer: Conv2d | Conv1d,
                 out_hw: tuple[int, int]) -> np.ndarray:
    """Adjoint of :func:`_conv_cols`: [B, C*kh*kw, Ho*Wo] -> input gradient [B, C, H, W]."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv_geometry(layer)
    b, c, h, w = in_shape
    ho, wo = out_hw
    blocks = dcols.reshape(b, c, kh, kw, ho, wo)
    out = np.zeros((b, c, h + 2 * ph, w + 2 * pw), dtype=dcols.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh,
                j * dw : j * dw + (wo - 1) * sw + 1 : sw] += blocks[:, :, i, j]
    return out[:, :, ph : ph + h, pw : pw + w]


def _avg_pool(h: np.ndarray, layer: AvgPool2d | AvgPool1d) -> np.ndarray:
    (kh, kw), (sh, sw) = pool_geometry(layer)
    h4 = h[:, :, None, :] if isinstance(layer, AvgPool1d) else h
    win = np.lib.stride_tricks.sliding_window_view(h4, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]
    out = win.mean(axis=(4, 5), dtype=np.float32)
    return out[:, :, 0, :] if isinstance(layer, AvgPool1d) else out


def _avg_unpool(d: np.ndarray, layer: AvgPool2d | AvgPool1d,
                in_shape: tuple[int, ...]) -> np.ndarray:
    """Input gradient [B, *in_shape]: each window's gradient spread evenly over its inputs."""
    (kh, kw), (sh, sw) = pool_geometry(layer)
    d4 = d[:, :, None, :] if isinstance(layer, AvgPool1d) else d
    b, c, ho, wo = d4.shape
    h, w = (1, in_shape[1]) if isinstance(layer, AvgPool1d) else in_shape[1:]
    share = d4 * np.float32(1.0 / (kh * kw))
    out = np.zeros((b, c, h, w), dtype=d.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw] += share
    return out[:, :, 0, :] if isinstance(layer, AvgPool1d) else out


def _norm_forward(h: np.ndarray, w: np.ndarray, b: np.ndarray,
                  layer: LayerNorm | GroupNorm) -> tuple[np.ndarray, tuple]:
    """Output of a LayerNorm/GroupNorm (statistics per sample) and its backward cache."""
    in_shape = h.shape[1:]
    if isinstance(layer, LayerNorm):
        group = math.prod(layer.normalized_shape)
        bshape: tuple[int, ...] = layer.normalized_shape
        axes = tuple(range(1, 1 + len(in_shape) - len(bshape)))
    else:
        group = math.prod(in_shape) // layer.num_groups
        bshape = (layer.num_channels, *([1] * (len(in_shape) - 1)))
        axes = tuple(range(2, 1 + len(in_shape)))
    hg = h.reshape(h.shape[0], -1, group)
    xc = hg - hg.mean(axis=2, keepdims=True, dtype=np.float32)
    var = (xc * xc).mean(axis=2, keepdims=True, dtype=np.float32)
    rstd = (1.0 / np.sqrt(var + np.float32(layer.eps))).astype(np.float32)
    xhat = (xc * rstd).reshape(h.shape)
    out = xhat * w.reshape(bshape) + b.reshape(bshape)
    return out, (xhat, rstd, w.reshape(bshape), group, axes)


def _norm_backward(d: np.ndarray, cache: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (weight, bias) gradients [B, *param shape] of a LayerNorm/GroupNorm."""
    xhat, _, _, _, axes = cache
    gw, gb = d * xhat, d
    if axes:
        gw, gb = gw.sum(axis=axes), gb.sum(axis=axes)
    return gw, gb


def _norm_input_grad(d: np.ndarray, cache: tuple) -> np.ndarray:
    xhat, rstd, w, group, _ = cache
    g = (d * w).reshape(d.shape[0], -1, group)
    xg = xhat.reshape(g.shape)
    dx = rstd * (g - g.mean(axis=2, keepdims=True)
                 - xg * (g * xg).mean(axis=2, keepdims=True))
    return dx.reshape(d.shape)


def _pool(h: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    parts = [h[:, :, 0::2, 0::2], h[:, :, 0::2, 1::2], h[:, :, 1::2, 0::2], h[:, :, 1::2, 1::2]]
    m = np.maximum(np.maximum(parts[0], parts[1]), np.maximum(parts[2], parts[3]))
    masks, taken = [], np.zeros(m.shape, dtype=bool)
    for part in parts:  # first maximum in scan order wins, as in torch
        hit = (part == m) & ~taken
        masks.append(hit)
        taken |= hit
    return m, masks


def _unpool(g: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
    b, c, ho, wo = g.shape
    out = np.zeros((b, c, 2 * ho, 2 * wo), dtype=g.dtype)
    for mask, (i, j) in zip(masks, ((0, 0), (0, 1), (1, 0), (1, 1)), strict=True):
        out[:, :, i::2, j::2] = g * mask
    return out


def _pair_pool(layer: Any, h: np.ndarray) -> bool:
    """The zoo's 2x2 stride-2 max pool on even sizes, with its own (older) code."""
    return (isinstance(layer, MaxPool2d) and layer.kernel == 2 and layer.stride == 2
            and h.shape[2] % 2 == 0 and h.shape[3] % 2 == 0)


def _max_pool(h: np.ndarray, layer: MaxPool2d | MaxPool1d) -> tuple[np.ndarray, tuple]:
    """Max pool of any kernel and stride (no padding, floor mode) and its backward cache:
    one winner mask per window element, the first maximum in scan order (torch's ties)."""
    (kh, kw), (sh, sw) = pool_geometry(layer)
    h4 = h[:, :, None, :] if isinstance(layer, MaxPool1d) else h
    hi, wi = h4.shape[2], h4.shape[3]
    ho, wo = (hi - kh) // sh + 1, (wi - kw) // sw + 1
    parts = [h4[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw]
             for i in range(kh) for j in range(kw)]
    m = np.maximum.reduce(parts)
    masks, taken = [], np.zeros(m.shape, dtype=bool)
    for part in parts:
        hit = (part == m) & ~taken
        masks.append(hit)
        taken |= hit
    out = m[:, :, 0, :] if isinstance(layer, MaxPool1d) else m
    return out, (masks, h.shape)


def _max_unpool(d: np.ndarray, cache: tuple, layer: MaxPool2d | MaxPool1d) -> np.ndarray:
    """Input gradient of :func:`_max_pool`: overlapping windows add at shared inputs."""
    masks, in_shape = cache
    (kh, kw), (sh, sw) = pool_geometry(layer)
    d4 = d[:, :, None, :] if isinstance(layer, MaxPool1d) else d
    b, c, ho, wo = d4.shape
    hi, wi = (1, in_shape[2]) if isinstance(layer, MaxPool1d) else in_shape[2:]
    out = np.zeros((b, c, hi, wi), dtype=d.dtype)
    for mask, (i, j) in zip(masks, [(i, j) for i in range(kh) for j in range(kw)], strict=True):
        out[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw] += d4 * mask
    return out.reshape(in_shape)


def _upstream(spec: ModelSpec) -> dict[int, bool]:
    """Node -> whether it or a node it depends on has parameters (-1, the input: never): a
    gradient is only carried back to nodes marked True."""
    up: dict[int, bool] = {-1: False}
    for i, layer in enumerate(spec.layers):
        own = isinstance(layer, Linear | Conv2d | Conv1d | LayerNorm | GroupNorm | Embedding)
        up[i] = own or any(up[j] for j in spec.node_inputs(i))
    return up


def _send(pending: dict[int, np.ndarray], up: dict[int, bool], j: int, d: np.ndarray) -> None:
    """Carry the gradient ``d`` back to node ``j`` (added to what other readers sent)."""
    if up[j]:
        pending[j] = pending[j] + d if j in pending else d


class NumpyEngine:
    """The same per-sample formulas in numpy: torch-free reference and fallback."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def _forward(self, params: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, list]:
        cache: list = []
        outs: list[np.ndarray] = []
        pi = 0
        for i, layer in enumerate(self.spec.layers):
            srcs = self.spec.node_inputs(i)
            h = x if srcs[0] < 0 else outs[srcs[0]]
            if isinstance(layer, Add):
                cache.append(None)
                for j in srcs[1:]:
                    h = h + (x if j < 0 else outs[j])
            elif isinstance(layer, Concat):
                parts = [x if j < 0 else outs[j] for j in srcs]
                cache.append([p.shape[1] for p in parts])
                h = np.concatenate(parts, axis=1)
            elif isinstance(layer, Embedding):
                cache.append((h, pi))
                h = params[pi][h]
                pi += 1
            elif isinstance(layer, Linear):
                cache.append((h, pi))
                h = h @ params[pi].T + params[pi + 1]
                pi += 2
            elif _plain(layer):
                k, b = layer.kernel, h.shape[0]
                ho, wo = h.shape[2] - k + 1, h.shape[3] - k + 1
                cols = _im2col(h, k)
                cache.append((cols, pi, h.shape))
                out = np.matmul(params[pi].reshape(layer.out_channels, -1), cols)
                h = (out + params[pi + 1][:, None]).reshape(b, layer.out_channels, ho, wo)
                pi += 2
            elif isinstance(layer, Conv2d | Conv1d):
                h4 = h if isinstance(layer, Conv2d) else h[:, :, None, :]
                cols = _conv_cols(h4, layer)
                cache.append((cols, pi, h4.shape, layer))
                if layer.groups == 1:
                    out = np.matmul(params[pi].reshape(layer.out_channels, -1), cols)
                else:
                    out = _conv_apply(params[pi], cols, layer.groups)
                out = out + params[pi + 1][:, None]
                (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv_geometry(layer)
                ho = (h4.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
                wo = (h4.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
                shape = (ho, wo) if isinstance(layer, Conv2d) else (wo,)
                h = out.reshape(h.shape[0], layer.out_channels, *shape)
                pi += 2
            elif _pair_pool(layer, h):
                h, masks = _pool(h)
                cache.append(masks)
            elif isinstance(layer, MaxPool2d | MaxPool1d):
                h, saved_pool = _max_pool(h, layer)
                cache.append(saved_pool)
            elif isinstance(layer, LayerNorm | GroupNorm):
                h, saved = _norm_forward(h, params[pi], params[pi + 1], layer)
                cache.append((saved, pi))
                pi += 2
            elif isinstance(layer, AvgPool2d | AvgPool1d):
                cache.append(h.shape[1:])
                h = _avg_pool(h, layer)
            elif isinstance(layer, GlobalAvgPool):
                cache.append(h.shape[1:])
                h = h.mean(axis=tuple(range(2, 2 + layer.dims)), keepdims=True, dtype=np.float32)
            elif isinstance(layer, Relu):
                cache.append(h > 0)
                h = np.maximum(h, 0)
            elif isinstance(layer, ACTIVATIONS):
                h, deriv = _activation(layer, h)
                h = h.astype(np.float32, copy=False)
                cache.append(deriv.astype(np.float32, copy=False))
            elif isinstance(layer, Flatten):
                cache.append(h.shape)
                h = h.reshape(h.shape[0], -1)
            outs.append(h)
        return h, cache

    def _backward(self, params: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                  masks: list[np.ndarray] | None = None, plain: bool = False):
        """Per-layer per-sample pieces, per-sample squared norms (over the masked
        coordinates when ``masks`` is given) and losses. ``plain``: each layer's piece is
        ("sum", [its parameters' gradients summed over the batch]), formed without the
        per-sample tensors, and no norms are computed (``sq`` stays 0)."""
        logits, cache = self._forward(params, x)
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        rows = np.arange(len(y))
        losses = -logp[rows, y]
        d = np.exp(logp)
        d[rows, y] -= 1.0
        sq = np.zeros(len(y), dtype=np.float64)
        pieces: dict[int, tuple] = {}
        up = _upstream(self.spec)
        last = len(self.spec.layers) - 1
        pending: dict[int, np.ndarray] = {last: d}
        for i in range(last, -1, -1):
            if i not in pending:  # nothing upstream of this node has parameters
                continue
            layer, c, d = self.spec.layers[i], cache[i], pending.pop(i)
            srcs = self.spec.node_inputs(i)
            if isinstance(layer, Add):
                for j in srcs:
                    _send(pending, up, j, d)
                continue
            if isinstance(layer, Concat):
                bounds = np.cumsum(c)[:-1]
                for j, part in zip(srcs, np.split(d, bounds, axis=1), strict=True):
                    _send(pending, up, j, part)
                continue
            if isinstance(layer, Embedding) and plain:
                ids, pi = c
                gw = np.zeros((layer.num_embeddings, layer.embedding_dim), np.float32)
                np.add.at(gw, ids, d)
                pieces[pi] = ("sum", [gw])
                continue
            if isinstance(layer, Embedding):  # always the first layer: nothing below it
                ids, pi = c
                gw = np.zeros((len(y), layer.num_embeddings, layer.embedding_dim), np.float32)
                rows = np.broadcast_to(np.arange(len(y))[:, None], ids.shape)
                np.add.at(gw, (rows, ids), d)  # a repeated id adds its positions
                if masks is not None:
                    gw = gw * masks[pi]
                sq += np.einsum("bvd,bvd->b", gw, gw)
                pieces[pi] = ("embedding", gw)
                continue
            if isinstance(layer, Linear):
                a, pi = c
                if plain:
                    pieces[pi] = ("sum", [d.T @ a, d.sum(axis=0)])
                elif masks is None:
                    dd = np.einsum("bo,bo->b", d, d)
                    sq += dd * np.einsum("bi,bi->b", a, a) + dd
                else:
                    d2 = d * d
                    sq += np.einsum("bi,bi->b", d2 @ masks[pi], a * a) + d2 @ masks[pi + 1]
                if not plain:
                    pieces[pi] = ("linear", d, a)
                if not up[srcs[0]]:
                    continue
                d = d @ params[pi]
            elif isinstance(layer, Conv2d | Conv1d):
                cols, pi, in_shape = c[:3]
                dflat = d.reshape(d.shape[0], d.shape[1], -1)
                if plain:  # per-sample MatMuls summed (faster than one transposed contraction)
                    gw = _conv_weight_grad(dflat, cols, layer.groups).sum(axis=0)
                    pieces[pi] = ("sum", [gw.reshape(params[pi].shape), dflat.sum(axis=(0, 2))])
                elif layer.groups == 1:
                    gw = np.matmul(dflat, cols.transpose(0, 2, 1))
                else:
                    gw = _conv_weight_grad(dflat, cols, layer.groups)
                if not plain:
                    gb = dflat.sum(axis=2)
                    if masks is not None:
                        gw = gw * masks[pi].reshape(1, gw.shape[1], -1)
                        gb = gb * masks[pi + 1]
                    sq += np.einsum("boi,boi->b", gw, gw) + np.einsum("bo,bo->b", gb, gb)
                    pieces[pi] = ("conv", gw, gb)
                if not up[srcs[0]]:
                    continue
                if layer.groups == 1:
                    w2 = params[pi].reshape(layer.out_channels, -1)
                    dcols = np.matmul(w2.T, dflat)  # B, C*k*k, Ho*Wo
                else:
                    dcols = _conv_cols_grad(params[pi], dflat, layer.groups)
                if len(c) == 4:
                    out_hw = d.shape[2:] if isinstance(layer, Conv2d) else (1, d.shape[2])
                    d = _conv_col2im(dcols, in_shape, layer, out_hw)
                    if isinstance(layer, Conv1d):
                        d = d[:, :, 0, :]
                else:
                    d = self._col2im(dcols, in_shape, layer.kernel)
            elif isinstance(layer, MaxPool2d | MaxPool1d):
                d = _unpool(d, c) if isinstance(c, list) else _max_unpool(d, c, layer)
            elif isinstance(layer, LayerNorm | GroupNorm):
                saved, pi = c
                gw, gb = _norm_backward(d, saved)
                if plain:
                    pieces[pi] = ("sum", [gw.sum(axis=0), gb.sum(axis=0)])
                elif masks is not None:
                    gw, gb = gw * masks[pi], gb * masks[pi + 1]
                if not plain:
                    gw2, gb2 = gw.reshape(len(y), -1), gb.reshape(len(y), -1)
                    sq += np.einsum("bi,bi->b", gw2, gw2) + np.einsum("bi,bi->b", gb2, gb2)
                    pieces[pi] = ("norm", gw, gb)
                if not up[srcs[0]]:
                    continue
                d = _norm_input_grad(d, saved)
            elif isinstance(layer, AvgPool2d | AvgPool1d):
                d = _avg_unpool(d, layer, c)
            elif isinstance(layer, GlobalAvgPool):
                share = d * np.float32(1.0 / math.prod(c[1:]))
                d = np.broadcast_to(share, (d.shape[0], *c)).copy()
            elif isinstance(layer, ACTIVATIONS):
                d = d * c
            elif isinstance(layer, Flatten):
                d = d.reshape(c)
            _send(pending, up, srcs[0], d)
        return pieces, sq, losses

    @staticmethod
    def _col2im(dcols: np.ndarray, in_shape: tuple[int, ...], k: int) -> np.ndarray:
        b, c, h, w = in_shape
        ho, wo = h - k + 1, w - k + 1
        blocks = dcols.reshape(b, c, k, k, ho, wo)
        out = np.zeros(in_shape, dtype=dcols.dtype)
        for i in range(k):
            for j in range(k):
                out[:, :, i : i + ho, j : j + wo] += blocks[:, :, i, j]
        return out

    def clipped_grad_sum(
        self,
        params: Sequence[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        clip: float,
        masks: Sequence[np.ndarray] | None = None,
    ) -> GradResult:
        """Same contract as :meth:`OnnxEngine.clipped_grad_sum`."""
        x = _inputs(self.spec, x)
        y = np.asarray(y, dtype=np.int64)
        _check_batch(self.spec, x, y)
        ps = _check_params(self.spec, params)
        ms = None if masks is None else _check_params(self.spec, masks)
        pieces, sq, losses = self._backward(ps, x, y, ms)
        norms = np.sqrt(sq).astype(np.float32)
        scale = np.minimum(np.float32(1.0), np.float32(clip) / np.maximum(norms, _TINY))
        out: list[np.ndarray] = []
        shapes = self.spec.param_shapes()
        for pi in sorted(pieces):  # graph order: each layer's parameters from index pi
            kind, p1, p2 = (*pieces[pi], None)[:3]
            shape = shapes[pi][1]
            if kind == "embedding":
                out.append(np.tensordot(scale, p1, axes=1) * (1 if ms is None else ms[pi]))
                continue
            if kind == "linear":
                ds = p1 * scale[:, None]
                pair = [ds.T @ p2, ds.sum(axis=0)]
            elif kind == "norm":
                pair = [np.tensordot(scale, p1, axes=1), np.tensordot(scale, p2, axes=1)]
            else:
                pair = [np.einsum("b,boi->oi", scale, p1).reshape(shape), scale @ p2]
            if ms is not None:
                pair = [pair[0] * ms[pi], pair[1] * ms[pi + 1]]
            out += pair
        return GradResult(norms, losses.astype(np.float32), out)

    def grad_sum(self, params: Sequence[np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> SumResult:
        """Same contract as :meth:`OnnxEngine.grad_sum`."""
        x = _inputs(self.spec, x)
        y = np.asarray(y, dtype=np.int64)
        _check_batch(self.spec, x, y)
        pieces, _, losses = self._backward(_check_params(self.spec, params), x, y, plain=True)
        out = [g.astype(np.float32, copy=False) for pi in sorted(pieces) for g in pieces[pi][1]]
        return SumResult(losses.astype(np.float32), out)

    def per_sample_grads(
        self, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> np.ndarray:
        """Unclipped per-sample gradients [B, d] in flat graph order (memory: B*d floats)."""
        return self.per_sample_grads_and_losses(params, x, y)[0]

    def per_sample_grads_and_losses(
        self, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`per_sample_grads` and each sample's cross-entropy loss [B], one pass."""
        x = _inputs(self.spec, x)
        y = np.asarray(y, dtype=np.int64)
        _check_batch(self.spec, x, y)
        pieces, _, losses = self._backward(_check_params(self.spec, params), x, y)
        cols = []
        for pi in sorted(pieces):
            kind, p1, p2 = (*pieces[pi], None)[:3]
            if kind == "embedding":
                cols.append(p1.reshape(len(y), -1))
            elif kind == "linear":
                cols += [np.einsum("bo,bi->boi", p1, p2).reshape(len(y), -1), p1]
            elif kind == "norm":
                cols += [p1.reshape(len(y), -1), p2.reshape(len(y), -1)]
            else:
                cols += [p1.reshape(len(y), -1), p2]
        return np.concatenate(cols, axis=1), losses

    def logits(self, params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
        """Logits [B, num_classes] of a batch."""
        x = _inputs(self.spec, x)
        _check_batch(self.spec, x)
        return self._forward(_check_params(self.spec, params), x)[0]


def load_engine(manifest_path: str | Path, *, backend: str = "onnx", threads: int = 1) -> Engine:
    """Engine for an exported model: ``backend`` is ``"onnx"`` (default) or ``"numpy"``."""
    manifest = load_manifest(manifest_path)
    if backend == "onnx":
        return OnnxEngine(manifest, threads=threads)
    if backend == "numpy":
        return NumpyEngine(manifest.spec)
    raise ValueError(f"backend must be 'onnx' or 'numpy', got {backend!r}")
