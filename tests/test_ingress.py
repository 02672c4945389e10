"""The validated ingress on a real broker: bad tasks are dead-lettered with a reason and counted,
good tasks around them are all handled, and the consumer keeps going."""

import asyncio
import json
import logging
import uuid

import msgpack
import pytest
from nats.js.errors import APIError

from broker.client import session
from broker.exceptions import UnavailableError
from broker.ingress import Delivery, HandBack, Ingress, tasks_ingress
from broker.messages import MessageRejected, TaskSubmitted
from broker.metrics import REGISTRY
from broker.provision import provision_run
from broker.retry import Backoff
from broker.server import EmbeddedBroker
from broker.subjects import Durable, RunNames
from tests.support import (
    SMALL_RUN,
    broker_config,
    consumer_settled,
    eventually,
    free_port,
    own_run,
    stream_messages,
)


def _count(source: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "sf_ingress_messages_total", {"source": source, "outcome": outcome}
    )
    return value or 0.0


def _task_dict(i: int) -> dict:
    return {"task_id": f"ok-{i}", "messages": [{"role": "user", "content": f"{i}*2?"}]}


class Collector:
    """Handler that records what it saw; fails the first delivery of ids in ``fail_once``."""

    def __init__(self, fail_once: set[str] = frozenset(), fail_always: set[str] = frozenset()):
        self.seen: list[tuple[TaskSubmitted, Delivery]] = []
        self.fail_once, self.fail_always = set(fail_once), set(fail_always)

    async def __call__(self, task: TaskSubmitted, delivery: Delivery) -> None:
        if task.task_id in self.fail_always or (
            task.task_id in self.fail_once and delivery.num_delivered == 1
        ):
            raise RuntimeError(f"handler trouble with {task.task_id}")
        self.seen.append((task, delivery))


def _ingress(js, names: RunNames, handler) -> Ingress[TaskSubmitted]:
    limits = SMALL_RUN.tasks.model_copy(update={"max_payload": 4096})
    return tasks_ingress(
        js, names, handler, limits, fetch_timeout=0.2, retry_delay=0.1, durable=Durable.SCHEDULER
    )


async def _run_until(ingress: Ingress, done, timeout: float = 20.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(ingress.run(stop))
    try:
        await eventually(done, timeout=timeout, watch=task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_malformed_tasks_are_dead_lettered_and_the_rest_handled(js, names):
    bad = [
        (b"\xc1\xc1", None, "not valid msgpack"),
        (
            msgpack.packb({**_task_dict(90), "group_size": "many"}),
            None,
            "group_size: Input should be a valid integer",
        ),
        (msgpack.packb({"messages": []}), None, "task_id: Field required"),
        (
            msgpack.packb({**_task_dict(91), "metadata": {"pad": "x" * 5000}}),
            None,
            "over the 4096-byte limit",
        ),
        (json.dumps(_task_dict(92)).encode(), None, "JSON senders must set Content-Type"),
        (
            b"{not json",
            "application/json",
            'Invalid JSON: key must be a string at line 1 column 2 (got "{not json")',
        ),
        (
            b"\xff\xfe",
            "application/json",
            'expected value at line 1 column 1 (got "2 bytes 0xfffe")',
        ),
        (
            msgpack.packb({**_task_dict(94), "task_id": b"ok-94"}),
            None,
            'task_id: Input should be a valid string (got "ok-94")',
        ),
        (msgpack.packb(_task_dict(93)), "text/csv; " + "x" * 1000, "unsupported Content-Type"),
        (  # a map with a bytes key cannot be shown as JSON: the reason names its type
            msgpack.packb({**_task_dict(95), "task_id": {b"x": 1}}),
            None,
            "task_id: Input should be a valid string (got <dict>)",
        ),
    ]
    # Interleave: good, bad, good, bad, ... so valid tasks sit on both sides of each bad one.
    for i, (payload, ctype, _) in enumerate(bad):
        await js.publish(names.tasks, msgpack.packb(_task_dict(i)))
        await js.publish(names.tasks, payload, headers={"Content-Type": ctype} if ctype else None)
    # JSON is accepted when the client says so, whatever the header name's case.
    await js.publish(
        names.tasks,
        json.dumps(_task_dict(50)).encode(),
        headers={"content-type": "application/json"},
    )

    accepted0, rejected0 = _count("tasks", "accepted"), _count("tasks", "rejected")
    handler = Collector()
    ingress = _ingress(js, names, handler)
    await _run_until(
        ingress,
        lambda: (
            len(handler.seen) == len(bad) + 1
            and _count("tasks", "rejected") - rejected0 == len(bad)
        ),
    )

    assert [t.task_id for t, _ in handler.seen] == [f"ok-{i}" for i in range(len(bad))] + ["ok-50"]
    assert _count("tasks", "accepted") - accepted0 == len(bad) + 1
    assert _count("tasks", "rejected") - rejected0 == len(bad)

    dead = await stream_messages(js, names.dead_stream, MessageRejected)
    assert len(dead) == len(bad)
    for letter, (payload, ctype, needle) in zip(dead, bad, strict=True):
        assert needle in letter.reason
        assert "b'" not in letter.reason and 'b"' not in letter.reason  # never a Python repr
        assert letter.source == "tasks" and letter.subject == names.tasks
        assert letter.payload == payload[: len(letter.payload)]
        assert letter.payload_size == len(payload)
        assert letter.content_type == (ctype or "")[:256]
    # Every message was settled: nothing left in the work queue, nothing awaiting an ack.
    info = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0


async def test_handler_failures_are_retried_then_dead_lettered(js, names):
    for i in range(3):
        await js.publish(names.tasks, msgpack.packb(_task_dict(i)))
    failed0, rejected0 = _count("tasks", "failed"), _count("tasks", "rejected")
    handler = Collector(fail_once={"ok-0"}, fail_always={"ok-2"})
    ingress = _ingress(js, names, handler)
    max_deliver = (await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)).config.max_deliver
    await _run_until(
        ingress, lambda: len(handler.seen) == 2 and _count("tasks", "rejected") - rejected0 == 1
    )

    by_id = {t.task_id: d for t, d in handler.seen}
    assert sorted(by_id) == ["ok-0", "ok-1"]
    assert by_id["ok-0"].num_delivered == 2  # nak'd once, handled on redelivery
    assert by_id["ok-1"].num_delivered == 1
    (letter,) = await stream_messages(js, names.dead_stream, MessageRejected)
    assert f"handler failed on all {max_deliver} deliveries" in letter.reason
    assert "handler trouble with ok-2" in letter.reason
    assert _count("tasks", "failed") - failed0 == 1 + max_deliver


async def test_a_long_handler_keeps_its_message_in_progress_past_ack_wait(js, run_name):
    """A handler that works four times the consumer's short ack_wait (1 s) and sends no progress
    of its own: the ingress keeps the message in progress, so it is handled once."""
    quick = SMALL_RUN.scheduler.model_copy(update={"ack_wait_s": 1.0})
    await provision_run(js, run_name, SMALL_RUN.model_copy(update={"scheduler": quick}))
    names = RunNames(run_name)
    calls: list[int] = []

    async def slow(task: TaskSubmitted, delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        await asyncio.sleep(4.0)

    await js.publish(names.tasks, msgpack.packb(_task_dict(0)))
    # Concurrency 2: the ingress keeps fetching meanwhile, so a redelivery would be handled.
    ingress = tasks_ingress(
        js,
        names,
        slow,
        SMALL_RUN.tasks,
        durable=Durable.SCHEDULER,
        fetch_timeout=0.2,
        concurrency=2,
    )
    await _run_until(ingress, lambda: _settled(js, names), timeout=30)
    assert calls == [1]
    info = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
    assert info.num_redelivered == 0


async def _settled(js, names: RunNames) -> bool:
    return await consumer_settled(js, names.tasks_stream, Durable.SCHEDULER)


async def test_a_handed_back_message_is_redelivered_at_once_and_not_a_failure(js, names):
    await js.publish(names.tasks, msgpack.packb(_task_dict(0)))
    failed0, returned0 = _count("tasks", "failed"), _count("tasks", "returned")
    seen: list[int] = []

    async def handler(task: TaskSubmitted, delivery: Delivery) -> None:
        seen.append(delivery.num_delivered)
        if delivery.num_delivered < 3:
            raise HandBack("stopping")

    # retry_delay is 0.1 s for failures; a hand-back must not wait for it (nor be dead-lettered).
    await _run_until(_ingress(js, names, handler), lambda: len(seen) == 3)
    assert seen == [1, 2, 3]
    assert _count("tasks", "returned") - returned0 == 2
    assert _count("tasks", "failed") == failed0
    assert await stream_messages(js, names.dead_stream, MessageRejected) == []


async def test_payload_over_the_stream_limit_is_refused_to_the_publisher(js, names):
    with pytest.raises(APIError) as info:
        await js.publish(names.tasks, b"x" * (1 << 20) + b"x")
    assert "maximum" in str(info.value).lower() or "size" in str(info.value).lower()
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0


async def test_ingress_survives_a_broker_restart(tmp_path, nats_binary, caplog):
    """Stop the server under a running ingress, start it again on the same port and store:
    tasks published before and after are all handled, none twice; the ingress pauses while the
    broker is away, with one line when it goes and one when it comes back."""
    caplog.set_level(logging.INFO, logger="broker.ingress")
    cfg = broker_config(tmp_path, nats_binary).model_copy(update={"port": free_port()})
    names = RunNames("restart")
    handler = Collector()
    stop = asyncio.Event()
    server = EmbeddedBroker(cfg)
    admin = own_run(server, names.run)
    server.start()
    try:
        async with session(server.url, "test", identity_file=admin) as nc:
            js = nc.jetstream()
            await provision_run(js, names.run, SMALL_RUN)
            run = asyncio.create_task(_ingress(js, names, handler).run(stop))
            for i in range(5):
                await js.publish(names.tasks, msgpack.packb(_task_dict(i)))
            await eventually(lambda: len(handler.seen) == 5, watch=run)

            server.stop()
            await asyncio.sleep(1.0)  # the ingress waits for a broker that is gone
            assert not run.done(), run.exception() if run.done() else None
            assert _paused() == 1.0
            server = EmbeddedBroker(cfg).start()
            await eventually(lambda: nc.is_connected)
            await eventually(lambda: _paused() == 0.0, watch=run)

            for i in range(5, 10):
                await js.publish(names.tasks, msgpack.packb(_task_dict(i)))
            await eventually(lambda: len(handler.seen) == 10, timeout=30, watch=run)
            stop.set()
            await asyncio.wait_for(run, 10)
    finally:
        stop.set()
        server.stop()
    assert sorted(t.task_id for t, _ in handler.seen) == sorted(f"ok-{i}" for i in range(10))
    lines = [r.getMessage() for r in caplog.records]
    (paused,) = [line for line in lines if line.startswith("ingress_paused")]
    assert "broker disconnected" in paused
    assert len([line for line in lines if line.startswith("ingress_resumed")]) == 1
    assert not [line for line in lines if line.startswith("ingress_fetch_failed")]


async def test_a_task_done_as_the_broker_stops_is_acked_and_not_run_again(tmp_path, nats_binary):
    """The broker is stopped right as the handler of a task returns, so its ack races the
    shutdown. The ack is confirmed by the server, tried again once it is back: the task leaves
    the work queue and is not run again, though ack_wait (1 s) passes many times over."""
    cfg = broker_config(tmp_path, nats_binary).model_copy(update={"port": free_port()})
    names = RunNames("acked")
    quick = SMALL_RUN.model_copy(
        update={"scheduler": SMALL_RUN.scheduler.model_copy(update={"ack_wait_s": 1.0})}
    )
    seen: list[str] = []
    server = EmbeddedBroker(cfg)
    admin = own_run(server, names.run)
    server.start()
    stopping: list[asyncio.Task] = []

    async def handler(task: TaskSubmitted, delivery: Delivery) -> None:
        seen.append(task.task_id)
        if len(seen) == 1:  # stop the broker as this returns (and its ack is sent)
            stopping.append(asyncio.create_task(asyncio.to_thread(server.stop)))

    stop = asyncio.Event()
    try:
        async with session(server.url, "test", identity_file=admin) as nc:
            js = nc.jetstream()
            await provision_run(js, names.run, quick)
            await js.publish(names.tasks, msgpack.packb(_task_dict(0)))
            run = asyncio.create_task(_ingress(js, names, handler).run(stop))
            await eventually(lambda: bool(stopping) and stopping[0].done(), watch=run)
            await asyncio.sleep(1.0)  # down for a while: the ack cannot be confirmed now
            server = EmbeddedBroker(cfg).start()
            await eventually(lambda: nc.is_connected, watch=run)

            async def acked() -> bool:
                return (await js.stream_info(names.tasks_stream)).state.messages == 0

            await eventually(acked, timeout=30, watch=run)
            await asyncio.sleep(4.0)  # four ack_waits: a lost ack would have it redelivered
            info = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
            stop.set()
            await asyncio.wait_for(run, 10)
    finally:
        stop.set()
        server.stop()
    assert seen == ["ok-0"]
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


def _outage_ingress(js, names: RunNames, handler, backoff: Backoff) -> Ingress[TaskSubmitted]:
    return tasks_ingress(
        js,
        names,
        handler,
        SMALL_RUN.tasks,
        fetch_timeout=0.2,
        backoff=backoff,
        durable=Durable.SCHEDULER,
    )


class Outage:
    """A handler whose part (a gateway, say) is down until ``up`` is set: an injected fault,
    since the ingress under test knows nothing of what its handler calls. Records every call."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.calls: list[tuple[str, int, int]] = []  # (task id, num_delivered, retry)

    async def __call__(self, task: TaskSubmitted, delivery: Delivery) -> None:
        self.calls.append((task.task_id, delivery.num_delivered, delivery.retry))
        if not self.up.is_set():
            raise UnavailableError("the part is down (injected)")


def _paused(source: str = "tasks") -> float:
    return REGISTRY.get_sample_value("sf_ingress_paused", {"source": source}) or 0.0


async def test_an_unavailable_part_pauses_the_ingress_and_spends_no_delivery(js, caplog):
    """A short ack_wait and max_deliver 2: if the outage spent deliveries or let ack timers run
    out, JetStream would redeliver, then drop the tasks. It does neither, and nothing is failed,
    dead-lettered or logged with a traceback."""
    names = RunNames("t" + uuid.uuid4().hex[:12])
    limits = SMALL_RUN.scheduler.model_copy(update={"ack_wait_s": 1.0, "max_deliver": 2})
    await provision_run(js, names.run, SMALL_RUN.model_copy(update={"scheduler": limits}))
    for i in range(3):
        await js.publish(names.tasks, msgpack.packb(_task_dict(i)))
    failed0, rejected0 = _count("tasks", "failed"), _count("tasks", "rejected")
    handler = Outage()
    ingress = _outage_ingress(js, names, handler, Backoff(0.05, 0.2))
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, logger="broker.ingress")
    run = asyncio.create_task(ingress.run(stop))
    try:
        await eventually(lambda: _paused() == 1.0, watch=run)
        await asyncio.sleep(3.0)  # three ack_waits
        # Paused: the first task is held and retried, the rest of its batch waits behind it.
        assert {task for task, _, _ in handler.calls} == {"ok-0"}
        assert len(handler.calls) >= 10  # the backoff is capped
        assert [retry for _, _, retry in handler.calls] == list(range(len(handler.calls)))
        info = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
        assert (info.num_redelivered, info.num_ack_pending) == (0, 3)
        handler.up.set()
        await eventually(lambda: {t for t, _, _ in handler.calls} == {"ok-0", "ok-1", "ok-2"})
        await eventually(lambda: _paused() == 0.0, watch=run)
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)
    assert all(delivered == 1 for _, delivered, _ in handler.calls)
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0  # all acked
    assert await stream_messages(js, names.dead_stream, MessageRejected) == []
    assert (_count("tasks", "failed"), _count("tasks", "rejected")) == (failed0, rejected0)
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert events.count("ingress_paused") == 1 and events.count("ingress_resumed") == 1
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    (paused,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ingress_p")]
    assert "source=tasks" in paused and "UnavailableError" in paused


async def test_stopping_while_paused_hands_the_held_task_back(js, names):
    await js.publish(names.tasks, msgpack.packb(_task_dict(0)))
    returned0, failed0 = _count("tasks", "returned"), _count("tasks", "failed")
    handler = Outage()
    ingress = _outage_ingress(js, names, handler, Backoff(0.05))
    await _run_until(ingress, lambda: _paused() == 1.0)
    assert _paused() == 0.0  # a stopped ingress is not paused
    assert _count("tasks", "returned") - returned0 == 1
    assert _count("tasks", "failed") == failed0
    assert await stream_messages(js, names.dead_stream, MessageRejected) == []
    # Back in the queue at once: the next consumer takes it on its next delivery.
    handler.up.set()
    handler.calls.clear()
    again = tasks_ingress(
        js, names, handler, SMALL_RUN.tasks, fetch_timeout=0.2, durable=Durable.SCHEDULER
    )
    await _run_until(again, lambda: handler.calls == [("ok-0", 2, 0)])
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0
