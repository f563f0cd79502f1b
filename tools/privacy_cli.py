"""``fedge privacy epsilon`` and ``fedge privacy noise``: the accountant from the shell.

JSON contract (``--json``): ``epsilon`` prints ``{"epsilon", "delta", "accountant", ...}``;
``noise`` prints ``{"noise_multiplier", "epsilon", "delta", "accountant", ...}``.
"""

from __future__ import annotations

import argparse
import json
import math

from edge_sdk.privacy import (
    PldAccountant,
    PoissonSubsampledGaussian,
    RdpAccountant,
    SampledWithoutReplacementGaussian,
    ZcdpAccountant,
    calibrate_noise_multiplier,
)

__all__ = ["add_privacy_parser", "run_privacy"]

ACCOUNTANTS = ("pld", "rdp", "zcdp")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delta", type=float, required=True, help="delta of the (eps, delta) pair")
    p.add_argument("--sample-rate", type=float, help="Poisson sampling rate q in (0, 1]")
    p.add_argument("--steps", type=int, required=True, help="number of noisy releases")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="pld",
                   help="pld (default, tightest), rdp, or zcdp (no subsampling amplification)")
    p.add_argument("--sampling", choices=["poisson", "without-replacement"], default="poisson")
    p.add_argument("--batch-size", type=int, help="fixed batch size B (without-replacement)")
    p.add_argument("--dataset-size", type=int, help="local data set size m (without-replacement)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_privacy_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``privacy epsilon`` and ``privacy noise`` on the ``fedge`` parser."""
    p = sub.add_parser("privacy", help="privacy accounting: epsilon of a run, noise for a target")
    psub = p.add_subparsers(dest="privacy_command", required=True)
    e = psub.add_parser("epsilon", help="epsilon at delta of K subsampled Gaussian steps")
    e.add_argument("--noise-multiplier", type=float, required=True,
                   help="z: noise std divided by the clip bound C (the add/remove and zero-out "
                        "sensitivity; without replacement the substitution sensitivity is 2C, "
                        "so that bound is evaluated at z / 2)")
    _common(e)
    n = psub.add_parser("noise", help="smallest noise multiplier meeting (epsilon, delta)")
    n.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    _common(n)
    k = psub.add_parser("kim-table", help="Kim-Gunlu-Schaefer's comparison, recomputed")
    k.add_argument("--json", action="store_true")


def _event(args: argparse.Namespace, z: float):
    if args.sampling == "poisson":
        if args.sample_rate is None:
            raise ValueError("--sample-rate is required with --sampling poisson")
        return PoissonSubsampledGaussian(noise_multiplier=z, sample_rate=args.sample_rate,
                                         steps=args.steps)
    if args.batch_size is None or args.dataset_size is None:
        raise ValueError("--sampling without-replacement needs --batch-size and --dataset-size")
    # z is relative to the clip bound C; the Wang-Balle-Kasiviswanathan bound is stated under
    # substitution, whose sensitivity for a sum of gradients clipped to C is 2C: z / 2.
    return SampledWithoutReplacementGaussian(noise_multiplier=z / 2, sample_size=args.batch_size,
                                             dataset_size=args.dataset_size, steps=args.steps)


def _epsilon(args: argparse.Namespace, z: float) -> tuple[float, str]:
    """(epsilon, accountant actually used)."""
    event = _event(args, z)
    if isinstance(event, SampledWithoutReplacementGaussian):
        # The without-replacement bound is an RDP bound (substitution adjacency; it holds for
        # zero-out too, a zero-out pair being a substitution pair).
        acc = RdpAccountant(adjacency="substitution").compose(event)
        return acc.get_epsilon(args.delta), "rdp"
    if args.accountant == "pld":
        return PldAccountant().compose(event).get_epsilon(args.delta), "pld"
    if args.accountant == "rdp":
        return RdpAccountant().compose(event).get_epsilon(args.delta), "rdp"
    return ZcdpAccountant().compose(event).get_epsilon(args.delta), "zcdp"


def run_privacy(args: argparse.Namespace) -> int:
    """Run ``fedge privacy ...``; prints text or JSON; returns the exit code."""
    if args.privacy_command == "kim-table":
        from tools.kim_table import print_table, rows

        if args.json:
            print(json.dumps({"rows": rows()}))
        else:
            print_table()
        return 0
    if args.privacy_command == "epsilon":
        eps, used = _epsilon(args, args.noise_multiplier)
        out = {"epsilon": eps if math.isfinite(eps) else None, "delta": args.delta,
               "accountant": used, "noise_multiplier": args.noise_multiplier,
               "steps": args.steps, "sampling": args.sampling}
        if args.sampling == "poisson":
            out["sample_rate"] = args.sample_rate
        text = f"epsilon = {eps:.6g} at delta = {args.delta:g} ({used} accountant)"
    else:
        if args.sampling != "poisson":
            raise ValueError("fedge privacy noise supports --sampling poisson only")
        if args.sample_rate is None:
            raise ValueError("--sample-rate is required")
        z = calibrate_noise_multiplier(args.epsilon, args.delta, args.sample_rate, args.steps,
                                       accountant=args.accountant)
        eps, used = _epsilon(args, z)
        out = {"noise_multiplier": z, "epsilon": eps, "target_epsilon": args.epsilon,
               "delta": args.delta, "accountant": used, "sample_rate": args.sample_rate,
               "steps": args.steps}
        text = (f"noise multiplier = {z:.6g} (epsilon {eps:.6g} <= {args.epsilon:g} at "
                f"delta = {args.delta:g}, {used} accountant)")
    print(json.dumps(out, allow_nan=False) if args.json else text)
    return 0
