"""Model specifications shared by the device, the aggregator and the exporter.

A model is a frozen list of layers from a small supported set. The spec is plain data:
the device reads it from the exported manifest, the aggregator uses it to initialise and
evaluate the global model, and ``models/`` builds the torch module and the per-sample
gradient graph from the same spec, so the three can never disagree on shapes or order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.errors import EdgeError

__all__ = [
    "ACTIVATIONS",
    "BATCHNORM_REASON",
    "COMBINERS",
    "DROPOUT_REASON",
    "NORMS",
    "ZOO",
    "Add",
    "AvgPool1d",
    "AvgPool2d",
    "Concat",
    "Conv1d",
    "Conv2d",
    "Embedding",
    "Flatten",
    "Gelu",
    "GlobalAvgPool",
    "GroupNorm",
    "Hardswish",
    "LayerNorm",
    "LeakyRelu",
    "Linear",
    "MaxPool1d",
    "MaxPool2d",
    "ModelSpec",
    "Relu",
    "Sigmoid",
    "Tanh",
    "UnsupportedLayer",
    "build_spec",
    "cnn",
    "dscnn_har",
    "dscnn_kws",
    "conv_geometry",
    "conv_out_size",
    "flatten_params",
    "init_params",
    "logreg",
    "mlp",
    "pool_geometry",
    "tabular",
    "unflatten_params",
]


class UnsupportedLayer(EdgeError, ValueError):
    """A layer outside the supported set (see ``_LAYER_TYPES``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Linear:
    in_features: int
    out_features: int
    kind: str = field(default="linear", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Embedding:
    """torch's nn.Embedding(num_embeddings, embedding_dim): integer ids [L] -> the rows [L, D]
    of a [num_embeddings, embedding_dim] table. Only as the first layer: the model's input is
    then integer (``ModelSpec.input_dtype`` is "int64", declared in the manifest), and ids
    outside [0, num_embeddings) are refused. A sample's gradient is nonzero only in the rows
    of its ids; an id repeated within a sample adds its positions' gradients."""

    num_embeddings: int
    embedding_dim: int
    kind: str = field(default="embedding", init=False)

    def __post_init__(self) -> None:
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Embedding {attr} must be an int >= 1, got {value!r}")


def _check_conv(layer: Any) -> None:
    name = type(layer).__name__
    for attr in ("in_channels", "out_channels", "kernel", "stride", "dilation", "groups"):
        value = getattr(layer, attr)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} {attr} must be an int >= 1, got {value!r}")
    if not isinstance(layer.padding, int) or isinstance(layer.padding, bool) or layer.padding < 0:
        raise ValueError(f"{name} padding must be an int >= 0, got {layer.padding!r}")
    if layer.in_channels % layer.groups or layer.out_channels % layer.groups:
        raise ValueError(f"{name} groups must divide in_channels and out_channels, got "
                         f"groups={layer.groups}, in_channels={layer.in_channels}, "
                         f"out_channels={layer.out_channels}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Conv2d:
    """Square kernel; the same stride, zero padding and dilation along both axes
    (torch's defaults: 1, 0, 1). ``groups`` splits the channels into independent
    convolutions (torch's ``groups``; groups = in_channels is a depthwise conv), so the
    weight is [out_channels, in_channels // groups, kernel, kernel]."""

    in_channels: int
    out_channels: int
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    kind: str = field(default="conv2d", init=False)

    def __post_init__(self) -> None:
        _check_conv(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Conv1d:
    """1-D convolution over [C, L] inputs (time series): stride, zero padding, dilation,
    groups (as Conv2d). Computed as a Conv2d of height 1."""

    in_channels: int
    out_channels: int
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    kind: str = field(default="conv1d", init=False)

    def __post_init__(self) -> None:
        _check_conv(self)


def conv_geometry(layer: Conv2d | Conv1d) -> tuple[tuple[int, int], ...]:
    """((kh, kw), (sh, sw), (ph, pw), (dh, dw)) of a conv seen as 2-D (Conv1d: height 1)."""
    if isinstance(layer, Conv1d):
        return (1, layer.kernel), (1, layer.stride), (0, layer.padding), (1, layer.dilation)
    k, st, p, dl = layer.kernel, layer.stride, layer.padding, layer.dilation
    return (k, k), (st, st), (p, p), (dl, dl)


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Output length along one axis (torch's formula, floor division)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _check_pool(layer: Any) -> None:
    if layer.stride is None:
        object.__setattr__(layer, "stride", layer.kernel)  # torch's default: stride = kernel
    for attr in ("kernel", "stride"):
        value = getattr(layer, attr)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(layer).__name__} {attr} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxPool2d:
    """Square max pooling, no padding, floor mode (torch's defaults); stride defaults to the
    kernel (the zoo's 2x2). Each window's gradient goes to its maximum; ties go to the first
    maximum in the window's scan order (row by row), as torch's CPU kernel breaks them.
    Overlapping windows (stride < kernel) add their gradients where they share an input."""

    kernel: int = 2
    stride: int | None = None
    kind: str = field(default="maxpool2d", init=False)

    def __post_init__(self) -> None:
        _check_pool(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxPool1d:
    """Max pooling over [C, L], no padding, floor mode; stride defaults to the kernel.
    Ties go to the first maximum in the window (torch)."""

    kernel: int
    stride: int | None = None
    kind: str = field(default="maxpool1d", init=False)

    def __post_init__(self) -> None:
        _check_pool(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class AvgPool2d:
    """Square average pooling, no padding, floor mode (torch's defaults); stride defaults to
    the kernel. A window's gradient is spread evenly over its kernel*kernel inputs."""

    kernel: int
    stride: int | None = None
    kind: str = field(default="avgpool2d", init=False)

    def __post_init__(self) -> None:
        _check_pool(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class AvgPool1d:
    """Average pooling over [C, L], no padding, floor mode; stride defaults to the kernel."""

    kernel: int
    stride: int | None = None
    kind: str = field(default="avgpool1d", init=False)

    def __post_init__(self) -> None:
        _check_pool(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalAvgPool:
    """Mean over all ``dims`` spatial axes (2: [C, H, W] -> [C, 1, 1]; 1: [C, L] -> [C, 1]),
    torch's AdaptiveAvgPool2d(1) / AdaptiveAvgPool1d(1); follow it with Flatten."""

    dims: int = 2
    kind: str = field(default="globalavgpool", init=False)

    def __post_init__(self) -> None:
        if self.dims not in (1, 2):
            raise ValueError(f"GlobalAvgPool dims must be 1 or 2, got {self.dims!r}")


BATCHNORM_REASON = (
    "BatchNorm is refused: it normalises each sample with statistics of the whole batch, so "
    "one sample's output and gradient depend on the other samples; per-sample gradients are "
    "then not defined and DP-SGD's clipping no longer bounds one sample's influence (the "
    "privacy guarantee fails). Use GroupNorm (statistics per sample over channel groups; "
    "GroupNorm(1, C) normalises each sample over all channels) or LayerNorm instead"
)


DROPOUT_REASON = (
    "Dropout is refused: the per-sample gradient graphs take no dropout-mask input, and a "
    "mask drawn inside the graph would come from onnxruntime's generator, not from the "
    "training step's rng, so the step could not be replayed or checked against the numpy "
    "engine; remove the Dropout layers (DP-SGD's clipping and noise already regularise)"
)


def _check_eps(layer: Any) -> None:
    if not (isinstance(layer.eps, int | float) and math.isfinite(layer.eps) and layer.eps > 0):
        raise ValueError(f"{type(layer).__name__} eps must be a finite float > 0, "
                         f"got {layer.eps!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerNorm:
    """torch's nn.LayerNorm(normalized_shape, eps) with its affine weight and bias (both
    shaped ``normalized_shape``): each sample normalised over its last len(normalized_shape)
    axes, statistics per sample, so per-sample gradients are well defined."""

    normalized_shape: tuple[int, ...]
    eps: float = 1e-5
    kind: str = field(default="layernorm", init=False)

    def __post_init__(self) -> None:
        shape = self.normalized_shape
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or not all(isinstance(v, int) and v >= 1 for v in shape):
            raise ValueError(f"LayerNorm normalized_shape must be ints >= 1, got {shape!r}")
        object.__setattr__(self, "normalized_shape", shape)  # JSON gives lists
        _check_eps(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupNorm:
    """torch's nn.GroupNorm(num_groups, num_channels, eps) with its per-channel affine weight
    and bias: each sample's channels split into groups, each normalised over its channels and
    positions, statistics per sample."""

    num_groups: int
    num_channels: int
    eps: float = 1e-5
    kind: str = field(default="groupnorm", init=False)

    def __post_init__(self) -> None:
        g, c = self.num_groups, self.num_channels
        if not (isinstance(g, int) and isinstance(c, int) and g >= 1 and c >= 1 and c % g == 0):
            raise ValueError(f"GroupNorm needs ints num_groups >= 1 dividing num_channels, "
                             f"got num_groups={g!r}, num_channels={c!r}")
        _check_eps(self)


NORMS = (LayerNorm, GroupNorm)


def pool_geometry(
    layer: AvgPool2d | AvgPool1d | MaxPool2d | MaxPool1d,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((kh, kw), (sh, sw)) of a pool seen as 2-D (AvgPool1d, MaxPool1d: height 1)."""
    k, st = layer.kernel, int(layer.stride or layer.kernel)
    return ((1, k), (1, st)) if isinstance(layer, AvgPool1d | MaxPool1d) else ((k, k), (st, st))


@dataclass(frozen=True, slots=True, kw_only=True)
class Relu:
    kind: str = field(default="relu", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Flatten:
    kind: str = field(default="flatten", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tanh:
    kind: str = field(default="tanh", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sigmoid:
    kind: str = field(default="sigmoid", init=False)


GELU_APPROXIMATIONS = ("none", "tanh")


@dataclass(frozen=True, slots=True, kw_only=True)
class Gelu:
    """x * Phi(x). ``approximate="none"`` (torch's default) is the exact erf form;
    ``"tanh"`` is torch's tanh approximation. The gradient follows the chosen form."""

    approximate: str = "none"
    kind: str = field(default="gelu", init=False)

    def __post_init__(self) -> None:
        if self.approximate not in GELU_APPROXIMATIONS:
            raise UnsupportedLayer(
                f"Gelu approximate must be one of {GELU_APPROXIMATIONS}, got {self.approximate!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class LeakyRelu:
    """x for x > 0, else negative_slope * x (gradient negative_slope at 0, as torch)."""

    negative_slope: float = 0.01
    kind: str = field(default="leakyrelu", init=False)

    def __post_init__(self) -> None:
        slope = self.negative_slope
        number = isinstance(slope, int | float) and not isinstance(slope, bool)
        if not number or not math.isfinite(slope):
            raise ValueError(
                f"LeakyRelu negative_slope must be a finite number, got {self.negative_slope!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardswish:
    """x * relu6(x + 3) / 6; gradient 0 for x <= -3, x/3 + 1/2 inside, 1 for x >= 3 (torch)."""

    kind: str = field(default="hardswish", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Add:
    """Element-wise sum of two or more nodes of one shape (a residual connection). The
    gradient reaching it goes unchanged to every input."""

    kind: str = field(default="add", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Concat:
    """Concatenation of two or more nodes along the channel axis (axis 0 of a sample; the
    other axes must agree). The gradient reaching it is split back by channels."""

    kind: str = field(default="concat", init=False)


# Nodes that read several others; every other layer reads exactly one.
COMBINERS = (Add, Concat)

Layer = (Add | Concat | Linear | Embedding | Conv2d | Conv1d | MaxPool2d | MaxPool1d | AvgPool2d
         | AvgPool1d | GlobalAvgPool | Relu | Flatten | Tanh | Sigmoid | Gelu | LeakyRelu
         | Hardswish | LayerNorm | GroupNorm)
# Element-wise activations: no parameters, shape kept, gradient = upstream * f'(pre-activation).
ACTIVATIONS = (Relu, Tanh, Sigmoid, Gelu, LeakyRelu, Hardswish)
_LAYER_TYPES: dict[str, type] = {
    "add": Add,
    "concat": Concat,
    "linear": Linear,
    "embedding": Embedding,
    "conv2d": Conv2d,
    "conv1d": Conv1d,
    "maxpool2d": MaxPool2d,
    "maxpool1d": MaxPool1d,
    "avgpool2d": AvgPool2d,
    "avgpool1d": AvgPool1d,
    "globalavgpool": GlobalAvgPool,
    "relu": Relu,
    "flatten": Flatten,
    "tanh": Tanh,
    "sigmoid": Sigmoid,
    "gelu": Gelu,
    "leakyrelu": LeakyRelu,
    "hardswish": Hardswish,
    "layernorm": LayerNorm,
    "groupnorm": GroupNorm,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A classifier as a graph of layers, ending in logits over ``num_classes``.

    The loss is always softmax cross-entropy on the final logits. Layer i is node ``l{i}``;
    ``inputs[i]`` lists the nodes it reads, as indices (-1: the model input ``x``, j: node
    ``l{j}``, j < i, so the list order is a topological order). ``inputs=None`` is a chain
    (layer i reads layer i - 1), the form every model had before residual blocks; a chain
    given explicitly is stored as None, so its spec, manifest and graphs stay the same. The
    last layer is the output; every other node must be read by some later one.
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    layers: tuple[Layer, ...]
    inputs: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.inputs is not None:
            given = tuple(tuple(int(j) for j in srcs) for srcs in self.inputs)
            if len(given) != len(self.layers):
                raise ValueError(f"model {self.name!r}: {len(given)} input lists for "
                                 f"{len(self.layers)} layers")
            chain = all(srcs == (i - 1,) for i, srcs in enumerate(given))
            object.__setattr__(self, "inputs", None if chain else given)
        shape = self.layer_shapes()[-1] if self.layers else tuple(self.input_shape)
        if self.inputs is not None:
            read = {j for srcs in self.inputs for j in srcs}
            dead = [f"l{i}" for i in range(len(self.layers) - 1) if i not in read]
            if dead:
                raise ValueError(f"model {self.name!r}: nodes {dead} are never read (only "
                                 "the last layer is an output)")
        if shape != (self.num_classes,):
            raise ValueError(
                f"model {self.name!r} ends in shape {shape}, expected ({self.num_classes},)"
            )

    @property
    def input_dtype(self) -> str:
        """"int64" for a model reading integer ids (first layer an Embedding), else
        "float32"."""
        return "int64" if self.layers and isinstance(self.layers[0], Embedding) else "float32"

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of the parameters, in graph-input order (torch's layout)."""
        out: list[tuple[str, tuple[int, ...]]] = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Embedding):
                out.append((f"l{i}.weight", (layer.num_embeddings, layer.embedding_dim)))
            elif isinstance(layer, Linear):
                out.append((f"l{i}.weight", (layer.out_features, layer.in_features)))
                out.append((f"l{i}.bias", (layer.out_features,)))
            elif isinstance(layer, Conv2d):
                k, cin = layer.kernel, layer.in_channels // layer.groups
                out.append((f"l{i}.weight", (layer.out_channels, cin, k, k)))
                out.append((f"l{i}.bias", (layer.out_channels,)))
            elif isinstance(layer, Conv1d):
                k, cin = layer.kernel, layer.in_channels // layer.groups
                out.append((f"l{i}.weight", (layer.out_channels, cin, k)))
                out.append((f"l{i}.bias", (layer.out_channels,)))
            elif isinstance(layer, LayerNorm):
                out.append((f"l{i}.weight", layer.normalized_shape))
                out.append((f"l{i}.bias", layer.normalized_shape))
            elif isinstance(layer, GroupNorm):
                out.append((f"l{i}.weight", (layer.num_channels,)))
                out.append((f"l{i}.bias", (layer.num_channels,)))
        return out

    def node_inputs(self, i: int) -> tuple[int, ...]:
        """The nodes layer ``i`` reads (-1: the model input)."""
        return (i - 1,) if self.inputs is None else self.inputs[i]

    def layer_shapes(self) -> list[tuple[int, ...]]:
        """Each layer's per-sample output shape, in order."""
        shapes: list[tuple[int, ...]] = []
        for i, layer in enumerate(self.layers):
            srcs = self.node_inputs(i)
            where = f"layer {i} ({layer.kind})"
            if any(not -1 <= j < i for j in srcs):
                raise ValueError(f"{where} reads {list(srcs)}: inputs must be earlier nodes "
                                 f"(-1 is the model input, j < {i} a layer)")
            many = isinstance(layer, COMBINERS)
            if (len(srcs) < 2) if many else (len(srcs) != 1):
                want = "two or more inputs" if many else "exactly one input"
                raise ValueError(f"{where} reads {list(srcs)}, expected {want}")
            ins = [tuple(self.input_shape) if j < 0 else shapes[j] for j in srcs]
            shapes.append(_combined_shape(layer, ins, where) if many
                          else _out_shape(layer, ins[0], i))
        return shapes

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in self.param_shapes())

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for layer in self.layers:
            d = {f: getattr(layer, f) for f in layer.__dataclass_fields__ if f != "kind"}
            # defaults added after the first release are left out, so the zoo's manifests
            # stay readable by devices that predate them
            if d.get("groups") == 1 and isinstance(layer, Conv2d | Conv1d):
                del d["groups"]
            if isinstance(layer, MaxPool2d) and d["stride"] == d["kernel"]:
                del d["stride"]
            layers.append({"kind": layer.kind, **d})
            if self.inputs is not None and self.inputs[len(layers) - 1] != (len(layers) - 2,):
                # a graph: a node that does not read the previous one names what it reads
                layers[-1]["inputs"] = ["x" if j < 0 else f"l{j}"
                                        for j in self.inputs[len(layers) - 1]]
        return {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "layers": layers,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        layers, inputs = [], []
        for i, entry in enumerate(data["layers"]):
            entry = dict(entry)
            kind = entry.pop("kind")
            inputs.append(tuple(_node_index(n, i) for n in entry.pop("inputs", [_name(i - 1)])))
            if str(kind).lower().startswith("batchnorm"):
                raise UnsupportedLayer(f"layer kind {kind!r}: {BATCHNORM_REASON}")
            if str(kind).lower().startswith("dropout"):
                raise UnsupportedLayer(f"layer kind {kind!r}: {DROPOUT_REASON}")
            if kind not in _LAYER_TYPES:
                raise UnsupportedLayer(
                    f"layer kind {kind!r} is not supported; expected one of {sorted(_LAYER_TYPES)}"
                )
            layers.append(_LAYER_TYPES[kind](**entry))
        return cls(
            name=str(data["name"]),
            input_shape=tuple(int(v) for v in data["input_shape"]),
            num_classes=int(data["num_classes"]),
            layers=tuple(layers),
            inputs=tuple(inputs),
        )


def _name(j: int) -> str:
    return "x" if j < 0 else f"l{j}"


def _node_index(name: Any, i: int) -> int:
    """-1 for "x", j for "l{j}" (a manifest's node names)."""
    if name == "x":
        return -1
    if isinstance(name, str) and name[:1] == "l" and name[1:].isdigit():
        return int(name[1:])
    raise ValueError(f"layer {i}: input {name!r} is not a node name (\"x\" or \"l<index>\")")


def _combined_shape(layer: Add | Concat, shapes: list[tuple[int, ...]],
                    where: str) -> tuple[int, ...]:
    if isinstance(layer, Add):
        if len(set(shapes)) != 1:
            raise ValueError(f"{where} adds inputs of different shapes {shapes}")
        return shapes[0]
    if len({len(s) for s in shapes}) != 1 or len({s[1:] for s in shapes}) != 1:
        raise ValueError(f"{where} concatenates along channels inputs whose other axes "
                         f"differ: {shapes}")
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _out_shape(layer: Layer, shape: tuple[int, ...], index: int) -> tuple[int, ...]:
    where = f"layer {index} ({layer.kind})"
    if isinstance(layer, Embedding):
        if index != 0:
            raise UnsupportedLayer(f"{where}: an Embedding must be the first layer (it reads "
                                   "the model's integer input)")
        if len(shape) != 1:
            raise ValueError(f"{where} expects integer ids of shape (L,), got {shape}")
        return (shape[0], layer.embedding_dim)
    if isinstance(layer, Linear):
        if shape != (layer.in_features,):
            raise ValueError(f"{where} expects input ({layer.in_features},), got {shape}")
        return (layer.out_features,)
    if isinstance(layer, Conv2d | Conv1d):
        rank, dims = (3, "H, W") if isinstance(layer, Conv2d) else (2, "L")
        if len(shape) != rank or shape[0] != layer.in_channels:
            raise ValueError(f"{where} expects input ({layer.in_channels}, {dims}), got {shape}")
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv_geometry(layer)
        spatial = (1, *shape[1:]) if rank == 2 else shape[1:]
        h = conv_out_size(spatial[0], kh, sh, ph, dh)
        w = conv_out_size(spatial[1], kw, sw, pw, dw)
        if h < 1 or w < 1:
            raise ValueError(
                f"{where}: kernel {layer.kernel} (dilation {layer.dilation}, padding "
                f"{layer.padding}) larger than input {shape}"
            )
        return (layer.out_channels, h, w) if rank == 3 else (layer.out_channels, w)
    if isinstance(layer, AvgPool2d | AvgPool1d | MaxPool2d | MaxPool1d):
        rank, dims = (3, "C, H, W") if isinstance(layer, AvgPool2d | MaxPool2d) else (2, "C, L")
        if len(shape) != rank:
            raise ValueError(f"{where} expects input ({dims}), got {shape}")
        (kh, kw), (sh, sw) = pool_geometry(layer)
        spatial = shape[1:] if rank == 3 else (1, shape[1])
        h, w = (spatial[0] - kh) // sh + 1, (spatial[1] - kw) // sw + 1
        if spatial[0] < kh or spatial[1] < kw:
            raise ValueError(f"{where}: kernel {layer.kernel} larger than input {shape}")
        return (shape[0], h, w) if rank == 3 else (shape[0], w)
    if isinstance(layer, GlobalAvgPool):
        if len(shape) != layer.dims + 1:
            raise ValueError(f"{where} (dims={layer.dims}) expects a rank-{layer.dims + 1} "
                             f"input (C, ...), got {shape}")
        return (shape[0], *([1] * layer.dims))
    if isinstance(layer, LayerNorm):
        n = len(layer.normalized_shape)
        if shape[len(shape) - n :] != layer.normalized_shape:
            raise ValueError(f"{where} expects input ending in {layer.normalized_shape}, "
                             f"got {shape}")
        return shape
    if isinstance(layer, GroupNorm):
        if not shape or shape[0] != layer.num_channels:
            raise ValueError(f"{where} expects input ({layer.num_channels}, ...), got {shape}")
        if math.prod(shape) // layer.num_groups < 2:
            # a group of one value normalises to 0 whatever it is (torch refuses it too)
            raise ValueError(f"{where}: groups of one value on input {shape}; use fewer groups")
        return shape
    if isinstance(layer, ACTIVATIONS):
        return shape
    if isinstance(layer, Flatten):
        return (math.prod(shape),)
    raise UnsupportedLayer(f"{where}: unsupported layer {layer!r}")


def _flat_in(input_shape: Sequence[int]) -> tuple[list[Layer], int]:
    if len(input_shape) == 1:
        return [], int(input_shape[0])
    return [Flatten()], math.prod(input_shape)


def logreg(input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """Multinomial logistic regression."""
    pre, d = _flat_in(input_shape)
    return ModelSpec(
        name="logreg",
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        layers=(*pre, Linear(in_features=d, out_features=num_classes)),
    )


def mlp(input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """The zCDP paper's 3-layer ReLU network (its widths are not given; we use 128-64)."""
    pre, d = _flat_in(input_shape)
    return ModelSpec(
        name="mlp",
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        layers=(
            *pre,
            Linear(in_features=d, out_features=128),
            Relu(),
            Linear(in_features=128, out_features=64),
            Relu(),
            Linear(in_features=64, out_features=num_classes),
        ),
    )


def tabular(input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """A small MLP for sensor/tabular features: one hidden layer of 32."""
    pre, d = _flat_in(input_shape)
    return ModelSpec(
        name="tabular",
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        layers=(
            *pre,
            Linear(in_features=d, out_features=32),
            Relu(),
            Linear(in_features=32, out_features=num_classes),
        ),
    )


def cnn(input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """The Fed-SPA MNIST CNN: conv5x5 1->10, pool, relu, conv5x5 10->20, pool, relu, 320-50-10."""
    if tuple(input_shape) != (1, 28, 28):
        raise ValueError(f"the cnn takes (1, 28, 28) images, got input shape {tuple(input_shape)}")
    return ModelSpec(
        name="cnn",
        input_shape=(1, 28, 28),
        num_classes=num_classes,
        layers=(
            Conv2d(in_channels=1, out_channels=10, kernel=5),
            MaxPool2d(),
            Relu(),
            Conv2d(in_channels=10, out_channels=20, kernel=5),
            MaxPool2d(),
            Relu(),
            Flatten(),
            Linear(in_features=320, out_features=50),
            Relu(),
            Linear(in_features=50, out_features=num_classes),
        ),
    )


def dscnn_har(input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """A depthwise-separable 1-D CNN for sensor time series: 3-axis accelerometer windows
    of 128 samples ([3, 128]). A strided stem (3 -> 16 channels, kernel 5, stride 2), two
    depthwise (groups = channels, kernel 3) + pointwise (1x1) blocks (16 -> 24 -> 32, the
    second depthwise strided), global average pooling over time, one linear layer: 1,822
    parameters at 6 classes, no normalization (GroupNorm would also do; BatchNorm mixes
    samples and is refused)."""
    if tuple(input_shape) != (3, 128):
        raise ValueError(f"dscnn-har takes (3, 128) sensor windows, got input shape "
                         f"{tuple(input_shape)}")
    return ModelSpec(
        name="dscnn-har",
        input_shape=(3, 128),
        num_classes=num_classes,
        layers=(
            Conv1d(in_channels=3, out_channels=16, kernel=5, stride=2, padding=2), Relu(),
            Conv1d(in_channels=16, out_channels=16, kernel=3, padding=1, groups=16), Relu(),
            Conv1d(in_channels=16, out_channels=24, kernel=1), Relu(),
            Conv1d(in_channels=24, out_channels=24, kernel=3, stride=2, padding=1,
                   groups=24), Relu(),
            Conv1d(in_channels=24, out_channels=32, kernel=1), Relu(),
            GlobalAvgPool(dims=1), Flatten(),
            Linear(in_features=32, out_features=num_classes),
        ),
    )


def dscnn_kws(input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """A DS-CNN for keyword spotting in the style of "Hello Edge" (Zhang, Suda, Lai,
    Chandra 2017), scaled down: MFCC-like frames [1, 49, 10] (49 time steps x 10
    coefficients), a strided 3x3 stem to 32 channels, two depthwise 3x3 + pointwise 1x1
    blocks of 32 channels, global average pooling, one linear layer: 3,336 parameters at
    8 classes. (The paper's stem is a 10x4 kernel; the zoo's Conv2d is square.)"""
    if tuple(input_shape) != (1, 49, 10):
        raise ValueError(f"dscnn-kws takes (1, 49, 10) MFCC frames, got input shape "
                         f"{tuple(input_shape)}")
    return ModelSpec(
        name="dscnn-kws",
        input_shape=(1, 49, 10),
        num_classes=num_classes,
        layers=(
            Conv2d(in_channels=1, out_channels=32, kernel=3, stride=2, padding=1), Relu(),
            Conv2d(in_channels=32, out_channels=32, kernel=3, padding=1, groups=32), Relu(),
            Conv2d(in_channels=32, out_channels=32, kernel=1), Relu(),
            Conv2d(in_channels=32, out_channels=32, kernel=3, padding=1, groups=32), Relu(),
            Conv2d(in_channels=32, out_channels=32, kernel=1), Relu(),
            GlobalAvgPool(dims=2), Flatten(),
            Linear(in_features=32, out_features=num_classes),
        ),
    )


ZOO = {"logreg": logreg, "mlp": mlp, "tabular": tabular, "cnn": cnn, "dscnn-har": dscnn_har,
       "dscnn-kws": dscnn_kws}


def build_spec(arch: str, input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """The zoo model ``arch`` for inputs of ``input_shape`` and ``num_classes`` labels."""
    if arch not in ZOO:
        raise ValueError(f"unknown model {arch!r}; expected one of {sorted(ZOO)}")
    return ZOO[arch](input_shape, num_classes)


def _norm_param_indices(spec: ModelSpec) -> dict[int, bool]:
    """Graph-order indices of normalisation parameters -> True for a weight, False a bias."""
    out: dict[int, bool] = {}
    pi = 0
    for layer in spec.layers:
        if isinstance(layer, NORMS):
            out[pi], out[pi + 1] = True, False
        if isinstance(layer, Linear | Conv2d | Conv1d | LayerNorm | GroupNorm):
            pi += 2
        elif isinstance(layer, Embedding):
            pi += 1
    return out


def init_params(spec: ModelSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Initial float32 parameters: He-uniform for layers that feed a ReLU, LeCun-uniform
    for the output layer, zero biases.

    He et al. (2015) keep the activation variance constant through ReLU layers; torch's
    default (U(+-1/sqrt(fan_in))) shrinks it by sqrt(6) per layer, which measurably slows
    the first FedAvg rounds (Fashion-MNIST CNN: 0.81 vs 0.84 test accuracy after 30 rounds
    in the issue-2 setting).
    """
    shapes = spec.param_shapes()
    norm = _norm_param_indices(spec)  # weight 1, bias 0: the identity affine map (torch)
    last_weight = max((i for i, (_, s) in enumerate(shapes) if len(s) > 1 and i not in norm),
                      default=-1)
    params = []
    for i, (_, shape) in enumerate(shapes):
        if i in norm:
            params.append(np.full(shape, 1.0 if norm[i] else 0.0, dtype=np.float32))
            continue
        if len(shape) == 1:
            params.append(np.zeros(shape, dtype=np.float32))
            continue
        gain = 1.0 if i == last_weight else 2.0
        bound = math.sqrt(3.0 * gain / math.prod(shape[1:]))
        params.append(rng.uniform(-bound, bound, size=shape).astype(np.float32))
    return params


def flatten_params(params: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate parameters into one float32 vector (graph-input order)."""
    return np.concatenate([np.asarray(p, dtype=np.float32).ravel() for p in params])


def unflatten_params(spec: ModelSpec, flat: np.ndarray) -> list[np.ndarray]:
    """Inverse of :func:`flatten_params` for ``spec``; checks the length."""
    flat = np.asarray(flat, dtype=np.float32)
    if flat.shape != (spec.num_params,):
        raise ValueError(
            f"flat parameter vector has shape {flat.shape}, expected ({spec.num_params},)"
        )
    out, start = [], 0
    for _, shape in spec.param_shapes():
        n = math.prod(shape)
        out.append(flat[start : start + n].reshape(shape))
        start += n
    return out
