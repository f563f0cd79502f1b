"""The experiment runner: declared TOML, resumable runs, calibration, the report.

The default suite checks the machinery on a tiny digits fleet; the ``slow`` tests run each
experiment's ``--quick`` variant end to end (``pytest -m slow tests/test_experiments.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_sdk.privacy import PldAccountant
from edge_sdk.privacy.events import PoissonSubsampledGaussian
from tools.cli import main
from tools.experiments import (
    calibrate,
    expand_runs,
    fleet_facts,
    list_experiments,
    load_experiment,
    load_records,
    parse_overrides,
    run_experiment,
    write_report,
)
from tools.experiments.spec import path_versions
from tools.simconfig import SimConfig
from tools.simulate import PATH_VERSION, simulate

TINY = """
name = "tiny"
title = "Tiny"
paper = "none"
analysis = "fedspa_table"
seeds = [0, 1]

[base]
dataset = "digits"
model = "logreg"
devices = 6
participation = 0.5
rounds = 2
local-steps = 2
batch-size = 8
lr = 0.5
clip = 1.0
delta = 1e-3

[quick]
seeds = [0]
rounds = 1

[[runs]]
label = "private"
noise = { multiplier = 1.0 }
meta = { p = 1.0, paper_accuracy = 90.0 }

[[runs]]
label = "plain"
clip = "inf"
grid = { local_steps = [1, 2] }
"""


@pytest.fixture
def tiny(tmp_path: Path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return load_experiment(path)


def test_expand_applies_grid_seeds_and_quick(tiny) -> None:
    full = expand_runs(tiny)
    assert [(s.label, s.seed) for s in full] == [
        ("private", 0), ("private", 1), ("plain local_steps=1", 0), ("plain local_steps=1", 1),
        ("plain local_steps=2", 0), ("plain local_steps=2", 1)]
    assert full[2].settings["clip"] == float("inf")
    quick = expand_runs(tiny, quick=True)
    assert {s.seed for s in quick} == {0} and all(s.settings["rounds"] == 1 for s in quick)
    assert len({s.key for s in full}) == len(full)  # every run stored under its own key


def test_runs_are_stored_and_a_rerun_skips_them(tiny, tmp_path: Path) -> None:
    calls = []

    def counting(cfg: SimConfig, *, out) -> dict:
        calls.append(cfg)
        return simulate(cfg, out=out)

    log = tmp_path / "log.txt"
    with log.open("w") as out:
        vdir = run_experiment(tiny, quick=True, root=tmp_path / "res", out=out,
                              simulate_fn=counting)
    assert len(calls) == 3 and len(load_records(vdir)) == 3
    first = next(p for p in sorted((vdir / "runs").glob("*.json")))
    first.unlink()  # as if killed before this run finished

    def must_not_rerun_others(cfg: SimConfig, *, out) -> dict:
        calls.append(cfg)
        return simulate(cfg, out=out)

    with log.open("a") as out:
        run_experiment(tiny, quick=True, root=tmp_path / "res", out=out,
                       simulate_fn=must_not_rerun_others)
    assert len(calls) == 4  # only the missing run ran again
    assert "(done, skipped)" in log.read_text()
    rec = next(r for r in load_records(vdir) if r["label"] == "private")
    assert rec["noise"] == {"method": "multiplier", "noise_multiplier": 1.0}
    assert rec["summary"]["epsilon"] > 0
    meta = json.loads((vdir / "meta.json").read_text())
    assert meta["command"] == "fedge experiment run tiny --quick"

    report = write_report(root=tmp_path / "res", report=tmp_path / "docs" / "results.md",
                          experiments=[tiny], preamble="# test")
    text = report.read_text()
    assert "`fedge experiment run tiny --quick`" in text
    assert "Not run yet" in text and "`fedge experiment run tiny`" in text  # full missing
    assert (vdir / "accuracy.png").exists() and "![accuracy per round](" in text
    assert "| private | 1.0 |" in text


def test_the_key_names_the_path_version(tiny) -> None:
    import hashlib

    spec = expand_runs(tiny)[0]
    assert PATH_VERSION == 3 and spec.key == spec.key_at(PATH_VERSION)
    # version 1: the key as stored before issue 15, settings, noise and seed alone
    legacy = json.dumps({"settings": spec.settings, "noise": spec.noise, "seed": spec.seed},
                        sort_keys=True)
    assert spec.key_at(1) == hashlib.sha256(legacy.encode()).hexdigest()[:16] != spec.key
    for bad in (0, PATH_VERSION + 1, True, 1.0):
        with pytest.raises(ValueError, match="path_version"):
            spec.key_at(bad)


def _as_path_v1(exp, vdir: Path) -> None:
    """Rewrite every stored quick run of ``exp`` in ``vdir`` as the pre-issue-15 runner
    stored it (no path_version, the version-1 key as its file name)."""
    for path in sorted((vdir / "runs").glob("*.json")):
        rec = json.loads(path.read_text())
        spec = next(s for s in expand_runs(exp, quick=True) if s.key == rec["key"])
        del rec["path_version"]
        rec["key"] = spec.key_at(1)
        path.unlink()
        (path.parent / f"{rec['key']}.json").write_text(json.dumps(rec))


def test_runs_of_an_older_path_are_labelled_and_redone(tiny, tmp_path: Path) -> None:
    calls = []

    def counting(cfg: SimConfig, *, out) -> dict:
        calls.append(cfg)
        return simulate(cfg, out=out)

    root, md = tmp_path / "res", tmp_path / "docs" / "results.md"
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        vdir = run_experiment(tiny, quick=True, root=root, out=out, simulate_fn=counting)
    assert len(calls) == 3 and path_versions(vdir) == {PATH_VERSION: 3}
    text = write_report(root=root, report=md, experiments=[tiny], preamble="# t").read_text()
    assert "| private | 1.0 |" in text and "Path v1" not in text and "path v1" not in text

    _as_path_v1(tiny, vdir)
    assert path_versions(vdir) == {1: 3}
    assert {r["path_version"] for r in load_records(vdir)} == {1}
    # not silently current, not gone: shown, with its numbers, labelled
    text = write_report(root=root, report=md, experiments=[tiny], preamble="# t").read_text()
    assert "### tiny / quick" in text and "| private | 1.0 |" in text
    assert ("**Path v1 numbers (before issue 15 step G0 re-seeded the fast simulator; rerun "
            "pending):**") in text
    assert "`fedge experiment run tiny --quick` redoes them" in text

    with log.open("a") as out:  # the runner does not take them for done
        run_experiment(tiny, quick=True, root=root, out=out, simulate_fn=counting)
    assert len(calls) == 6
    assert path_versions(vdir) == {1: 3, PATH_VERSION: 3}
    assert {r["path_version"] for r in load_records(vdir)} == {PATH_VERSION}
    text = write_report(root=root, report=md, experiments=[tiny], preamble="# t").read_text()
    assert "Path v1 numbers" not in text and "| private | 1.0 |" in text
    assert "3 stored run(s) of older path versions (v1) are superseded and not shown" in text

    # a partial rerun: the current runs only, never a mix of two paths in one table
    next(p for p in sorted((vdir / "runs").glob("*.json"))
         if json.loads(p.read_text()).get("path_version") == PATH_VERSION).unlink()
    assert len(load_records(vdir)) == 2
    text = write_report(root=root, report=md, experiments=[tiny], preamble="# t").read_text()
    assert "Path v1 numbers" not in text and "3 stored run(s) of older path" in text
    assert "**Grid incomplete: 2 of 3 runs stored** (`fedge experiment run tiny --quick` " \
           "resumes it)" in text


GRID = """
name = "grid"
title = "Grid"
paper = "none"
analysis = "fedspa_fig1"
seeds = [0]
""" + TINY[TINY.index("[base]"):TINY.index("[quick]")] + """
[[runs]]
label = "Fed-SPA"
noise = { calibrate = "fed-spa" }
grid = { sparsity = [0.5, 1.0], noise_epsilon = [0.5, 2.0] }
"""


def test_a_partial_grid_is_reported_without_a_verdict_and_never_crashes(tmp_path: Path) -> None:
    """fedspa-fig1's analysis compares cells of its grid; a resumed run with cells missing
    once raised KeyError in `experiment report`. The report shows the stored runs as they
    are and judges nothing until the grid is whole."""
    path = tmp_path / "grid.toml"
    path.write_text(GRID)
    exp = load_experiment(path)
    root, md = tmp_path / "res", tmp_path / "docs" / "results.md"
    with (tmp_path / "log.txt").open("w") as out:
        vdir = run_experiment(exp, quick=False, root=root, out=out)
    whole = write_report(root=root, report=md, experiments=[exp], preamble="# t").read_text()
    assert "Grid incomplete" not in whole and "Claim (b)" in whole.split("### grid / full")[1]
    # drop the dense run at the largest eps: the cell every claim (b) reads
    gone = next(p for p in sorted((vdir / "runs").glob("*.json"))
                if json.loads(p.read_text())["settings"].get("sparsity", 1.0) == 1.0
                and json.loads(p.read_text())["noise"]["epsilon_target"] == 2.0)
    gone.unlink()
    text = write_report(root=root, report=md, experiments=[exp], preamble="# t").read_text()
    assert "**Grid incomplete: 3 of 4 runs stored** (`fedge experiment run grid` resumes it)" \
           in text
    section = text.split("### grid / full")[1]  # (the report's preamble quotes CHANGES.md)
    assert "Claim (" not in section and "**held**" not in section
    assert "did not hold" not in section and "Claims at a glance" not in text
    assert section.count("| Fed-SPA ") == 3 and "| run | seed | best accuracy (%) |" in section


def test_workers_share_the_runs_and_a_claimed_run_is_left_alone(tiny, tmp_path: Path) -> None:
    import fcntl
    import io
    import os

    ran_by = tmp_path / "ran_by"
    ran_by.mkdir()

    def recording(cfg: SimConfig, *, out) -> dict:
        # one file per (run, process): a run executed twice would leave two
        (ran_by / f"{cfg.local_steps}-{cfg.seed}-{cfg.clip}-{os.getpid()}").touch()
        return simulate(cfg, out=out)

    specs = expand_runs(tiny)
    root = tmp_path / "res"
    vdir = root / "tiny" / "full"
    # another process holds the claim on the first run: neither worker may start it
    (vdir / ".locks").mkdir(parents=True)
    fd = os.open(vdir / ".locks" / specs[0].key, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with (tmp_path / "log.txt").open("w") as out:
            run_experiment(tiny, root=root, out=out, simulate_fn=recording, jobs=2)
    finally:
        os.close(fd)
    stored = {r["key"] for r in load_records(vdir)}
    assert stored == {s.key for s in specs[1:]}
    runs = sorted(p.name for p in ran_by.iterdir())
    assert len(runs) == len(specs) - 1  # each unclaimed run exactly once
    assert "(running elsewhere, skipped)" in (tmp_path / "log.txt").read_text()
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_experiment(tiny, root=root, jobs=0)
    # the claim released: a rerun finishes the last run only
    before = len(runs)
    run_experiment(tiny, root=root, out=io.StringIO(), simulate_fn=recording)
    assert len(list(ran_by.iterdir())) == before + 1
    assert {r["key"] for r in load_records(vdir)} == {s.key for s in specs}


def test_pld_calibration_meets_the_target_for_the_busiest_device(tiny) -> None:
    spec = expand_runs(tiny)[0]
    facts = calibrate(spec.settings, {"calibrate": "pld", "epsilon": 2.0})
    rounds_max, m = fleet_facts(spec.settings)
    assert facts["rounds_per_device_max"] == rounds_max and facts["local_samples_min"] == m
    event = PoissonSubsampledGaussian(noise_multiplier=facts["noise_multiplier"],
                                      sample_rate=8 / m, steps=2 * rounds_max)
    assert PldAccountant().compose(event).get_epsilon(1e-3) <= 2.0


def test_ddg_calibration_meets_the_target_for_the_busiest_device(tiny) -> None:
    from edge_sdk.privacy import RdpAccountant
    from tools.simulate import ddg_event

    settings = {**expand_runs(tiny)[0].settings, "mechanism": "ddg", "local_steps": 1}
    facts = calibrate(settings, {"calibrate": "ddg", "epsilon": 1.0})
    rounds_max = fleet_facts(settings)[0]
    assert facts["method"] == "ddg" and facts["rounds_per_device_max"] == rounds_max

    def eps(z: float) -> float:
        cfg = SimConfig(**{**settings, "noise_multiplier": z, "progress": False})
        event = ddg_event(cfg, 650, rounds_max)  # digits logreg: 64 x 10 + 10 parameters
        return RdpAccountant(adjacency="zero_out").compose(event).get_epsilon(1e-3)

    z = facts["noise_multiplier"]
    assert eps(z) <= 1.0 < eps(0.99 * z)  # the smallest such noise, to the search's rtol
    summary = simulate(SimConfig(**{**settings, "noise_multiplier": z, "progress": False}))
    # the busiest device's ledger, aggregate view: the calibrated figure (to float rounding
    # of the ledger's composition)
    assert summary["num_params"] == 650
    assert summary["epsilon_aggregate"] == pytest.approx(eps(z), rel=1e-9)
    assert summary["epsilon_aggregate"] <= 1.0 + 1e-9


def test_fleet_facts_replay_the_simulators_cohorts() -> None:
    settings = dict(dataset="digits", model="logreg", devices=10, participation=0.3,
                    rounds=7, local_steps=1, batch_size=8, lr=0.1, seed=5)
    summary = simulate(SimConfig(**settings, progress=False))
    assert fleet_facts(settings)[0] == summary["max_rounds_per_device"]


def test_overrides_and_bad_noise_are_clear_errors(tiny) -> None:
    assert parse_overrides(["local_steps=300", "clip=1.5", "partition=het:2"]) == {
        "local_steps": 300, "clip": 1.5, "partition": "het:2"}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["oops"])
    with pytest.raises(ValueError, match="calibrate=M"):
        calibrate(expand_runs(tiny)[0].settings, {"calibrate": "magic", "epsilon": 1})


def test_every_declared_experiment_loads_and_cli_lists_them(capsys) -> None:
    exps = list_experiments()
    assert {"fedspa-table1", "zcdp-fig3-4", "kim-fig1", "fedpaq-fig2-4",
            "ours-fedspa-pld"} <= {e.name for e in exps}
    for exp in exps:
        for quick in (False, True):
            for spec in expand_runs(exp, quick=quick):
                SimConfig(**{**spec.settings, "progress": False})  # every run is valid
    assert main(["experiment", "list"]) == 0
    assert "fedspa-table1" in capsys.readouterr().out
    assert main(["experiment", "run", "no-such-thing"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", [e.name for e in list_experiments()])
def test_quick_variant_runs(name: str, tmp_path: Path) -> None:
    exp = load_experiment(name)
    with (tmp_path / "log.txt").open("w") as out:
        vdir = run_experiment(exp, quick=True, root=tmp_path, out=out)
    report = write_report(root=tmp_path, report=tmp_path / "results.md", experiments=[exp])
    assert f"### {name} / quick" in report.read_text()
    if exp.kind == "simulate":
        keys = {spec.key for spec in expand_runs(exp, quick=True)}
        assert {r["key"] for r in load_records(vdir)} == keys


def test_cross_summary_judges_the_fedspa_target_on_sound_rows_only(tmp_path: Path) -> None:
    from tools.experiments import analyses

    def store(name: str, label: str, acc: float, z: float, eps: float | None,
              method: str = "multiplier", note: str = "RDP accountant") -> None:
        runs = tmp_path / name / "full" / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        (runs / f"{label.replace(' ', '_')}.json").write_text(json.dumps({
            "label": label, "key": label, "noise": {"method": method, "noise_multiplier": z},
            "summary": {"accuracy_per_round": [acc / 2, acc], "epsilon": eps,
                        "epsilon_note": note}}))

    assert analyses.cross_summary(tmp_path) == []  # the Fed-SPA table not run yet
    store("fedspa-table1", "FedAvg (non-private)", 0.86, 0.0, None)
    store("fedspa-table1", "DP-Fed", 0.60, 7.0, 0.2)
    # cpSGD's epsilon is a paper bound: never counted, however accurate
    store("fedspa-table1", "cpSGD", 0.85, 1.0, 0.5, note="cpSGD Thm 1 (paper bound)")
    store("ours-fedspa-pld", "DP-Fed (PLD)", 0.80, 1.5, 1.16, method="pld")
    store("ours-fedspa-ddg", "DDG dense", 0.83, 9.0, 1.0)
    store("ours-fedspa-ddg", "DDG too loose", 0.845, 1.0, 3.0)  # eps 3 > 1: not counted
    [line] = analyses.cross_summary(tmp_path)
    assert "best private row at a sound eps <= 1 (delta = 1e-3) 83.00 % (DDG dense" in line
    assert "gap 3.00 points: within 5 points **held**" in line
    assert "cpSGD" not in line and "too loose" not in line


def test_fedspa_table_shows_cpsgd_thm1_only_as_a_labelled_paper_figure(tmp_path: Path) -> None:
    # A stored binomial run as older runs stored it: cpSGD Thm 1 in `epsilon`. The table
    # must recompute the figure from the config into the paper column, labelled (Thm 1 can
    # be below the true epsilon), and our column must hold the sound restricted-RDP bound.
    path = tmp_path / "tinybin.toml"
    path.write_text(TINY.replace('name = "tiny"', 'name = "tinybin"').split("[[runs]]")[0]
                    + '[[runs]]\nlabel = "cpSGD"\nmechanism = "binomial"\nquant-levels = 15\n'
                    'meta = { p = 1.0, paper_accuracy = 88.48, paper_epsilon = 2.26 }\n')
    exp = load_experiment(path)
    with (tmp_path / "log.txt").open("w") as out:
        vdir = run_experiment(exp, quick=True, root=tmp_path / "res", out=out)
    [rec] = load_records(vdir)
    summary = rec["summary"]
    assert summary["paper_epsilon"] > 0 and summary["epsilon"] > 0
    stored = next(vdir.glob("runs/*.json"))
    old = json.loads(stored.read_text())
    old["summary"]["epsilon"] = summary["paper_epsilon"]  # the pre-fix form
    stored.write_text(json.dumps(old))
    text = write_report(root=tmp_path / "res", report=tmp_path / "docs" / "results.md",
                        experiments=[exp], preamble="# test").read_text()
    [row] = [line for line in text.splitlines() if line.startswith("| cpSGD |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[7] == f"{summary['paper_epsilon']:.3f} (cpSGD Thm 1, not verified)"
    assert cells[8] == f"{summary['epsilon']:.3f}"  # "eps RDP (ours, same run)"
    assert summary["epsilon"] != summary["paper_epsilon"]
    assert "paper bound, not verified: can be below the true epsilon" in text
