"""The device owner's data files (edge_sdk.data): good files load, each bad one is refused
with a message naming the file, the array, what it holds and what was expected; and the
``fedge device`` data options (files, or a bundled set only where [sim] is installed)."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.data import DataFileError, NpyPair, check_samples, read_samples

SHAPE, CLASSES = (4,), 3
REPO = Path(__file__).resolve().parents[1]


def good(m: int = 5, shape: tuple[int, ...] = SHAPE) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, *shape)).astype(np.float32)
    return x, (np.arange(m) % CLASSES).astype(np.int64)


def npz(tmp_path: Path, name: str = "d.npz", **arrays: np.ndarray) -> Path:
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def read(*sources: object, shape: tuple[int, ...] = SHAPE) -> tuple[np.ndarray, np.ndarray]:
    return read_samples(list(sources), input_shape=shape, num_classes=CLASSES)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- good files


def test_npz_npy_pair_and_several_sources_concatenated_in_order(tmp_path: Path) -> None:
    x1, y1 = good(5)
    x2, y2 = good(7)
    a = npz(tmp_path, "a.npz", x=x1, y=y1, note=np.zeros(2))  # other arrays are ignored
    np.save(tmp_path / "x.npy", x2)
    np.save(tmp_path / "y.npy", y2)
    pair = NpyPair(x=tmp_path / "x.npy", y=str(tmp_path / "y.npy"))
    x, y = read(a)
    assert x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, x1)
    np.testing.assert_array_equal(y, y1)
    x, y = read(pair, a)
    np.testing.assert_array_equal(x, np.concatenate([x2, x1]))
    np.testing.assert_array_equal(y, np.concatenate([y2, y1]))
    # one path alone, a compressed archive, an image-shaped model input
    xi, yi = good(3, (1, 2, 2))
    c = tmp_path / "c.npz"
    np.savez_compressed(c, x=xi, y=yi)
    x, y = read_samples(c, input_shape=(1, 2, 2), num_classes=CLASSES)
    np.testing.assert_array_equal(x, xi)


# ----------------------------------------------------------------------- bad files


def refused(match: str, *sources: object, shape: tuple[int, ...] = SHAPE) -> str:
    with pytest.raises(DataFileError, match=match) as info:
        read(*sources, shape=shape)
    return str(info.value)


def test_wrong_dtypes_are_refused_not_converted(tmp_path: Path) -> None:
    x, y = good()
    f = npz(tmp_path, x=x.astype(np.float64), y=y)
    msg = refused("array x has dtype float64, expected float32 \\[m, 4\\]", f)
    assert str(f) in msg and "astype(np.float32)" in msg
    f = npz(tmp_path, x=x, y=y.astype(np.int32))
    assert "astype(np.int64)" in refused(r"array y has dtype int32, expected int64", f)
    f = npz(tmp_path, x=x, y=y.astype(np.float32))
    refused(r"array y has dtype float32, expected int64 labels", f)


def test_wrong_shapes_are_refused(tmp_path: Path) -> None:
    x, y = good()
    msg = refused(r"array x has shape \[5, 5\], expected float32 \[m, 4\]",
                  npz(tmp_path, x=np.zeros((5, 5), np.float32), y=y))
    assert "input shape is [4]" in msg
    refused(r"array x has shape \[20\], expected", npz(tmp_path, x=x.reshape(-1), y=y))
    refused(r"array x has shape \[5, 4\], expected float32 \[m, 1, 2, 2\]",
            npz(tmp_path, x=x, y=y), shape=(1, 2, 2))
    refused(r"array y has shape \[5, 1\], expected int64 \[m\]",
            npz(tmp_path, x=x, y=y[:, None]))


def test_mismatched_lengths_empty_nonfinite_and_out_of_range(tmp_path: Path) -> None:
    x, y = good()
    refused(r"x holds 5 samples but y holds 4 labels", npz(tmp_path, x=x, y=y[:4]))
    refused(r"holds no samples \(m = 0\)", npz(tmp_path, x=x[:0], y=y[:0]))
    for bad in (np.nan, np.inf, -np.inf):
        xb = x.copy()
        xb[3, 1] = bad
        refused(r"array x has NaN or infinite values in 1 of 5 samples \(first: sample 3\)",
                npz(tmp_path, x=xb, y=y))
    for label in (-1, CLASSES):
        yb = y.copy()
        yb[2] = label
        refused(rf"array y has 1 labels outside \[0, 3\) \(first: y\[2\] = {label}\)",
                npz(tmp_path, x=x, y=yb))


def test_missing_arrays_and_files(tmp_path: Path) -> None:
    x, y = good()
    msg = refused(r"no array 'y'; it holds \['X', 'x'\], expected arrays named 'x' and 'y'",
                  npz(tmp_path, x=x, X=y))
    assert str(tmp_path / "d.npz") in msg
    refused(re.escape(f"{tmp_path / 'nope.npz'}: no such file"), tmp_path / "nope.npz")
    np.save(tmp_path / "x.npy", x)
    refused(re.escape(f"{tmp_path / 'y.npy'}: no such file"),
            NpyPair(x=tmp_path / "x.npy", y=tmp_path / "y.npy"))
    refused(r"expected a \.npz file \(a \.npy file holds one array", tmp_path / "x.npy")
    with pytest.raises(DataFileError, match="no data files given"):
        read()


def test_corrupt_and_foreign_files(tmp_path: Path) -> None:
    x, y = good()
    text = tmp_path / "text.npz"
    text.write_text("time,temp\n0,21.5\n")
    refused(r"text\.npz: not a \.npz file \(not a zip archive\)", text)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    refused(r"text\.npz \(array y\): not a \.npy file \(no numpy header\)",
            NpyPair(x=tmp_path / "x.npy", y=text))
    # a truncated archive and a truncated .npy
    whole = npz(tmp_path, x=x, y=y).read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole[: len(whole) // 2])
    refused(r"cut\.npz.*not a readable numpy array", cut)
    short = tmp_path / "short.npy"
    short.write_bytes((tmp_path / "x.npy").read_bytes()[:-7])
    refused(r"short\.npy \(array x\): not a readable numpy array",
            NpyPair(x=short, y=tmp_path / "y.npy"))


def test_pickled_object_arrays_are_never_loaded(tmp_path: Path) -> None:
    x, y = good()
    ran = tmp_path / "ran"

    class Boom:  # unpickling it would create a file: it must never happen
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path.touch, (ran,))  # type: ignore[return-value]

    obj = np.empty(5, dtype=object)
    obj[:] = [Boom()] * 5
    f = npz(tmp_path, x=x, y=obj)
    msg = refused(r"d\.npz \(array y\): holds pickled \(object\) data, refused", f)
    assert "np.savez" in msg
    np.save(tmp_path / "y.npy", obj, allow_pickle=True)
    np.save(tmp_path / "x.npy", x)
    refused(r"y\.npy \(array y\): holds pickled \(object\) data, refused",
            NpyPair(x=tmp_path / "x.npy", y=tmp_path / "y.npy"))
    # a bare pickle named .npy
    (tmp_path / "p.npy").write_bytes(pickle.dumps(y))
    refused(r"p\.npy \(array x\): not a \.npy file", NpyPair(x=tmp_path / "p.npy",
                                                            y=tmp_path / "y.npy"))
    assert not ran.exists()


def test_the_first_bad_source_is_named(tmp_path: Path) -> None:
    x, y = good()
    ok = npz(tmp_path, "ok.npz", x=x, y=y)
    bad = npz(tmp_path, "bad.npz", x=x, y=y + CLASSES)
    msg = refused(r"bad\.npz: array y has 5 labels outside", ok, bad)
    assert "ok.npz" not in msg


def test_check_samples_takes_arrays_from_anywhere() -> None:
    from edge_sdk.errors import EdgeError

    assert issubclass(DataFileError, EdgeError) and issubclass(DataFileError, ValueError)
    x, y = good()
    check_samples(x, y, input_shape=SHAPE, num_classes=CLASSES)
    with pytest.raises(DataFileError, match=r"^sensor: array y has 5 labels outside \[0, 2\)"):
        check_samples(x, y + 2, input_shape=SHAPE, num_classes=2, where="sensor")


# ----------------------------------------------------------------------- fedge device


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cli", "device", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


def test_device_cli_refuses_bad_data_with_a_message_not_a_traceback(tmp_path: Path) -> None:
    from tools.enroll import enroll

    fleet = enroll(tmp_path / "fleet", devices=1, fleet="lab", broker=True, tls=False,
                   port=18830, model="logreg-64-10")
    config = str(next(iter(fleet.device_configs.values())))
    x = np.zeros((3, 63), np.float32)
    bad = npz(tmp_path, x=x, y=np.zeros(3, np.int64))
    r = cli("--config", config, "--data", str(bad))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"fedge device: error: {bad}: array x has shape [3, 63], "
                                f"expected float32 [m, 64] (the model's input shape is [64])")
    # good files: a .npz and a .npy pair, read whole (--rounds 0: start, then stop)
    xg, yg = np.zeros((4, 64), np.float32), np.arange(4, dtype=np.int64)
    ok = npz(tmp_path, "ok.npz", x=xg, y=yg)
    np.save(tmp_path / "x.npy", xg[:3])
    np.save(tmp_path / "y.npy", yg[:3])
    r = cli("--config", config, "--data", str(ok), "--data-npy", str(tmp_path / "x.npy"),
            str(tmp_path / "y.npy"), "--rounds", "0")
    assert r.returncode == 0, r.stderr
    start = json.loads(r.stdout.splitlines()[0])
    assert start["event"] == "start" and start["samples"] == 7, start
    r = cli("--config", config)
    assert r.returncode == 2 and "either as files (--data FILE.npz" in r.stderr, r.stderr
    r = cli("--config", config, "--data", str(bad), "--dataset", "digits")
    assert r.returncode == 2 and "exactly one of the two" in r.stderr, r.stderr
    r = cli("--config", config, "--data", str(bad), "--shard", "0")
    assert r.returncode == 2 and "trained on whole" in r.stderr, r.stderr
    r = cli("--config", config, "--dataset", "digits")
    assert r.returncode == 2 and "--dataset needs --shard and --shards" in r.stderr, r.stderr
