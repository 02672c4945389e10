"""The ``machine`` block every bench script writes into its JSON results, in one shape."""

import os
import platform


def machine(**measured: object) -> dict:
    """This host (platform, Python, CPUs) and its 1-minute load average now, then what the
    script measured of it (``measured``: e.g. ``loadavg_before``, ``nats_server``)."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg()[0],
        **measured,
    }


class CpuShare:
    """The share of this machine's CPU time that was busy, and that the host took (steal), from
    ``/proc/stat`` between ``__init__`` and ``read``: a run slowed by the host or by a saturated
    machine tells itself apart. Empty where ``/proc/stat`` is not."""

    def __init__(self) -> None:
        self._start = _cpu_times()

    def read(self) -> dict[str, float]:
        end = _cpu_times()
        if not end or not self._start:
            return {}
        delta = [b - a for a, b in zip(self._start, end, strict=True)]
        total = sum(delta[:8]) or 1  # user .. steal (guest time is counted in user)
        idle = delta[3] + delta[4]  # idle, iowait
        return {"cpu_busy": round(1 - idle / total, 3), "cpu_steal": round(delta[7] / total, 3)}


def _cpu_times() -> list[int]:
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return []
