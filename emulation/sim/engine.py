"""The event loop and a continuous-batching engine, as a fluid model.

Assumptions:

- an engine decodes its resident generations together: each decode iteration over ``B`` of them
  takes ``EngineCost.iteration_s(B)`` and advances each by one token. Tokens are treated as
  continuous between events (a generation finishes at the exact fraction of an iteration), which
  is exact while ``B`` is constant and off by under one iteration per event otherwise;
- a generation placed with a retained prefix (after an abort) first re-prefills it: the engine
  stalls ``EngineCost.prefill_s(prefix)`` (busy time), then decodes;
- a weight load stalls the engine ``weight_sync_s`` (not busy); resident generations keep their
  KV and continue on the new weights (their later tokens are of the new version);
- a turn's context is in the engine's prefix cache: only a re-placed (aborted) generation pays
  a prefill;
- with a KV budget (``EngineCost.kv_tokens``) a resident generation holds its whole length (a
  scheduler that knows it: no preemption), and the engine takes none while its residents hold
  the budget or more; longer generations mean smaller batches.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from emulation.workload import EngineCost


class Loop:
    """A discrete-event loop: callbacks at simulated times, ties in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.stopped = False

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, max_time: float) -> None:
        """Run callbacks until ``stop()``, no events are left, or ``max_time``."""
        while self._heap and not self.stopped:
            t, _, fn, args = heapq.heappop(self._heap)
            if t > max_time:
                self.now = max_time
                return
            self.now = t
            fn(*args)

    def stop(self) -> None:
        self.stopped = True


@dataclass(eq=False)
class Generation:
    """One turn of one sample: ``length`` tokens to generate, ``done`` of them so far."""

    sample: Any
    length: int
    done: float = 0.0
    engine: Engine | None = None
    start_p: float = 0.0
    finish_p: float = 0.0
    placed: int = 0  # placement order on its engine (ties broken by it: runs are reproducible)

    @property
    def left(self) -> float:
        return self.length - self.done


@dataclass(eq=False)
class Engine:
    """One device's engine. ``serving``: the router may place generations on it."""

    eid: int
    cost: EngineCost
    loop: Loop
    on_finish: Callable[[Engine, list[Generation]], None]
    version: int = 0
    serving: bool = False
    residents: set[Generation] = field(default_factory=set)
    kv: int = 0
    """KV tokens its residents hold (their lengths)."""
    busy_s: float = 0.0
    sync_s: float = 0.0
    batch_s: float = 0.0
    """Integral of the resident count over decoding time (mean batch = batch_s / decode time)."""
    _heap: list[tuple[float, int, Generation]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)
    _p: float = 0.0  # tokens each resident generation has advanced since the start
    _t: float = 0.0  # when _p was brought up to date
    _stall_until: float = 0.0
    _token: int = 0  # invalidates scheduled finish events

    @property
    def batch(self) -> int:
        return len(self.residents)

    @property
    def free(self) -> int:
        if self.kv >= self.cost.kv_tokens > 0:
            return 0
        return self.cost.max_batch - len(self.residents)

    def _advance(self) -> None:
        now = self.loop.now
        start = max(self._t, self._stall_until)
        if self.residents and now > start:
            dt = now - start
            self._p += dt / self.cost.iteration_s(len(self.residents))
            self.busy_s += dt
            self.batch_s += dt * len(self.residents)
        self._t = now

    def _schedule(self) -> None:
        self._token += 1
        while self._heap and self._heap[0][2] not in self.residents:
            heapq.heappop(self._heap)
        if not self._heap:
            return
        left = max(0.0, self._heap[0][0] - self._p)
        start = max(self.loop.now, self._stall_until)
        t = start + left * self.cost.iteration_s(len(self.residents))
        self.loop.at(t, self._finish, self._token)

    def _finish(self, token: int) -> None:
        if token != self._token:
            return
        self._advance()
        done = []
        while self._heap and self._heap[0][0] <= self._p + 1e-6:
            _, _, gen = heapq.heappop(self._heap)
            if gen in self.residents:
                self.residents.discard(gen)
                self.kv -= gen.length
                gen.done = gen.length
                gen.engine = None
                done.append(gen)
        self._schedule()
        if done:
            self.on_finish(self, done)

    def add(self, gen: Generation, prefill_tokens: int) -> None:
        """Place ``gen``; it first re-prefills ``prefill_tokens`` (a retained prefix)."""
        self._advance()
        if prefill_tokens:
            stall = self.cost.prefill_s(prefill_tokens)
            self._stall_until = max(self._stall_until, self.loop.now) + stall
            self.busy_s += stall
        gen.engine = self
        gen.start_p = self._p
        gen.finish_p = self._p + gen.left
        gen.placed = next(self._order)
        self.residents.add(gen)
        self.kv += gen.length
        heapq.heappush(self._heap, (gen.finish_p, gen.placed, gen))
        self._schedule()

    def abort_all(self) -> list[Generation]:
        """Take every resident generation off, its progress kept in ``done``."""
        self._advance()
        out = sorted(self.residents, key=lambda g: (g.finish_p, g.placed))
        for gen in out:
            gen.done += min(gen.left, max(0.0, self._p - gen.start_p))
            gen.engine = None
        self.residents.clear()
        self.kv = 0
        self._heap.clear()
        self._schedule()
        return out

    def stall(self, seconds: float) -> None:
        """Pause decoding for ``seconds`` (a weight load): not busy time."""
        self._advance()
        self._stall_until = max(self._stall_until, self.loop.now) + seconds
        self.sync_s += seconds
        self._schedule()
