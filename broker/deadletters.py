"""Reading a run's dead letters back: every ``MessageRejected`` on ``sf.<run>.dead.<source>``
with its original payload decoded into a JSON-able value.

The payload is read as the ingress would have read it: JSON when its Content-Type says so, else
msgpack, else JSON (a sender that forgot the header). Bytes that are neither are given as base64
and labelled so (``payload_encoding == "base64"``); so are bytes nested in a msgpack payload
(``{"base64": ...}``). A payload longer than the dead letter keeps is cut, so it is usually shown
as base64 (``truncated``).
"""

import base64
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgpack
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from broker import codec
from broker.exceptions import InvalidMessageError
from broker.messages import MessageRejected
from broker.provision import run_stream_info
from broker.subjects import RunNames

PayloadEncoding = Literal["json", "msgpack", "base64"]


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter, ready for ``json.dumps(asdict(letter))``."""

    seq: int
    """Its sequence in the run's dead-letter stream."""
    subject: str
    """The dead-letter subject, ``sf.<run>.dead.<source>``."""
    source: str
    reason: str
    original_subject: str
    stream_seq: int | None
    """The rejected message's sequence in its own stream."""
    content_type: str
    rejected_at: float | None
    payload_size: int
    truncated: bool
    """Only the first bytes of the payload were kept."""
    payload_encoding: PayloadEncoding
    payload: Any

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def read_dead_letters(
    js: JetStreamContext, names: RunNames, source: str | None = None
) -> list[DeadLetter]:
    """Every dead letter of the run (of ``source`` only, if given), oldest first. A message on
    the dead-letter stream that is no ``MessageRejected`` is listed too, as its raw bytes."""
    stream = names.dead_stream
    state = (await run_stream_info(js, names, stream)).state
    subject = names.dead(source) if source is not None else None
    letters = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            msg = await js.get_msg(stream, seq)
        except NotFoundError:
            continue  # deleted
        if subject is None or msg.subject == subject:
            letters.append(dead_letter_of(seq, msg.subject, msg.data, msg.headers))
    return letters


def dead_letter_of(
    seq: int, subject: str, data: bytes, headers: dict[str, str] | None
) -> DeadLetter:
    """The dead letter stored as ``data`` at ``seq`` on ``subject``."""
    source = subject.rsplit(".", 1)[-1]
    try:
        rejected = codec.decode(MessageRejected, data, content_type=codec.content_type_of(headers))
    except InvalidMessageError as exc:
        return DeadLetter(
            seq=seq,
            subject=subject,
            source=source,
            reason=f"(not a MessageRejected: {exc.reason})",
            original_subject="",
            stream_seq=None,
            content_type="",
            rejected_at=None,
            payload_size=len(data),
            truncated=False,
            payload_encoding="base64",
            payload=_base64(data),
        )
    encoding, payload = decode_payload(rejected.payload, rejected.content_type)
    return DeadLetter(
        seq=seq,
        subject=subject,
        source=rejected.source,
        reason=rejected.reason,
        original_subject=rejected.subject,
        stream_seq=rejected.stream_seq,
        content_type=rejected.content_type,
        rejected_at=rejected.rejected_at,
        payload_size=rejected.payload_size,
        truncated=len(rejected.payload) < rejected.payload_size,
        payload_encoding=encoding,
        payload=payload,
    )


def decode_payload(payload: bytes, content_type: str) -> tuple[PayloadEncoding, Any]:
    """How ``payload`` reads (see the module docstring) and its JSON-able value."""
    says_json = content_type.split(";", 1)[0].strip().lower() == codec.Encoding.JSON
    readers = (_json, _msgpack) if says_json else (_msgpack, _json)
    for reader in readers:
        try:
            return reader(payload)
        except (ValueError, TypeError, msgpack.UnpackException):  # TypeError: unhashable key
            continue
    return "base64", _base64(payload)


def _json(payload: bytes) -> tuple[PayloadEncoding, Any]:
    return "json", _jsonable(json.loads(payload))


def _msgpack(payload: bytes) -> tuple[PayloadEncoding, Any]:
    return "msgpack", _jsonable(msgpack.unpackb(payload, raw=False, strict_map_key=False))


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"base64": _base64(value)}
    if isinstance(value, msgpack.ExtType):
        return {"msgpack_ext": value.code, "base64": _base64(value.data)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or infinity
    return value


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
