"""How many more requests a rollout worker takes from the shared queue (pure): up to
``max_waiting`` not yet started while its engine starts what it is given, one while it does not.

A request a worker holds that its engine has not started (no token out yet) waits in that
engine's queue, where no other worker can take it. ``max_waiting`` of them let an engine with
room fill in a few of its steps (the burst a step's end admits, a worker just lent to rollout).
Once the engine is full (its KV cache, its batch), each of them waits for one of this engine's
requests to end, while another engine may have room: a trainer worker lent to rollout found the
backlog held by the rollout workers, four each (docs/performance.md, "A full engine holds one
request").

The engine counts as full when a request waited longer than ``FULL_AFTER_STEPS`` of the
engine's own steps for its first token: one waiting now, or one it started. Its step is measured,
not configured: the seconds per token of the requests it decodes (a moving average). A late
start brings the worker's allowance of requests not started down to one; each start within that
many steps raises it by one, up to ``max_waiting`` (a full engine's one free place is not room
for four).
"""

from dataclasses import dataclass, field

FULL_AFTER_STEPS = 4.0
"""A first token later than this many of the engine's steps: the engine had no room for it."""
STEP_SMOOTHING = 0.2
"""Weight of each new measure of the engine's step in its moving average."""


@dataclass
class Intake:
    max_waiting: int
    step_s: float | None = None
    """The engine's seconds per token of a decoding request (None until measured)."""
    allowance: int = field(init=False)
    """Requests not started the worker may hold now: ``max_waiting`` until a start is late."""

    def __post_init__(self) -> None:
        self.allowance = self.max_waiting

    def decoded(self, tokens: int, seconds: float) -> None:
        """``tokens`` more of a started request came ``seconds`` after its tokens before."""
        if tokens <= 0 or seconds <= 0:
            return
        step = seconds / tokens
        self.step_s = (
            step if self.step_s is None else self.step_s + STEP_SMOOTHING * (step - self.step_s)
        )

    def started(self, waited_s: float) -> None:
        """The engine started a request ``waited_s`` after it was handed to it."""
        if self._late(waited_s):
            self.allowance = 1
        else:
            self.allowance = min(self.max_waiting, self.allowance + 1)

    def limited(self, oldest_waited_s: float) -> bool:
        """Whether the worker holds fewer than ``max_waiting`` for a full engine, the oldest
        request it has not started having waited ``oldest_waited_s``."""
        return self.allowance < self.max_waiting or self._late(oldest_waited_s)

    def room(self, waiting: int, oldest_waited_s: float) -> int:
        """How many more to take, holding ``waiting`` not started, the oldest for
        ``oldest_waited_s``."""
        allowance = 1 if self._late(oldest_waited_s) else self.allowance
        return allowance - waiting

    def _late(self, waited_s: float) -> bool:
        return self.step_s is not None and waited_s > FULL_AFTER_STEPS * self.step_s
