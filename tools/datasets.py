"""Data sets for simulated fleets: Fashion-MNIST (Debian package), sklearn's bundled sets, and
two GENERATED sets for the sensor and keyword-spotting example models.

Nothing is downloaded at run time. Fashion-MNIST comes from the Debian package
``dataset-fashion-mnist`` (IDX files under /usr/share/datasets/fashion-mnist); ``digits``
and ``breast-cancer`` ship inside scikit-learn. ``synthetic-har`` and ``synthetic-kws`` are
generated here from fixed seeds (numpy only; no real recordings are bundled on this machine),
and their names say so: :func:`synthetic_har` (3-axis accelerometer-like windows, one
activity per class) and :func:`synthetic_kws` (MFCC-like frames, one keyword per class).
Loaded sets are cached in-process and returned read-only so the cache cannot be corrupted
by a caller.
"""

from __future__ import annotations

import functools
import gzip
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["DATASETS", "Dataset", "DatasetMissing", "load_dataset", "read_idx", "synthetic_har",
           "synthetic_kws"]

DATASETS = ("fashion-mnist", "digits", "breast-cancer", "synthetic-har", "synthetic-kws")
GENERATED = ("synthetic-har", "synthetic-kws")
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST training-set pixel mean and std (after scaling to [0, 1]).
_FMNIST_MEAN, _FMNIST_STD = 0.2860, 0.3530


class DatasetMissing(RuntimeError):
    """A data set's files are not on this machine (the message names the package)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def read_idx(path: Path, magic: int) -> np.ndarray:
    """Read a gzipped IDX file of unsigned bytes (magic 2051: images, 2049: labels)."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip IDX file ({exc})") from exc
    if len(raw) < 8 or int.from_bytes(raw[:4], "big") != magic:
        got = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
        raise ValueError(f"{path}: IDX magic {got}, expected {magic}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise ValueError(f"{path}: {len(raw)} bytes, expected {expected} for shape {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _readonly(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def _standardise(raw: np.ndarray) -> np.ndarray:
    """Fashion-MNIST uint8 images [N, 28, 28] -> standardised float32 [N, 1, 28, 28]."""
    x = (raw.astype(np.float32) / 255.0 - _FMNIST_MEAN) / _FMNIST_STD
    return np.ascontiguousarray(x[:, None, :, :])


_FMNIST_FILES = {
    "xtr": "train-images-idx3-ubyte.gz", "ytr": "train-labels-idx1-ubyte.gz",
    "xte": "t10k-images-idx3-ubyte.gz", "yte": "t10k-labels-idx1-ubyte.gz",
}


def _fashion_mnist(root: Path) -> Dataset:
    files = _FMNIST_FILES
    missing = [n for n in files.values() if not (root / n).exists()]
    if missing:
        raise DatasetMissing(
            f"Fashion-MNIST not found in {root} (missing {', '.join(missing)}); install it with "
            "`apt-get install dataset-fashion-mnist` (tools/setup.sh does this as root)"
        )

    def images(name: str) -> np.ndarray:
        return _standardise(read_idx(root / name, 2051))

    def labels(name: str) -> np.ndarray:
        return read_idx(root / name, 2049).astype(np.int64)

    ds = Dataset(name="fashion-mnist", x_train=images(files["xtr"]), y_train=labels(files["ytr"]),
                 x_test=images(files["xte"]), y_test=labels(files["yte"]), num_classes=10)
    if len(ds.x_train) != len(ds.y_train) or len(ds.x_test) != len(ds.y_test):
        raise ValueError(f"{root}: image and label counts differ")
    return ds


def _sklearn(name: str) -> Dataset:
    try:
        from sklearn.datasets import load_breast_cancer, load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as exc:  # the device stack alone: no [sim] extra
        raise DatasetMissing(
            f"the data set {name!r} ships inside scikit-learn, which is not installed here "
            f"(no module {exc.name!r}): install the simulation extra, `pip install "
            f"'fedge[sim]'`, or train a device on its owner's files (`fedge device --data "
            f"FILE.npz`, see edge_sdk.data)") from None

    if name == "digits":
        x, y = load_digits(return_X_y=True)
        x = x / 16.0
    else:
        x, y = load_breast_cancer(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    if name == "breast-cancer":  # standardise with the training split's statistics only
        mu, sd = xtr.mean(axis=0), xtr.std(axis=0)
        sd[sd == 0] = 1.0
        xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    return Dataset(
        name=name,
        x_train=np.ascontiguousarray(xtr, dtype=np.float32),
        y_train=ytr.astype(np.int64),
        x_test=np.ascontiguousarray(xte, dtype=np.float32),
        y_test=yte.astype(np.int64),
        num_classes=int(y.max()) + 1,
    )


def _split(name: str, x: np.ndarray, y: np.ndarray, classes: int, n_test: int) -> Dataset:
    """The last ``n_test`` of a generated set (already in random order) as its test split."""
    return Dataset(name=name,
                   x_train=np.ascontiguousarray(x[:-n_test], dtype=np.float32),
                   y_train=y[:-n_test].astype(np.int64),
                   x_test=np.ascontiguousarray(x[-n_test:], dtype=np.float32),
                   y_test=y[-n_test:].astype(np.int64), num_classes=classes)


def synthetic_har(n: int = 6000, *, seed: int = 0, classes: int = 6,
                  length: int = 128) -> Dataset:
    """GENERATED accelerometer-like windows [3, length] (not recordings): class c is an
    activity whose three axes oscillate at its own frequencies f_c = (0.6 + 0.45 c) cycles
    per 32 samples on axis 0, 1.3 f_c on axis 1, 0.7 f_c on axis 2, each with a random
    phase, an amplitude in [0.6, 1.4], a class-specific gravity offset on one axis and
    Gaussian noise of std 0.5 (so neighbouring classes overlap). Balanced classes, random
    order from ``seed``; the last 1/6 is the test split."""
    rng = np.random.default_rng([seed, 0x4A52])
    y = rng.permutation(np.arange(n) % classes)
    t = np.arange(length, dtype=np.float64) / 32.0
    f = 0.6 + 0.45 * y[:, None, None] * np.array([1.0, 1.3, 0.7])[None, :, None]
    phase = rng.uniform(0, 2 * np.pi, size=(n, 3, 1))
    amp = rng.uniform(0.6, 1.4, size=(n, 3, 1))
    x = amp * np.sin(2 * np.pi * f * t[None, None, :] + phase)
    x[np.arange(n), y % 3, :] += 0.5 * (1 + y // 3)[:, None]  # gravity on one axis
    x += rng.normal(0.0, 0.5, size=x.shape)
    return _split("synthetic-har", x, y, classes, n // 6)


def synthetic_kws(n: int = 6000, *, seed: int = 0, classes: int = 8, frames: int = 49,
                  coeffs: int = 10) -> Dataset:
    """GENERATED MFCC-like frames [1, frames, coeffs] (not speech): keyword c is a smooth
    random spectral envelope over the coefficients (its own template from ``seed``), spoken
    for 15-30 frames starting at a random time, its envelope drifting by up to one
    coefficient over the utterance; silence and Gaussian noise of std 0.6 elsewhere and on
    top. Balanced classes, random order from ``seed``; the last 1/6 is the test split."""
    rng = np.random.default_rng([seed, 0x4B57])
    templates = rng.normal(0.0, 1.0, size=(classes, coeffs))
    templates = (templates + np.roll(templates, 1, axis=1)) / 2  # smooth envelopes
    y = rng.permutation(np.arange(n) % classes)
    x = rng.normal(0.0, 0.6, size=(n, 1, frames, coeffs))
    lengths = rng.integers(15, 31, size=n)
    starts = rng.integers(0, frames - lengths + 1)
    drift = rng.uniform(-1.0, 1.0, size=n)
    grid = np.arange(coeffs, dtype=np.float64)
    for i in range(n):
        steps = np.arange(lengths[i])
        shift = drift[i] * steps / max(1, lengths[i] - 1)
        env = np.stack([np.interp(grid - s, grid, templates[y[i]]) for s in shift])
        x[i, 0, starts[i]:starts[i] + lengths[i]] += 1.5 * env
    return _split("synthetic-kws", x, y, classes, n // 6)


@functools.lru_cache(maxsize=8)
def _load(name: str, root: str) -> Dataset:
    if name == "synthetic-har":
        ds = synthetic_har()
    elif name == "synthetic-kws":
        ds = synthetic_kws()
    else:
        ds = _fashion_mnist(Path(root)) if name == "fashion-mnist" else _sklearn(name)
    _readonly(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    return ds


def load_train_subset(name: str, select: Callable[[np.ndarray], np.ndarray], *,
                      root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One device's share of a training set, without holding the whole set as floats.

    A device agent needs only its shard: for Fashion-MNIST the labels are read first,
    ``select(labels)`` picks the indices, and only those images are converted to float32
    (the whole standardised training set alone is 179 MiB, a third of a Pi-class
    device's memory budget).

    Args:
        name: one of :data:`DATASETS`.
        select: labels [N] (int64) -> indices of the samples to keep.
        root: directory of the Fashion-MNIST IDX files (default: the Debian package's).

    Returns:
        (x, y) of the selected training samples, as :func:`load_dataset` would give them.
    """
    if name != "fashion-mnist":
        ds = load_dataset(name, root=root)
        idx = select(ds.y_train)
        return ds.x_train[idx], ds.y_train[idx]
    base = Path(root) if root is not None else FASHION_MNIST_DIR
    if not (base / _FMNIST_FILES["ytr"]).exists():
        load_dataset(name, root=root)  # raises DatasetMissing naming the package
    y = read_idx(base / _FMNIST_FILES["ytr"], 2049).astype(np.int64)
    idx = select(y)
    raw = read_idx(base / _FMNIST_FILES["xtr"], 2051)
    if len(raw) != len(y):
        raise ValueError(f"{base}: image and label counts differ")
    return _standardise(raw[idx]), y[idx]


def load_dataset(name: str, *, root: str | Path | None = None) -> Dataset:
    """Load a data set by name (one of :data:`DATASETS`); arrays are read-only.

    Args:
        name: ``fashion-mnist`` (x [N, 1, 28, 28], standardised pixels), ``digits``
            (x [N, 64] in [0, 1]) or ``breast-cancer`` (x [N, 30], standardised).
        root: directory of the Fashion-MNIST IDX files (default: the Debian package's).

    Raises:
        ValueError: unknown name or a corrupted file. DatasetMissing: files not installed.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    return _load(name, str(root if root is not None else FASHION_MNIST_DIR))
