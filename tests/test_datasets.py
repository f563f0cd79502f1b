"""Data sets and partitions: shapes, clear errors for missing/corrupted files, properties."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tools.datasets import DatasetMissing, load_dataset, load_train_subset, read_idx
from tools.partition import parse_scheme, partition


@pytest.mark.parametrize(
    ("name", "shape", "n_train", "n_test", "classes"),
    [
        ("fashion-mnist", (1, 28, 28), 60000, 10000, 10),
        ("digits", (64,), 1437, 360, 10),
        ("breast-cancer", (30,), 455, 114, 2),
    ],
)
def test_datasets_load(name, shape, n_train, n_test, classes) -> None:
    ds = load_dataset(name)
    assert ds.input_shape == shape
    assert (len(ds.y_train), len(ds.y_test), ds.num_classes) == (n_train, n_test, classes)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert set(np.unique(ds.y_train)) == set(range(classes))
    assert np.isfinite(ds.x_train).all()
    with pytest.raises(ValueError, match="read-only"):
        ds.x_train[0] = 0


def test_missing_fashion_mnist_names_the_package(tmp_path) -> None:
    with pytest.raises(DatasetMissing, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", root=tmp_path)


def test_corrupted_idx_names_the_file(tmp_path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    header = (2051).to_bytes(4, "big") + b"".join(v.to_bytes(4, "big") for v in (2, 28, 28))
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(100))  # 2 images need 1568 bytes
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: .* expected"):
        read_idx(path, 2051)
    path.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="not a readable gzip"):
        read_idx(path, 2051)


def test_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")


@pytest.mark.parametrize("bad", ["", "het", "het:0", "dirichlet:-1", "dirichlet:x", "zipf:2"])
def test_bad_scheme_lists_the_forms(bad: str) -> None:
    with pytest.raises(ValueError, match="expected 'iid'"):
        parse_scheme(bad)


@settings(max_examples=60, deadline=None)
@given(
    n_samples=st.integers(20, 400),
    n_classes=st.integers(2, 10),
    n_devices=st.integers(1, 20),
    scheme=st.sampled_from(["iid", "het:1", "het:2", "het:3", "dirichlet:0.5", "dirichlet:5"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_partition_properties(n_samples, n_classes, n_devices, scheme, seed) -> None:
    labels = np.arange(n_samples) % n_classes
    p = parse_scheme(scheme)
    if p.kind == "het" and p.k > n_classes:
        return
    try:
        shards = partition(labels, n_devices, scheme, np.random.default_rng(seed),
                           num_classes=n_classes)
    except ValueError as exc:  # only an honest refusal is allowed
        assert "dirichlet" in str(exc) or "het" in str(exc)
        return
    assert len(shards) == n_devices
    flat = np.concatenate(shards)
    assert len(flat) == len(np.unique(flat))  # disjoint
    assert all(len(s) >= 1 for s in shards)
    if p.kind != "het" or n_devices * p.k >= n_classes:
        assert len(flat) == n_samples  # covers every sample
    if p.kind == "het":
        assert all(len(np.unique(labels[s])) == p.k for s in shards)
    again = partition(labels, n_devices, scheme, np.random.default_rng(seed),
                      num_classes=n_classes)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def test_het2_on_fashion_mnist() -> None:
    y = load_dataset("fashion-mnist").y_train
    shards = partition(y, 100, "het:2", np.random.default_rng(0))
    assert all(len(np.unique(y[s])) == 2 for s in shards)
    assert sum(len(s) for s in shards) == 60000


@pytest.mark.parametrize("name", ["fashion-mnist", "digits"])
def test_train_subset_equals_indexing_the_whole_set(name: str) -> None:
    ds = load_dataset(name)
    pick = lambda y: np.flatnonzero(y == 3)[:50]  # noqa: E731
    x, y = load_train_subset(name, pick)
    idx = pick(ds.y_train)
    np.testing.assert_array_equal(x, ds.x_train[idx])
    np.testing.assert_array_equal(y, ds.y_train[idx])
    assert x.dtype == np.float32 and y.dtype == np.int64


def test_train_subset_missing_fashion_mnist_names_the_package(tmp_path) -> None:
    with pytest.raises(DatasetMissing, match="dataset-fashion-mnist"):
        load_train_subset("fashion-mnist", lambda y: y[:1], root=tmp_path)
