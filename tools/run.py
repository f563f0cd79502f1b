"""The front door of a simulated fleet: one :class:`~tools.simconfig.SimConfig` in, the
JSON-able summary out, whichever path the config selects.

* ``secagg`` false: the fast in-process simulator, :func:`tools.simulate.simulate`;
* ``secagg`` true (implied by ``transport = "mqtt"``): the fleet with device sessions,
  ledgers and secure aggregation, :func:`tools.fleet.simulate_fleet`, over the in-memory
  broker or a real mosquitto.

``fedge simulate`` and the experiment runner call :func:`run`; the two paths import only
``tools.simconfig`` and ``tools.evaluate``, never each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from tools.fleet import simulate_fleet
from tools.simconfig import SimConfig
from tools.simulate import simulate

__all__ = ["run"]


def run(cfg: SimConfig, *, workdir: str | Path | None = None,
        out: TextIO | None = None) -> dict[str, Any]:
    """Run ``cfg`` on the path it selects; return that path's summary.

    Args:
        cfg: the fleet's settings.
        workdir: the fleet path's directory for ledgers, checkpoint and broker files
            (None: a temporary directory). Only the fleet path keeps files.
        out: where progress goes.
    """
    if cfg.secagg:
        return simulate_fleet(cfg, workdir=workdir, out=out)
    if workdir is not None:
        raise ValueError(f"workdir applies to the fleet path (secagg = true or transport "
                         f"'mqtt'), got workdir={str(workdir)!r} with secagg={cfg.secagg!r}")
    return simulate(cfg, out=out)
