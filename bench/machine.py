"""The ``machine`` block every bench script writes into its JSON results, in one shape."""

import os
import platform

import psutil


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
    """The share of this machine's CPU time that was busy, and that the host took (steal),
    between ``__init__`` and ``read`` (``psutil.cpu_times``): a run slowed by the host or by a
    saturated machine tells itself apart."""

    def __init__(self) -> None:
        self._start = psutil.cpu_times()

    def read(self) -> dict[str, float]:
        end = psutil.cpu_times()
        delta = {f: getattr(end, f) - getattr(self._start, f) for f in end._fields}
        # guest time is counted in user already
        total = sum(v for f, v in delta.items() if not f.startswith("guest")) or 1.0
        idle = delta["idle"] + delta.get("iowait", 0.0)
        steal = delta.get("steal", 0.0)
        return {"cpu_busy": round(1 - idle / total, 3), "cpu_steal": round(steal / total, 3)}
