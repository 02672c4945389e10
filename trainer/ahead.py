"""The trainer's ``overlap`` (``trainer.config.TrainerConfig.overlap``): a step computed ahead, as
its groups complete, while the trainer would wait for its last groups. A part of ``Trainer``
(``trainer.service``), kept apart: the trainer's loop calls ``_ahead_turn`` instead of taking a
whole step when ``overlap`` is set; the rest (planning, training on the ranks, settling a step)
is the trainer's own.

A turn computes, in one pass, the oldest complete groups there is room for beside those computed
and those reserved for the earlier admitted tasks the step must take (``AdmissionOrder.due``:
asking starts no wait): every complete group that waited while the last pass ran (or while the
trainer was lent) costs one forward and backward, not one each. It commits once a step's groups
are computed, and only when nothing is left to compute waits for those tasks (``OrderWait``,
bounded by ``order_wait_s``). A computed group stays in its step. A step computed ahead belongs to
one formation of the trainer group: the check is made under the step lock, and a new formation
computes it again.
"""

import asyncio

from broker.messages import SampleReady
from trainer.batcher import Batcher, StepAhead
from trainer.config import TrainerConfig
from trainer.metrics import AHEAD, AHEAD_PASSES
from trainer.ranks import RankGroup
from trainer.waits import OrderWait


class AheadSteps:
    """``Trainer``'s overlap turns. Of the trainer they use its state below and its
    ``_busy``, ``_plan``, ``_skip``, ``_train`` and ``_settle``."""

    _config: TrainerConfig
    _batcher: Batcher
    _ranks: RankGroup
    _order_wait: OrderWait
    _formation: int
    _ahead: StepAhead
    version: int

    async def _ahead_turn(self, stop: asyncio.Event) -> bool:
        """``overlap``: compute the next groups or commit a computed step (checked again once
        the group cannot re-form meanwhile), else wait for the earlier tasks the step must take
        (bounded); False: nothing to do until a sample comes."""
        gps = self._config.groups_per_step
        if self._ahead.trained >= gps or self._room():
            async with self._busy():
                if self._ahead.formation != self._formation:  # another formation's gradients
                    ahead, self._ahead = self._ahead, self._afresh()
                    self._batcher.restore(ahead.groups)
                    await asyncio.to_thread(self._ranks.discard)
                elif self._ahead.trained >= gps:
                    await self._step_ahead()
                elif room := self._room():
                    await self._compute(self._batcher.take(room))
            return True
        if await self._order_wait.wait(self._batcher, self.version, stop, self._complete):
            return True
        return self._room() > 0  # tasks given up: room again

    @property
    def _complete(self) -> int:
        """Complete groups for the next step: those computed ahead and those in the batcher."""
        return self._ahead.trained + self._batcher.complete_groups

    def _room(self) -> int:
        """The complete groups the next pass computes: as many as wait, up to the room beside
        those computed and those reserved for the earlier admitted tasks the step must take."""
        reserved = self._order_wait.due(self._batcher, self.version)
        room = self._config.groups_per_step - self._ahead.trained - len(reserved)
        return max(0, min(room, self._batcher.complete_groups))

    async def _compute(self, groups: list[list[SampleReady]]) -> None:
        """``overlap``: more groups of the step computed ahead, in one pass (when all of them
        are dropped whole, they are settled at once, as a step of their own)."""
        ahead = self._ahead
        items, dropped = self._plan(groups)
        if not items:
            await self._skip([s.sample_id for g in groups for s in g], dropped)
            return
        ahead.add(groups, items, dropped)
        if done := await self._train(ahead.groups, lambda: self._ranks.accumulate(items)):
            ahead.seconds += done[1]
            AHEAD.set(ahead.trained)
            AHEAD_PASSES.observe(len(groups))
        else:
            self._ahead = self._afresh()

    def _afresh(self) -> StepAhead:
        """No step computed ahead (yet) in this formation."""
        AHEAD.set(0)
        return StepAhead(self._formation)

    async def _step_ahead(self) -> None:
        """``overlap``: commit the step computed ahead."""
        ahead, self._ahead = self._ahead, self._afresh()
        if done := await self._train(ahead.groups, lambda: self._ranks.commit(self.version)):
            stats, seconds = done
            dropped = tuple(ahead.dropped)
            await self._settle(ahead.consumed, dropped, ahead.items, stats, ahead.seconds + seconds)
