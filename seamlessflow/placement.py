"""Which CPUs the heavy processes of ``seamlessflow run`` get, and their torch threads; pure (the
caller passes the CPUs this process may use, ``os.sched_getaffinity(0)``).

With ``cpus.placement = "split"`` the trainer (all its ranks) and the rollout workers run on
disjoint CPU sets, so a training step and generation never compete for a core; each process
gets one torch thread per CPU of its set (the trainer's shared by its ranks); a machine with a
single CPU has nothing to split, and everything shares it. Workers share out
the rollout CPUs in contiguous slices; with more workers than rollout CPUs they take them in
turn. ``"none"`` sets no affinity: threads come from ``trainer.threads`` and ``rollout.threads``.
"""

from dataclasses import dataclass

from seamlessflow.config import CpusConfig, Placement, RolloutConfig
from seamlessflow.exceptions import PlacementError
from trainer.config import TrainerConfig


@dataclass(frozen=True)
class CpuSet:
    """Where one process runs: ``cpus`` (None: anywhere) with ``threads`` torch threads."""

    cpus: frozenset[int] | None
    threads: int


@dataclass(frozen=True)
class CpuPlan:
    trainer: CpuSet
    workers: list[CpuSet]


def place(
    cpus: CpusConfig, trainer: TrainerConfig, rollout: RolloutConfig, available: set[int]
) -> CpuPlan:
    """The CPU set and threads of the trainer and of each rollout worker. Without
    ``cpus.trainer``/``cpus.rollout`` the split is automatic: the first ``cpus.trainer_share``
    of ``available`` (at least one CPU, and one left) to the trainer, the rest to rollout; a
    single CPU is shared by all. Raises ``PlacementError`` for CPUs not in ``available`` or
    when the given sets leave none for rollout."""
    workers = rollout.workers
    if cpus.placement is Placement.NONE:
        return CpuPlan(
            CpuSet(None, trainer.threads or 1), [CpuSet(None, rollout.threads)] * workers
        )
    allowed = sorted(available)
    for key, given in (("cpus.trainer", cpus.trainer), ("cpus.rollout", cpus.rollout)):
        if missing := sorted(set(given) - available):
            raise PlacementError(
                f"{key} names CPUs {missing} that this machine does not have (this process may "
                f"use CPUs {_ranges(allowed)})"
            )
    if not cpus.trainer and not cpus.rollout and len(allowed) == 1:
        alone = CpuSet(frozenset(allowed), 1)  # nothing to split
        return CpuPlan(alone, [alone] * workers)
    trainer_cpus = cpus.trainer
    if not trainer_cpus:
        share = max(1, round(len(allowed) * cpus.trainer_share))
        trainer_cpus = allowed[: max(1, min(share, len(allowed) - 1))] if workers else allowed
    rollout_cpus = cpus.rollout or [c for c in allowed if c not in trainer_cpus]
    if workers and not rollout_cpus:
        raise PlacementError(
            f"no CPU left for the rollout workers: the trainer has {_ranges(trainer_cpus)} of "
            f"{_ranges(allowed)}; set cpus.rollout, fewer cpus.trainer, or cpus.placement = "
            "'none'"
        )
    ranks = trainer.world_size
    return CpuPlan(
        CpuSet(frozenset(trainer_cpus), max(1, len(trainer_cpus) // ranks)),
        [CpuSet(s, len(s)) for s in _share_out(rollout_cpus, workers)],
    )


def _share_out(cpus: list[int], parts: int) -> list[frozenset[int]]:
    if parts > len(cpus):
        return [frozenset({cpus[i % len(cpus)]}) for i in range(parts)]
    base, extra = divmod(len(cpus), parts) if parts else (0, 0)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(frozenset(cpus[start:end]))
        start = end
    return out


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
