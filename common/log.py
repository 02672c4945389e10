"""Log lines as ``event key=value ...`` so they grep and parse alike."""

import logging


def kv(event: str, **fields: object) -> str:
    """Render one log line: the event name, then its fields in the order given."""
    parts = [event]
    for key, value in fields.items():
        text = str(value)
        if not text or any(c.isspace() or c in '"=' for c in text):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)


def setup_logging(level: str = "INFO") -> None:
    """Plain, timestamped lines on stderr for every SeamlessFlow process."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if logging.getLogger().level > logging.DEBUG:  # httpx logs every request at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
