"""Issue 17's example models and their generated data: a depthwise-separable 1-D CNN for
sensor windows (``dscnn-har`` on ``synthetic-har``) and a DS-CNN for keyword spotting
(``dscnn-kws`` on ``synthetic-kws``). The committed ONNX graphs give torch.func's per-sample
gradients and Opacus' noisy step; the generated sets are what their docstrings say; each
example trains in a fleet (tools/configs/har.toml, kws.toml: the fast path here, MQTT in
docs/examples.md, the same model)."""

from __future__ import annotations

import numpy as np
import pytest
from test_layers import both, check_against_torch_func, check_opacus_step

from edge_sdk.engine import load_engine
from edge_sdk.model import build_spec, init_params
from models import manifest_path
from tools.datasets import load_dataset, synthetic_har, synthetic_kws
from tools.simconfig import load_config
from tools.simulate import simulate

EXAMPLES = {"dscnn-har": ("synthetic-har", (3, 128), 6, 1822),
            "dscnn-kws": ("synthetic-kws", (1, 49, 10), 8, 3336)}


@pytest.mark.parametrize("arch", sorted(EXAMPLES))
def test_the_zoo_builds_the_examples_and_names_a_wrong_shape(arch: str) -> None:
    _, shape, classes, count = EXAMPLES[arch]
    spec = build_spec(arch, shape, classes)
    assert sum(p.size for p in init_params(spec, np.random.default_rng(0))) == count
    with pytest.raises(ValueError, match=f"{arch} takes"):
        build_spec(arch, (1, 28, 28), classes)


@pytest.mark.parametrize("make, name, shape, classes", [
    (synthetic_har, "synthetic-har", (3, 128), 6),
    (synthetic_kws, "synthetic-kws", (1, 49, 10), 8)])
def test_generated_sets_are_deterministic_balanced_and_named(make, name, shape, classes) -> None:
    a, b, other = make(600), make(600), make(600, seed=1)
    assert a.name == name and a.num_classes == classes
    assert a.x_train.shape == (500, *shape) and a.x_test.shape == (100, *shape)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, other.x_train)
    counts = np.bincount(np.concatenate([a.y_train, a.y_test]), minlength=classes)
    assert counts.min() == counts.max() == 600 // classes
    assert np.isfinite(a.x_train).all()
    # the classes differ in the mean signal: a nearest-class-mean rule beats chance well
    means = np.stack([a.x_train[a.y_train == c].reshape(-1, np.prod(shape)).mean(0)
                      for c in range(classes)])
    flat = a.x_test.reshape(len(a.x_test), -1)
    if name == "synthetic-har":  # random phases: the classes live in the spectrum
        spec = np.abs(np.fft.rfft(a.x_train, axis=-1)).reshape(len(a.x_train), -1)
        means = np.stack([spec[a.y_train == c].mean(0) for c in range(classes)])
        flat = np.abs(np.fft.rfft(a.x_test, axis=-1)).reshape(len(a.x_test), -1)
    guess = np.argmin(((flat[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (guess == a.y_test).mean() > 2.0 / classes
    assert load_dataset(name).x_train.shape[1:] == shape  # the registered full set


@pytest.mark.slow  # the float64 Jacobian tolerance: 27 s (har), 442 s (kws) here
@pytest.mark.parametrize("arch", sorted(EXAMPLES))
def test_committed_graphs_match_torch_func_and_the_numpy_engine(arch: str) -> None:
    _, shape, classes, _ = EXAMPLES[arch]
    spec = build_spec(arch, shape, classes)
    engine = load_engine(manifest_path(spec.name, spec.input_shape, spec.num_classes))
    for b in (1, 5):
        check_against_torch_func(spec, (engine, *both(spec)), b=b, seed=b)


@pytest.mark.parametrize("arch", sorted(EXAMPLES))
def test_committed_graphs_take_opacus_noisy_step(arch: str, monkeypatch) -> None:
    _, shape, classes, _ = EXAMPLES[arch]
    spec = build_spec(arch, shape, classes)
    engine = load_engine(manifest_path(spec.name, spec.input_shape, spec.num_classes))
    check_opacus_step(spec, engine, monkeypatch)


@pytest.mark.parametrize("config", ["har", "kws"])
def test_each_example_trains_in_a_fleet(config: str) -> None:
    """A short fast-path run of the example's fleet config (the fleet over MQTT gives the
    same model: tests/test_one_path.py's equality, docs/examples.md's runs)."""
    cfg = load_config(f"tools/configs/{config}.toml", transport="inproc", secagg=False,
                      rounds=8, progress=False)
    summary = simulate(cfg)
    classes = EXAMPLES[f"dscnn-{config}"][2]
    assert summary["rounds_completed"] == 8 and summary["epsilon"] > 0
    assert summary["final_accuracy"] > 2.0 / classes  # twice chance after 8 rounds


@pytest.mark.slow  # two exports: about 30 s here
def test_fedge_export_of_the_examples_gives_the_committed_files(tmp_path) -> None:
    """`fedge export --only dscnn` writes the two examples' manifests byte for byte the
    committed ones and graphs that compute the same: equal nodes, attributes, weights and
    I/O once the exporter's debug metadata (per-node source paths of the exporting
    checkout) is dropped. A user can re-make them."""
    import onnx

    from models import ONNX_DIR
    from tools.cli import main

    def computation(path) -> bytes:
        model = onnx.load(path)
        for node in model.graph.node:
            del node.metadata_props[:]
        del model.metadata_props[:]
        return model.graph.SerializeToString()

    assert main(["export", "--only", "dscnn", "--out", str(tmp_path)]) == 0
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == sorted(p.name for p in ONNX_DIR.glob("dscnn-*"))
    assert len(made) == 8  # per model: manifest, inference, per-sample, masked graphs
    for name in made:
        if name.endswith(".json"):
            assert (tmp_path / name).read_bytes() == (ONNX_DIR / name).read_bytes(), name
        else:
            assert computation(tmp_path / name) == computation(ONNX_DIR / name), name
