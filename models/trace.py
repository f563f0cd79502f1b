"""A user's torch module as a :class:`~edge_sdk.model.ModelSpec` graph, by torch.fx tracing.

``fedge export --module pkg.mod:factory`` imports the factory, calls it, traces the module
with ``torch.fx.symbolic_trace`` and maps each node of the traced graph onto a spec node:
submodules through :func:`models.zoo.layer_of` (the layers ``nn.Sequential`` exports
support), ``+`` / ``torch.add`` of two tensors onto ``Add``, ``torch.cat(..., dim=1)`` onto
``Concat``, ``torch.flatten(x, 1)`` / ``x.flatten(1)`` onto ``Flatten`` and the functional
ReLU, tanh and sigmoid onto their layers. The first node outside that set is named with the
reason (BatchNorm: it mixes samples, so per-sample gradients and DP-SGD's clipping bound do
not exist; use GroupNorm or LayerNorm).
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from edge_sdk.model import (
    BATCHNORM_REASON,
    DROPOUT_REASON,
    Add,
    Concat,
    Flatten,
    ModelSpec,
    Relu,
    Sigmoid,
    Tanh,
    UnsupportedLayer,
)
from models.zoo import layer_of

_FUNCTIONS: dict[Any, Callable[[], Any]] = {
    F.relu: Relu, torch.relu: Relu, torch.tanh: Tanh, torch.sigmoid: Sigmoid,
    F.tanh: Tanh, F.sigmoid: Sigmoid,
}
_METHODS = {"relu": Relu, "tanh": Tanh, "sigmoid": Sigmoid}
_ADDS = (operator.add, torch.add)


def load_factory(target: str) -> nn.Module:
    """Call ``pkg.mod:factory`` (no arguments) and return the module it builds."""
    mod_name, sep, attr = target.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--module {target!r}: expected 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--module {target!r}: cannot import it ({exc})") from exc
    module = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    if not isinstance(module, nn.Module):
        raise ValueError(f"--module {target!r} gave {type(module).__name__}, expected a "
                         "torch.nn.Module")
    return module


def _describe(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        return f"node {node.name} ({type(sub).__name__} {node.target}: {sub})"
    name = getattr(node.target, "__name__", str(node.target))
    return f"node {node.name} ({node.op} {name})"


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.args if isinstance(a, fx.Node)]


def _layer(node: fx.Node, gm: fx.GraphModule) -> tuple[Any, list[fx.Node]]:
    """(spec layer, the traced nodes it reads) of one traced node, or UnsupportedLayer."""
    where = _describe(node, gm)
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        return layer_of(sub, f"node {node.name}"), _tensor_args(node)
    target = node.target
    if node.op == "call_function":
        name = getattr(target, "__name__", "")
        if "batch_norm" in name:
            raise UnsupportedLayer(f"{where}: {BATCHNORM_REASON}")
        if "dropout" in name:
            raise UnsupportedLayer(f"{where}: {DROPOUT_REASON}")
        if target in _ADDS and len(_tensor_args(node)) == 2 and len(node.args) == 2 \
                and not node.kwargs:
            return Add(), _tensor_args(node)
        if target is torch.cat:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
            parts = node.args[0]
            if dim == 1 and isinstance(parts, list | tuple) and len(parts) >= 2:
                return Concat(), list(parts)
            raise UnsupportedLayer(f"{where}: only concatenation of two or more tensors "
                                   f"along the channel axis (dim=1) is supported, got dim={dim}")
        if target is torch.flatten:
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            if start == 1 and node.kwargs.get("end_dim", -1) == -1 and len(node.args) <= 2:
                return Flatten(), _tensor_args(node)
            raise UnsupportedLayer(f"{where}: only flatten(x, 1) (keep the batch axis)")
        if target in _FUNCTIONS and len(node.args) == 1 and not node.kwargs:
            return _FUNCTIONS[target](), _tensor_args(node)
    if node.op == "call_method":
        if target == "flatten" and list(node.args[1:]) == [1] and not node.kwargs:
            return Flatten(), _tensor_args(node)
        if target in _METHODS and len(node.args) == 1 and not node.kwargs:
            return _METHODS[target](), _tensor_args(node)
    raise UnsupportedLayer(
        f"{where} cannot be exported for per-sample gradients: supported are the layers of "
        "models.zoo.layer_of as submodules, tensor + tensor (residual), torch.cat(..., dim=1), "
        "flatten(x, 1) and functional relu/tanh/sigmoid")


def spec_from_traced(module: nn.Module, input_shape: Sequence[int], num_classes: int,
                     name: str = "custom") -> ModelSpec:
    """The spec graph of ``module`` (traced with torch.fx; its nodes in traced order).

    Raises:
        UnsupportedLayer: naming the first traced operation outside the supported set.
        ValueError: a graph the spec refuses (shapes, a branch that reaches no output).
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise UnsupportedLayer(f"the module itself ({module}): {BATCHNORM_REASON}")
    try:
        gm = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many types on data-dependent control flow
        raise UnsupportedLayer(f"torch.fx cannot trace {type(module).__name__}: {exc}") from exc
    index: dict[fx.Node, int] = {}
    layers: list = []
    inputs: list[tuple[int, ...]] = []
    output: fx.Node | None = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if index:
                raise UnsupportedLayer(f"node {node.name}: the module takes more than one "
                                       "input; a spec reads one tensor x")
            index[node] = -1
            continue
        if node.op == "output":
            output = node.args[0] if isinstance(node.args[0], fx.Node) else None
            continue
        if node.op == "get_attr":
            raise UnsupportedLayer(f"{_describe(node, gm)}: reads a tensor attribute directly "
                                   "(a parameter outside a supported layer)")
        layer, reads = _layer(node, gm)
        missing = [r.name for r in reads if r not in index]
        if missing:
            raise UnsupportedLayer(f"{_describe(node, gm)} reads {missing}, not tensors of the "
                                   "model")
        index[node] = len(layers)
        layers.append(layer)
        inputs.append(tuple(index[r] for r in reads))
    if output is None or index.get(output) != len(layers) - 1:
        raise UnsupportedLayer("the module must return one tensor, the last operation it "
                               "computes (the logits)")
    return ModelSpec(name=name, input_shape=tuple(input_shape), num_classes=num_classes,
                     layers=tuple(layers), inputs=tuple(inputs))


def num_classes_of(module: nn.Module, input_shape: Sequence[int]) -> int:
    """The logits' width, by running the module on one zero input (float32, or int64 ids
    for a module that starts with an embedding)."""
    with torch.no_grad():
        try:
            out = module.eval()(torch.zeros((1, *input_shape), dtype=torch.float32))
        except RuntimeError:
            out = module.eval()(torch.zeros((1, *input_shape), dtype=torch.int64))
    if out.dim() != 2:
        raise ValueError(f"the module returns shape {tuple(out.shape)} for one sample, "
                         "expected (1, num_classes) logits")
    return int(out.shape[1])
