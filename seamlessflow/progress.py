"""What a run is doing, read from the data plane alone: rewards, tokens, versions, staleness,
tool use.

``RunStats`` is the pure core: fed the run's own messages (samples, call records, weight events,
session ends) it keeps the reward (and, for agents that count them in their ``SessionEnded``
metrics, the tool calls) per policy version and gives the live progress line and the summary. The
launcher feeds it from core NATS subscriptions; nothing here reads another process's internals.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from broker.messages import CallRecorded, SampleReady, SessionEnded, WeightsPublished
from common.staleness import lag

TOKENS_WINDOW_S = 10.0
"""Tokens per second are averaged over this window."""
REWARD_WINDOW = 64
"""The progress line's reward mean is over this many latest sessions."""
CALL_SPANS = 100_000
"""The summary's engine costs (``seamlessflow.costs.run_costs``) are read from this many latest
calls."""
TOOL_CALLS = "tool_calls"
"""The ``SessionEnded`` metric that counts a session's tool calls (``rollout.agents.calculator``,
the framework examples)."""


@dataclass(frozen=True)
class SessionPoint:
    """One scored session: when its sample arrived, the policy version that produced it (the
    newest version among its generated tokens: the reward curve's), its lag behind the trainer's
    version then (``common.staleness.lag``: its oldest generated token's, as the trainer
    counts it), its reward, and how many versions produced its generated tokens (more than one:
    weight updates landed while the session ran)."""

    at: float
    policy_version: int
    lag: int
    reward: float
    versions: int = 1
    tool_calls: float | None = None
    """The session's tool calls, when its agent counted them."""


@dataclass
class RunStats:
    started_at: float = field(default_factory=time.time)
    version: int = 0
    sessions: list[SessionPoint] = field(default_factory=list)
    samples: int = 0
    generated_tokens: int = 0
    calls: int = 0
    _seen_sessions: set[str] = field(default_factory=set)
    _tool_calls: dict[str, float] = field(default_factory=dict)
    """Tool calls of ended sessions whose sample has not arrived yet."""
    _tokens: deque[tuple[float, int]] = field(default_factory=deque)
    call_spans: deque[tuple[str, float, float, int]] = field(
        default_factory=lambda: deque(maxlen=CALL_SPANS)
    )
    """``(session_id, started_at, finished_at, output tokens)`` of the latest calls."""
    versions_at: list[tuple[int, float]] = field(default_factory=list)
    """``(version, when it was first announced)``."""
    admitted_at: dict[str, float] = field(default_factory=dict)
    """When each session's task was admitted (its samples' ``Admitted.at``), by session."""

    def on_weights(self, event: WeightsPublished, now: float) -> None:
        if event.version > self.version:
            self.versions_at.append((event.version, now))
        self.version = max(self.version, event.version)

    def on_call(self, call: CallRecorded, now: float) -> None:
        self.calls += 1
        self.generated_tokens += len(call.output_ids)
        self._tokens.append((now, len(call.output_ids)))
        spans = (call.session_id, call.started_at, call.finished_at, len(call.output_ids))
        self.call_spans.append(spans)

    def on_end(self, ended: SessionEnded, now: float) -> None:
        if TOOL_CALLS in ended.metrics:  # its sample comes after (the trajectory manager's)
            self._tool_calls[ended.session_id] = ended.metrics[TOOL_CALLS]

    def on_sample(self, sample: SampleReady, now: float) -> None:
        self.samples += 1
        if sample.session_id in self._seen_sessions:
            return  # a session with several leaves is scored once
        self._seen_sessions.add(sample.session_id)
        if sample.admitted is not None and sample.admitted.at is not None:
            self.admitted_at[sample.session_id] = sample.admitted.at
        versions = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
        behind = lag(self.version, versions)
        tools = self._tool_calls.pop(sample.session_id, None)
        self.sessions.append(
            SessionPoint(
                now,
                max(versions, default=self.version),
                behind,
                sample.reward,
                len(set(versions)),
                tools,
            )
        )

    def tokens_per_second(self, now: float) -> float:
        while self._tokens and self._tokens[0][0] < now - TOKENS_WINDOW_S:
            self._tokens.popleft()
        span = min(TOKENS_WINDOW_S, max(now - self.started_at, 1e-9))
        return sum(n for _, n in self._tokens) / span

    def reward_mean(self, last: int = REWARD_WINDOW) -> float | None:
        recent = self.sessions[-last:]
        return sum(p.reward for p in recent) / len(recent) if recent else None

    def staleness(self, last: int = REWARD_WINDOW) -> float | None:
        """Mean lag of recent sessions behind the trainer."""
        recent = self.sessions[-last:]
        if not recent:
            return None
        return sum(p.lag for p in recent) / len(recent)

    def tool_calls_mean(self, last: int = REWARD_WINDOW) -> float | None:
        """Mean tool calls of recent sessions that counted them."""
        counted = [p.tool_calls for p in self.sessions[-last:] if p.tool_calls is not None]
        return sum(counted) / len(counted) if counted else None

    def line(self, now: float) -> str:
        reward, stale, tools = self.reward_mean(), self.staleness(), self.tool_calls_mean()
        return (
            f"step {self.version:4d} | reward {_fmt(reward)} (last {REWARD_WINDOW}) | "
            + ("" if tools is None else f"tool calls {tools:.2f} | ")
            + f"{self.tokens_per_second(now):6.1f} tok/s | version {self.version} | "
            f"staleness {_fmt(stale, 1)} | sessions {len(self.sessions)} | "
            f"{now - self.started_at:5.0f}s"
        )

    def curve(self) -> list[tuple[int, float, int]]:
        """``(policy version, mean reward, sessions)`` per version that produced sessions."""
        by_version: dict[int, list[float]] = {}
        for p in self.sessions:
            by_version.setdefault(p.policy_version, []).append(p.reward)
        return [(v, sum(r) / len(r), len(r)) for v, r in sorted(by_version.items())]

    def tool_curve(self) -> list[tuple[int, float, int]]:
        """``(policy version, mean tool calls per session, sessions)`` per version whose
        sessions counted their tool calls."""
        by_version: dict[int, list[float]] = {}
        for p in self.sessions:
            if p.tool_calls is not None:
                by_version.setdefault(p.policy_version, []).append(p.tool_calls)
        return [(v, sum(c) / len(c), len(c)) for v, c in sorted(by_version.items())]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "  -  " if value is None else f"{value:.{digits}f}"
