"""One request's choices as they run: each choice is a task that puts ``Event``s on the
request's queue; the response reads them in arrival order (streaming) or all at once."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from broker.messages import SamplingParams, ToolCall
from rollout.exceptions import RolloutError


@dataclass(frozen=True)
class Event:
    """Part of one choice's output; the last one has ``finish_reason`` or ``error``."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    completion_tokens: int = 0
    error: RolloutError | None = None


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    params: SamplingParams


@dataclass
class Run:
    """The choice tasks of one request and the events they put."""

    n: int
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    started: list[asyncio.Future[None]] = field(default_factory=list)

    async def stream(self) -> AsyncIterator[Event]:
        """Events as they come, until every choice has put its last one. Leaving early
        cancels the choices that still run."""
        remaining = self.n
        try:
            while remaining:
                event = await self.events.get()
                if event.finish_reason is not None or event.error is not None:
                    remaining -= 1
                yield event
        finally:
            self.cancel()

    async def collect(self) -> list[list[Event]]:
        """Every choice's events, in order; raises the first error."""
        per_choice: list[list[Event]] = [[] for _ in range(self.n)]
        async for event in self.stream():
            if event.error is not None:
                raise event.error
            per_choice[event.index].append(event)
        return per_choice

    def cancel(self) -> None:
        # Not awaited: a cancelled request may not wait; each task closes its own call.
        for task in self.tasks:
            task.cancel()
