"""Model specs and the exported manifests: shapes, round trips, clear errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from edge_sdk.engine import load_engine, load_manifest
from edge_sdk.model import (
    ModelSpec,
    UnsupportedLayer,
    build_spec,
    flatten_params,
    init_params,
    unflatten_params,
)
from models import ONNX_DIR, manifest_path


def test_fed_spa_cnn_has_the_papers_shape() -> None:
    spec = build_spec("cnn", (1, 28, 28), 10)
    assert [s for _, s in spec.param_shapes()] == [
        (10, 1, 5, 5), (10,), (20, 10, 5, 5), (20,), (50, 320), (50,), (10, 50), (10,),
    ]
    assert spec.num_params == 21840


def test_spec_round_trips_through_dict() -> None:
    for arch in ("logreg", "mlp", "tabular"):
        spec = build_spec(arch, (30,), 2)
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_flatten_round_trip_and_length_check() -> None:
    spec = build_spec("mlp", (64,), 10)
    params = init_params(spec, np.random.default_rng(0))
    back = unflatten_params(spec, flatten_params(params))
    for a, b in zip(params, back, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"expected \(\d+,\)"):
        unflatten_params(spec, np.zeros(3, dtype=np.float32))


def test_unsupported_layer_is_named() -> None:
    data = build_spec("logreg", (30,), 2).to_dict()
    data["layers"].append({"kind": "batchnorm"})
    with pytest.raises(UnsupportedLayer, match="batchnorm"):
        ModelSpec.from_dict(data)


def test_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="cnn takes"):
        build_spec("cnn", (64,), 10)
    with pytest.raises(ValueError, match="unknown model"):
        build_spec("resnet", (64,), 10)


@pytest.mark.parametrize("path", sorted(ONNX_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_exported_graphs_have_a_dynamic_batch_and_weights_as_inputs(path) -> None:
    manifest = load_manifest(path)
    for graph in (manifest.grad_graph, manifest.masked_grad_graph, manifest.infer_graph):
        model = onnx.load(str(graph))
        inputs = {v.name: v for v in model.graph.input}
        assert inputs["x"].type.tensor_type.shape.dim[0].dim_param, "batch dim is fixed"
        for name, shape in manifest.spec.param_shapes():
            dims = [d.dim_value for d in inputs[name].type.tensor_type.shape.dim]
            assert tuple(dims) == shape
        assert not model.graph.initializer or all(
            i.name not in dict(manifest.spec.param_shapes()) for i in model.graph.initializer
        )


def test_engine_rejects_wrong_shapes() -> None:
    engine = load_engine(manifest_path("logreg", (30,), 2))
    params = init_params(engine.spec, np.random.default_rng(0))
    x = np.zeros((4, 30), dtype=np.float32)
    y = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="parameter l0.weight has shape"):
        engine.clipped_grad_sum([params[0].T, params[1]], x, y, 1.0)
    with pytest.raises(ValueError, match="y has shape"):
        engine.clipped_grad_sum(params, x, y[:3], 1.0)
    with pytest.raises(ValueError, match="empty batch"):
        engine.logits(params, x[:0])


def test_missing_variant_names_the_fix() -> None:
    with pytest.raises(FileNotFoundError, match="fedge export"):
        manifest_path("cnn", (3, 32, 32), 10)


def test_corrupted_manifest_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid fedge model manifest"):
        load_manifest(bad)


def test_export_refuses_unsupported_torch_layers_by_name() -> None:
    from torch import nn

    from models.zoo import spec_from_module

    ok = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    assert spec_from_module(ok, (1, 8, 8), 10).num_params == 64 * 16 + 16 + 16 * 10 + 10
    bad = nn.Sequential(nn.Linear(30, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayer, match=r"layer 1 \(BatchNorm1d"):
        spec_from_module(bad, (30,), 2)
    circular = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"))
    with pytest.raises(UnsupportedLayer, match="layer 0 \\(Conv2d"):  # groups work since i17
        spec_from_module(circular, (2, 28, 28), 10)
