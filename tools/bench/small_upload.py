"""Benchmark 5b: what a small model's device sends per round, by secure-aggregation protocol.

IoT models are small, and there secure aggregation's per-round keys, shares and signatures
can outweigh the update (issue 18: a 650-parameter logistic regression in a cohort of 10).
Each row is one run of the real fleet (:class:`tools.fleet.Fleet`: device sessions with
their ledgers, the aggregator's round machine) over mosquitto (TLS), digits + logreg
(d = 650), a cohort of all 10 devices, ``rounds`` rounds without dropouts, with the plan's
``secagg`` protocol:

* ``secagg+``: per-round X25519 keys, Shamir shares of two secrets per neighbour (sealed
  and signed), the masked vector, the unmask shares (``edge_sdk.secagg.SecAggClient``);
* ``amortized``: pairwise seeds agreed once at enrollment, the masked vector alone and, only
  for dropped neighbours, this round's seeds (``edge_sdk.secagg.AmortizedSecAggClient``;
  its weaker dropout story is in ``edge_sdk.secagg``).

``bytes_per_upload``: every MQTT PUBLISH packet the devices sent (headers included: the
fleet's meter), check-ins too, over the uploads that entered a sum; ``float32_bytes`` =
4 d, the dense float32 update; ``bytes_over_float32`` their ratio (issue 18: <= 2). The
per-message split of SecAgg+'s bytes for the same cohort and d is in section 3's JSON
(``bytes_by_message``).
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any, TextIO

__all__ = ["run_small_upload_bench"]

COHORT = 10


def _one(protocol: str, rounds: int) -> dict[str, Any]:
    from tools.bench.fleet import digits_logreg_fleet
    from tools.fleet import Fleet

    data, (spec, engine), cfg = digits_logreg_fleet(
        devices=COHORT, participation=1.0, rounds=rounds, dropout=0.0, transport="mqtt",
        secagg_protocol=protocol)
    with tempfile.TemporaryDirectory() as tmp:
        summary = Fleet(cfg, tmp, data=data, engine=(spec, engine)).run()
    per = summary["bytes_up_per_upload"]
    f32 = summary["bytes_up_float32_per_upload"]
    return {"model": "logreg", "cohort": COHORT, "protocol": protocol,
            "params": summary["num_params"], "rounds": rounds,
            "rounds_completed": summary["rounds_completed"],
            "device_rounds": summary["device_rounds"], "bytes_up": summary["bytes_up_total"],
            "bytes_per_upload": per, "float32_bytes": f32,
            "bytes_over_float32": None if per is None else per / f32,
            "model_sha256": summary["model_sha256"]}


def run_small_upload_bench(*, rounds: int = 3,
                           out: TextIO | None = sys.stdout) -> list[dict[str, Any]]:
    """Both protocols on the same fleet; one row each (see the module docstring).

    The issue-18 target reads the ``amortized`` row (the protocol selectable for such
    uplinks); the ``secagg+`` row is the reference it is measured against, and the same
    model on both rows (``same_model``) shows both summed the same inputs.
    """
    rows = [_one(p, rounds) for p in ("secagg+", "amortized")]
    same = rows[0]["model_sha256"] == rows[1]["model_sha256"]
    for r in rows:
        r["same_model"] = same
    if out is not None:
        print(f"# bytes a device sends per round, logreg (d = {rows[0]['params']}) in a cohort "
              f"of {COHORT} over mosquitto (TLS), {rounds} rounds, no dropouts; MQTT packets "
              "with headers, check-ins included, over the uploads summed", file=out)
        print("| protocol | rounds ok | uploads | B per upload | float32 B | x float32 "
              "| vs SecAgg+ | same model |", file=out)
        print("|---|---|---|---|---|---|---|---|", file=out)
        for r in rows:
            ratio = r["bytes_over_float32"]
            vs = (f"{r['bytes_per_upload'] / rows[0]['bytes_per_upload']:.2f}x"
                  if r is not rows[0] else "reference")
            print(f"| {r['protocol']} | {r['rounds_completed']}/{r['rounds']} "
                  f"| {r['device_rounds']} | {r['bytes_per_upload']:.0f} "
                  f"| {r['float32_bytes']} | {ratio:.2f} | {vs} "
                  f"| {'yes' if r['same_model'] else 'NO'} |", file=out)
    return rows
