"""torch modules for the zoo, built from :class:`edge_sdk.model.ModelSpec`.

The plain module (``build_module``) is the reference the per-sample graph is tested
against (torch.func, Opacus). Its parameter order equals ``spec.param_shapes()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_sdk.model import (
    BATCHNORM_REASON,
    DROPOUT_REASON,
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
    UnsupportedLayer,
)


class AddNode(nn.Module):
    """The sum of its inputs (a residual connection)."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out


class ConcatNode(nn.Module):
    """Its inputs concatenated along the channel axis (dim 1 of a batch)."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs, dim=1)


class SpecGraph(nn.Module):
    """A graph spec as a torch module: ``layers[i]`` reads the nodes ``inputs[i]`` (-1: the
    module's input). Parameters in spec order, as ``nn.Sequential`` has them for a chain."""

    def __init__(self, layers: Sequence[nn.Module], inputs: Sequence[Sequence[int]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.inputs = [tuple(srcs) for srcs in inputs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for layer, srcs in zip(self.layers, self.inputs, strict=True):
            outs.append(layer(*(x if j < 0 else outs[j] for j in srcs)))
        return outs[-1]


def build_module(spec: ModelSpec,
                 params: Sequence[np.ndarray] | None = None) -> nn.Sequential | SpecGraph:
    """An ``nn.Sequential`` equal to a chain ``spec`` (a :class:`SpecGraph` for a graph);
    loads ``params`` (graph order) when given."""
    mods: list[nn.Module] = []
    for layer in spec.layers:
        if isinstance(layer, Add):
            mods.append(AddNode())
        elif isinstance(layer, Concat):
            mods.append(ConcatNode())
        elif isinstance(layer, Embedding):
            mods.append(nn.Embedding(layer.num_embeddings, layer.embedding_dim))
        elif isinstance(layer, Linear):
            mods.append(nn.Linear(layer.in_features, layer.out_features))
        elif isinstance(layer, Conv2d | Conv1d):
            cls = nn.Conv2d if isinstance(layer, Conv2d) else nn.Conv1d
            mods.append(cls(layer.in_channels, layer.out_channels, layer.kernel,
                            stride=layer.stride, padding=layer.padding,
                            dilation=layer.dilation, groups=layer.groups))
        elif isinstance(layer, MaxPool2d):
            mods.append(nn.MaxPool2d(layer.kernel, layer.stride))
        elif isinstance(layer, MaxPool1d):
            mods.append(nn.MaxPool1d(layer.kernel, layer.stride))
        elif isinstance(layer, Relu):
            mods.append(nn.ReLU())
        elif isinstance(layer, Flatten):
            mods.append(nn.Flatten())
        elif isinstance(layer, AvgPool2d):
            mods.append(nn.AvgPool2d(layer.kernel, layer.stride))
        elif isinstance(layer, AvgPool1d):
            mods.append(nn.AvgPool1d(layer.kernel, layer.stride))
        elif isinstance(layer, GlobalAvgPool):
            mods.append(nn.AdaptiveAvgPool2d(1) if layer.dims == 2 else nn.AdaptiveAvgPool1d(1))
        elif isinstance(layer, LayerNorm):
            mods.append(nn.LayerNorm(layer.normalized_shape, eps=layer.eps))
        elif isinstance(layer, GroupNorm):
            mods.append(nn.GroupNorm(layer.num_groups, layer.num_channels, eps=layer.eps))
        elif isinstance(layer, Tanh):
            mods.append(nn.Tanh())
        elif isinstance(layer, Sigmoid):
            mods.append(nn.Sigmoid())
        elif isinstance(layer, Gelu):
            mods.append(nn.GELU(approximate=layer.approximate))
        elif isinstance(layer, LeakyRelu):
            mods.append(nn.LeakyReLU(layer.negative_slope))
        elif isinstance(layer, Hardswish):
            mods.append(nn.Hardswish())
        else:
            raise UnsupportedLayer(f"no torch module for layer {layer!r}")
    module = (nn.Sequential(*mods) if spec.inputs is None
              else SpecGraph(mods, [spec.node_inputs(i) for i in range(len(mods))]))
    if params is not None:
        load_params(module, params)
    return module


def load_params(module: nn.Module, params: Sequence[np.ndarray]) -> None:
    """Copy graph-order numpy parameters into ``module``."""
    own = list(module.parameters())
    if len(own) != len(params):
        raise ValueError(f"module has {len(own)} parameters, got {len(params)}")
    with torch.no_grad():
        for p, v in zip(own, params, strict=True):
            if tuple(p.shape) != tuple(v.shape):
                raise ValueError(f"parameter shape {tuple(v.shape)} != module's {tuple(p.shape)}")
            p.copy_(torch.as_tensor(np.asarray(v, dtype=np.float32)))


_SUPPORTED = (
    "Embedding (first layer; no padding_idx, max_norm or scale_grad_by_freq), Linear, "
    "Conv2d/Conv1d (with bias; square kernel, same stride, numeric zero padding and "
    "dilation on both axes; any groups), MaxPool2d/MaxPool1d and AvgPool2d/AvgPool1d (square, "
    "no padding, floor mode; max pools undilated), AdaptiveAvgPool2d(1)/AdaptiveAvgPool1d(1), "
    "ReLU, Tanh, Sigmoid, GELU, LeakyReLU, Hardswish, LayerNorm/GroupNorm (affine, with bias), "
    "Flatten"
)


def _one(value: int | tuple[int, ...]) -> int:
    """The single value of an int or an all-equal tuple (callers check equality first)."""
    return int(value) if isinstance(value, int) else int(value[0])


def _pool_plain(mod: nn.Module) -> bool:
    """A pool the spec can say: square, no padding, floor mode, no divisor (average)."""
    same = all(isinstance(v, int) or len(set(v)) == 1 for v in (mod.kernel_size, mod.stride))
    return (same and _one(mod.padding) == 0 and len(set(np.atleast_1d(mod.padding).tolist())) == 1
            and not mod.ceil_mode and getattr(mod, "divisor_override", None) is None)


def layer_of(mod: nn.Module, where: str) -> Any:
    """The spec layer of one torch module (``where`` names it in errors).

    Raises:
        UnsupportedLayer: the module is outside the supported set, with the reason.
    """
    kind = type(mod).__name__
    if (isinstance(mod, nn.Embedding) and mod.padding_idx is None and mod.max_norm is None
            and not mod.scale_grad_by_freq):
        return Embedding(num_embeddings=mod.num_embeddings,
                         embedding_dim=mod.embedding_dim)
    elif isinstance(mod, nn.Linear) and mod.bias is not None:
        return Linear(in_features=mod.in_features, out_features=mod.out_features)
    elif (isinstance(mod, nn.Conv2d | nn.Conv1d) and mod.bias is not None
          and len(set(mod.kernel_size)) == 1 and len(set(mod.stride)) == 1
          and isinstance(mod.padding, tuple) and len(set(mod.padding)) == 1
          and len(set(mod.dilation)) == 1 and mod.padding_mode == "zeros"):
        cls = Conv2d if isinstance(mod, nn.Conv2d) else Conv1d
        return cls(in_channels=mod.in_channels, out_channels=mod.out_channels,
                   kernel=mod.kernel_size[0], stride=mod.stride[0],
                   padding=mod.padding[0], dilation=mod.dilation[0],
                   groups=mod.groups)
    elif (isinstance(mod, nn.MaxPool2d | nn.MaxPool1d) and _pool_plain(mod)
          and _one(mod.dilation) == 1 and len(set(np.atleast_1d(mod.dilation))) == 1
          and not mod.return_indices):
        cls = MaxPool2d if isinstance(mod, nn.MaxPool2d) else MaxPool1d
        return cls(kernel=_one(mod.kernel_size), stride=_one(mod.stride))
    elif isinstance(mod, nn.ReLU):
        return Relu()
    elif isinstance(mod, nn.Flatten):
        return Flatten()
    elif (isinstance(mod, nn.AvgPool2d | nn.AvgPool1d) and _pool_plain(mod)):
        cls = AvgPool2d if isinstance(mod, nn.AvgPool2d) else AvgPool1d
        return cls(kernel=_one(mod.kernel_size), stride=_one(mod.stride))
    elif (isinstance(mod, nn.AdaptiveAvgPool2d | nn.AdaptiveAvgPool1d)
          and set(np.atleast_1d(mod.output_size).tolist()) == {1}):
        return GlobalAvgPool(dims=2 if isinstance(mod, nn.AdaptiveAvgPool2d) else 1)
    elif (isinstance(mod, nn.LayerNorm) and mod.elementwise_affine
          and mod.bias is not None):
        return LayerNorm(normalized_shape=tuple(mod.normalized_shape),
                         eps=float(mod.eps))
    elif isinstance(mod, nn.GroupNorm) and mod.affine:
        return GroupNorm(num_groups=mod.num_groups, num_channels=mod.num_channels,
                         eps=float(mod.eps))
    elif isinstance(mod, nn.modules.batchnorm._BatchNorm):
        raise UnsupportedLayer(f"{where} ({kind}: {mod}): {BATCHNORM_REASON}")
    elif isinstance(mod, nn.Tanh):
        return Tanh()
    elif isinstance(mod, nn.Sigmoid):
        return Sigmoid()
    elif isinstance(mod, nn.GELU):
        return Gelu(approximate=mod.approximate)
    elif isinstance(mod, nn.LeakyReLU):
        return LeakyRelu(negative_slope=float(mod.negative_slope))
    elif isinstance(mod, nn.Hardswish):
        return Hardswish()
    elif isinstance(mod, nn.modules.dropout._DropoutNd):
        raise UnsupportedLayer(f"{where} ({kind}: {mod}): {DROPOUT_REASON}")
    else:
        raise UnsupportedLayer(
            f"{where} ({kind}: {mod}) cannot be exported for per-sample gradients; "
            f"supported: {_SUPPORTED}"
        )


def spec_from_module(
    module: nn.Sequential, input_shape: Sequence[int], num_classes: int, name: str = "custom"
) -> ModelSpec:
    """The :class:`ModelSpec` of a user's ``nn.Sequential``, for export.

    Raises:
        UnsupportedLayer: naming the first layer outside the supported set.
    """
    layers = [layer_of(mod, f"layer {i}") for i, mod in enumerate(module)]
    return ModelSpec(name=name, input_shape=tuple(input_shape), num_classes=num_classes,
                     layers=tuple(layers))
