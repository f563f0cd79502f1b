"""Peak resident set size of this process, for the benchmarks' child processes.

Linux's ``VmHWM`` (the high-water mark of this process image), not ``ru_maxrss``: Linux keeps
``ru_maxrss`` across fork and execve, so a child started by a large parent (``fedge bench
all``) reports the parent's peak (seen: 1,131 MiB for a 230 MiB child). Standard library
only: the device-stack children import it after what they measure.
"""

from __future__ import annotations

import resource

__all__ = ["peak_rss_mib"]


def peak_rss_mib() -> float:
    """This process's peak RSS so far, MiB (``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
