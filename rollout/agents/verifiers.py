"""Verifiers: is an attempt's final answer right? Named by ``TaskSubmitted.reward.verifier``.

Pure functions of ``(answer, reference)``. ``bind`` checks a task's reward spec once, when the
task arrives, so a task that no verifier can score is refused before any agent runs.
"""

import re
from collections.abc import Callable
from decimal import Decimal

from broker.messages import RewardSpec
from rollout.agents.exceptions import InvalidTaskError

Verifier = Callable[[str, str], bool]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def exact_match(answer: str, reference: str) -> bool:
    """The answer, stripped, equals the reference, stripped."""
    return answer.strip() == reference.strip()


def first_number(text: str) -> Decimal | None:
    """The first number in ``text``, if any."""
    found = _NUMBER.search(text)
    return None if found is None else Decimal(found.group())


def number(answer: str, reference: str) -> bool:
    """The first number in the answer equals the reference number (``5.0`` equals ``5``)."""
    found = first_number(answer)
    return found is not None and found == Decimal(reference.strip())


def last_number(answer: str, reference: str) -> bool:
    """The last number in the answer equals the reference number: the result of a worked
    answer (``3+4=7``, ``The answer is 7.``)."""
    found = _NUMBER.findall(answer)
    return bool(found) and Decimal(found[-1]) == Decimal(reference.strip())


VERIFIERS: dict[str, Verifier] = {
    "exact_match": exact_match,
    "number": number,
    "last_number": last_number,
}


def bind(spec: RewardSpec) -> Callable[[str], bool]:
    """The spec's verifier with its reference filled in; ``InvalidTaskError`` saying why when
    the verifier is unknown or the reference does not suit it."""
    verifier = VERIFIERS.get(spec.verifier)
    if verifier is None:
        known = ", ".join(sorted(VERIFIERS))
        raise InvalidTaskError(
            f"reward.verifier: unknown verifier {spec.verifier!r} (known: {known})"
        )
    reference = spec.reference
    if reference is None:
        raise InvalidTaskError(f"reward.reference: verifier {spec.verifier!r} needs a reference")
    if verifier in (number, last_number) and not _NUMBER.fullmatch(reference.strip()):
        raise InvalidTaskError(
            f"reward.reference: verifier {spec.verifier!r} needs a number such as -12 or 3.5, "
            f"got {reference[:60]!r}"
        )
    return lambda answer: verifier(answer, reference)


def binary_reward(correct: bool, turns: int) -> float:
    """1.0 for a right answer, else 0.0, however many turns it took."""
    return 1.0 if correct else 0.0
