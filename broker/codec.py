"""Messages to bytes and back: the only place that does it.

msgpack is the default. A client may send JSON instead by setting the ``Content-Type`` header to
``application/json``. Every decode validates against the message's schema and raises
``InvalidMessageError`` with a reason a person can act on.
"""

import json
from enum import StrEnum
from typing import Any, TypeVar

import msgpack
from pydantic import ValidationError

from broker.exceptions import InvalidMessageError
from broker.messages import Message

M = TypeVar("M", bound=Message)

CONTENT_TYPE = "Content-Type"
MSG_ID = "Nats-Msg-Id"
"""JetStream de-duplication header: a repeated id within the stream's window is dropped."""


class Encoding(StrEnum):
    MSGPACK = "application/msgpack"
    JSON = "application/json"


def content_type_of(headers: dict[str, str] | None) -> str | None:
    """The ``Content-Type`` header, whatever the case of its name."""
    for key, value in (headers or {}).items():
        if key.lower() == "content-type":
            return value
    return None


def encoding_of(content_type: str | None) -> Encoding:
    """The encoding a ``Content-Type`` header names; msgpack when there is none."""
    if not content_type:
        return Encoding.MSGPACK
    base = content_type.split(";", 1)[0].strip().lower()
    for encoding in Encoding:
        if base == encoding.value:
            return encoding
    raise InvalidMessageError(
        f"unsupported Content-Type {_short(content_type)}: use {Encoding.MSGPACK} (default) "
        f"or {Encoding.JSON}"
    )


def encode(message: Message, encoding: Encoding = Encoding.MSGPACK) -> bytes:
    if encoding is Encoding.JSON:
        return message.model_dump_json().encode()
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def headers(encoding: Encoding = Encoding.MSGPACK, msg_id: str | None = None) -> dict[str, str]:
    """NATS headers for a payload made by ``encode``; ``msg_id`` enables de-duplication."""
    out = {CONTENT_TYPE: encoding.value}
    if msg_id is not None:
        out[MSG_ID] = msg_id
    return out


def decode(
    schema: type[M],
    data: bytes,
    *,
    content_type: str | None = None,
    max_size: int | None = None,
) -> M:
    """Decode and validate one payload as ``schema``, or raise ``InvalidMessageError``."""
    name = schema.__name__
    if max_size is not None and len(data) > max_size:
        raise InvalidMessageError(
            f"{name} payload is {len(data)} bytes, over the {max_size}-byte limit"
        )
    encoding = encoding_of(content_type)
    try:
        if encoding is Encoding.JSON:
            return schema.model_validate_json(data)
        return schema.model_validate(_unpack_map(data, name))
    except ValidationError as exc:
        raise InvalidMessageError(f"invalid {name}: {describe(exc)}") from exc


def _unpack_map(data: bytes, name: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise InvalidMessageError(
            f"payload is not valid msgpack ({type(exc).__name__}{': ' if str(exc) else ''}{exc}); "
            f"JSON senders must set {CONTENT_TYPE}: {Encoding.JSON}"
        ) from exc
    if not isinstance(obj, dict):
        raise InvalidMessageError(f"{name} must be a msgpack map, got {type(obj).__name__}")
    return obj


def describe(exc: ValidationError, limit: int = 5) -> str:
    """A one-line summary of a validation error: ``field.path: problem (got value)``."""
    problems = []
    for err in exc.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "<message>"
        got = "" if err["type"] == "missing" else f" (got {_short(err.get('input'))})"
        problems.append(f"{where}: {err['msg']}{got}")
    more = exc.error_count() - limit
    if more > 0:
        problems.append(f"... and {more} more")
    return "; ".join(problems)


def _short(value: Any, width: int = 60) -> str:
    """``value`` as JSON, cut to ``width``: never a Python repr (bytes show as their text, or as
    hex when they are not UTF-8; other objects as their type)."""
    try:
        text = json.dumps(value, default=_plain, ensure_ascii=False)
    except (TypeError, ValueError):  # e.g. a map with bytes keys: JSON takes only str keys
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[: width - 3] + "..."


def _plain(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            return f"{len(value)} bytes 0x{bytes(value[:32]).hex()}"
    return f"<{type(value).__name__}>"
