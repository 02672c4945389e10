"""The policy a local run starts from: the base model, warm-started (``trainer.warmstart``,
cached) on the demonstrations of the configured env, when it has any."""

import hashlib
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path

from common.models import load_tokenizer, resolve_model
from rollout.agents import arithmetic, calculator, guess
from rollout.gateway.tools import chatml_tools_system, load_tool_template
from seamlessflow.config import RunConfig
from trainer.warmstart import warm_start


def prepare_model(config: RunConfig) -> Path:
    """The policy's starting folder: the base model, warm-started on the task when configured."""
    base = resolve_model(config.model.name)
    warm = WARM_STARTS.get(config.tasks.env)
    return base if warm is None else warm(base, config)


def _arithmetic_warm_start(base: Path, config: RunConfig) -> Path:
    """``base`` warm-started on sums of operands up to ``tasks.max_operand``."""
    max_operand = config.tasks.max_operand

    def demonstration(rng: random.Random) -> tuple[list[dict[str, str]], str]:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        return [{"role": "user", "content": arithmetic.question(a, b)}], arithmetic.answer(a, b)

    return warm_start(base, config.model.warm_start, demonstration, f"arithmetic-{max_operand}")


def _calculator_warm_start(base: Path, config: RunConfig) -> Path:
    """``base`` warm-started on calls of the calculator and answers from its results, in the
    prompts the gateway renders with the model's tool template (or its own template)."""
    template = load_tool_template(config.model.tool_template)
    system = chatml_tools_system(load_tokenizer(base), [calculator.TOOL], template)
    return warm_start(
        base,
        config.model.warm_start,
        partial(calculator.demonstration, system=system),
        f"calculator-{hashlib.sha256(system.encode()).hexdigest()[:12]}",  # the tools block's
    )


def _guess_warm_start(base: Path, config: RunConfig) -> Path:
    """``base`` warm-started on games in progress over ``[1, tasks.max_number]``."""
    high = config.tasks.max_number
    return warm_start(
        base,
        config.model.warm_start,
        partial(guess.demonstration, high=high),
        f"guess-range-{high}",
    )


WARM_STARTS: dict[str, Callable[[Path, RunConfig], Path]] = {
    arithmetic.ENV: _arithmetic_warm_start,
    calculator.ENV: _calculator_warm_start,
    guess.ENV: _guess_warm_start,
}
"""The envs with a warm start; any other starts from the base model."""
