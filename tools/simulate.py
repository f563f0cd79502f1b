"""The fast simulator: the round core and the mechanisms' device halves, summed in the clear.

:func:`simulate` is a driver loop over the code the fleet runs (plan15 §3.3), with
:class:`aggregator.plain_sum.PlainSum` in place of SecAgg+'s messages and keys. Each round:

* the cohort and the plan come from ``aggregator.round_core`` (``draw_cohort`` over
  ``eligible_devices``: budget left, and not reselected after a budget decline until the
  budget grows; ``draw_plan`` from the fleet's seeded round source, :func:`round_draws`),
  under the policy ``tools.simconfig.round_policy`` maps the config onto, exactly as the
  fleet's ``RoundMachine`` draws them; when fewer than min_cohort devices can pay
  (``round_core.too_few_eligible``) the run ends there with the fleet's note;
* the dropouts of ``tools.dropouts.DropoutSchedule`` (same seed, same victims and stages
  as the fleet's): a device vanishing at ``keys`` never sees the plan; every other cohort
  member runs ``edge_sdk.round.open_round`` on its own in-memory ledger
  (``edge_sdk.ledger.Book``; no limit unless ``budget_epsilon`` is set) with the plan's
  mechanism from ``edge_sdk.mechanisms.MECHANISMS`` and its round rng from the fleet's
  per-device seed; a declined device is, to the sum, one that never advertised keys;
* ``PlainSum`` decides the survivors (or the failure) as SecAgg+ would and sums their ring
  values, after the round machine's own rule (``round_core.short_of_survivors``: fewer
  than the plan's min_survivors answering a stage fails the round); ``round_core.finish``
  decodes with the mechanism's server half and applies the server optimizer. A failed
  round leaves the model as it was.

So with the same config and seeds, this path, the in-process fleet and the MQTT fleet
(``tools.fleet``) give the same final model (``model_sha256``) and the same ledgers
(``tests/test_one_path.py``).

Epsilon: each device's Book, as its ledger would report it (zero-out adjacency, every
reservation counted, at ``delta``): ``epsilon`` is the maximum over devices of the local
view (against anyone who sees a device's upload), ``epsilon_aggregate`` of the aggregate
view (against whoever sees only the sums; for ddg the noise shares of min_survivors -
max_colluders honest members, KLS 2021 Thm 1); ``device_epsilon`` lists each device's.
``paper_epsilon`` (update-noise): FedPAQ's eq. (16), a labelled paper bound.

Mechanism ``binomial`` (cpSGD) runs like the others since issue 15 G6: its ledger event
(:class:`edge_sdk.privacy.events.Binomial`) is the sound restricted-RDP bound of
:mod:`edge_sdk.privacy.binomial` (every round charged in full, composed with delta0 added,
converted at delta); cpSGD's Theorem 1 appears only as the labelled ``paper_epsilon``
(:func:`_cpsgd_paper_epsilon`).

Uploads are the plan's ``length`` ring values of ``bits`` each, counted with their real
framing (``wire.upload_sizes``: signed masked parts under MQTT v5 headers), for every
device that uploaded. Additive masking needs the ring's width, so QSGD levels no longer
shrink an upload; ``bytes_up_packed_no_secagg_per_upload`` is what gaussian's and
update-noise's values would take packed in the clear (float32 or QSGD symbols), a labelled
comparison (plan15 R2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.optimizers import OPTIMIZERS
from aggregator.plain_sum import STAGES, PlainSum
from aggregator.round_core import (
    draw_cohort,
    draw_plan,
    eligible_devices,
    finish,
    mechanism_params,
    next_update_clip,
    round_secrets,
    select_cohort,
    server_half,
    short_of_survivors,
    too_few_eligible,
    with_update_clip,
)
from edge_sdk import compress
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.engine import load_engine
from edge_sdk.ledger import Budget
from edge_sdk.ledger.accounting import Book, EpsilonCache
from edge_sdk.mechanisms import ddg
from edge_sdk.mechanisms.binomial import BinomialRound
from edge_sdk.model import build_spec, init_params
from edge_sdk.privacy import DistributedDiscreteGaussian
from edge_sdk.privacy.binomial import PAPER_BOUND_LABEL, CpsgdBinomial
from edge_sdk.privacy.paper_bounds import fedpaq_epsilon_from_noise
from edge_sdk.round import Declined, open_round
from edge_sdk.secagg import RoundConfig
from edge_sdk.train import subsample_size
from edge_sdk.wire import ModelUpdate, RoundPlan, mqtt_publish_size, upload_sizes
from edge_sdk.wire import encode as wire_encode
from models import manifest_path
from tools.broker import device_names
from tools.datasets import load_dataset
from tools.dropouts import DropoutSchedule
from tools.evaluate import evaluate
from tools.partition import partition
from tools.seeding import device_seed, round_random_bytes
from tools.simconfig import DDG_SCALE, FLEET_NAME, SimConfig, round_policy
from tools.summary import EPSILON_NOTE, device_level_max, model_sha256, sum_sha256, worst

__all__ = ["DDG_SCALE", "PATH_VERSION", "ddg_event", "round_draws", "simulate"]

PATH_VERSION = 3
"""The fast simulator's numbers' version, part of every stored experiment run's key
(``tools.experiments.spec.RunSpec.key``): bumped whenever a change moves its results, so
``fedge experiment run`` reruns stored runs instead of keeping the old path's numbers.
1: before issue 15; 2: issue 15 G0, cohorts, round seeds and device randomness drawn as the
fleet draws them (:func:`round_draws`); 3: issue 15 G3, the round core, the mechanisms'
device halves and PlainSum (fixed-point ring values clamped at the value bound, the mean
over survivors, ledger epsilons, ring-sized uploads)."""


def _finite_or_none(v: float | None) -> float | None:
    """A JSON-safe epsilon: None for none stated or infinite."""
    return v if v is not None and math.isfinite(v) else None


class _Progress:
    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self.total, self.out, self.enabled = total, out, enabled
        self.tty = enabled and out.isatty()
        self.start = time.perf_counter()

    def show(self, rnd: int, acc: float | None, eps: float,
             eps_device: float | None = None) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * rnd / self.total)
        bar = "#" * done + "." * (width - done)
        acc_s = "  -  " if acc is None else f"{acc:.4f}"
        eps_s = "inf" if math.isinf(eps) else f"{eps:.3f}"
        dev_s = "" if eps_device is None else f" eps device-level {eps_device:.3f}"
        line = (f"round {rnd:>4}/{self.total} [{bar}] acc {acc_s} eps sample-level local "
                f"{eps_s}{dev_s} {time.perf_counter() - self.start:6.1f}s")
        if self.tty:
            self.out.write("\r" + line + ("\n" if rnd == self.total else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()


def round_draws(seed: int, devices: int, cohort_size: int, rounds: int
                ) -> Iterator[tuple[int, tuple[int, ...], bytes]]:
    """(round id, cohort as sorted device indices, round seed) of rounds 1..``rounds``,
    drawn as a simulated fleet of ``seed`` draws them when every device stays eligible:
    the round core's cohort (``round_core.draw_cohort`` is ``select_cohort`` with the
    policy seed and round id over the sorted device names) and its round seed and nonce
    from the fleet's seeded source (``round_core.round_secrets``). A deployment's
    aggregator draws the seeds from os.urandom. Any ``cohort_size`` >= 1 (stored runs of
    older paths had smaller cohorts)."""
    names = device_names(devices)
    index = {n: i for i, n in enumerate(names)}
    random_bytes = round_random_bytes(seed)
    for rnd in range(1, rounds + 1):
        cohort = select_cohort(names, min(cohort_size, devices), seed=seed, round_id=rnd)
        round_seed, _nonce = round_secrets(random_bytes)  # the nonce: secure aggregation's
        yield rnd, tuple(index[n] for n in cohort), round_seed


def ddg_event(cfg: SimConfig, dim: int, steps: int = 1) -> DistributedDiscreteGaussian:
    """The aggregate-view event a device of the ``ddg`` config ``cfg`` reserves per round
    (``edge_sdk.mechanisms.ddg.DdgDevice.events``: one sample, zero-out, the noise shares
    of the plan's min_survivors - max_colluders honest members), composed over ``steps``
    rounds, for a model of ``dim`` parameters: what the fast path's ``epsilon_aggregate``
    composes for a device in every round of a full cohort (noise calibration, tests).

    Raises:
        ValueError: ``cfg`` is not a ddg config.
    """
    if cfg.mechanism != "ddg":
        raise ValueError(f"ddg_event needs mechanism 'ddg', got {cfg.mechanism!r}")
    policy = round_policy(cfg, [1])  # local data sizes set the ring's bits, not the event
    honest = max(1, policy.survivors_needed(cfg.cohort_size) - policy.max_colluders)
    k = dim if cfg.sparsity == 1.0 else compress.kept_count(dim, cfg.sparsity)
    l2, l1 = ddg.sensitivities(cfg.clip, cfg.gamma, k)
    return ddg.sample_event(l2=l2, l1=l1,
                            sigma=ddg.device_sigma(cfg.noise_multiplier, cfg.clip, cfg.gamma,
                                                   honest),
                            devices=honest, dim=k, steps=steps, adjacency="zero_out")


def _fedpaq_paper_epsilon(cfg: SimConfig, m: int) -> float:
    """Per-round epsilon FedPAQ's eq. (16) claims for this run's noise, at delta / rounds,
    with the same update sensitivity 2S our accountant charges (paper bound)."""
    if cfg.noise_multiplier == 0:
        return math.inf
    s_bound = cfg.update_clip or cfg.local_steps * cfg.lr * cfg.clip
    b = min(cfg.batch_size, max(1, m // cfg.local_steps))
    return fedpaq_epsilon_from_noise(
        sensitivity=2 * s_bound, noise_std=cfg.noise_multiplier * s_bound,
        delta=cfg.delta / cfg.rounds, batch_size=b, local_steps=cfg.local_steps,
        dataset_size=m)


def _cpsgd_paper_epsilon(plan: RoundPlan, m: int, delta: float) -> float:
    """cpSGD's Theorem 1 epsilon of one round of ``plan``'s binomial mechanism over ``m``
    local samples, at ``delta`` (a paper figure, labelled as such: it can be below the true
    epsilon; the ledger holds the sound restricted-RDP event instead)."""
    rnd = BinomialRound.from_plan(plan, dim=plan.length)  # what the device resolves
    rate = subsample_size(m, rnd.training) / m
    event = CpsgdBinomial(trials=rnd.trials, grid=rnd.update_clip / rnd.levels, dim=rnd.dim,
                          update_clip=rnd.update_clip, sample_rate=rate)
    return event.paper_epsilon_delta(delta)[0]


def simulate(cfg: SimConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Run the fleet; return the JSON-able summary (module docstring).

    The fast path only: a config with ``secagg`` is the fleet path's, which
    :func:`tools.run.run` dispatches to (this module does not import ``tools.fleet``).
    """
    out = sys.stderr if out is None else out  # at call time, not import time
    if cfg.secagg:
        raise ValueError("simulate() is the in-process path without secure aggregation: "
                         "run a config with secagg = true through tools.run.run (the fleet "
                         f"path), got transport={cfg.transport!r}, secagg={cfg.secagg!r}")
    t0 = time.perf_counter()
    data = load_dataset(cfg.dataset)
    spec = build_spec(cfg.model, data.input_shape, data.num_classes)
    engine = load_engine(
        manifest_path(spec.name, spec.input_shape, spec.num_classes),
        backend=cfg.backend,
        threads=cfg.threads,
    )
    # partition and init as the fleet (tools.fleet.Fleet) draws them
    seeds = np.random.SeedSequence(cfg.seed).spawn(3)
    part_rng, init_rng, _ = (np.random.default_rng(s) for s in seeds)
    names = device_names(cfg.devices)
    shards = partition(data.y_train, cfg.devices, cfg.partition, part_rng,
                       num_classes=data.num_classes)
    device_data = {n: (data.x_train[idx], data.y_train[idx])
                   for n, idx in zip(names, shards, strict=True)}
    sizes = [len(idx) for idx in shards]
    binomial = cfg.mechanism == "binomial"
    policy = round_policy(cfg, sizes)
    # device-dp's S, which adaptive clipping moves round by round (as the round machine)
    update_clip = None if policy.update_clip is None else float(policy.update_clip)
    # each device's randomness: round r's generator from its fleet seed, as the fleet's
    # DeviceSession gets it (csprng.seeded_round_rng)
    round_rngs = {n: seeded_round_rng(device_seed(cfg.seed, i)) for i, n in enumerate(names)}
    budget = None if cfg.budget_epsilon is None else Budget(epsilon=cfg.budget_epsilon,
                                                           delta=cfg.delta)
    cache = EpsilonCache()  # one for all books: most devices share their event multisets
    books = {n: Book(budget=budget, delta=None if budget else cfg.delta, cache=cache)
             for n in names}
    device_eps = {n: (0.0, 0.0) for n in names}  # (local, aggregate)
    device_level: dict[str, float | None] = dict.fromkeys(names, 0.0)  # None: no theorem
    paper_eps = dict.fromkeys(names, 0.0)  # FedPAQ eq. (16) / cpSGD Thm 1, summed
    participated = dict.fromkeys(names, 0)
    schedule = DropoutSchedule(cfg.dropout, cfg.seed) if cfg.dropout > 0 else None
    random_bytes = round_random_bytes(cfg.seed)

    params = [np.asarray(p, dtype=np.float32) for p in init_params(spec, init_rng)]
    version = 0
    d = spec.num_params
    optimizer = OPTIMIZERS[policy.server_opt](server_lr=policy.server_lr)
    opt_state = optimizer.init(params)

    acc_hist: list[float | None] = []
    eps_hist: list[float] = []
    agg_hist: list[float] = []
    loss_hist: list[float | None] = []
    bytes_hist: list[dict[str, int]] = []
    rounds: list[dict[str, Any]] = []
    clamped = 0
    max_abs_integer = 0
    bytes_up_payload = bytes_up_overhead = bytes_down = 0
    progress = _Progress(cfg.rounds, out, cfg.progress)
    plan: RoundPlan | None = None
    budget_short: dict[str, float] = {}  # the round machine's: a budget decline's remaining epsilon
    end_note = ""
    eps = agg_eps = 0.0  # no round, no spend
    dev_eps: float | None = 0.0  # device-level: None once any device's has no theorem
    dev_hist: list[float | None] = []

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    for rnd in range(1, cfg.rounds + 1):
        before = (bytes_up_payload, bytes_up_overhead, bytes_down)
        # the round machine's eligibility (round_core.eligible_devices) from the remaining
        # epsilon each device's check-in would state (no budget: no limit), and its end
        remaining = {n: math.inf if budget is None else books[n].remaining() for n in names}
        eligible = eligible_devices(remaining, short=budget_short)
        why = too_few_eligible(len(eligible), policy=policy)
        if why:
            end_note = f"ended after {rnd - 1} rounds: {why}"
            if acc_hist and acc_hist[-1] is None:  # the last round's model, evaluated
                acc_hist[-1] = evaluate(engine, params, data.x_test, data.y_test,
                                        cfg.eval_batch)
                rounds[-1]["accuracy"] = acc_hist[-1]
            break
        cohort = draw_cohort(eligible, policy=policy, round_id=rnd)
        this_round = (policy if update_clip is None  # adaptive clipping's current S
                      else with_update_clip(policy, update_clip))
        plan = draw_plan(this_round, round_id=rnd, model_version=version, cohort=cohort,
                         dim=d, random_bytes=random_bytes)
        config = RoundConfig.of_plan(plan)
        model_bytes = wire_encode(replace(ModelUpdate.of(version=version, round_id=rnd,
                                                         params=params), sig=bytes(64)))
        dropped = dict(schedule.victims(rnd, cohort)) if schedule is not None else {}
        vanished = dict(dropped)  # and, to the sum, the devices that declined
        declined: list[str] = []
        values: dict[str, np.ndarray] = {}
        reserved: dict[str, Any] = {}
        losses: list[float] = []
        for n in cohort:
            bytes_down += mqtt_publish_size(f"fedge/{FLEET_NAME}/model", len(model_bytes))
            if vanished.get(n) == "keys":  # gone on receipt of the plan
                continue
            got = open_round(plan, fleet=FLEET_NAME, ledger=books[n], params=params,
                             model_version=version, data=lambda n=n: device_data[n],
                             engine=engine, dim=d, round_rng=round_rngs[n],
                             max_colluders=cfg.max_colluders)
            if isinstance(got, Declined):
                declined.append(n)
                if got.reason == "budget":  # not selected again until its budget grows
                    budget_short[n] = remaining[n]
                vanished[n] = "keys"  # a declined device never advertises keys
                if got.reservation is None:  # declined before training
                    continue
                loss = math.nan  # diverged: reserved and trained
            else:
                c = got.contribution
                values[n] = c.values
                reserved[n] = got.reservation
                loss = c.mean_loss
                clamped += int(c.diagnostics.get("clamped", 0))
                max_abs_integer = max(max_abs_integer,
                                      int(c.diagnostics.get("max_abs_integer", 0)))
                if cfg.mechanism == "update-noise":
                    paper_eps[n] += _fedpaq_paper_epsilon(cfg, c.num_samples)
                elif binomial:  # per round at delta / rounds (the paper figure)
                    paper_eps[n] += _cpsgd_paper_epsilon(plan, c.num_samples,
                                                         cfg.delta / cfg.rounds)
            s = books[n].spent()
            device_eps[n] = (s.local_epsilon, s.aggregate_epsilon)
            device_level[n] = s.device_epsilon
            participated[n] += 1
            if math.isfinite(loss):
                losses.append(loss)
        agg = PlainSum.for_config(config, vanished=vanished)
        # the round machine's rule at each stage reached, before secure aggregation's
        # (declines are answers to the round machine: they do not hold a stage open)
        shorts = [short_of_survivors(stage, got, min_survivors=plan.min_survivors,
                                     why="all answered" if got == asked - (
                                         len(declined) if stage == "collect_keys" else 0)
                                     else "deadline")
                  for stage, got, asked in agg.answered]
        short = next((i for i, why in enumerate(shorts) if why), None)
        # the round machine's detail: its own rule's words, or secure aggregation's
        # RoundFailed (``round <id> failed: <why>``)
        failed = (shorts[short] if short is not None else None if agg.failed is None
                  else f"round {rnd} failed: {agg.failed}")
        # the stages the round opened: a victim of a later one never got to vanish
        opened = (short + 1 if short is not None else len(STAGES)
                  if failed is None or agg.survivors else len(agg.answered))
        dropped = {n: st for n, st in dropped.items() if STAGES.index(st) < opened}
        # the uploads: the answers to the masked-input stage, if the round opened it
        n_uploads = dict((st, got) for st, got, _ in agg.answered[:opened]).get(
            "collect_masked", 0)
        if n_uploads:
            payload, overhead = upload_sizes(config.length, config.bits, fleet=FLEET_NAME,
                                             device=cohort[0])  # names: all the same length
            bytes_up_payload += n_uploads * payload
            bytes_up_overhead += n_uploads * overhead
        survivors = agg.survivors
        if failed is None:
            for n in survivors:
                agg.add(n, values[n])
            total = agg.total()
            server = server_half(plan, dim=d)
            for n in survivors:  # the aggregator holds the upload: the device commits
                books[n].commit(reserved[n])
            done = finish(plan, total, len(survivors), params=params, server=server,
                          optimizer=optimizer, opt_state=opt_state)
            params, opt_state = done.params, done.opt_state
            if update_clip is not None:
                update_clip = next_update_clip(policy, update_clip, done.quantile)
            version += 1
        total_sha = None if failed is not None else sum_sha256(total)
        eps = max(e for e, _ in device_eps.values())
        agg_eps = max(a for _, a in device_eps.values())
        eps = max(eps, eps_hist[-1] if eps_hist else 0.0)
        agg_eps = max(agg_eps, agg_hist[-1] if agg_hist else 0.0)
        dev_eps = worst(dev_eps, device_level_max(device_level.values()))
        acc = None
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
            acc = evaluate(engine, params, data.x_test, data.y_test, cfg.eval_batch)
        bytes_hist.append({"up_payload": bytes_up_payload - before[0],
                           "up_overhead": bytes_up_overhead - before[1],
                           "down": bytes_down - before[2]})
        acc_hist.append(acc)
        eps_hist.append(eps)
        agg_hist.append(agg_eps)
        dev_hist.append(dev_eps)
        up = bytes_up_payload + bytes_up_overhead - before[0] - before[1]
        # the fleet's row (tools.fleet), where the fast path has the figure
        rounds.append({"round": rnd, "completed": failed is None,
                       "detail": failed or "", "cohort": len(cohort),
                       "survivors": len(survivors) if failed is None else 0,
                       "dropped": dict(sorted(dropped.items())), "declined": declined,
                       "model_version": version,
                       "accuracy": acc, "epsilon_local": finite(eps),
                       "epsilon_aggregate": finite(agg_eps),
                       "epsilon_device": _finite_or_none(dev_eps),
                       "update_clip": plan.params.update_clip if cfg.mechanism == "device-dp"
                       else None,
                       "bytes": {"up_payload": bytes_up_payload - before[0],
                                 "up_packets": up, "down_packets": bytes_down - before[2]},
                       "sum_sha256": total_sha})
        loss_hist.append(float(np.mean(losses)) if losses else None)
        progress.show(rnd, acc, eps, dev_eps)

    uploads = sum(r["survivors"] for r in rounds)
    # the plan of a full cohort where no round started
    k, bits = (plan.length, plan.bits) if plan is not None else mechanism_params(
        policy, dim=d)[1:]
    ddg_facts = None
    if cfg.mechanism == "ddg" and plan is not None:
        w = plan.params
        honest = plan.min_survivors - plan.max_colluders
        ddg_facts = {"gamma": w.gamma, "sigma_dev": w.sigma, "honest_shares": honest,
                     "summed_noise_std_model_units": w.sigma * w.gamma * math.sqrt(honest),
                     "bits": plan.bits, "nominal_local_samples": w.nominal_samples,
                     "max_local_samples": max(sizes), "max_abs_integer": max_abs_integer}
    paper = (finite(max(paper_eps.values()))
             if cfg.mechanism in ("update-noise", "binomial") else None)
    return {
        "transport": "none",
        "secagg": False,
        "final_accuracy": acc_hist[-1] if acc_hist else evaluate(
            engine, params, data.x_test, data.y_test, cfg.eval_batch),
        "accuracy_per_round": acc_hist,
        "train_loss_per_round": loss_hist,
        "rounds": rounds,
        "rounds_completed": sum(r["completed"] for r in rounds),
        "rounds_failed": sum(not r["completed"] for r in rounds),
        "note": end_note,
        "model_version": version,
        "epsilon": finite(eps),
        "epsilon_aggregate": finite(agg_eps),
        "epsilon_per_round": [finite(e) for e in eps_hist],
        "epsilon_aggregate_per_round": [finite(e) for e in agg_hist],
        "epsilon_device": _finite_or_none(dev_eps),
        "epsilon_device_per_round": [_finite_or_none(e) for e in dev_hist],
        "device_level_epsilon": {n: _finite_or_none(e) for n, e in device_level.items()},
        "device_epsilon": {n: [finite(e), finite(a)] for n, (e, a) in device_eps.items()},
        "epsilon_note": EPSILON_NOTE,
        # what the aggregate figures assume, resolved (None in the config: the threshold)
        "min_survivors": policy.survivors_needed(policy.cohort_size),
        "max_colluders": policy.max_colluders,
        "delta": cfg.delta,
        "paper_epsilon": paper,
        "paper_epsilon_note": ("update-noise: FedPAQ eq. (16) per round at delta/rounds, "
                               "summed over a device's rounds (paper bound, not necessarily "
                               "sound)" if cfg.mechanism == "update-noise" else
                               f"{PAPER_BOUND_LABEL}; per round at delta/rounds, amplified by "
                               "the subsample, summed over a device's rounds"
                               if binomial else None),
        "clamped_values": clamped,
        "bytes_up_total": bytes_up_payload + bytes_up_overhead,
        "bytes_up_payload": bytes_up_payload,
        "bytes_up_overhead": bytes_up_overhead,
        "bytes_up_per_upload": ((bytes_up_payload + bytes_up_overhead) / uploads
                                if uploads else None),
        "bytes_up_float32_per_upload": 4 * d,
        # plan15 R2: additive masking needs the ring's width, so QSGD no longer shrinks an
        # upload; what its values would take packed in the clear, labelled, for comparison
        "bytes_up_packed_no_secagg_per_upload": (
            compress.packed_size(k, cfg.quant_levels) if cfg.quant_levels
            and cfg.mechanism in ("gaussian", "update-noise") else
            4 * k if cfg.mechanism in ("gaussian", "update-noise") else None),
        "bytes_down_total": bytes_down,
        "bytes_per_round": bytes_hist,
        "kept_coordinates": k,
        "ring_bits": bits,
        "ddg": ddg_facts,
        "device_rounds": uploads,
        "max_rounds_per_device": max(participated.values()),
        "num_params": d,
        "model_sha256": model_sha256(params),
        "wall_seconds": time.perf_counter() - t0,
        "config": {k: (finite(v) if isinstance(v, float) else v)
                   for k, v in dataclasses.asdict(cfg).items()},
    }


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    """Write the summary as strict JSON (no NaN/Infinity)."""
    Path(path).write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
