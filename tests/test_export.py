"""``seamlessflow export``: the Parquet tables of hand-built messages (bad ones skipped and
counted), read from a real broker without touching the run's durables, and the export of a real
``seamlessflow run`` against what its trainer trained, sample for sample."""

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from broker import codec  # noqa: E402
from broker.messages import CallRecorded, SampleReady, SessionEnded  # noqa: E402
from broker.subjects import Durable, RunNames  # noqa: E402
from seamlessflow.export import (  # noqa: E402
    Collected,
    ExportRequest,
    export_run,
    parse_since,
    sources,
    write_tables,
)
from tests.support import eventually  # noqa: E402
from trainer.checkpoint import read_steps  # noqa: E402


def call(session: str, n: int, version: int = 0) -> CallRecorded:
    return CallRecorded(
        session_id=session,
        call_id=f"{session}-c{n}",
        model="tiny",
        prompt_ids=[1, 2, 3 + n],
        output_ids=[7, 8],
        output_logprobs=[-0.25, -1.5],
        output_versions=[version, version + 1],
        finish_reason="stop",
        started_at=100.0 + n,
        finished_at=101.0 + n,
        engine_s=0.5 if n else None,
    )


def end(session: str, reward: float) -> SessionEnded:
    return SessionEnded(
        session_id=session, reward=reward, task_id="t1", group_id="g1", metrics={"turns": 2.0}
    )


def sample(session: str) -> SampleReady:
    return SampleReady(
        sample_id=f"{session}-0",
        session_id=session,
        group_id="g1",
        token_ids=[1, 2, 3, 7, 8],
        loss_mask=[0, 0, 0, 1, 1],
        logprobs=[0.0, 0.0, 0.0, -0.25, -1.5],
        versions=[-1, -1, -1, 0, 1],
        reward=1.0,
        on_policy=False,
        task_id="t1",
    )


def read(out, name: str) -> list[dict]:
    return pq.read_table(out / f"{name}.parquet").to_pylist()


def test_the_tables_of_hand_built_messages_skip_the_bad_ones(tmp_path):
    calls, ends, samples = sources(RunNames("r"))
    collected = Collected()
    json_headers = codec.headers(codec.Encoding.JSON)
    assert collected.add(calls, 1, "sf.r.traj.calls.s1", codec.encode(call("s1", 0)), None)
    assert collected.add(
        calls,
        2,
        "sf.r.traj.calls.s1",
        codec.encode(call("s1", 1), codec.Encoding.JSON),
        json_headers,
    )
    assert collected.add(calls, 3, "sf.r.traj.calls.s2", codec.encode(call("s2", 0)), None)
    assert not collected.add(calls, 4, "sf.r.traj.calls.s1", b"\xc1 not msgpack", None)
    assert not collected.add(calls, 5, "sf.r.traj.calls.s9", codec.encode(call("s1", 2)), None)
    assert collected.add(ends, 6, "sf.r.traj.end", codec.encode(end("s1", 0.5)), None)
    assert not collected.add(ends, 7, "sf.r.traj.end", codec.encode(sample("s1")), None)
    assert collected.add(samples, 8, "sf.r.samples", codec.encode(sample("s1")), None)
    paths = write_tables(collected, tmp_path / "out", decode=lambda ids: " ".join(map(str, ids)))
    out = tmp_path / "out"
    assert sorted(p.name for p in paths.values()) == sorted(
        ["calls.parquet", "sessions.parquet", "samples.parquet", "export.json"]
    )
    rows = read(out, "calls")
    assert [(r["stream_seq"], r["call_id"]) for r in rows] == [
        (1, "s1-c0"),
        (2, "s1-c1"),
        (3, "s2-c0"),
    ]
    assert rows[1]["prompt_ids"] == [1, 2, 4] and rows[1]["output_versions"] == [0, 1]
    assert rows[1]["output_logprobs"] == [-0.25, -1.5] and rows[1]["finish_reason"] == "stop"
    assert [r["engine_s"] for r in rows] == [None, 0.5, None]
    assert rows[1]["prompt_text"] == "1 2 4" and rows[1]["output_text"] == "7 8"
    s1, s2 = read(out, "sessions")
    assert (s1["session_id"], s1["ended"], s1["reward"], s1["end_seq"]) == ("s1", True, 0.5, 6)
    assert (s1["calls"], s1["output_tokens"], s1["metrics"]) == (2, 4, [("turns", 2.0)])
    assert (s1["started_at"], s1["finished_at"]) == (100.0, 102.0)
    assert (s2["session_id"], s2["ended"], s2["reward"], s2["calls"]) == ("s2", False, None, 1)
    (row,) = read(out, "samples")
    assert row == {"stream_seq": 8, **sample("s1").model_dump(exclude={"schema_version"})}
    summary = json.loads((out / "export.json").read_text())
    assert summary["rows"] == {"sessions": 2, "calls": 3, "samples": 1}
    assert summary["skipped"] == {"calls": 2, "sessions": 1}
    reasons = {(s["table"], s["stream_seq"]): s["reason"] for s in summary["skips"]}
    assert "not valid msgpack" in reasons[("calls", 4)]
    assert "is not its subject's ('s9')" in reasons[("calls", 5)]
    assert "invalid SessionEnded" in reasons[("sessions", 7)]


def test_an_empty_export_still_has_its_columns(tmp_path):
    write_tables(Collected(), tmp_path)
    table = pq.read_table(tmp_path / "samples.parquet")
    assert table.num_rows == 0 and "loss_mask" in table.column_names


def test_since_reads_times_and_durations():
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_since("30m", now) == now - timedelta(minutes=30)
    assert parse_since("2026-01-01T00:00", now) == datetime(2026, 1, 1, tzinfo=UTC)
    with pytest.raises(Exception, match="neither an ISO 8601 time"):
        parse_since("yesterday", now)


async def test_export_reads_the_streams_and_takes_nothing_from_the_run(broker, js, names, tmp_path):
    for n in range(3):
        await js.publish(names.traj_calls("s1"), codec.encode(call("s1", n)))
    await js.publish(names.traj_calls("s2"), b"garbage")
    await js.publish(names.traj_end, codec.encode(end("s1", 1.0)))
    await js.publish(names.samples, codec.encode(sample("s1")))
    await js.publish(names.samples, b'{"sample_id": 1}', headers=codec.headers(codec.Encoding.JSON))
    before = {
        s: (await js.consumer_info(s, d)).num_pending
        for s, d in (
            (names.samples_stream, Durable.TRAINER),
            (names.traj_stream, Durable.TRAJECTORY),
        )
    }
    request = ExportRequest(url=broker.url, run=names.run, out_dir=tmp_path, progress=False)
    collected = await export_run(request)
    assert collected.counts() == {"calls": 3, "sessions": 1, "samples": 1}
    assert collected.skipped == {"calls": 1, "samples": 1}
    assert [r["call_id"] for r in read(tmp_path, "calls")] == ["s1-c0", "s1-c1", "s1-c2"]
    assert read(tmp_path, "samples")[0]["token_ids"] == [1, 2, 3, 7, 8]
    # The durables still hold everything for the run; the export's consumers are gone.
    for (stream, durable), pending in zip(
        ((names.samples_stream, Durable.TRAINER), (names.traj_stream, Durable.TRAJECTORY)),
        before.values(),
        strict=True,
    ):
        assert (await js.consumer_info(stream, durable)).num_pending == pending
    for stream in (names.samples_stream, names.traj_stream):
        assert (await js.stream_info(stream)).state.consumer_count == 1
    # --since: only what was stored from then on.
    since = datetime.now(UTC)
    await asyncio.sleep(0.05)
    await js.publish(names.samples, codec.encode(sample("s3")))
    recent = ExportRequest(broker.url, names.run, tmp_path / "recent", since=since, progress=False)
    assert (await export_run(recent)).counts() == {"calls": 0, "sessions": 0, "samples": 1}
    assert read(tmp_path / "recent", "samples")[0]["session_id"] == "s3"
    # --since after the last message: empty tables, not an error.
    later = datetime.now(UTC) + timedelta(hours=1)
    late = ExportRequest(broker.url, names.run, tmp_path / "late", since=later, progress=False)
    assert (await export_run(late)).counts() == {"calls": 0, "sessions": 0, "samples": 0}


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
async def test_the_export_of_a_real_run_is_what_its_trainer_trained(
    broker, js, run_name, tmp_path, run_toml
):
    """A short ``seamlessflow run`` (2 steps, disaggregated), then ``seamlessflow export``: every
    sample the trainer's steps log names is exported once, token-exact with the stream's
    ``SampleReady``, and each sample is one exported call's ``prompt_ids + output_ids``."""
    config = run_toml(
        run_name,
        tasks={"group_size": 2},
        trainer={"groups_per_step": 2, "max_staleness": 2},
        stop={"max_steps": 2, "max_seconds": 200},
    )
    env = {**os.environ, "SEAMLESSFLOW_MODELS": str(tmp_path / "models"), "HF_HUB_OFFLINE": "1"}

    def sf(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "seamlessflow.cli", *args, "--nats", broker.url],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
        )

    done = sf("run", str(config))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = tmp_path / "export"
    done = sf("export", "--run", run_name, str(out), "--tokenizer", "tiny", "--no-progress")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "0 skipped" in done.stdout and "Traceback" not in done.stderr

    names = RunNames(run_name)
    stored = {s.sample_id: s for s in await _stored(js, names.samples_stream, SampleReady)}
    samples = {row["sample_id"]: row for row in read(out, "samples")}
    assert len(samples) == len(read(out, "samples")) == len(stored)
    steps = read_steps(tmp_path / "out" / "checkpoints")
    trained = [sid for step in steps for sid in step.trained]
    consumed = {sid for step in steps for sid in step.sample_ids}
    assert len(trained) >= 2 * 2 * 2 and consumed <= samples.keys()
    for sid in trained:  # what the trainer trained, token for token
        row, message = samples[sid], stored[sid]
        assert {k: row[k] for k in message.model_dump(exclude={"schema_version"})} == (
            message.model_dump(exclude={"schema_version"})
        )
    calls = read(out, "calls")
    _check_calls_and_sessions(out, calls, samples)
    summary = json.loads((out / "export.json").read_text())
    assert summary["rows"]["calls"] == len(calls) and summary["skipped"] == {}


def _check_calls_and_sessions(out, calls: list[dict], samples: dict[str, dict]) -> None:
    """Each sample is the path of one of its session's exported calls (its ``prompt_ids +
    output_ids``, with the call's logprobs on the output), in an ended session of its reward."""
    by_session = {}
    for c in calls:
        by_session.setdefault(c["session_id"], []).append(c)
    for row in samples.values():  # each sample is the path of one of its session's calls
        n = len(row["token_ids"])
        assert any(
            c["prompt_ids"] + c["output_ids"] == row["token_ids"]
            and row["logprobs"][n - len(c["output_ids"]) :] == c["output_logprobs"]
            for c in by_session[row["session_id"]]
        )
    sessions = {s["session_id"]: s for s in read(out, "sessions")}
    for row in samples.values():
        session = sessions[row["session_id"]]
        assert session["ended"] and session["reward"] == row["reward"]
        assert session["calls"] == len(by_session[row["session_id"]])
    assert all(c["output_text"] is not None and c["prompt_text"] for c in calls)


async def _stored(js, stream: str, schema) -> list:
    state = (await js.stream_info(stream)).state
    return [
        codec.decode(schema, (await js.get_msg(stream, seq)).data)
        for seq in range(state.first_seq, state.last_seq + 1)
    ]


async def test_follow_reads_new_messages_until_cancelled(broker, js, names, tmp_path):
    await js.publish(names.samples, codec.encode(sample("s1")))
    request = ExportRequest(broker.url, names.run, tmp_path, follow=True, progress=False)
    task = asyncio.create_task(export_run(request))
    await js.publish(names.samples, codec.encode(sample("s2")))

    async def read_up_to_the_last_sample() -> bool:
        readers = [
            c for c in await js.consumers_info(names.samples_stream) if c.name != Durable.TRAINER
        ]
        return bool(readers) and readers[0].delivered.stream_seq == 2

    await eventually(read_up_to_the_last_sample, watch=task)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [r["session_id"] for r in read(tmp_path, "samples")] == ["s1", "s2"]
    assert (await js.stream_info(names.samples_stream)).state.consumer_count == 1
