"""Export the zoo to ONNX: an inference graph and a per-sample-gradient graph per variant.

Both graphs take the weights as inputs (a new global model needs no re-export) and have a
dynamic batch dimension, checked after export because the exporter can silently fix it.
A JSON manifest beside them carries the spec and the parameter names/shapes the device
needs, and ``input_dtype: "int64"`` when the input is integer ids (a leading Embedding;
absent means float32). Run with ``fedge export``.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from edge_sdk.model import ModelSpec, build_spec, init_params
from models import ONNX_DIR
from models.persample import Logits, PerSampleGrad

OPSET = 18


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    arch: str
    input_shape: tuple[int, ...]
    num_classes: int

    @property
    def name(self) -> str:
        return variant_name(self.arch, self.input_shape, self.num_classes)


def variant_name(arch: str, input_shape: tuple[int, ...], num_classes: int) -> str:
    """File stem of an exported variant, e.g. ``cnn-1x28x28-10``."""
    return f"{arch}-{'x'.join(str(s) for s in input_shape)}-{num_classes}"


# What the bundled data sets need: Fashion-MNIST (1x28x28, 10), digits (64, 10),
# breast-cancer (30, 2); and the generated synthetic-har (3x128, 6) and synthetic-kws
# (1x49x10, 8).
VARIANTS: tuple[Variant, ...] = (
    *(Variant(arch=a, input_shape=(1, 28, 28), num_classes=10) for a in ("logreg", "mlp", "cnn")),
    *(Variant(arch=a, input_shape=(64,), num_classes=10) for a in ("logreg", "mlp", "tabular")),
    *(Variant(arch=a, input_shape=(30,), num_classes=2) for a in ("logreg", "mlp", "tabular")),
    # the example models (issue 17) on their generated data sets (tools.datasets)
    Variant(arch="dscnn-har", input_shape=(3, 128), num_classes=6),
    Variant(arch="dscnn-kws", input_shape=(1, 49, 10), num_classes=8),
)


class ExportError(RuntimeError):
    """The exported graph is not what the device needs (e.g. a fixed batch dimension)."""


def _check_dynamic_batch(model: onnx.ModelProto, inputs: list[str], path: Path) -> None:
    for value in model.graph.input:
        if value.name in inputs:
            dim = value.type.tensor_type.shape.dim[0]
            if not dim.dim_param:
                raise ExportError(
                    f"{path.name}: input {value.name!r} has a fixed batch dim {dim.dim_value}, "
                    "expected a symbolic one"
                )


def _export(module: torch.nn.Module, args: tuple, names_in: list[str], names_out: list[str],
            batch_inputs: list[str], path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    dynamic = tuple({0: batch} if n in batch_inputs else None for n in names_in)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=names_in,
            output_names=names_out,
            dynamic_shapes=(dynamic,),  # forward(*args): one varargs entry
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    _check_dynamic_batch(model, batch_inputs, path)


def export_variant(spec: ModelSpec, out_dir: Path = ONNX_DIR, *, plain: bool = False,
                   digests: bool = False) -> Path:
    """Write ``<name>.{grad,maskgrad,infer}.onnx`` and ``<name>.json``; return the json.

    ``plain``: also ``<name>.plaingrad.onnx``, ``(*params, x, y) -> (losses, *grad_sums)``,
    the batch's unclipped summed gradient for the device-level mode, recorded in the
    manifest as ``plain_grad_graph`` (without it a device computes the same sum from the
    per-sample graph with clip = inf). ``digests``: the manifest records each graph's sha256
    (``graph_sha256``), and a device refuses a graph file that does not match it. Both off
    by default so the zoo's files stay as they are."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = variant_name(spec.name, spec.input_shape, spec.num_classes)
    shapes = spec.param_shapes()
    rng = np.random.default_rng(0)
    params = tuple(torch.tensor(p) for p in init_params(spec, rng))
    b = 4
    if spec.input_dtype == "int64":  # ids for a leading Embedding
        rows = spec.layers[0].num_embeddings
        x = torch.tensor(rng.integers(0, rows, (b, *spec.input_shape)), dtype=torch.int64)
    else:
        x = torch.tensor(rng.standard_normal((b, *spec.input_shape)).astype(np.float32))
    y = torch.tensor(rng.integers(0, spec.num_classes, b), dtype=torch.int64)
    clip = torch.tensor(1.0, dtype=torch.float32)
    pnames = [n for n, _ in shapes]
    grad_outputs = ["norms", "losses", *(f"grad.{n}" for n in pnames)]
    _export(PerSampleGrad(spec), (*params, x, y, clip), [*pnames, "x", "y", "clip"],
            grad_outputs, ["x", "y"], out_dir / f"{name}.grad.onnx")
    masks = tuple((torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) < 0.5).float()
                  for p in params)
    mnames = [f"mask.{n}" for n in pnames]
    _export(PerSampleGrad(spec, masked=True), (*params, *masks, x, y, clip),
            [*pnames, *mnames, "x", "y", "clip"], grad_outputs, ["x", "y"],
            out_dir / f"{name}.maskgrad.onnx")
    _export(Logits(spec), (*params, x), [*pnames, "x"], ["logits"], ["x"],
            out_dir / f"{name}.infer.onnx")
    if plain:
        _export(PerSampleGrad(spec, plain=True), (*params, x, y), [*pnames, "x", "y"],
                ["losses", *(f"grad.{n}" for n in pnames)], ["x", "y"],
                out_dir / f"{name}.plaingrad.onnx")
    manifest = {
        "format": 1,
        "name": name,
        "spec": spec.to_dict(),
        "params": [{"name": n, "shape": list(s)} for n, s in shapes],
        "grad_graph": f"{name}.grad.onnx",
        "infer_graph": f"{name}.infer.onnx",
        "masked_grad_graph": f"{name}.maskgrad.onnx",
        "grad_outputs": grad_outputs,
        "opset": OPSET,
    }
    if plain:
        manifest["plain_grad_graph"] = f"{name}.plaingrad.onnx"
    if digests:  # what the graphs compute, bound to the spec beside it
        manifest["graph_sha256"] = {
            key: hashlib.sha256((out_dir / manifest[key]).read_bytes()).hexdigest()
            for key in ("grad_graph", "masked_grad_graph", "infer_graph", "plain_grad_graph")
            if key in manifest}
    if spec.input_dtype != "float32":  # float models' manifests keep their form
        manifest["input_dtype"] = spec.input_dtype
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def export_all(out_dir: Path = ONNX_DIR, only: str | None = None) -> list[Path]:
    """Export every zoo variant (or those whose name contains ``only``)."""
    written = []
    for v in VARIANTS:
        if only and only not in v.name:
            continue
        written.append(export_variant(build_spec(v.arch, v.input_shape, v.num_classes), out_dir))
    return written


def export_module(target: str, input_shape: Sequence[int], num_classes: int | None = None,
                  out_dir: Path = ONNX_DIR, name: str | None = None) -> Path:
    """``fedge export --module pkg.mod:factory``: trace the factory's module (torch.fx), map
    it onto a spec graph (naming the first unsupported operation), export its per-sample,
    masked, plain and inference graphs and a manifest recording the spec and each graph's
    sha256. ``num_classes`` defaults to the width of the module's output."""
    from models.trace import load_factory, num_classes_of, spec_from_traced

    module = load_factory(target)
    shape = tuple(int(v) for v in input_shape)
    if num_classes is None:
        num_classes = num_classes_of(module, shape)
    spec = spec_from_traced(module, shape, num_classes, name or target.rpartition(":")[2])
    return export_variant(spec, out_dir, plain=True, digests=True)
