"""``seamlessflow export``: a run's trajectories and training samples as Parquet files.

It reads the run's durable streams as a second reader that takes nothing from anyone: one
ephemeral pull consumer per subject (no acks, in memory, gone when idle), never the trainer's or
the trajectory manager's durable, and never a work-queue stream. ``SF_<run>_TRAJ`` and
``SF_<run>_SAMPLES`` keep their messages by limits, so reading them changes nothing for the run.

It writes to ``OUT_DIR`` (the columns are in ``docs/protocol.md``, section 12):

- ``calls.parquet``: one row per ``CallRecorded`` (token ids, logprobs, versions per token);
- ``sessions.parquet``: one row per session seen (ended with its ``SessionEnded``, or still
  running: calls and no end yet), with its reward, group and call totals;
- ``samples.parquet``: one row per ``SampleReady``, as the trainer consumes it;
- ``export.json``: counts per table, and the messages skipped with their reasons.

A message that does not decode (or a call record whose session is not its subject's) is skipped:
counted, logged with its stream sequence and reason, never raised. ``pyarrow`` comes from the
``export`` extra; this module imports it only when it writes.
"""

import asyncio
import contextlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from tqdm import tqdm

from broker import codec
from broker.exceptions import InvalidMessageError
from broker.messages import CallRecorded, Message, SampleReady, SessionEnded
from broker.subjects import RunNames
from common.durations import parse_duration
from common.log import kv
from seamlessflow.exceptions import InputError

log = logging.getLogger(__name__)

BATCH = 256
"""Messages per pull."""
IDLE_S = 2.0
"""A pull that waits this long for nothing ends a one-shot read."""
FLUSH_S = 30.0
"""With ``follow``, the tables are rewritten this often."""
KEEP_SKIPS = 100
"""Skipped messages listed in ``export.json`` (all are counted and logged)."""
TABLES = ("sessions", "calls", "samples")


@dataclass(frozen=True)
class Source:
    """One subject read into one table."""

    table: str
    schema: type[Message]
    stream: str
    subject: str


def sources(names: RunNames) -> tuple[Source, ...]:
    return (
        Source("calls", CallRecorded, names.traj_stream, names.traj_calls_all),
        Source("sessions", SessionEnded, names.traj_stream, names.traj_end),
        Source("samples", SampleReady, names.samples_stream, names.samples),
    )


@dataclass
class Collected:
    """The decoded messages of an export, in stream order, and what was skipped."""

    calls: list[tuple[int, CallRecorded]] = field(default_factory=list)
    ends: list[tuple[int, SessionEnded]] = field(default_factory=list)
    samples: list[tuple[int, SampleReady]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    """Skipped messages per table."""
    skips: list[dict[str, Any]] = field(default_factory=list)
    """The first ``KEEP_SKIPS`` skipped: table, stream_seq, subject, reason."""

    def add(
        self, source: Source, seq: int, subject: str, data: bytes, headers: dict | None
    ) -> bool:
        """Decode one stored message into its table; a bad one is skipped (False)."""
        try:
            message = codec.decode(source.schema, data, content_type=codec.content_type_of(headers))
            if isinstance(message, CallRecorded):
                token = subject.rsplit(".", 1)[-1]
                if token != message.session_id:
                    raise InvalidMessageError(
                        f"session_id {message.session_id!r} is not its subject's ({token!r})"
                    )
        except InvalidMessageError as exc:
            self.skip(source.table, seq, subject, exc.reason)
            return False
        target = {"calls": self.calls, "sessions": self.ends, "samples": self.samples}
        target[source.table].append((seq, message))
        return True

    def skip(self, table: str, seq: int, subject: str, reason: str) -> None:
        self.skipped[table] += 1
        skip = {"table": table, "stream_seq": seq, "subject": subject, "reason": reason}
        log.warning(kv("export_skipped", **skip))
        if len(self.skips) < KEEP_SKIPS:
            self.skips.append(skip)

    def counts(self) -> dict[str, int]:
        return {"calls": len(self.calls), "sessions": len(self.ends), "samples": len(self.samples)}


# -- reading ------------------------------------------------------------------------------


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``--since``: an ISO 8601 time (UTC unless it says otherwise) or a duration ago such as
    ``90s``, ``30m``, ``2h``, ``1d``."""
    if (ago := parse_duration(text)) is not None:
        return (now or datetime.now(UTC)) - ago
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise InputError(
            f"--since {text!r} is neither an ISO 8601 time nor a duration like 30m"
        ) from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _consumer_config(since: datetime | None) -> ConsumerConfig:
    """An ephemeral reader's: nothing to ack, kept in memory, removed 30 s after its last pull."""
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=30)
    if since is None:
        config.deliver_policy = DeliverPolicy.ALL
    else:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = since.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return config


async def read_source(
    js: JetStreamContext,
    source: Source,
    collected: Collected,
    *,
    since: datetime | None = None,
    follow: bool = False,
    bar: tqdm | None = None,
) -> None:
    """Every message of ``source`` into ``collected``, oldest first; with ``follow``, then every
    new one until cancelled. Without it, it ends when the consumer has nothing pending."""
    sub = await js.pull_subscribe(
        source.subject, stream=source.stream, config=_consumer_config(since)
    )
    info = await sub.consumer_info()
    try:
        if bar is not None:
            bar.total = (bar.total or 0) + info.num_pending
            bar.refresh()
        if info.num_pending or follow:
            await _pull(sub, source, collected, follow=follow, bar=bar)
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(NotFoundError):  # unsubscribing leaves it to expire
            await js.delete_consumer(source.stream, info.name)


async def _pull(sub, source: Source, collected: Collected, *, follow: bool, bar) -> None:
    while True:
        try:
            msgs = await sub.fetch(BATCH, timeout=IDLE_S)
        except TimeoutError:
            if follow:
                continue
            return
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            collected.add(source, seq, msg.subject, msg.data, msg.headers)
        if bar is not None:
            bar.update(len(msgs))
        if not follow and (not msgs or msgs[-1].metadata.num_pending == 0):
            return


async def _check_streams(js: JetStreamContext, names: RunNames) -> None:
    for stream in (names.traj_stream, names.samples_stream):
        try:
            await js.stream_info(stream)
        except NotFoundError as exc:
            raise InputError(
                f"run {names.run!r} has no stream {stream}: is it provisioned?"
            ) from exc


# -- rows and tables ----------------------------------------------------------------------


def call_rows(collected: Collected, decode: Callable[[list[int]], str] | None) -> list[dict]:
    rows = []
    for seq, c in collected.calls:
        row = {"stream_seq": seq, **c.model_dump(mode="json", exclude={"schema_version"})}
        if decode is not None:
            row["prompt_text"], row["output_text"] = decode(c.prompt_ids), decode(c.output_ids)
        rows.append(row)
    return rows


def session_rows(collected: Collected) -> list[dict]:
    """One row per session: its ``SessionEnded`` (the last one, if repeated) and its calls'
    totals; a session with calls but no end yet is listed with ``ended`` false."""
    ends = {e.session_id: (seq, e) for seq, e in collected.ends}
    calls: dict[str, list[CallRecorded]] = {}
    for _, c in collected.calls:
        calls.setdefault(c.session_id, []).append(c)
    rows = []
    for session_id in dict.fromkeys([*ends, *calls]):
        seq, end = ends.get(session_id, (None, None))
        its = calls.get(session_id, [])
        rows.append(
            {
                "session_id": session_id,
                "ended": end is not None,
                "end_seq": seq,
                "reward": end.reward if end else None,
                "task_id": end.task_id if end else None,
                "group_id": end.group_id if end else None,
                "group_size": end.group_size if end else None,
                "admitted": end.admitted.model_dump() if end and end.admitted else None,
                "metrics": list(end.metrics.items()) if end else [],
                "calls": len(its),
                "output_tokens": sum(len(c.output_ids) for c in its),
                "started_at": min((c.started_at for c in its), default=None),
                "finished_at": max((c.finished_at for c in its), default=None),
            }
        )
    return rows


def sample_rows(collected: Collected) -> list[dict]:
    return [
        {"stream_seq": seq, **s.model_dump(mode="json", exclude={"schema_version"})}
        for seq, s in collected.samples
    ]


def arrow_schemas(with_text: bool = False) -> dict[str, Any]:
    """The Parquet schema of each table (``docs/protocol.md`` section 12)."""
    import pyarrow as pa

    ids, floats, ints = pa.list_(pa.int32()), pa.list_(pa.float64()), pa.list_(pa.int64())
    stamp = [("ticket", pa.int64()), ("version", pa.int64()), ("at", pa.float64())]
    admitted = pa.struct([*stamp, ("since", pa.int64())])
    text = [("prompt_text", pa.string()), ("output_text", pa.string())] if with_text else []
    calls = [("stream_seq", pa.int64()), ("session_id", pa.string()), ("call_id", pa.string())]
    calls += [("model", pa.string()), ("prompt_ids", ids), ("output_ids", ids)]
    calls += [("output_logprobs", floats), ("output_versions", ints)]
    calls += [("finish_reason", pa.string()), ("started_at", pa.float64())]
    calls += [("finished_at", pa.float64()), ("interruptions", pa.int64())]
    calls += [("engine_s", pa.float64()), *text]
    sessions = [("session_id", pa.string()), ("ended", pa.bool_()), ("end_seq", pa.int64())]
    sessions += [("reward", pa.float64()), ("task_id", pa.string()), ("group_id", pa.string())]
    sessions += [("group_size", pa.int64()), ("admitted", admitted)]
    sessions += [("metrics", pa.map_(pa.string(), pa.float64()))]
    sessions += [("calls", pa.int64()), ("output_tokens", pa.int64())]
    sessions += [("started_at", pa.float64()), ("finished_at", pa.float64())]
    samples = [("stream_seq", pa.int64()), ("sample_id", pa.string())]
    samples += [("session_id", pa.string()), ("group_id", pa.string()), ("token_ids", ids)]
    samples += [("loss_mask", pa.list_(pa.int8())), ("logprobs", floats), ("versions", ints)]
    samples += [("reward", pa.float64()), ("on_policy", pa.bool_()), ("task_id", pa.string())]
    samples += [("group_size", pa.int64()), ("session_samples", pa.int64())]
    samples += [("admitted", admitted)]
    return {
        name: pa.schema(cols) for name, cols in zip(TABLES, (sessions, calls, samples), strict=True)
    }


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise InputError(
            "export writes Parquet with pyarrow: pip install 'seamlessflow[export]'"
        ) from exc
    return pyarrow


def write_tables(
    collected: Collected, out_dir: Path, decode: Callable[[list[int]], str] | None = None
) -> dict[str, Path]:
    """Write the three tables and ``export.json`` into ``out_dir``, each file atomically."""
    pa = _pyarrow()
    out_dir.mkdir(parents=True, exist_ok=True)
    schemas = arrow_schemas(decode is not None)
    rows = {
        "sessions": session_rows(collected),
        "calls": call_rows(collected, decode),
        "samples": sample_rows(collected),
    }
    paths = {}
    for name in TABLES:
        table = pa.Table.from_pylist(rows[name], schema=schemas[name])
        paths[name] = _replace(
            out_dir / f"{name}.parquet", lambda p, t=table: pa.parquet.write_table(t, p)
        )
    summary = {
        "rows": {name: len(rows[name]) for name in TABLES},
        "skipped": dict(collected.skipped),
        "skips": collected.skips,
        "written_at": datetime.now(UTC).isoformat(),
    }
    text = json.dumps(summary, indent=2) + "\n"
    paths["summary"] = _replace(out_dir / "export.json", lambda p: Path(p).write_text(text))
    return paths


def _replace(path: Path, write: Callable[[str], object]) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    write(str(tmp))
    os.replace(tmp, path)
    return path


# -- the command --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportRequest:
    url: str
    run: str
    out_dir: Path
    since: datetime | None = None
    follow: bool = False
    tokenizer: str | None = None
    progress: bool = True


def tokenizer_decoder(spec: str) -> Callable[[list[int]], str]:
    """Token ids to text with the tokenizer of ``spec`` (a model name or an HF folder)."""
    from common.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(spec))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


async def export_run(request: ExportRequest) -> Collected:
    """Read the run's streams and write its tables (see the module docstring); a one-shot export
    that fails writes nothing. With ``follow`` it rewrites them every ``FLUSH_S`` and once more
    when it ends (cancelled: Ctrl-C)."""
    from broker.client import session
    from broker.permissions import Principal

    _pyarrow()  # fail before reading anything
    decode = tokenizer_decoder(request.tokenizer) if request.tokenizer else None
    names = RunNames(request.run)
    collected = Collected()
    async with session(request.url, "seamlessflow-export", principal=Principal.ADMIN) as nc:
        js = nc.jetstream()
        await _check_streams(js, names)
        with tqdm(unit="msg", desc="export", disable=not request.progress) as bar:
            readers = [
                read_source(js, s, collected, since=request.since, follow=request.follow, bar=bar)
                for s in sources(names)
            ]
            if not request.follow:
                await asyncio.gather(*readers)
                write_tables(collected, request.out_dir, decode)
                return collected
            try:
                await _follow(readers, collected, request.out_dir, decode)
            finally:  # on Ctrl-C too: what was read so far
                write_tables(collected, request.out_dir, decode)
    return collected


async def _follow(readers: list, collected: Collected, out_dir: Path, decode) -> None:
    tasks = [asyncio.create_task(r) for r in readers]
    try:
        while not any(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=FLUSH_S, return_when=asyncio.FIRST_COMPLETED)
            write_tables(collected, out_dir, decode)
        for t in tasks:
            if t.done():
                t.result()  # a reader that failed fails the export
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
