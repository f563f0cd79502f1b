"""Child process of the ledger crash test (tests/test_ledger.py): reserve/commit until killed.

Usage: ``python tests/ledger_crash_child.py LEDGER_PATH CYCLES``. Creates the ledger if it
is missing, then runs CYCLES reserve/commit cycles, printing ``released N`` (N: the number
of reservations now in the ledger) only after ``reserve`` returned, i.e. at the moment a
real device would let its upload leave. The parent SIGKILLs it at a random time; whatever
it printed is a lower bound on what the ledger must show afterwards.
"""

import sys

from edge_sdk import ddp
from edge_sdk.ledger import Budget, Ledger, Plan
from edge_sdk.privacy import PoissonSubsampledGaussian, aggregate_event

BUDGET = Budget(epsilon=1e6, delta=1e-5, device_epsilon=1e6)
DEVICE_ID = "crash-child"
EVENT = PoissonSubsampledGaussian(noise_multiplier=4.0, sample_rate=0.01, steps=10)
COHORT, THRESHOLD = 16, 11
AGGREGATE = aggregate_event(EVENT, honest_members=COHORT - 1, linear_sum=True)
# a device-level event (issue 16), so that the crash test covers the device unit too
DEVICE = ddp.event(ddp.DistributedDP(clip=1.0, gamma=1 / 1024, noise="discrete_gaussian",
                                     bits=24, sigma=300.0), COHORT - 1, 1000,
                   adjacency="zero_out")


def main(path: str, cycles: int) -> None:
    with Ledger.open(path, budget=BUDGET, device_id=DEVICE_ID, create=True) as ledger:
        count = len(ledger.reservations())
        for _ in range(cycles):
            res = ledger.reserve(Plan(round_id=f"r{count + 1}", model_id="m", event=EVENT,
                                      aggregate_event=AGGREGATE, cohort_size=COHORT,
                                      secagg_threshold=THRESHOLD, device_event=DEVICE,
                                      colluders=1))
            count += 1
            print(f"released {count}", flush=True)  # the upload may leave now
            ledger.commit(res)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
