"""Tasks from `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_'s procedural
generators, scored by each dataset's own ``score_answer``.

reasoning-gym (``pip install 'seamlessflow[reasoning-gym]'``) makes its questions in code from a
seed: nothing is downloaded. ``reasoning_gym_tasks`` turns ``size`` entries of one dataset into
``TaskSubmitted`` (env ``chat``: the built-in agent asks once; any configured agent works too)
whose ``reward.function`` is ``score`` below. A task carries what regenerates its entry (dataset
name, config, seed, size, index) in its metadata, so the runner scores it against exactly the
entry that was asked, with the dataset's own ``score_answer`` (partial credit included), on the
answer inside ``<answer>...</answer>`` when the reply has one, else on the whole reply.

The module is imported by the runner only for tasks that name ``score``; reasoning-gym itself is
imported on first use.
"""

import functools
import json
from typing import Any

from broker.messages import ChatMessage, RewardSpec, TaskSubmitted
from rollout.agents.rewards import Transcript

SCORE = "rollout.agents.reasoninggym:score"
"""The reward function the tasks name."""
DATASET, CONFIG, SEED, SIZE, INDEX = (
    "rg_dataset",
    "rg_config",
    "rg_seed",
    "rg_size",
    "rg_index",
)
"""Task metadata keys: what regenerates the entry."""
SYSTEM_PROMPT = "default"
"""The reasoning-gym system prompt the tasks start with (``reasoning_gym.utils.SYSTEM_PROMPTS``);
None: no system message."""


def reasoning_gym_tasks(
    name: str,
    *,
    size: int,
    seed: int,
    group_size: int = 1,
    prefix: str | None = None,
    system_prompt: str | None = SYSTEM_PROMPT,
    **config: Any,
) -> list[TaskSubmitted]:
    """Tasks ``<prefix>-<i>`` (default prefix: ``rg-<seed>``), one per entry of
    ``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)``; ``config`` must be
    JSON (it travels in the task)."""
    dataset = _dataset(name, json.dumps(config, sort_keys=True), seed, size)
    system = []
    if system_prompt is not None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        system = [ChatMessage(role="system", content=SYSTEM_PROMPTS[system_prompt])]
    prefix = prefix or f"rg-{seed}"
    metadata = {
        DATASET: name,
        CONFIG: json.dumps(config, sort_keys=True),
        SEED: str(seed),
        SIZE: str(size),
    }
    return [
        TaskSubmitted(
            task_id=f"{prefix}-{i}",
            messages=[*system, ChatMessage(role="user", content=entry["question"])],
            reward=RewardSpec(function=SCORE, reference=str(entry["answer"])),
            group_size=group_size,
            metadata={**metadata, INDEX: str(i)},
        )
        for i, entry in enumerate(dataset)
    ]


def score(transcript: Transcript, task: TaskSubmitted) -> float:
    """The dataset's ``score_answer`` of the attempt's answer against the task's entry."""
    from reasoning_gym.utils import extract_answer

    meta = task.metadata
    dataset = _dataset(meta[DATASET], meta[CONFIG], int(meta[SEED]), int(meta[SIZE]))
    entry = dataset[int(meta[INDEX])]
    answer = extract_answer(transcript.answer)
    if answer is None:
        answer = transcript.answer.strip()
    return float(dataset.score_answer(answer, entry))


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config: str, seed: int, size: int) -> Any:
    """The dataset, made once per process (entries are made from the seed on access)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config))
