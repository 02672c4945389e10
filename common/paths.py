"""Where SeamlessFlow keeps state on this machine, and how it writes its secrets."""

import os
import secrets
from pathlib import Path


def default_state_dir() -> Path:
    """``$SEAMLESSFLOW_STATE_DIR``, else ``$XDG_STATE_HOME/seamlessflow`` (``~/.local/state``)."""
    if explicit := os.environ.get("SEAMLESSFLOW_STATE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(xdg) / "seamlessflow"


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, created 0600 (never readable by others, even briefly) and
    replaced atomically; its folder is made 0700 if missing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
