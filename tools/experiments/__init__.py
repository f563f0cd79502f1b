"""Paper reproductions as declared experiments: TOML in, per-run JSON, plots and a report out.

An experiment is a TOML file in this directory (frozen *data*); the runner interprets it::

    name = "fedspa-table1"          # also the file's stem
    title = "..."; paper = "..."; analysis = "fedspa_table"   # a function in .analyses
    kind = "simulate"               # or "compute": no fleet runs, the analysis computes
    seeds = [0]                     # repetitions (the paper's, where it averages)
    [base]                          # SimConfig settings shared by every run
    [quick]                         # overrides for ``--quick`` (applied last; may set seeds)
    [[runs]]                        # one entry per curve / table row
    label = "Fed-SPA p=0.05"
    sparsity = 0.05                 # any SimConfig setting
    noise = { calibrate = "fed-spa", epsilon = 1.0 }   # how the noise multiplier is set
    grid = { local_steps = [1, 5] } # optional: the cartesian product of these values
    meta = { paper_accuracy = 92.65 }                    # carried to the analysis as is

``noise`` (see :func:`calibrate`): ``{std = s}`` (absolute std on the averaged gradient,
z = s B / C), ``{multiplier = z}``, or ``{calibrate = M, epsilon = e}`` with M one of
``pld``/``rdp`` (our accountants, Poisson-subsampled Gaussian), ``ddg`` (mechanism
``ddg``: our distributed-discrete-Gaussian accountant, z = summed noise std / C),
``fed-spa`` (Fed-SPA Thm. 1), ``hu-guo-gong`` / ``hu-guo-gong-nosecagg`` (zCDP paper
Thm. 1 with r or 1 cohort members under secure aggregation), ``fedpaq`` (FedPAQ eq. (16),
per round). Paper bounds are used only to reproduce a paper's noise; every run also
reports our RDP epsilon (mechanism ``ddg``: the distributed-discrete-Gaussian one).

Resumable: each finished (config, seed) run is written, atomically, to
``<root>/<name>/<variant>/runs/<key>.json`` as it completes (key: hash of the exact
settings and of the fast simulator's ``PATH_VERSION``); a rerun skips the runs whose file
exists (a run stored by an older path version has another key: it is redone, and the report
shows it, labelled as such, until then), and concurrent workers (``--jobs``)
claim runs with a per-run advisory lock. ``variant`` is ``full`` or ``quick``,
with ``+key=value`` appended for ``--set`` overrides.

The data model (:class:`Experiment`, :class:`RunSpec`, :func:`expand_runs`,
:func:`load_records`) lives in ``tools.experiments.spec`` and is re-exported here; the
analyses import it from there, never this runner.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shlex
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from tools.experiments import analyses
from tools.experiments.spec import (
    EXPERIMENTS_DIR,
    REPORT_PATH,
    RESULTS_DIR,
    Experiment,
    RunSpec,
    _variant,
    expand_runs,
    list_experiments,
    load_experiment,
    load_records,
    path_versions,
)
from tools.simulate import PATH_VERSION

__all__ = [
    "EXPERIMENTS_DIR",
    "RESULTS_DIR",
    "Experiment",
    "RunSpec",
    "calibrate",
    "expand_runs",
    "fleet_facts",
    "list_experiments",
    "load_experiment",
    "load_records",
    "run_experiment",
    "write_report",
]

_CALIBRATIONS = ("pld", "rdp", "ddg", "fed-spa", "hu-guo-gong", "hu-guo-gong-nosecagg",
                 "fedpaq")


# ------------------------------------------------------------------ noise calibration


def fleet_facts(settings: dict[str, Any]) -> tuple[int, int]:
    """(max rounds any device takes part in, smallest local data set) of a simulated fleet.

    Replays the simulator's seeded cohort draws (:func:`tools.simulate.round_draws`, the
    fleet's too) and partition (the first of the SeedSequence(seed).spawn(3) streams), so a
    noise calibrated for this count meets the target on every device of that exact run; a
    test checks it against the simulator.
    """
    from tools.datasets import load_dataset
    from tools.partition import partition
    from tools.simconfig import SimConfig
    from tools.simulate import round_draws

    cfg = SimConfig(**{**settings, "progress": False})
    part_rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(3)[0])
    data = load_dataset(cfg.dataset)
    shards = partition(data.y_train, cfg.devices, cfg.partition, part_rng,
                       num_classes=data.num_classes)
    counts = np.zeros(cfg.devices, dtype=np.int64)
    for _, cohort, _ in round_draws(cfg.seed, cfg.devices, cfg.cohort_size, cfg.rounds):
        counts[list(cohort)] += 1
    return int(counts.max()), int(min(len(s) for s in shards))


def _smallest_noise(eps_of: Callable[[float], float], target: float, *,
                    rtol: float = 1e-3) -> float:
    """Smallest z (to rtol, from above) with eps_of(z) <= target; eps_of decreasing in z."""
    lo, hi = 0.0, 0.5
    while eps_of(hi) > target:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon {target!r}")
    while hi - lo > rtol * hi:
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if eps_of(mid) > target:
            lo = mid
        else:
            hi = mid
        if lo == 0 and hi < 1e-6:
            break
    return hi


def fed_spa_formula(*, sample_rate: float, rounds: int, local_steps: int,
                    keep_fraction: float, noise_multiplier: float, delta: float) -> float:
    """Paper bound (not necessarily sound): Fed-SPA Theorem 1's expression without its order
    condition, eps = min over integer alpha >= 2 of
    7 q^2 I tau alpha p / z^2 + log(1/delta) / (alpha - 1), with z = B sigma / G.

    Why without the condition: as printed, alpha <= (2/3) sigma^2 log(1/(q alpha
    (1 + sigma'^2))) + 1 with the absolute std sigma = z G / B admits no alpha >= 2 at the
    paper's own B = 10 for any noise (q alpha (1 + sigma'^2) >= 1 once sigma is large enough
    for the first factor), so :func:`~edge_sdk.privacy.paper_bounds.fed_spa_epsilon` is
    infinite; the paper nevertheless reports eps = 1. Dropping the condition is the most
    generous reading of the bound, used only to reproduce the paper's noise level.
    """
    alphas = np.arange(2, 4097, dtype=np.float64)
    per = 7.0 * sample_rate**2 * rounds * local_steps * keep_fraction / noise_multiplier**2
    return float(np.min(per * alphas + math.log(1.0 / delta) / (alphas - 1.0)))


def _ddg_noise(settings: dict[str, Any], target: float, delta: float, rounds: int) -> float:
    """Smallest z whose distributed-discrete-Gaussian epsilon over ``rounds`` rounds of one
    device (the aggregate-view event its ledger reserves, :func:`tools.simulate.ddg_event`,
    composed) is <= target."""
    from edge_sdk.model import build_spec
    from edge_sdk.privacy import discrete_epsilon
    from tools.datasets import load_dataset
    from tools.simconfig import SimConfig
    from tools.simulate import ddg_event

    data = load_dataset(settings.get("dataset", "fashion-mnist"))
    d = build_spec(settings.get("model", "cnn"), data.input_shape, data.num_classes).num_params

    def eps_of(z: float) -> float:
        cfg = SimConfig(**{**settings, "noise_multiplier": z, "progress": False})
        # the relation and share count the devices' ledgers state (zero-out, the plan's
        # min_survivors - max_colluders honest shares), so the calibrated z is the one the
        # summary's epsilon_aggregate reports
        return discrete_epsilon(ddg_event(cfg, d, rounds), delta)

    return _smallest_noise(eps_of, target)


def calibrate(settings: dict[str, Any], noise: dict[str, Any]) -> dict[str, Any]:
    """The noise multiplier z for one run, and how it was chosen (see module docstring).

    Returns a dict with ``noise_multiplier`` and the facts used (method, target epsilon,
    rounds per device, local data size), recorded in the run's JSON.
    """
    from edge_sdk.privacy import calibrate_noise_multiplier
    from edge_sdk.privacy.paper_bounds import (
        fed_spa_epsilon,
        fedpaq_noise_variance,
        hu_guo_gong_epsilon,
    )

    if not noise:
        return {"method": "none", "noise_multiplier": settings.get("noise_multiplier", 0.0)}
    clip = float(settings.get("clip", math.inf))
    batch = int(settings.get("batch_size", 32))
    if "multiplier" in noise:
        return {"method": "multiplier", "noise_multiplier": float(noise["multiplier"])}
    if "std" in noise:
        if not math.isfinite(clip):
            raise ValueError("noise std needs a finite clip")
        return {"method": "std", "noise_std": noise["std"],
                "noise_multiplier": float(noise["std"]) * batch / clip}
    method, eps = noise.get("calibrate"), noise.get("epsilon")
    if method not in _CALIBRATIONS or not (isinstance(eps, int | float) and eps > 0):
        raise ValueError(f"noise must be {{std=..}}, {{multiplier=..}} or {{calibrate=M, "
                         f"epsilon=e > 0}} with M in {_CALIBRATIONS}, got {noise!r}")
    rounds_max, m = fleet_facts(settings)
    delta = float(settings.get("delta", 1e-5))
    tau = int(settings.get("local_steps", 20))
    q = min(1.0, batch / m)
    facts = {"method": method, "epsilon_target": eps, "rounds_per_device_max": rounds_max,
             "local_samples_min": m, "sample_rate": q, "delta": delta}
    if method in ("pld", "rdp"):
        # A sparsified round clips the kept coordinates to sqrt(p) C with noise std z C
        # (edge_sdk/train.py), so its accounted multiplier is z / sqrt(p): calibrate that.
        p_kept = float(settings.get("sparsity", 1.0))
        z = math.sqrt(p_kept) * calibrate_noise_multiplier(eps, delta, q, tau * rounds_max,
                                                           accountant=method)
    elif method == "ddg":
        z = _ddg_noise(settings, eps, delta, rounds_max)
        facts["sample_rate"] = 1.0  # every local sample, every round: no amplification
    elif method == "fed-spa":
        p = float(settings.get("sparsity", 1.0))

        def as_printed(z: float) -> float:
            return fed_spa_epsilon(sample_rate=q, rounds=rounds_max, local_steps=tau,
                                   keep_fraction=p, grad_bound=clip, batch_size=batch,
                                   noise_std=z * clip / batch, delta=delta)

        def formula(z: float) -> float:
            return fed_spa_formula(sample_rate=q, rounds=rounds_max, local_steps=tau,
                                   keep_fraction=p, noise_multiplier=z, delta=delta)
        facts["theorem1_as_printed_finite"] = any(
            math.isfinite(as_printed(z)) for z in np.geomspace(0.1, 1e3, 41))
        z = _smallest_noise(formula, eps)
    elif method.startswith("hu-guo-gong"):
        from tools.simconfig import SimConfig

        r = 1 if method.endswith("nosecagg") else SimConfig(
            **{**settings, "progress": False}).cohort_size

        def hgg(z: float) -> float:
            return hu_guo_gong_epsilon(rounds=rounds_max, local_steps=tau, grad_bound=clip,
                                       dataset_size=m, batch_size=batch,
                                       noise_std=z * clip / batch, delta=delta,
                                       cohort_size=r)
        z = _smallest_noise(hgg, eps)
        facts["cohort_size"] = r
    else:  # fedpaq: eq. (16) per round, update sensitivity 2S as the simulator charges
        s_bound = settings.get("update_clip") or tau * float(settings.get("lr", 0.05)) * clip
        var = fedpaq_noise_variance(sensitivity=2 * s_bound, epsilon=eps, delta=delta,
                                    batch_size=batch, local_steps=tau, dataset_size=m)
        z = math.sqrt(var) / s_bound
        facts["per_round"] = True
    facts["noise_multiplier"] = z
    return facts


# ------------------------------------------------------------------------- runner


def _jsonable(obj: Any) -> Any:
    """Non-finite floats as the strings TOML settings use for them ("inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def _write_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _command(exp: Experiment, quick: bool, overrides: dict[str, Any]) -> str:
    parts = ["fedge", "experiment", "run", exp.name] + (["--quick"] if quick else [])
    for k, v in sorted(overrides.items()):
        parts += ["--set", f"{k}={v}"]
    return shlex.join(parts)


def run_experiment(exp: Experiment, *, quick: bool = False,
                   overrides: dict[str, Any] | None = None, root: Path = RESULTS_DIR,
                   out: TextIO = sys.stderr, simulate_fn: Callable[..., dict] | None = None,
                   jobs: int = 1) -> Path:
    """Run every missing (config, seed) of ``exp``; return the variant's directory.

    Each finished run is stored before the next starts, so a killed run resumes where it
    stopped. ``jobs`` > 1 runs that many worker processes (one core each: the simulator
    is single-threaded); workers, and separate invocations of the same experiment, claim
    runs with an advisory lock per run, so none is run twice and a killed worker's claim
    ends with it. ``simulate_fn`` is injectable for tests (default: :func:`tools.run.run`,
    which picks the fast or the fleet path from the settings' ``secagg``).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    overrides = dict(overrides or {})
    variant = _variant(quick, overrides)
    vdir = root / exp.name / variant
    started = time.time()
    t0 = time.perf_counter()
    meta_path = vdir / "meta.json"
    with _locked(vdir / ".locks" / "meta"):
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        meta.update(command=_command(exp, quick, overrides), quick=quick, overrides=overrides)
        _write_atomic(meta_path, meta)  # a variant still running is reported with its command
    if exp.kind == "compute":
        data = getattr(analyses, f"compute_{exp.analysis}")(quick=quick)
        _write_atomic(vdir / "results.json", data)
        ran, skipped = 1, 0
    else:
        specs = expand_runs(exp, quick=quick, overrides=overrides)
        seen: set[str] = set()
        specs = [s for s in specs if not (s.key in seen or seen.add(s.key))]  # shared points
        if jobs == 1:
            ran, skipped = _run_specs(exp, specs, vdir, variant, out, simulate_fn, "")
        else:
            import multiprocessing

            # fork: workers inherit simulate_fn and the loaded modules (Linux, as the fleet)
            # (Process, not Pool: nothing is pickled, so an injected simulate_fn may be local)
            ctx = multiprocessing.get_context("fork")
            done = ctx.SimpleQueue()

            def work(w: int) -> None:
                done.put(_run_specs(exp, specs, vdir, variant, out, simulate_fn, f"w{w} ")[0])

            procs = [ctx.Process(target=work, args=(w,)) for w in range(jobs)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            failed = [w for w, proc in enumerate(procs) if proc.exitcode != 0]
            ran = sum(done.get() for _ in range(jobs - len(failed)))
            if failed:
                raise RuntimeError(f"experiment workers {failed} failed (exit codes "
                                   f"{[procs[w].exitcode for w in failed]}); the runs they "
                                   "finished are stored, rerun to resume")
            skipped = len(specs) - ran
    elapsed = time.perf_counter() - t0
    with _locked(vdir / ".locks" / "meta"):
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        meta.update(command=_command(exp, quick, overrides), quick=quick, overrides=overrides,
                    variant=variant)
        meta["last_invocation"] = {"started_unix": started, "ran": ran, "skipped": skipped,
                                   "elapsed_s": elapsed, "jobs": jobs}
        if ran:
            # concurrent invocations each add their own wall time (the report sums the
            # runs' own wall times instead)
            meta["wall_s_total"] = meta.get("wall_s_total", 0.0) + elapsed
        meta["cpu"] = f"{os.cpu_count()} logical cores (shared), nice 10 where run by hand"
        _write_atomic(meta_path, meta)
    print(f"{exp.name} {variant}: {ran} run(s) done, {skipped} skipped or done elsewhere, "
          f"{elapsed:.1f} s", file=out, flush=True)
    return vdir


@contextlib.contextmanager
def _locked(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an advisory lock on ``path`` (created); yield whether it was acquired.

    The kernel drops the lock when its holder dies, so a killed run leaves no stale claim.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _run_specs(exp: Experiment, specs: list[RunSpec], vdir: Path, variant: str,
               out: TextIO, simulate_fn: Callable[..., dict] | None,
               tag: str) -> tuple[int, int]:
    """Run each spec not yet stored and not claimed by another process; (ran, skipped)."""
    from tools.simconfig import SimConfig

    if simulate_fn is None:
        from tools.run import run as simulate_fn
    ran = skipped = 0
    for i, spec in enumerate(specs, 1):
        path = vdir / "runs" / f"{spec.key}.json"
        head = f"{tag}[{i}/{len(specs)}] {exp.name} {variant}: {spec.label} seed={spec.seed}"
        with _locked(vdir / ".locks" / spec.key, blocking=False) as mine:
            if not mine:
                print(f"{head} (running elsewhere, skipped)", file=out, flush=True)
                continue
            if path.exists():  # checked under the claim: another worker may just have finished
                skipped += 1
                print(f"{head} (done, skipped)", file=out, flush=True)
                continue
            print(head, file=out, flush=True)
            noise = calibrate(spec.settings, spec.noise)
            cfg = SimConfig(**{**spec.settings, "noise_multiplier": noise["noise_multiplier"],
                               "progress": True})
            summary = simulate_fn(cfg, out=out)
            _write_atomic(path, {"experiment": exp.name, "variant": variant,
                                 "label": spec.label, "seed": spec.seed, "key": spec.key,
                                 "path_version": PATH_VERSION,
                                 "meta": _jsonable(spec.meta), "noise": _jsonable(noise),
                                 "settings": _jsonable(spec.settings), "summary": summary})
            ran += 1
    return ran, skipped


# ------------------------------------------------------------------------- report


def _spec_records(exp: Experiment, vdir: Path, meta: dict[str, Any]
                  ) -> tuple[list[dict[str, Any]], int]:
    """(one record per declared run that has a stored result, labelled by its spec; the
    path version they all come from).

    The version is the newest one the variant stores (:func:`load_records`): the current
    :data:`PATH_VERSION` once any run was redone, an older one while none was, never a mix.
    Runs with identical settings (the default point of several sweeps) share one stored
    result; each spec gets it under its own label and meta.
    """
    records = load_records(vdir)
    version = records[0]["path_version"] if records else PATH_VERSION
    stored = {r["key"]: r for r in records}
    out = []
    for spec in expand_runs(exp, quick=meta.get("quick", vdir.name.startswith("quick")),
                            overrides=meta.get("overrides", {})):
        key = spec.key_at(version)
        if key in stored:
            out.append({**stored[key], "label": spec.label, "meta": spec.meta})
    return out, version


def _path_note(vdir: Path, version: int, command: str) -> str:
    """What the report says about a variant's runs of older path versions ("" if none)."""
    older = {v: n for v, n in path_versions(vdir).items() if v < PATH_VERSION}
    if version < PATH_VERSION:
        return (f"**Path v{version} numbers (before issue 15 step G0 re-seeded the fast "
                f"simulator; rerun pending):** every run below was made by the fast "
                f"simulator's path version {version}, not the current {PATH_VERSION}; "
                f"`{command}` redoes them.")
    if older:
        n = sum(older.values())
        versions = ", ".join(f"v{v}" for v in older)
        return (f"{n} stored run(s) of older path versions ({versions}) are superseded and "
                f"not shown (rerun pending where no current run replaces them).")
    return ""


def _variants(root: Path, exp: Experiment) -> list[Path]:
    d = root / exp.name
    if not d.is_dir():
        return []
    # full first, then quick, then overridden variants
    order = {"full": 0, "quick": 1}
    return sorted((p for p in d.iterdir()
                   if (p / "meta.json").exists() or (p / "runs").is_dir()),
                  key=lambda p: (order.get(p.name, 2), p.name))


def write_report(*, root: Path = RESULTS_DIR, report: Path = REPORT_PATH,
                 experiments: Sequence[Experiment] | None = None,
                 preamble: str | None = None) -> Path:
    """Regenerate ``report`` (markdown) and every plot from the stored runs under ``root``."""
    exps = list(experiments) if experiments is not None else list_experiments()
    lines = [preamble if preamble is not None else analyses.PREAMBLE, ""]
    missing: list[str] = []
    claims: list[str] = []
    toc = []
    body: list[str] = []
    for exp in exps:
        variants = _variants(root, exp)
        if not any(v.name == "full" for v in variants):
            missing.append(f"- {exp.title}: `{_command(exp, False, {})}`")
        if not any(v.name == "quick" for v in variants):
            missing.append(f"- {exp.title} (quick): `{_command(exp, True, {})}`")
        if not variants:
            continue
        toc.append(f"- [{exp.title}](#{exp.name})")
        body += [f'<a id="{exp.name}"></a>', f"## {exp.title}", "", f"Paper: {exp.paper}.", ""]
        if exp.notes:
            body += [exp.notes.strip(), ""]
        for vdir in variants:
            meta_path = vdir / "meta.json"
            meta = (json.loads(meta_path.read_text()) if meta_path.exists() else
                    {"command": _command(exp, vdir.name == "quick", {}),  # still running
                     "quick": vdir.name == "quick", "overrides": {}})
            version = PATH_VERSION
            if exp.kind == "compute":
                records = json.loads((vdir / "results.json").read_text())
            else:
                records, version = _spec_records(exp, vdir, meta)
            if exp.kind == "simulate":
                wall = sum(r["summary"]["wall_seconds"] for r in records)
                wall_s = (f"{wall:.0f} s summed over {len(records)} run(s)"
                          f" ({wall / 60:.1f} min)")
            else:
                wall_s = f"{meta.get('wall_s_total', 0.0):.1f} s"
            body += [f"### {exp.name} / {vdir.name}", "",
                     f"Command: `{meta['command']}`  ", f"Wall time: {wall_s}, on "
                     f"{meta.get('cpu', 'this machine')}.", ""]
            note = "" if exp.kind == "compute" else _path_note(vdir, version, meta["command"])
            if note:
                body += [note, ""]
            declared = (len(records) if exp.kind == "compute" else
                        len(expand_runs(exp, quick=meta.get("quick", vdir.name.startswith("quick")),
                                        overrides=meta.get("overrides", {}))))
            if exp.kind != "compute" and len(records) < declared:
                # an analysis reads a whole grid (its claims compare cells): a partial or
                # resumed variant gets the stored runs as they are and no verdict
                section = _partial_section(records, declared, meta["command"])
            else:
                section = getattr(analyses, exp.analysis)(exp, records, vdir, report.parent)
            body += [section, ""]
            stale = f"(path v{version}, rerun pending) " if version < PATH_VERSION else ""
            if vdir.name == "full":  # claims are judged on full variants only
                claims += [f"- [{exp.name}](#{exp.name}): {stale}{line.strip().lstrip('- ')}"
                           for line in section.splitlines()
                           if "**held**" in line or "**did not hold**" in line]
    lines += ["## Contents", "", *toc, ""]
    # hand-written notes on what moved the numbers between path versions (issue 15)
    changes = Path(__file__).with_name("CHANGES.md")
    if changes.exists():
        lines += [changes.read_text().rstrip(), ""]
    summary = analyses.cross_summary(root)
    if claims or summary:
        lines += ["## Claims at a glance", "",
                  "Every verdict of the full variants below, as stated in its section "
                  "(each with the rule it was judged by):", "", *claims, "", *summary, ""]
    if missing:
        lines += ["## Not run yet", "", "These variants have no stored results; each command "
                  "runs (and resumes) one:", "", *missing, ""]
    lines += body
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report


def _partial_section(records: list[dict[str, Any]], declared: int, command: str) -> str:
    """A variant with fewer stored runs than it declares: its runs as a plain table (label,
    seed, best and final accuracy, the summary's epsilon), and no claim judged."""
    lines = [f"**Grid incomplete: {len(records)} of {declared} runs stored** (`{command}` "
             "resumes it); the analysis and its claims wait for the whole grid.", "",
             "| run | seed | best accuracy (%) | final accuracy (%) | epsilon |",
             "|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["label"], json.dumps(r["settings"],
                                                                  sort_keys=True))):
        s = r["summary"]
        best = max((a for a in s.get("accuracy_per_round", []) if a is not None),
                   default=None)
        final, eps = s.get("final_accuracy"), s.get("epsilon")
        cells = [r["label"], str(r["settings"].get("seed", "-")),
                 "-" if best is None else f"{100 * best:.2f}",
                 "-" if final is None else f"{100 * final:.2f}",
                 "-" if eps is None else f"{eps:.4g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``key=value`` pairs (values parsed as TOML scalars, else kept as strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            out[key.replace("-", "_")] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.replace("-", "_")] = value
    return out
