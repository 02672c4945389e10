"""Admission order (``trainer.order``): which earlier admitted tasks a step waits for."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

import trainer.waits
from broker.messages import Admitted, SampleReady
from trainer.batcher import Batcher, Outcome, plan_step
from trainer.config import TrainerConfig
from trainer.order import AdmissionOrder
from trainer.waits import OrderWait


def stamp(ticket: int, version: int = 0) -> Admitted:
    return Admitted(ticket=ticket, version=version)


def test_only_a_missing_ticket_the_step_would_put_past_the_bound_blocks():
    order = AdmissionOrder(wait_s=60)
    order.completed(stamp(1, version=4))
    order.completed(stamp(3, version=5))  # ticket 2 is missing: at version 4 or later
    assert order.blocking(version=5, max_staleness=2, now=0) == []  # a step to 6 leaves it lag 2
    assert order.blocking(version=6, max_staleness=2, now=0) == [2]  # to 7: lag 3
    order.completed(stamp(2, version=4))
    assert order.blocking(version=9, max_staleness=2, now=0) == []


def test_a_ticket_seen_but_not_complete_blocks_at_its_own_version():
    order = AdmissionOrder(wait_s=60)
    order.completed(stamp(1, version=0))
    order.seen(stamp(2, version=3))  # a sample came; its group is still filling
    order.completed(stamp(3, version=3))
    assert order.blocking(version=4, max_staleness=2, now=0) == []
    assert order.blocking(version=5, max_staleness=2, now=0) == [2]


def test_a_ticket_not_seen_yet_is_at_the_version_a_later_stamp_gives_it():
    """Tickets 1-2 at version 0, 3-5 at version 1 (the first at 1: ticket 3). Ticket 5's group
    completes first; 2, 3 and 4 have sent nothing yet. A step at version 2 (bound 2) must take
    ticket 2 (version 0: lag 3 after it), not 3 or 4: ticket 5's stamp says they are at
    version 1. Without ``since`` (an older scheduler) 3 and 4 count at ticket 1's version 0
    and the step waits for them too."""
    for since, due in ((3, [2]), (None, [2, 3, 4])):
        order = AdmissionOrder(wait_s=60)
        order.completed(stamp(1, version=0))
        order.completed(Admitted(ticket=5, version=1, since=since))
        assert order.blocking(version=2, max_staleness=2, now=0) == due
        assert order.blocking(version=3, max_staleness=2, now=0) == [2, 3, 4]


def test_a_stamp_whose_since_is_above_its_ticket_is_refused():
    with pytest.raises(ValidationError, match="since 6 is above the ticket 5"):
        Admitted(ticket=5, version=1, since=6)


def test_a_ticket_waited_for_past_wait_s_is_given_up_and_counted():
    order = AdmissionOrder(wait_s=10)
    order.completed(stamp(1))
    order.completed(stamp(4))
    assert order.blocking(version=5, max_staleness=0, now=100) == [2, 3]
    assert order.deadline() == 110
    assert order.blocking(version=5, max_staleness=0, now=109.9) == [2, 3]
    assert order.blocking(version=5, max_staleness=0, now=110) == []
    assert order.given_up == 2 and order.deadline() is None
    order.completed(stamp(2))  # late: nothing waits for it any more
    order.completed(stamp(6))
    assert order.blocking(version=5, max_staleness=0, now=111) == [5]


def test_a_resumed_trainer_does_not_wait_for_tickets_before_the_first_it_sees():
    order = AdmissionOrder(wait_s=60, from_start=lambda: False)
    order.completed(stamp(7))  # a trainer resumed mid-run
    assert order.blocking(version=50, max_staleness=0, now=0) == []
    order.completed(stamp(3))  # admitted before it started, arriving late
    assert order.blocking(version=50, max_staleness=0, now=0) == []
    fresh = AdmissionOrder(wait_s=60)  # one that starts the run waits from ticket 1
    fresh.completed(stamp(7))
    assert fresh.blocking(version=50, max_staleness=0, now=0) == [1, 2, 3, 4, 5, 6]


def group(ticket: int, version: int) -> list[SampleReady]:
    return [
        SampleReady(
            sample_id=f"t{ticket}",
            session_id=f"t{ticket}",
            group_id=f"t{ticket}",
            token_ids=[1, 2, 3],
            loss_mask=[0, 1, 1],
            logprobs=[0.0, -1.0, -1.0],
            versions=[-1, version, version],
            reward=0.0,
            on_policy=True,
            admitted=stamp(ticket, version),
        )
    ]


def run(ordered: bool) -> dict[int, Outcome]:
    """A long group overtaken, as ``bench/pipeline.py`` saw it, one group per step and
    ``max_staleness`` 1 (admission: 2 groups outstanding). Ticket 1 starts at version 0 and
    finishes last; tickets 2 and 3 are short, each admitted as the one before it is trained. A
    step taken when the trainer does not wait is the one the old trainer took."""
    config = TrainerConfig(groups_per_step=1, max_staleness=1)
    batcher = Batcher(AdmissionOrder(wait_s=60))
    outcomes: dict[int, Outcome] = {}
    version = 0
    arrivals = [group(2, 0), group(3, 1), group(1, 0)]
    while arrivals or batcher.complete_groups:
        blocked = ordered and batcher.order.blocking(version, config.max_staleness, now=0)
        if batcher.complete_groups and not blocked:
            (taken,) = batcher.take(1)
            _, out, _ = plan_step([taken], version, config)
            outcomes[taken[0].admitted.ticket] = out[taken[0].sample_id]
            version += 1
        else:
            for sample in arrivals.pop(0):
                batcher.add(sample)
    return outcomes


def test_a_long_group_is_dropped_in_completion_order_and_trained_in_admission_order():
    assert run(ordered=False)[1] is Outcome.STALE_DROPPED
    assert set(run(ordered=True).values()) == {Outcome.TRAINED}


def test_the_tasks_a_step_waits_for_are_told_until_they_come_or_are_given_up(monkeypatch):
    """``OrderWait.refresh`` (as samples come, and while the trainer is lent) tells the trainer's
    registry entry how many earlier tasks its step waits for once a batch's worth is complete,
    so the scheduler lends a colocated trainer's worker to generate them. (Without it the worker
    stayed in ``train`` with a batch "ready", nothing generated the task, and the wait ran out:
    60 s, then its group dropped as stale.) Once the task comes, or is given up, it tells 0."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(trainer.waits, "time", SimpleNamespace(monotonic=lambda: clock.now))
    config = TrainerConfig(groups_per_step=2, max_staleness=0, order_wait_s=10)
    for arrives in (True, False):
        batcher, wait, told = Batcher(AdmissionOrder(wait_s=10)), OrderWait(config, None), []
        wait.on_waiting = told.append
        for ticket in (2, 3):  # ticket 1, admitted first, is still generating
            batcher.add(group(ticket, 0)[0])
            wait.refresh(batcher, version=1, complete=batcher.complete_groups)
        assert told == [1]  # told once a batch's worth (2 groups) is complete
        if arrives:
            batcher.add(group(1, 0)[0])
        else:
            clock.now += 10  # order_wait_s: given up
        wait.refresh(batcher, version=1, complete=batcher.complete_groups)
        assert told == [1, 0] and batcher.order.given_up == (0 if arrives else 1)
