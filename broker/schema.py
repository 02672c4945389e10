"""JSON Schema files of the wire messages, for clients in other languages."""

import json
from pathlib import Path

from broker.control import SchedulerState
from broker.messages import (
    SCHEMA_VERSION,
    CallRecorded,
    CallUnavailable,
    GenerationCancelled,
    GenerationRequested,
    Message,
    MessageRejected,
    SampleReady,
    SessionEnded,
    TaskSubmitted,
    TokensGenerated,
    WeightsPublished,
)
from broker.worker_messages import RoleChangeAcked, RoleChangeRequested, WorkerRegistered

WIRE_MESSAGES: tuple[type[Message], ...] = (
    TaskSubmitted,
    GenerationRequested,
    TokensGenerated,
    GenerationCancelled,
    CallRecorded,
    CallUnavailable,
    SessionEnded,
    SampleReady,
    WeightsPublished,
    WorkerRegistered,
    RoleChangeRequested,
    RoleChangeAcked,
    SchedulerState,
    MessageRejected,
)
"""Every top-level wire message, in the order ``docs/protocol.md`` describes them."""


def json_schema(message: type[Message]) -> dict[str, object]:
    schema = message.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"urn:seamlessflow:v{SCHEMA_VERSION}:{message.__name__}"
    return schema


def export_schemas(directory: Path) -> list[Path]:
    """Write ``<MessageName>.json`` for every wire message into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for message in WIRE_MESSAGES:
        path = directory / f"{message.__name__}.json"
        path.write_text(json.dumps(json_schema(message), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
