"""The simulated cluster's lending (``emulation.sim.cluster.Cluster``, kept apart): once per
scheduler tick the scheduler's own ``tagsched.lending.trainer_roles`` decides, fed the measured
switch times and the rate of groups published, whether each trainer device is lent to rollout
or reclaimed; a switch takes ``switch.warm_s``, and a reclaimed device's generations continue on
other engines (after a re-prefill of their prefix, or from the start)."""

from broker.messages import Role
from emulation.sim.order import Order
from tagsched.lending import trainer_roles


class Lending:
    """``Cluster``'s lending turns; they use its state and its ``_admission``, ``_serve``,
    ``_submit``, ``_dispatch`` and ``_maybe_train``."""

    def _tick(self) -> None:
        rate = self.rate.update(self.loop.now, self.published)
        state = self._admission()
        desired = trainer_roles(
            self.placement.assignment,
            self.policy,
            self.lent,
            missing_groups=state.missing_groups(self.w.groups_per_step),
            groups_per_s=rate,
            computes_ahead=self.batches.order is Order.OVERLAP,
        )
        for wid, (role, _) in desired.items():
            if self.role[wid] is role or wid in self.switching:
                continue
            if role is Role.ROLLOUT and not (self.training or self.computing):
                self._lend(wid)
            elif role is Role.TRAIN:
                self._reclaim(wid)
        self.loop.after(self.config.tick_s, self._tick)

    def _lend(self, wid: str) -> None:
        self.switching.add(wid)
        self.m.lends += 1
        self.loop.after(self.w.switch.warm_s, self._lent, wid)

    def _lent(self, wid: str) -> None:
        self.switching.discard(wid)
        self.role[wid] = Role.ROLLOUT
        self.lent.add(wid)
        self.policy.lends.append(self.w.switch.warm_s)
        self.engines[wid].version = self.version  # the trainer's own weights
        self.lent_since_step = True
        self._serve(wid)

    def _reclaim(self, wid: str) -> None:
        e = self.engines[wid]
        e.serving = False
        self.switching.add(wid)
        self.m.reclaims += 1
        for gen in reversed(e.abort_all()):
            if not self.w.switch.reprefill:
                self.m.lost += gen.done
                gen.done = 0.0
            self._submit(gen, front=True)
        self._dispatch()
        self.loop.after(self.w.switch.warm_s, self._reclaimed, wid)

    def _reclaimed(self, wid: str) -> None:
        self.switching.discard(wid)
        self.role[wid] = Role.TRAIN
        self.lent.discard(wid)
        self.policy.reclaims.append(self.w.switch.warm_s)
        self._maybe_train()
