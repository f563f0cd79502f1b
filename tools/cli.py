"""The ``fedge`` command line: simulate, export, bench, privacy, ledger, broker, experiment.

Heavy imports (torch for ``export``, opacus for ``bench``) happen inside the subcommand
that needs them, so ``fedge simulate`` starts with numpy and onnxruntime only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from edge_sdk.device import DeviceConfig

__all__ = ["main"]


def _float_or_inf(text: str) -> float:
    value = float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run a simulated private fleet (in-process, or "
                                        "with secure aggregation over a broker)")
    p.add_argument("--config", help="TOML file with the same settings (flags override it)")
    p.add_argument("--dataset", help="fashion-mnist | digits | breast-cancer")
    p.add_argument("--model", help="logreg | mlp | tabular | cnn")
    p.add_argument("--devices", type=int, help="fleet size n")
    p.add_argument("--participation", type=float, help="cohort fraction r/n per round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--local-steps", type=int, help="local SGD steps tau per round")
    p.add_argument("--batch-size", type=int, help="(expected) local batch size")
    p.add_argument("--lr", type=float, help="local step size")
    p.add_argument("--clip", type=_float_or_inf, help="per-sample L2 clip bound C (default: none)")
    p.add_argument("--noise-multiplier", type=float, help="noise std / C on the clipped sum")
    p.add_argument("--delta", type=float, help="delta at which epsilon is reported")
    p.add_argument("--partition", help="iid | het:K | dirichlet:ALPHA")
    p.add_argument("--sampling", choices=["poisson", "shuffle"])
    p.add_argument("--server-lr", type=float)
    p.add_argument("--server-opt",
                   choices=["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedspa"],
                   help="server optimizer (fedspa: Fed-SPA's adaptive update, eq. (6); "
                        "fedadam/fedyogi/fedadagrad: Reddi et al. 2021)")
    # edge_sdk's registry, not tools.simconfig's MECHANISM_NAMES (the same names): the CLI
    # of a device install (fedge doctor) must not import the aggregator package
    from edge_sdk.mechanisms import MECHANISMS

    p.add_argument("--mechanism", choices=sorted(MECHANISMS),
                   help="gaussian: noise every step (default); update-noise: privatized "
                        "FedPAQ, noise once on the clipped update; binomial: cpSGD baseline; "
                        "ddg: FedSGD with distributed discrete Gaussian noise under secure "
                        "aggregation's sum mod 2^bits; device-dp: device-level DP-FedAvg "
                        "(update clipped to --update-clip, distributed discrete Gaussian; "
                        "fleet path only)")
    p.add_argument("--ddg-gamma", type=float,
                   help="ddg, device-dp: model units per integer step (default: clip / 1024; "
                        "device-dp: update-clip / 1024)")
    p.add_argument("--binomial-trials", type=int, help="binomial: coin flips N per coordinate")
    p.add_argument("--sparsity", type=float, help="kept fraction p of rand-k (default 1)")
    p.add_argument("--quant-levels", type=int, help="QSGD levels s for uploads (0: float32)")
    p.add_argument("--update-clip", type=float,
                   help="update-noise, binomial: L2 bound S on the update (default E*lr*C); "
                        "device-dp: S (required)")
    p.add_argument("--adaptive-clip-quantile", type=float,
                   help="device-dp: adaptive clipping (Andrew et al. 2021): S follows this "
                        "quantile of the devices' update norms (from --update-clip), the "
                        "indicator released with the update and accounted with it")
    p.add_argument("--adaptive-clip-lr", type=float,
                   help="device-dp: adaptive clipping's geometric step (default 0.2)")
    p.add_argument("--self-sample-rate", type=float,
                   help="device-dp: each member sends its data with this probability by its "
                        "own hidden coin (zeros otherwise), and accounts the amplification "
                        "(default 1: always)")
    p.add_argument("--weighting", choices=["uniform"],
                   help="the sum is unweighted (a key of older configs; weights by data "
                        "size would reveal each device's m)")
    p.add_argument("--backend", choices=["onnx", "numpy"])
    p.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default 1)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--seed", type=int)
    g = p.add_argument_group("fleet (device sessions, ledgers, secure aggregation)")
    g.add_argument("--transport", choices=["inproc", "mqtt"],
                   help="inproc: in-memory broker, simulated clock (default); mqtt: a real "
                        "mosquitto with TLS and per-device credentials (implies --secagg)")
    g.add_argument("--secagg", action=argparse.BooleanOptionalAction, default=None,
                   help="run the fleet path: every device a DeviceSession with its ledger, "
                        "SecAgg+ with dropout recovery (default: off for inproc)")
    g.add_argument("--secagg-protocol", choices=("secagg+", "amortized"),
                   help="the fleet's secure aggregation: secagg+ (default: per-round keys "
                        "and shares, double masking) or amortized (pairwise seeds agreed at "
                        "enrollment: an upload is about the masked vector alone; a "
                        "semi-honest aggregator only, every neighbour of a dropped device "
                        "must answer; see edge_sdk.secagg)")
    g.add_argument("--buffered", action=argparse.BooleanOptionalAction, default=None,
                   help="buffered asynchronous rounds (FedBuff): devices train ahead on the "
                        "newest model they hold, a round starts when a cohort of them is "
                        "ready, stale updates weighted (1 + tau)^-a (device-dp over "
                        "secagg+; see aggregator/rounds.py)")
    g.add_argument("--max-staleness", type=int,
                   help="buffered rounds: the most model versions an update may lag (4)")
    g.add_argument("--staleness-exponent", type=float,
                   help="buffered rounds: a of the weight (1 + tau)^-a (0.5)")
    g.add_argument("--dropout", type=float,
                   help="fraction of each round's cohort that vanishes at a random stage "
                        "(both paths: the same devices at the same stages)")
    g.add_argument("--stage-timeout", type=float,
                   help="seconds per secure-aggregation stage (a safety net; vanished "
                        "devices are detected without waiting)")
    g.add_argument("--value-bound", type=float,
                   help="uploaded values are clamped to [-B, B] before fixed-point encoding")
    g.add_argument("--budget-epsilon", type=float,
                   help="each device ledger's lifetime budget (default: none on the fast "
                        "path, 100 on the fleet path)")
    g.add_argument("--min-survivors", type=int,
                   help="the fewest uploads a round may sum (default: SecAgg+'s threshold)")
    g.add_argument("--max-colluders", type=int,
                   help="cohort members assumed to collude with the aggregator (default 1)")
    g.add_argument("--workdir", help="keep ledgers, checkpoint and broker files here "
                                     "(default: a temporary directory)")
    p.add_argument("--json-out", help="write the JSON summary here, and beside it (same name, "
                   ".png) a plot of accuracy, epsilon and bytes per round")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--beside-no-noise", action="store_true",
                   help="then run the same fleet without noise (noise multiplier 0; the same "
                        "seeds, cohorts, dropouts, clipping and compression, on the fast "
                        "path, which ends with the fleet's model) and print its accuracy "
                        "beside: what the privacy costs (summary key 'no_noise')")


def _simulate(args: argparse.Namespace) -> int:
    from tools.plots import plot_run, png_beside, run_series
    from tools.run import run
    from tools.simconfig import SimConfig, load_config
    from tools.simulate import write_json
    from tools.summary import epsilon_lines

    keys = ["dataset", "model", "devices", "participation", "rounds", "local_steps",
            "batch_size", "lr", "clip", "noise_multiplier", "delta", "partition", "sampling",
            "server_lr", "server_opt", "weighting", "backend", "threads", "eval_every",
            "seed", "mechanism", "sparsity", "quant_levels", "update_clip",
            "adaptive_clip_quantile", "adaptive_clip_lr", "self_sample_rate",
            "binomial_trials",
            "ddg_gamma", "transport", "secagg", "secagg_protocol", "dropout",
            "stage_timeout", "value_bound",
            "budget_epsilon", "min_survivors", "max_colluders", "buffered",
            "max_staleness", "staleness_exponent"]
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.quiet:
        overrides["progress"] = False
    if args.transport == "mqtt" and args.secagg is None:
        overrides["secagg"] = True  # a config file's secagg = false must not contradict it
    cfg = load_config(args.config, **overrides) if args.config else SimConfig(**overrides)
    if args.workdir and not cfg.secagg:
        raise ValueError("--workdir applies to the fleet path (--secagg or --transport mqtt)")
    # the plot's path is checked before the run, not after it
    png = png_beside(args.json_out) if args.json_out else None
    twin = cfg.without_noise() if args.beside_no_noise else None  # refused before the run
    summary = run(cfg, workdir=args.workdir)
    if twin is not None:
        plain = run(twin)
        summary["no_noise"] = {k: plain[k] for k in ("final_accuracy", "accuracy_per_round",
                                                     "model_sha256", "rounds_completed")}
    if args.json_out and png is not None:
        write_json(summary, args.json_out)
        plot_run(run_series(summary), png)
    per = summary["bytes_up_per_upload"]
    print(f"final accuracy {summary['final_accuracy']:.4f}, "
          f"uploaded {summary['bytes_up_total'] / 2**20:.2f} MiB "
          f"({'-' if per is None else f'{per:.0f}'} B per upload vs "
          f"{summary['bytes_up_float32_per_upload']} B float32), "
          f"{summary['wall_seconds']:.1f} s")
    for line in epsilon_lines(summary):  # each with its unit, view and adjacency
        print(line)
    if twin is not None:
        acc, plain_acc = summary["final_accuracy"], summary["no_noise"]["final_accuracy"]
        print(f"the same fleet without noise (fast path, same seeds, cohorts, dropouts, "
              f"clipping and compression): final accuracy {plain_acc:.4f}; the privacy "
              f"costs {100 * (plain_acc - acc):.2f} points")
    if summary.get("paper_epsilon") is not None:
        paper = "cpSGD Thm 1, not verified" if cfg.mechanism == "binomial" else "FedPAQ"
        print(f"paper's {paper} bound (labelled, not the ledger's): "
              f"{summary['paper_epsilon']:.4f}")
    path = ("fast path" if not cfg.secagg else
            f"fleet over {summary['transport']} with secure aggregation")
    print(f"{path}: {summary['rounds_completed']} rounds completed, "
          f"{summary['rounds_failed']} failed; model sha256 {summary['model_sha256'][:16]}")
    if summary["note"]:
        print(f"fedge simulate: {summary['note']}", file=sys.stderr)
        # budgets that ran out end a run cleanly (round_core.too_few_eligible), on either
        # path; any other note is a fleet that stalled or could not run
        if not summary["note"].startswith("ended after "):
            return 1
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export the model zoo, or your own torch module, to ONNX "
                                      "(needs the [export] extra)")
    p.add_argument("--out", help="output directory (default: models/onnx)")
    p.add_argument("--only", help="export only variants whose name contains this")
    p.add_argument("--module", help="pkg.mod:factory, a function returning your torch module "
                                    "(traced with torch.fx) instead of the zoo")
    p.add_argument("--input-shape", help="with --module: one sample's shape, e.g. 1,28,28")
    p.add_argument("--num-classes", type=int,
                   help="with --module: the number of labels (default: the output's width)")
    p.add_argument("--name", help="with --module: the exported files' model name")


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from models.export import ONNX_DIR, export_all, export_module

    out = Path(args.out) if args.out else ONNX_DIR
    if args.module:
        if not args.input_shape:
            raise ValueError("--module needs --input-shape (one sample's shape, e.g. 1,28,28)")
        try:
            shape = [int(v) for v in args.input_shape.split(",")]
        except ValueError as exc:
            raise ValueError(f"--input-shape {args.input_shape!r}: expected comma-separated "
                             "ints, e.g. 1,28,28") from exc
        print(export_module(args.module, shape, args.num_classes, out, args.name))
        return 0
    for path in export_all(Path(args.out) if args.out else ONNX_DIR, args.only):
        print(path)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a reference measured in the same run")
    p.add_argument("what",
                   choices=["all", "client", "stacks", "wire", "small-upload", "accountant",
                            "ledger", "secagg", "round-timeline", "scale", "workers",
                            "fedbuff", "envelope", "compare"],
                   help="all: every benchmark, written to docs/benchmarks.md (shortfalls "
                        "against the issues' targets at the top); client: DP-SGD step, fedge "
                        "vs Opacus, beside the FLOP floor; stacks: import time and installed "
                        "size, device stack vs torch + Opacus; wire: bytes per upload; "
                        "small-upload: a 650-parameter model's bytes per round in a cohort "
                        "of 10, SecAgg+ vs the amortized protocol, over mosquitto; "
                        "round-timeline: where a 10-device round's time goes over mosquitto "
                        "(per stage, busy vs waiting, broker round trips); "
                        "scale: 10,000 and 100,000 registered devices, cohorts of 100 and "
                        "(without --quick) 20 rounds of 1,000: peak RSS, device-rounds/min; "
                        "workers: one gateway's rounds over 1 and 2 worker processes (shared "
                        "subscriptions) over mosquitto: device-rounds/min, same sums; "
                        "fedbuff: buffered asynchronous rounds vs synchronous ones, time to "
                        "target accuracy on a simulated clock under a stated availability "
                        "model, same device-level budget (tools/fedbuff.py); "
                        "accountant: fedge vs dp_accounting; ledger: epsilon_if on a durable "
                        "ledger of 10,000 entries; secagg: one full SecAgg+ "
                        "round vs the mask PRG's floor (needs --clients, --dim, --dropout); "
                        "envelope: one device round pinned to one core under 512 MiB; "
                        "compare BEFORE AFTER [AFTER ...]: every ratio of `bench all "
                        "--json-out` files, exit 1 where AFTER (the median of several "
                        "runs) is worse beyond --noise or the runs' own spread "
                        "(tools/bench/compare.py says how). "
                        "Peers come from tools/bench/requirements.txt")
    p.add_argument("files", nargs="*", metavar="JSON",
                   help="compare: the BEFORE and AFTER `fedge bench all --json-out` files "
                        "(several AFTER runs: their median, noise at least their spread)")
    p.add_argument("--quick", action="store_true",
                   help="fewer configurations and repetitions (all: under 10 minutes)")
    p.add_argument("--device-budget", type=float, default=30.0,
                   help="fedbuff: every ledger's device-level epsilon budget (nats at "
                        "delta 1e-5; default 30)")
    p.add_argument("--json-out", help="write the rows as JSON here")
    p.add_argument("--noise", type=float,
                   help="compare: allowed relative change the wrong way (default 0.1)")
    g = p.add_argument_group("secagg")
    g.add_argument("--clients", type=int, help="cohort size n (>= 3)")
    g.add_argument("--dim", type=int, help="values per device d")
    g.add_argument("--dropout", type=float,
                   help="fraction of the cohort that drops after sharing keys, in [0, 1)")
    g.add_argument("--neighbors", type=int,
                   help="SecAgg+ degree k (rounded up to even; default 2 * ceil(log2 n))")
    g.add_argument("--full-graph", action="store_true",
                   help="every device neighbours every other (the original O(n^2) SecAgg)")
    g.add_argument("--bits", type=int, help="ring size b: sums mod 2^b (default 32)")
    g.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (else a one-line summary)")


_SECAGG_ONLY = ("clients", "dim", "dropout", "neighbors", "bits")


def _bench_secagg(args: argparse.Namespace) -> dict[str, object]:
    from tools.bench.secagg import run_secagg_bench

    missing = [f"--{k}" for k in ("clients", "dim", "dropout") if getattr(args, k) is None]
    if missing:
        raise ValueError(f"bench secagg needs {', '.join(missing)}")
    if args.full_graph and args.neighbors is not None:
        raise ValueError("--full-graph and --neighbors exclude each other")
    extra = {"bits": args.bits} if args.bits is not None else {}
    result = run_secagg_bench(args.clients, args.dim, args.dropout, args.neighbors,
                              args.full_graph, reps=1 if args.quick else 3,
                              out=sys.stdout if args.json else None, **extra)
    if not args.json:
        if result["failed"]:
            print(f"secagg: {result['failed']}")
        else:
            print(f"secagg n={result['clients']} d={result['dim']} k={result['degree']}: "
                  f"exact={result['exact']}, client mask {result['client_mask_s']:.4f} s "
                  f"({result['client_mask_over_bound']}x PRG floor), server unmask "
                  f"{result['server_unmask_s']:.4f} s ({result['server_unmask_over_bound']}x), "
                  f"Shamir {result['server_shamir_s']:.4f} s, "
                  f"{result['bytes_up_per_client']} B up per client "
                  f"({result['bytes_vector']} B vector), round {result['run_s']} s")
    return {"secagg": result}


def _bench(args: argparse.Namespace) -> int:
    if args.what == "compare":
        if len(args.files) < 2 or args.quick:
            raise ValueError("bench compare takes BEFORE and one or more AFTER files (and "
                             "--noise, --json-out)")
    elif args.files or args.noise is not None:
        raise ValueError("JSON files and --noise are for bench compare only")
    if args.what != "secagg":
        given = [f"--{k}" for k in _SECAGG_ONLY if getattr(args, k) is not None]
        given += ["--full-graph"] * args.full_graph + ["--json"] * args.json
        if given:
            raise ValueError(f"{', '.join(given)} only apply to bench secagg")
    if args.what == "compare":
        from tools.bench.compare import run

        noise = 0.1 if args.noise is None else args.noise
        return run(*args.files, noise=noise, json_out=args.json_out)
    if args.what == "all":
        from tools.bench.report import run_all

        report = run_all(quick=args.quick, json_out=args.json_out)
        broken = [k for k, v in report.items() if isinstance(v, dict) and "failed" in v]
        if broken:
            print(f"fedge bench: section(s) failed: {', '.join(broken)}", file=sys.stderr)
            return 1
        return 0
    if args.what == "client":
        from tools.bench.client import run_client_bench

        result = {"client": run_client_bench(quick=args.quick)}
    elif args.what == "stacks":
        from tools.bench.stacks import run_stacks_bench

        result = {"stacks": run_stacks_bench(quick=args.quick)}
    elif args.what == "envelope":
        from tools.bench.envelope import run_envelope_bench

        result = {"envelope": run_envelope_bench(quick=args.quick)}
    elif args.what == "accountant":
        from tools.bench.accountant import run_accountant_bench

        result = {"accountant": run_accountant_bench(quick=args.quick)}
    elif args.what == "ledger":
        from tools.bench.ledger import run_ledger_bench

        result = {"ledger": run_ledger_bench(quick=args.quick)}
    elif args.what == "secagg":
        result = _bench_secagg(args)
    elif args.what == "round-timeline":
        from tools.bench.round_timeline import run_round_timeline_bench

        result = {"round_timeline": run_round_timeline_bench()}
    elif args.what == "scale":
        from tools.bench.scale import run_scale_bench

        result = {"scale": run_scale_bench(quick=args.quick)}
    elif args.what == "fedbuff":
        from tools.bench.fedbuff import run_fedbuff_bench

        result = {"fedbuff": run_fedbuff_bench(quick=args.quick,
                                               budget=args.device_budget)}
    elif args.what == "workers":
        from tools.bench.workers import run_workers_bench

        result = {"workers": run_workers_bench(quick=args.quick)}
    elif args.what == "small-upload":
        from tools.bench.small_upload import run_small_upload_bench

        result = {"small_upload": run_small_upload_bench()}
    else:
        from tools.bench.wire import run_wire_bench

        result = {"wire": run_wire_bench()}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _privacy(args: argparse.Namespace) -> int:
    from tools.privacy_cli import run_privacy

    return run_privacy(args)


def _ledger(args: argparse.Namespace) -> int:
    from tools.ledger_cli import run_ledger

    return run_ledger(args)


def _add_broker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="a locked-down local mosquitto for a fleet")
    bsub = p.add_subparsers(dest="broker_command", required=True)
    c = bsub.add_parser("config", help="write mosquitto.conf, passwords, ACLs, TLS material "
                                       "and credentials.json for N devices")
    c.add_argument("--devices", type=int, required=True, help="fleet size (dev-0000, ...)")
    c.add_argument("--fleet", default="fleet", help="fleet name (topics fedge/<fleet>/...)")
    c.add_argument("--port", type=int, help="listener port on 127.0.0.1 (default 8883 with "
                                            "TLS, 1883 without)")
    c.add_argument("--out", default="broker", help="output directory (default: ./broker)")
    c.add_argument("--no-tls", action="store_true", help="plain TCP (local experiments only)")
    c.add_argument("--messages-per-round", type=int, default=64,
                   help="most messages one device sends per round (sizes the broker queues)")


def _broker(args: argparse.Namespace) -> int:
    from tools.broker import device_names, write_broker_config

    tls = not args.no_tls
    port = args.port if args.port is not None else (8883 if tls else 1883)
    cfg = write_broker_config(args.out, devices=device_names(args.devices), fleet=args.fleet,
                              port=port, tls=tls, messages_per_round=args.messages_per_round)
    print(f"wrote {cfg.config_file} ({len(cfg.devices)} devices, fleet {cfg.fleet!r}, "
          f"{'TLS' if tls else 'plain TCP'} on {cfg.host}:{cfg.port})")
    print(f"credentials (keep private): {cfg.credentials_file}")
    if cfg.ca_file is not None:
        print(f"CA certificate for clients: {cfg.ca_file}")
    print(f"run it with: mosquitto -c {cfg.config_file}")
    return 0


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the papers' experiments: run, list, report "
                                          "(docs/results.md)")
    esub = p.add_subparsers(dest="experiment_command", required=True)
    esub.add_parser("list", help="the declared experiments (tools/experiments/*.toml)")
    r = esub.add_parser("run", help="run one experiment (resumable: finished runs are skipped)")
    r.add_argument("name", help="experiment name, or 'all'")
    r.add_argument("--quick", action="store_true", help="the small CI-sized variant")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a simulator setting for every run (a separate variant)")
    r.add_argument("--no-report", action="store_true", help="do not regenerate the report")
    r.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="worker processes, one core each (default 1); a second invocation "
                        "of the same experiment also shares the work")
    esub.add_parser("report", help="regenerate docs/results.md and its plots from stored runs")


def _experiment(args: argparse.Namespace) -> int:
    from tools.experiments import (
        list_experiments,
        load_experiment,
        parse_overrides,
        run_experiment,
        write_report,
    )

    if args.experiment_command == "list":
        for exp in list_experiments():
            print(f"{exp.name:28} {exp.title}")
        return 0
    if args.experiment_command == "run":
        overrides = parse_overrides(args.set)
        exps = list_experiments() if args.name == "all" else [load_experiment(args.name)]
        for exp in exps:
            run_experiment(exp, quick=args.quick, overrides=overrides, jobs=args.jobs)
        if args.no_report:
            return 0
    print(write_report())
    return 0


def _add_enroll(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("enroll", help="generate identities, registry, broker config, ledgers "
                                      "and service configs for a fleet")
    p.add_argument("--devices", type=int, required=True, help="fleet size (dev-0000, ...)")
    p.add_argument("--fleet", required=True, help="fleet name (topics fedge/<fleet>/...)")
    p.add_argument("--out", required=True, help="fleet directory to create")
    p.add_argument("--port", type=int, help="broker port (default 8883 with TLS, 1883 without)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the broker's address: its listener, its certificate's name and what "
                        "the TOML configs connect to (default 127.0.0.1; a gateway serving "
                        "devices on a network: its host name or address)")
    p.add_argument("--no-tls", action="store_true", help="plain TCP (local experiments only)")
    p.add_argument("--no-broker", action="store_true",
                   help="identities and registry only (no broker config, no TOML configs)")
    p.add_argument("--no-ledgers", action="store_true", help="do not provision ledgers")
    p.add_argument("--budget-eps", type=float, default=10.0, help="each device's epsilon budget")
    p.add_argument("--budget-delta", type=float, default=1e-5, help="delta of the budget")
    p.add_argument("--model", default="logreg-64-10", help="zoo model name (models/onnx)")
    p.add_argument("--cohort-size", type=int, help="devices per round (default min(10, n))")


def _enroll(args: argparse.Namespace) -> int:
    from tools.enroll import enroll

    policy = {} if args.cohort_size is None else {"cohort_size": args.cohort_size}
    done = enroll(args.out, devices=args.devices, fleet=args.fleet, broker=not args.no_broker,
                  port=args.port, tls=not args.no_tls, host=args.host,
                  ledgers=not args.no_ledgers,
                  budget_epsilon=args.budget_eps, budget_delta=args.budget_delta,
                  model=args.model, policy=policy)
    print(f"enrolled {args.devices} devices of fleet {done.fleet!r} in {done.directory}")
    print(f"public registry: {done.registry}")
    if done.broker_dir is not None:
        print(f"broker: mosquitto -c {done.broker_dir / 'mosquitto.conf'}")
        print(f"aggregator: fedge aggregator --config {done.aggregator_config}")
        first = next(iter(done.device_configs.values()))
        print(f"a device: fedge device --config {first} --data FILE.npz (its owner's data, "
              f"see edge_sdk.data), or in an experiment --dataset digits --shard 0 "
              f"--shards {args.devices} (needs the [sim] extra)")
    return 0


def _add_device(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "device", help="run one device: it trains on its owner's files (--data, --data-npy) "
                       "or, in experiments, on a shard of a bundled data set (--dataset)",
        description="Run one device agent. Its training data: the owner's files (--data "
                    "FILE.npz: arrays x float32 [m, *input_shape] and y int64 [m] in [0, "
                    "classes); --data-npy X.npy Y.npy: the same as two files; both "
                    "repeatable, concatenated; see edge_sdk.data), or a shard of a bundled "
                    "data set (--dataset, needs the [sim] extra for digits and "
                    "breast-cancer).")
    p.add_argument("--config", required=True, help="device TOML (see edge_sdk.device)")
    p.add_argument("--data", action="extend", nargs="+", default=[], metavar="FILE.npz",
                   help="the owner's data: .npz files with arrays x and y")
    p.add_argument("--data-npy", action="append", nargs=2, default=[],
                   metavar=("X.npy", "Y.npy"), help="the owner's data as a .npy pair")
    p.add_argument("--dataset", help="a bundled data set instead: digits | breast-cancer "
                                     "(both need `pip install 'fedge[sim]'`) | fashion-mnist")
    p.add_argument("--shard", type=int, help="with --dataset: this device's shard index")
    p.add_argument("--shards", type=int, help="with --dataset: number of shards")
    p.add_argument("--partition", default="iid", help="with --dataset: iid | het:K | "
                                                      "dirichlet:ALPHA")
    p.add_argument("--partition-seed", type=int, default=0)
    p.add_argument("--rounds", type=int, help="exit after contributing to this many rounds")
    p.add_argument("--audit", help="directory for the encoded (pre-mask) input of each "
                                   "upload, <device>-round-<r>.npy (tests, audits)")


def _device_data(args: argparse.Namespace,
                 config: DeviceConfig) -> tuple[np.ndarray, np.ndarray]:
    """The device's (x, y): the owner's files, or a shard of a bundled data set."""
    own = bool(args.data or args.data_npy)
    if own == (args.dataset is not None):
        raise ValueError("give the device's data either as files (--data FILE.npz, "
                         "--data-npy X.npy Y.npy) or as --dataset with --shard/--shards, "
                         "exactly one of the two")
    if own:
        if args.shard is not None or args.shards is not None:
            raise ValueError("--shard and --shards choose a share of --dataset; the owner's "
                             "files (--data, --data-npy) are trained on whole")
        from edge_sdk.config import resolve_manifest
        from edge_sdk.data import NpyPair, read_samples
        from edge_sdk.engine import load_manifest

        spec = load_manifest(resolve_manifest(config.model, config.manifest,
                                              zoo_dir=config.zoo_dir)).spec
        pairs = [NpyPair(x=a, y=b) for a, b in args.data_npy]
        return read_samples([*args.data, *pairs], input_shape=spec.input_shape,
                            num_classes=spec.num_classes)
    import numpy as np

    from tools.datasets import DatasetMissing, load_train_subset
    from tools.partition import partition

    if args.shard is None or args.shards is None:
        raise ValueError("--dataset needs --shard and --shards")
    if not 0 <= args.shard < args.shards:
        raise ValueError(f"--shard must be in [0, --shards={args.shards}), got {args.shard}")
    try:
        return load_train_subset(args.dataset, lambda labels: partition(
            labels, args.shards, args.partition, np.random.default_rng(args.partition_seed)
        )[args.shard])
    except DatasetMissing as exc:  # not installed here: say what to install, no traceback
        raise ValueError(str(exc)) from None


def _device(args: argparse.Namespace) -> int:
    import signal
    import time
    from pathlib import Path

    import numpy as np

    from edge_sdk.device import Device, DeviceConfig
    from models import ONNX_DIR

    config = DeviceConfig.from_toml(args.config, zoo_dir=ONNX_DIR)
    x, y = _device_data(args, config)
    audit = Path(args.audit) if args.audit else None
    if audit is not None:
        audit.mkdir(parents=True, exist_ok=True)
    holder: list[Device] = []

    def emit(event: dict) -> None:
        if audit is not None and event["event"] == "uploaded" and holder:
            r = event["round"]
            np.save(audit / f"{config.device}-round-{r}.npy",
                    holder[0].session.encoded_input(r), allow_pickle=False)
        print(json.dumps({"ts": round(time.time(), 3), "device": config.device, **event}),
              flush=True)

    device = Device(config, data=lambda: (x, y), on_event=emit)
    holder.append(device)
    signal.signal(signal.SIGTERM, lambda *_: device.stop())
    signal.signal(signal.SIGINT, lambda *_: device.stop())
    print(json.dumps({"ts": round(time.time(), 3), "device": config.device, "event": "start",
                      "pid": __import__("os").getpid(), "samples": len(y),
                      "reservations": len(device.ledger.reservations())}), flush=True)
    try:
        if args.rounds is not None:
            device.run_rounds(args.rounds)
        else:
            device.run()
    finally:
        device.close()
    return 0


def _add_aggregator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("aggregator", help="run the aggregator service (JSON log lines on "
                                          "stdout, Prometheus metrics)")
    p.add_argument("--config", required=True, help="aggregator TOML (see aggregator.service)")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit once policy.max_rounds rounds have ended")


def _aggregator(args: argparse.Namespace) -> int:
    import logging
    import signal

    from aggregator.service import AggregatorConfig, AggregatorService
    from models import ONNX_DIR

    # What the round machine logs (for humans) about peers is in the JSON log too, rate
    # limited per device; without a handler, logging's last resort would copy every refused
    # message's line to stderr, unbounded.
    logging.getLogger("aggregator.rounds").addHandler(logging.NullHandler())
    config = AggregatorConfig.from_toml(args.config, zoo_dir=ONNX_DIR)
    service = AggregatorService(config)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    limit = config.policy.max_rounds

    def done() -> bool:
        m = service.machine
        return (args.exit_when_done and limit is not None and m.stage == "idle"
                and bool(m.history) and m.history[-1].round_id >= limit)

    try:
        service.run(done)
    finally:
        service.close()
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from models import ONNX_DIR
    from tools.doctor import run_doctor

    return run_doctor(args, zoo_dir=ONNX_DIR)  # the zoo `fedge device` looks models up in


def main(argv: Sequence[str] | None = None) -> int:
    from tools.doctor import add_doctor_parser
    from tools.ledger_cli import add_ledger_parser
    from tools.privacy_cli import add_privacy_parser
    from tools.site_cli import add_site_parser, run_site_command

    parser = argparse.ArgumentParser(prog="fedge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_export(sub)
    _add_bench(sub)
    add_privacy_parser(sub)
    add_ledger_parser(sub)
    _add_broker(sub)
    _add_experiment(sub)
    _add_enroll(sub)
    _add_device(sub)
    _add_aggregator(sub)
    add_doctor_parser(sub)
    add_site_parser(sub)
    args = parser.parse_args(argv)
    commands = {"simulate": _simulate, "export": _export, "bench": _bench, "privacy": _privacy,
                "ledger": _ledger, "broker": _broker, "experiment": _experiment,
                "enroll": _enroll, "device": _device, "aggregator": _aggregator,
                "doctor": _doctor, "site": run_site_command}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fedge {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
