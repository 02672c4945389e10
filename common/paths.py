"""Where SeamlessFlow keeps state on this machine."""

import os
from pathlib import Path


def default_state_dir() -> Path:
    """``$SEAMLESSFLOW_STATE_DIR``, else ``$XDG_STATE_HOME/seamlessflow`` (``~/.local/state``)."""
    if explicit := os.environ.get("SEAMLESSFLOW_STATE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(xdg) / "seamlessflow"
