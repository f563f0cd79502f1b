"""Data sets for simulated fleets: Fashion-MNIST (Debian package) and sklearn's bundled sets.

Nothing is downloaded at run time. Fashion-MNIST comes from the Debian package
``dataset-fashion-mnist`` (IDX files under /usr/share/datasets/fashion-mnist); ``digits``
and ``breast-cancer`` ship inside scikit-learn. Loaded sets are cached in-process and
returned read-only so the cache cannot be corrupted by a caller.
"""

from __future__ import annotations

import functools
import gzip
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["DATASETS", "Dataset", "DatasetMissing", "load_dataset", "read_idx"]

DATASETS = ("fashion-mnist", "digits", "breast-cancer")
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


@functools.lru_cache(maxsize=8)
def _load(name: str, root: str) -> Dataset:
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
