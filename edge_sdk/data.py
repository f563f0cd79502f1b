"""The device owner's training data: ``.npz`` files and ``.npy`` pairs, checked against the model.

A device trains on files its owner put there, read with numpy alone (no simulation extras)::

    from edge_sdk.data import NpyPair, read_samples

    x, y = read_samples(["/var/lib/sensor/week1.npz",
                         NpyPair(x="/var/lib/sensor/x.npy", y="/var/lib/sensor/y.npy")],
                        input_shape=(64,), num_classes=10)

The formats (both as numpy writes them: ``np.savez``/``np.savez_compressed``, ``np.save``):

* ``.npz``: arrays named ``x`` and ``y`` (other arrays in the file are ignored);
* a ``.npy`` pair: one file holding ``x``, one holding ``y``.

In either, ``x`` is float32 of shape ``[m, *input_shape]`` (the model's input shape, e.g.
``[m, 64]`` or ``[m, 1, 28, 28]``), finite, and ``y`` is int64 of shape ``[m]`` with labels
in ``[0, num_classes)``; ``m >= 1``. Several sources are concatenated in the order given.
Nothing is converted silently (a float64 ``x`` may have been scaled for another model):
a file that differs is refused with a :class:`DataFileError` naming the file, the array,
what it holds and what was expected. Pickled (object) arrays are never loaded
(``allow_pickle=False``): unpickling a file runs code from whoever wrote it.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.errors import EdgeError

__all__ = ["DataFileError", "DataSource", "NpyPair", "check_samples", "read_samples"]

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with members, an empty zip
X_DTYPE, Y_DTYPE = np.dtype(np.float32), np.dtype(np.int64)


class DataFileError(EdgeError, ValueError):
    """A data file that cannot be trained on (the message names the file, the array, what
    it holds and what was expected)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NpyPair:
    """Two ``.npy`` files: ``x`` (features) and ``y`` (labels) of the same samples."""

    x: str | os.PathLike[str]
    y: str | os.PathLike[str]


DataSource = str | os.PathLike[str] | NpyPair
"""A ``.npz`` file's path, or an :class:`NpyPair`."""


def _magic(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(6)
    except FileNotFoundError:
        raise DataFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _refusal(where: str, exc: Exception) -> DataFileError:
    text = str(exc)
    if "pickle" in text.lower() or "object arrays" in text.lower():
        return DataFileError(f"{where}: holds pickled (object) data, refused (loading it would "
                             f"run code from the file); save plain numeric arrays "
                             f"(np.save / np.savez)")
    return DataFileError(f"{where}: not a readable numpy array ({type(exc).__name__}: {text})")


_LOAD_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error)


def _read_npy(path: Path, name: str) -> np.ndarray:
    where = f"{path} (array {name})"
    if _magic(path) != _NPY_MAGIC:
        raise DataFileError(f"{where}: not a .npy file (no numpy header); expected a file "
                            f"written by np.save")
    try:
        with path.open("rb") as f:  # ours to close, whatever np.load raises
            return np.load(f, allow_pickle=False)
    except _LOAD_ERRORS as exc:
        raise _refusal(where, exc) from None


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if _magic(path)[:4] not in _ZIP_MAGICS:
        raise DataFileError(f"{path}: not a .npz file (not a zip archive); expected a file "
                            f"written by np.savez or np.savez_compressed")
    try:
        # the file is ours to close: np.load leaks its handle on a truncated archive
        with path.open("rb") as f, np.load(f, allow_pickle=False) as archive:
            names = sorted(archive.files)
            missing = [n for n in ("x", "y") if n not in names]
            if missing:
                raise DataFileError(f"{path}: no array {' or '.join(map(repr, missing))}; it "
                                    f"holds {names}, expected arrays named 'x' and 'y'")
            arrays = {}
            for n in ("x", "y"):
                try:
                    arrays[n] = archive[n]
                except _LOAD_ERRORS as exc:
                    raise _refusal(f"{path} (array {n})", exc) from None
    except DataFileError:
        raise
    except _LOAD_ERRORS as exc:
        raise _refusal(str(path), exc) from None
    return arrays["x"], arrays["y"]


def check_samples(x: np.ndarray, y: np.ndarray, *, input_shape: Sequence[int],
                  num_classes: int, where: str = "data") -> None:
    """Raise :class:`DataFileError` unless (x, y) is a training set for the model.

    Args:
        x: features, float32 [m, *input_shape], finite.
        y: labels, int64 [m], each in [0, num_classes).
        input_shape: the model's input shape (one sample, without the batch axis).
        num_classes: the model's number of classes.
        where: what the message names (a file, or a file pair).
    """
    shape = tuple(int(s) for s in input_shape)
    want_x = f"float32 [m, {', '.join(map(str, shape))}]"
    if x.dtype != X_DTYPE:
        hint = " (convert with x.astype(np.float32))" if x.dtype.kind in "fiu" else ""
        raise DataFileError(f"{where}: array x has dtype {x.dtype}, expected {want_x}{hint}")
    if x.ndim != 1 + len(shape) or tuple(x.shape[1:]) != shape:
        raise DataFileError(f"{where}: array x has shape {list(x.shape)}, expected {want_x} "
                            f"(the model's input shape is {list(shape)})")
    if y.dtype != Y_DTYPE:
        hint = " (convert with y.astype(np.int64))" if y.dtype.kind in "iu" else ""
        raise DataFileError(f"{where}: array y has dtype {y.dtype}, expected int64 labels "
                            f"[m]{hint}")
    if y.ndim != 1:
        raise DataFileError(f"{where}: array y has shape {list(y.shape)}, expected int64 [m] "
                            f"(one label per sample)")
    if len(x) != len(y):
        raise DataFileError(f"{where}: x holds {len(x)} samples but y holds {len(y)} labels; "
                            f"expected one label per sample")
    if len(y) == 0:
        raise DataFileError(f"{where}: holds no samples (m = 0); expected at least one")
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        raise DataFileError(f"{where}: array x has NaN or infinite values in "
                            f"{int(bad.sum())} of {len(x)} samples (first: sample {first}); "
                            f"expected finite features")
    out = (y < 0) | (y >= num_classes)
    if out.any():
        first = int(np.argmax(out))
        raise DataFileError(f"{where}: array y has {int(out.sum())} labels outside "
                            f"[0, {num_classes}) (first: y[{first}] = {int(y[first])}); "
                            f"the model has {num_classes} classes")


def read_samples(sources: Sequence[DataSource], *, input_shape: Sequence[int],
                 num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read and check the owner's data files; the samples of all of them, in order.

    Args:
        sources: ``.npz`` paths and :class:`NpyPair` s (see the module docstring for the
            format); at least one.
        input_shape: the model's input shape (``ModelSpec.input_shape``).
        num_classes: the model's number of classes (``ModelSpec.num_classes``).

    Returns:
        (x float32 [m, *input_shape], y int64 [m]), m the total over the sources.

    Raises:
        DataFileError: a source missing, unreadable, pickled, or not as documented (the
            first problem found, naming its file and array).
    """
    if isinstance(sources, (str, os.PathLike, NpyPair)):
        sources = [sources]
    if not sources:
        raise DataFileError("no data files given; expected at least one .npz file or .npy pair")
    xs, ys = [], []
    for src in sources:
        if isinstance(src, NpyPair):
            px, py = Path(src.x), Path(src.y)
            x, y = _read_npy(px, "x"), _read_npy(py, "y")
            where = f"{px} + {py}"
        else:
            path = Path(src)
            if path.suffix != ".npz":
                raise DataFileError(f"{path}: expected a .npz file (a .npy file holds one "
                                    f"array: give x and y as a pair)")
            x, y = _read_npz(path)
            where = str(path)
        check_samples(x, y, input_shape=input_shape, num_classes=num_classes, where=where)
        xs.append(x)
        ys.append(y)
    if len(xs) == 1:
        return np.ascontiguousarray(xs[0]), np.ascontiguousarray(ys[0])
    return np.concatenate(xs), np.concatenate(ys)
