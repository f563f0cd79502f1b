"""The data model of the declared experiments: what a TOML file says and what a run stores.

An :class:`Experiment` is a TOML file of this directory (the format is described in
``tools.experiments``); :func:`expand_runs` turns it into :class:`RunSpec` s, one per
(settings, seed), each stored under its :attr:`RunSpec.key` in
``<root>/<name>/<variant>/runs/<key>.json``; :func:`load_records` reads them back. Pure
data and file reading: the runner (``tools.experiments``) and the analyses
(``tools.experiments.analyses``) both import this module, and it imports neither.

A key includes the fast simulator's :data:`tools.simulate.PATH_VERSION`, so a run stored by
an older path is not found under the current key and ``fedge experiment run`` redoes it;
its file stays readable (:func:`path_versions`, :func:`load_records` with ``path_version``)
so a report can show it, labelled, until the rerun replaces it. Version 1 keys (stored before
issue 15) hash the settings, noise and seed alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.simulate import PATH_VERSION

__all__ = [
    "EXPERIMENTS_DIR",
    "REPORT_PATH",
    "RESULTS_DIR",
    "Experiment",
    "RunSpec",
    "expand_runs",
    "list_experiments",
    "load_experiment",
    "load_records",
    "path_versions",
]

EXPERIMENTS_DIR = Path(__file__).parent
REPO_ROOT = EXPERIMENTS_DIR.parent.parent
RESULTS_DIR = REPO_ROOT / "docs" / "results"
REPORT_PATH = REPO_ROOT / "docs" / "results.md"


@dataclass(frozen=True, slots=True, kw_only=True)
class Experiment:
    """One declared experiment (a TOML file of this directory)."""

    name: str
    title: str
    paper: str
    analysis: str
    kind: str = "simulate"
    seeds: tuple[int, ...] = (0,)
    base: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    runs: tuple[dict[str, Any], ...] = ()
    notes: str = ""
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("simulate", "compute"):
            raise ValueError(f"{self.name}: kind must be 'simulate' or 'compute', "
                             f"got {self.kind!r}")
        if self.kind == "simulate" and not self.runs:
            raise ValueError(f"{self.name}: a simulate experiment needs [[runs]]")
        if not self.seeds:
            raise ValueError(f"{self.name}: seeds must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """One fleet run: a label, the SimConfig settings, how the noise is set, and a seed."""

    label: str
    settings: dict[str, Any]
    noise: dict[str, Any]
    seed: int
    meta: dict[str, Any]

    @property
    def key(self) -> str:
        """The file stem of this run made by the current path (:data:`PATH_VERSION`)."""
        return self.key_at(PATH_VERSION)

    def key_at(self, path_version: int) -> str:
        """The file stem this run had when made by fast-simulator path ``path_version``
        (1: before issue 15, when the key did not name a version)."""
        if isinstance(path_version, bool) or not isinstance(path_version, int) or not (
                1 <= path_version <= PATH_VERSION):
            raise ValueError(f"path_version must be an integer in [1, {PATH_VERSION}], "
                             f"got {path_version!r}")
        fields: dict[str, Any] = {"settings": self.settings, "noise": self.noise,
                                  "seed": self.seed}
        if path_version > 1:
            fields["path_version"] = path_version
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _normalise(table: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("-", "_"): v for k, v in table.items()}


def load_experiment(path_or_name: str | Path) -> Experiment:
    """An :class:`Experiment` from a TOML path or the name of one in this directory."""
    path = Path(path_or_name)
    if not path.suffix:
        path = EXPERIMENTS_DIR / f"{path_or_name}.toml"
        if not path.exists():
            names = ", ".join(e.name for e in list_experiments())
            raise ValueError(f"no experiment {str(path_or_name)!r}; known: {names}")
    data = tomllib.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(Experiment)} - {"path"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    if data.get("name") != path.stem:
        raise ValueError(f"{path}: name {data.get('name')!r} must equal the file stem")
    return Experiment(
        name=data["name"], title=data["title"], paper=data["paper"],
        analysis=data["analysis"], kind=data.get("kind", "simulate"),
        seeds=tuple(data.get("seeds", (0,))), base=_normalise(data.get("base", {})),
        quick=_normalise(data.get("quick", {})),
        runs=tuple(_normalise(r) for r in data.get("runs", ())), notes=data.get("notes", ""),
        path=path,
    )


def list_experiments(directory: Path = EXPERIMENTS_DIR) -> list[Experiment]:
    """Every experiment of ``directory``, sorted by name."""
    return [load_experiment(p) for p in sorted(directory.glob("*.toml"))]


def _variant(quick: bool, overrides: dict[str, Any]) -> str:
    name = "quick" if quick else "full"
    for k, v in sorted(overrides.items()):
        name += f"+{k}={v}"
    return name


def expand_runs(exp: Experiment, *, quick: bool = False,
                overrides: dict[str, Any] | None = None) -> list[RunSpec]:
    """The (settings, seed) runs of ``exp``: base <- run <- grid point <- quick <- overrides."""
    quick_table = dict(exp.quick) if quick else {}
    seeds = tuple(quick_table.pop("seeds", exp.seeds))
    quick_runs = quick_table.pop("runs", None)  # optional label filter for --quick
    specs = []
    for run in exp.runs:
        run = dict(run)
        label = run.pop("label")
        if quick_runs is not None and not any(label.startswith(p) for p in quick_runs):
            continue
        noise = dict(run.pop("noise", {}))
        meta = dict(run.pop("meta", {}))
        grid = run.pop("grid", {})
        keys = sorted(grid)
        for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            point = dict(zip(keys, values, strict=True))
            settings = {**exp.base, **run, **point, **quick_table, **(overrides or {})}
            settings.pop("progress", None)
            for k in ("clip", "update_clip"):
                if isinstance(settings.get(k), str):
                    settings[k] = float(settings[k])
            point_noise = dict(noise)
            for k in list(point):
                if k.startswith("noise_"):  # grid over a noise setting, e.g. noise_std
                    point_noise[k.removeprefix("noise_")] = settings.pop(k)
            full_label = label + "".join(f" {k}={v}" for k, v in point.items())
            for seed in seeds:
                specs.append(RunSpec(label=full_label, settings={**settings, "seed": seed},
                                     noise=point_noise, seed=seed,
                                     meta={**meta, **point, "group": label}))
    return specs


def _all_records(vdir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted((vdir / "runs").glob("*.json")):
        r = json.loads(p.read_text())
        r.setdefault("path_version", 1)  # stored before issue 15 named it
        out.append(r)
    return out


def path_versions(vdir: Path) -> dict[int, int]:
    """Path version -> how many runs of it one variant directory stores."""
    counts: dict[int, int] = {}
    for r in _all_records(vdir):
        counts[r["path_version"]] = counts.get(r["path_version"], 0) + 1
    return dict(sorted(counts.items()))


def load_records(vdir: Path, *, path_version: int | None = None) -> list[dict[str, Any]]:
    """The stored runs of one variant directory made by one path version, in file-name
    order, each with its ``path_version``.

    ``path_version`` None: the newest version the directory holds (the current one once
    any run was redone), so runs of two paths are never read as one set.
    """
    records = _all_records(vdir)
    if path_version is None:
        path_version = max((r["path_version"] for r in records), default=PATH_VERSION)
    return [r for r in records if r["path_version"] == path_version]
