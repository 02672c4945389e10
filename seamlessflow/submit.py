"""Publish tasks from a JSONL file (one ``TaskSubmitted`` as JSON per line) to a run."""

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from tqdm import tqdm

from broker import codec
from broker.exceptions import BrokerError, InvalidMessageError
from broker.messages import TaskSubmitted
from broker.provision import run_stream_info
from broker.subjects import RunNames
from common.log import kv

log = logging.getLogger(__name__)


@dataclass
class SubmitReport:
    published: int = 0
    duplicates: int = 0


def parse_tasks(lines: Iterable[str], source: str) -> tuple[list[TaskSubmitted], list[str]]:
    """Valid tasks, and an error naming the line for each invalid one; blank lines are skipped."""
    tasks, errors = [], []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            tasks.append(
                codec.decode(TaskSubmitted, line.encode(), content_type=codec.Encoding.JSON)
            )
        except InvalidMessageError as exc:
            errors.append(f"{source}:{lineno}: {exc.reason}")
    return tasks, errors


async def submit_tasks(
    js: JetStreamContext,
    names: RunNames,
    tasks: list[TaskSubmitted],
    *,
    window: int = 64,
    progress: bool | None = None,
) -> SubmitReport:
    """Publish ``tasks``, ``window`` at a time, each de-duplicated by its ``task_id``.

    ``progress=None`` shows a bar only on a terminal.
    """
    await run_stream_info(js, names, names.tasks_stream)
    report = SubmitReport()
    disable = None if progress is None else not progress
    with tqdm(total=len(tasks), unit="task", desc="submit", disable=disable) as bar:
        for start in range(0, len(tasks), window):
            chunk = tasks[start : start + window]
            try:
                acks = await asyncio.gather(
                    *(
                        js.publish(
                            names.tasks, codec.encode(t), headers=codec.headers(msg_id=t.task_id)
                        )
                        for t in chunk
                    )
                )
            except NatsError as exc:
                raise BrokerError(
                    f"publishing to {names.tasks} failed after {report.published} tasks: "
                    f"{type(exc).__name__}: {exc}; submitting again is safe (ids de-duplicate)"
                ) from exc
            for ack in acks:
                if ack.duplicate:
                    report.duplicates += 1
                else:
                    report.published += 1
            bar.update(len(chunk))
    log.debug(  # the CLI prints its own line; the run's task feed would flood the console
        kv(
            "tasks_submitted",
            run=names.run,
            published=report.published,
            duplicates=report.duplicates,
        )
    )
    return report
