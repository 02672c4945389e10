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
