"""``fedge site``: a site above gateways, in memory or over bridged mosquittos (issue 19).

The deployed objects (``aggregator.site.SiteMachine`` above ``RoundMachine`` gateways) on
``tools.hierarchy`` (one process, in-memory brokers and bridges) or
``tools.hierarchy_mqtt`` (a process and a mosquitto per party, bridges between the
brokers; with ``--netns`` each party in its own network namespace, as root).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_site_parser", "run_site_command"]

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "site.toml"


def _kill(text: str) -> tuple[int, int, str]:
    try:
        r, g, stage = text.split(":")
        return int(r), int(g), stage
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--kill takes ROUND:GATEWAY:STAGE (e.g. 2:1:masked), got {text!r}") from None


def add_site_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``site`` on the ``fedge`` parser."""
    p = subparsers.add_parser("site", help="a site above gateways: each gateway securely "
                                           "aggregates its own cohort, the site combines "
                                           "their sums (in memory or over bridged mosquittos)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="TOML of the fleet (devices in all, each gateway's cohort = "
                        "participation of its devices); default tools/configs/site.toml")
    p.add_argument("--gateways", type=int, default=2, help="gateways (default 2)")
    p.add_argument("--transport", choices=["inproc", "mqtt"], default="inproc",
                   help="inproc: one process, in-memory brokers and bridges; mqtt: a "
                        "process and a mosquitto per party, joined by mosquitto bridges")
    p.add_argument("--netns", action="store_true",
                   help="mqtt: each party in its own network namespace (root, ip netns)")
    p.add_argument("--kill", type=_kill, metavar="ROUND:GATEWAY:STAGE",
                   help="that gateway's broker dies when its round reaches the stage "
                        "(keys, shares, masked, unmask; inproc also forward)")
    p.add_argument("--round-timeout", type=float, default=60.0,
                   help="seconds the site waits for gateway sums (default 60)")
    p.add_argument("--rounds", type=int, help="site rounds (overrides the config)")
    p.add_argument("--check-flat", action="store_true",
                   help="also run the devices as one flat gateway with the same cohorts "
                        "and compare the models")
    p.add_argument("--json-out", help="write the summary as JSON here")


def run_site_command(args: argparse.Namespace) -> int:
    """``fedge site``: print each site round and the final model; 1 if a check failed."""
    from tools.hierarchy import Hierarchy
    from tools.simconfig import load_config

    over: dict[str, Any] = {"progress": False, "transport": "inproc"}
    if args.rounds is not None:
        over["rounds"] = args.rounds
    cfg = load_config(args.config, **over)
    with tempfile.TemporaryDirectory(prefix="fedge-site-") as tmp:
        work = Path(tmp)
        if args.transport == "mqtt":
            from tools.hierarchy_mqtt import netns_available, run_site_mqtt

            if args.netns and (why := netns_available()) is not None:
                raise ValueError(f"--netns: {why}")
            summary = run_site_mqtt(cfg, work / "mqtt", gateways=args.gateways,
                                    netns=args.netns, kill=args.kill,
                                    round_timeout=args.round_timeout)
        else:
            h = Hierarchy(cfg, work / "site", gateways=args.gateways, kill=args.kill,
                          round_timeout=args.round_timeout)
            try:
                summary = h.run()
            finally:
                h.close()
        for r in summary["rounds"]:
            lost = ", ".join(f"{g}: {why}" for g, why in r["missing"].items())
            print(f"site round {r['round']}: {'done' if r['completed'] else 'FAILED'}, "
                  f"gateways {', '.join(r['gateways']) or '-'}, {r['survivors']} uploads"
                  + (f"; lost {lost}" if lost else ""))
        print(f"final accuracy {summary['final_accuracy']:.4f}, model sha256 "
              f"{summary['model_sha256'][:16]}")
        status = 0
        if args.check_flat:
            sim = Hierarchy(cfg, work / "sim", gateways=args.gateways, kill=args.kill,
                            round_timeout=args.round_timeout)
            try:
                sim.run()  # the cohorts (and any lost gateway) the flat run takes
                flat = sim.run_flat_twin(work / "flat")
            finally:
                sim.close()
            same = flat["model_sha256"] == summary["model_sha256"]
            summary["flat_model_sha256"] = flat["model_sha256"]
            print(f"one flat gateway with the same cohorts: model sha256 "
                  f"{flat['model_sha256'][:16]} ({'the same' if same else 'DIFFERENT'})")
            status = 0 if same else 1
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    if not all(r["completed"] for r in summary["rounds"]):
        print("fedge site: some site rounds failed", file=sys.stderr)
    return status
