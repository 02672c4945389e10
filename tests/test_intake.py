"""``rollout.intake``: how many requests a rollout worker takes, from how its engine starts them."""

from rollout.intake import FULL_AFTER_STEPS, STEP_SMOOTHING, Intake

STEP = 0.02
LATE = (FULL_AFTER_STEPS + 1) * STEP


def measured(max_waiting: int = 4) -> Intake:
    intake = Intake(max_waiting)
    intake.decoded(10, 10 * STEP)
    return intake


def test_an_engine_that_starts_what_it_is_given_takes_up_to_max_waiting():
    intake = measured()
    intake.started(STEP)
    assert intake.room(waiting=0, oldest_waited_s=0.0) == 4
    assert intake.room(waiting=3, oldest_waited_s=STEP) == 1
    assert not intake.limited(STEP)


def test_a_request_waiting_several_steps_limits_the_worker_to_one_not_started():
    intake = measured()
    assert intake.limited(LATE) and not intake.limited(STEP)
    assert intake.room(waiting=1, oldest_waited_s=LATE) == 0
    assert intake.room(waiting=0, oldest_waited_s=0.0) == 4  # none waits now, none started late


def test_after_a_late_start_each_start_in_time_allows_one_more():
    intake = measured()
    intake.started(LATE)
    assert intake.room(waiting=0, oldest_waited_s=0.0) == 1 and intake.limited(0.0)
    rooms = []
    for _ in range(4):
        intake.started(STEP)
        rooms.append(intake.room(waiting=0, oldest_waited_s=0.0))
    assert rooms == [2, 3, 4, 4] and not intake.limited(0.0)
    intake.started(LATE)
    assert intake.room(waiting=0, oldest_waited_s=0.0) == 1


def test_nothing_is_late_before_the_engines_step_is_measured():
    intake = Intake(4)
    intake.started(30.0)
    assert intake.room(waiting=2, oldest_waited_s=30.0) == 2


def test_the_step_is_a_moving_average_of_seconds_per_token():
    intake = measured()
    intake.decoded(1, 1.0)  # one slow gap (a weight load) moves it, does not set it
    assert intake.step_s == STEP + STEP_SMOOTHING * (1.0 - STEP)
    intake.decoded(0, 1.0)  # a chunk without tokens says nothing
    intake.decoded(5, 0.0)
    assert intake.step_s == STEP + STEP_SMOOTHING * (1.0 - STEP)
