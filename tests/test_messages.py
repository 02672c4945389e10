"""Wire schemas: round-trips, the exported JSON Schema agreeing with the validator, and garbage
always turned into one clear error."""

import json

import jsonschema
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import codec
from broker.exceptions import InvalidMessageError
from broker.messages import (
    MessageRejected,
    SampleReady,
    SessionEnded,
    TaskSubmitted,
    TokensGenerated,
)
from broker.schema import WIRE_MESSAGES, export_schemas, json_schema
from tests.schema_strategy import from_json_schema

# MessageRejected carries raw bytes (base64 in JSON): tested apart with arbitrary bytes.
JSON_MESSAGES = [m for m in WIRE_MESSAGES if m is not MessageRejected]
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("schema", JSON_MESSAGES, ids=lambda m: m.__name__)
def test_every_instance_of_the_exported_schema_round_trips(schema):
    """What a foreign client writes against the JSON Schema is accepted, and survives both
    encodings unchanged."""

    instance_schema = json_schema(schema)

    @SLOW
    @given(from_json_schema(instance_schema))
    def check(instance):
        raw = json.dumps(instance).encode()
        try:
            message = codec.decode(schema, raw, content_type="application/json")
        except InvalidMessageError as exc:
            # Cross-field rules (one logprob per token, ...) are not expressible in JSON
            # Schema; they are the only reason a schema-valid instance may be refused.
            rules = (
                "one entry per token",
                "one logprob per token",
                "unless the copy is host-local",
                "is above the ticket",
            )
            assert any(rule in exc.reason for rule in rules), exc.reason
            return
        for encoding in codec.Encoding:
            data = codec.encode(message, encoding)
            assert codec.decode(schema, data, content_type=encoding.value) == message
        encoded = json.loads(codec.encode(message, codec.Encoding.JSON))
        jsonschema.validate(encoded, instance_schema)

    check()


@SLOW
@given(payload=st.binary(min_size=0, max_size=64), size=st.integers(0, 1 << 20))
def test_dead_letters_round_trip_any_bytes(payload, size):
    rejected = MessageRejected(
        source="tasks",
        subject="sf.r.tasks",
        reason="because",
        payload=payload,
        payload_size=size,
        rejected_at=1.5,
    )
    for encoding in codec.Encoding:
        data = codec.encode(rejected, encoding)
        assert codec.decode(MessageRejected, data, content_type=encoding.value) == rejected


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256), schema=st.sampled_from(WIRE_MESSAGES))
def test_random_bytes_give_only_invalid_message_errors(data, schema):
    with pytest.raises(InvalidMessageError):
        codec.decode(schema, data)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(obj=json_values, schema=st.sampled_from(WIRE_MESSAGES))
def test_random_msgpack_values_are_refused_cleanly(obj, schema):
    """Well-formed msgpack of any shape is either a valid message or refused with
    InvalidMessageError, never anything else."""
    try:
        message = codec.decode(schema, msgpack.packb(obj))
    except InvalidMessageError:
        return
    assert codec.decode(schema, codec.encode(message)) == message


def _task(**overrides):
    base = {"task_id": "t1", "messages": [{"role": "user", "content": "2+2?"}]}
    base.update(overrides)
    return msgpack.packb(base)


@pytest.mark.parametrize(
    ("payload", "content_type", "needle"),
    [
        (_task(group_size="4"), None, "group_size: Input should be a valid integer"),
        (_task(group_size=4.0), None, "group_size: Input should be a valid integer"),
        (_task(messages=[]), None, "messages: List should have at least 1 item"),
        (msgpack.packb({"task_id": "t1"}), None, "messages: Field required"),
        (_task(surprise=1), None, "surprise: Extra inputs are not permitted"),
        (_task(task_id="has space"), None, "task_id: String should match pattern"),
        (_task(schema_version=2), None, "schema_version: Input should be 1"),
        (_task(messages=[{"role": "robot"}]), None, "messages.0.role"),
        (b"\xc1", None, "not valid msgpack"),
        (b'{"task_id": "t1"}', None, "JSON senders must set Content-Type"),
        (b'{"task_id": ', "application/json", "Invalid JSON"),
        (_task(), "text/plain", 'unsupported Content-Type "text/plain"'),
        (msgpack.packb([1, 2]), None, "must be a msgpack map, got list"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else "",
)
def test_errors_say_what_is_wrong_and_where(payload, content_type, needle):
    with pytest.raises(InvalidMessageError) as info:
        codec.decode(TaskSubmitted, payload, content_type=content_type)
    assert needle in info.value.reason


def test_oversize_payload_is_refused_before_parsing():
    payload = _task(metadata={"blob": "x" * 5000})
    with pytest.raises(InvalidMessageError, match=r"is \d+ bytes, over the 4096-byte limit"):
        codec.decode(TaskSubmitted, payload, max_size=4096)
    assert codec.decode(TaskSubmitted, payload, max_size=len(payload)).task_id == "t1"


def _chunk(**fields) -> bytes:
    base = {"call_id": "c", "attempt": 0, "seq": 0, "worker_id": "w", "version": 3}
    return msgpack.packb({**base, **fields})


def test_per_token_lists_must_align():
    with pytest.raises(InvalidMessageError, match="one logprob per token"):
        codec.decode(TokensGenerated, _chunk(token_ids=[1, 2], logprobs=[-0.5]))
    sample = {
        "sample_id": "s",
        "session_id": "x",
        "group_id": "g",
        "token_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -1.0, -2.0],
        "versions": [-1, 0],
        "reward": 1.0,
        "on_policy": True,
    }
    with pytest.raises(InvalidMessageError, match="one entry per token"):
        codec.decode(SampleReady, msgpack.packb(sample))
    with pytest.raises(InvalidMessageError, match=r"loss_mask\.0: Input should be a valid integer"):
        codec.decode(SampleReady, msgpack.packb({**sample, "loss_mask": [True, 1, 1]}))
    with pytest.raises(InvalidMessageError, match=r"logprobs\.1: Input should be a finite number"):
        codec.decode(SampleReady, msgpack.packb({**sample, "logprobs": [0.0, float("nan"), 0.0]}))


@pytest.mark.parametrize(
    ("reward", "needle"),
    [
        (float("nan"), "reward: Input should be a finite number"),
        (float("inf"), "reward: Input should be a finite number"),
        ("1.0", "reward: Input should be a valid number"),
        (None, "reward: Input should be a valid number"),
    ],
)
def test_a_session_reward_from_any_client_is_a_finite_number(reward, needle):
    """What a client that drives the gateway itself publishes on ``traj.end`` is checked: a
    reward that is not a finite number is dead-lettered with this reason."""
    end = {"session_id": "s", "reward": reward}
    with pytest.raises(InvalidMessageError, match=needle):
        codec.decode(SessionEnded, msgpack.packb(end))
    with pytest.raises(InvalidMessageError, match=needle):  # JSON: NaN, Infinity literals too
        codec.decode(SessionEnded, json.dumps(end).encode(), content_type=codec.Encoding.JSON)
    assert codec.decode(SessionEnded, msgpack.packb({**end, "reward": -3.5})).reward == -3.5
    assert codec.decode(SessionEnded, msgpack.packb({**end, "reward": 1})).reward == 1.0


def test_a_reward_function_is_named_module_function():
    task = {"task_id": "t", "messages": [{"role": "user", "content": "q"}]}
    named = {**task, "reward": {"function": "pkg.rewards:score"}}
    assert codec.decode(TaskSubmitted, msgpack.packb(named)).reward.function == "pkg.rewards:score"
    for bad in ("score", "pkg rewards:score", "pkg:", ":score"):
        with pytest.raises(InvalidMessageError, match=r"reward\.function: String should match"):
            codec.decode(TaskSubmitted, msgpack.packb({**task, "reward": {"function": bad}}))


def test_an_engines_seconds_are_a_duration():
    assert (
        codec.decode(TokensGenerated, _chunk(finish_reason="stop", engine_s=0.25)).engine_s == 0.25
    )
    with pytest.raises(InvalidMessageError, match="engine_s: Input should be greater than"):
        codec.decode(TokensGenerated, _chunk(finish_reason="stop", engine_s=-0.5))


def test_enums_travel_as_strings_and_are_checked():
    ok = codec.decode(TokensGenerated, _chunk(finish_reason="length"))
    assert ok.finish_reason == "length"
    assert msgpack.unpackb(codec.encode(ok))["finish_reason"] == "length"
    with pytest.raises(InvalidMessageError, match="finish_reason"):
        codec.decode(TokensGenerated, _chunk(finish_reason="tired"))


def test_schema_export_writes_one_valid_schema_per_message(tmp_path):
    paths = export_schemas(tmp_path)
    assert sorted(p.stem for p in paths) == sorted(m.__name__ for m in WIRE_MESSAGES)
    task_schema = json.loads((tmp_path / "TaskSubmitted.json").read_text())
    jsonschema.Draft202012Validator.check_schema(task_schema)
    good = {"task_id": "t1", "messages": [{"role": "user", "content": "hi"}]}
    jsonschema.validate(good, task_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "group_size": "4"}, task_schema)


def test_tasks_payloads_are_plain_msgpack_maps():
    """What other languages must produce: a msgpack map with field names as keys."""
    task = TaskSubmitted(task_id="task-1", messages=[{"role": "user", "content": "1+1?"}])
    decoded = msgpack.unpackb(codec.encode(task))
    assert decoded["task_id"] == "task-1"
    assert decoded["schema_version"] == 1
    assert decoded["messages"][0] == {
        "role": "user",
        "content": "1+1?",
        "name": None,
        "tool_call_id": None,
        "tool_calls": [],
    }


def test_default_worker_ids_are_valid_whatever_the_host_name(monkeypatch):
    import re
    import socket

    from broker.registry import default_worker_id
    from broker.subjects import NAME_PATTERN

    monkeypatch.setattr(socket, "gethostname", lambda: "MacBook-Pro.local")
    for prefix in ("", "trainer-"):
        worker_id = default_worker_id(prefix)
        assert re.fullmatch(NAME_PATTERN, worker_id) and "MacBook-Pro-local" in worker_id
