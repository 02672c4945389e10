"""Write reasoning-gym tasks as JSONL for ``seamlessflow submit``: one ``TaskSubmitted`` a line.

    python examples/reasoning_gym/make_tasks.py chain_sum --size 256 --seed 0 --group-size 8 \
        --config '{"min_terms": 2, "max_terms": 3, "max_digits": 1}' > chain_sum.jsonl
    seamlessflow submit --nats nats://127.0.0.1:4222 --run rg chain_sum.jsonl

Each task names the reward function ``rollout.agents.reasoninggym:score``: the agent runner
scores every attempt with the dataset's own ``score_answer`` (nothing is downloaded: the
generators make their questions from the seed). Needs ``pip install 'seamlessflow[reasoning-gym]'``.
"""

import argparse
import json
import sys

from broker import codec
from rollout.agents.reasoninggym import reasoning_gym_tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("dataset", help="a reasoning-gym dataset name, e.g. chain_sum")
    parser.add_argument("--size", type=int, default=64, help="tasks (entries of the dataset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8, help="attempts per task")
    parser.add_argument("--prefix", help="task ids <prefix>-<i>; default rg-<seed>")
    parser.add_argument("--config", default="{}", help="the dataset's options, as JSON")
    parser.add_argument(
        "--system-prompt",
        default="default",
        help="a reasoning_gym.utils.SYSTEM_PROMPTS name, or 'none'",
    )
    args = parser.parse_args(argv)
    tasks = reasoning_gym_tasks(
        args.dataset,
        size=args.size,
        seed=args.seed,
        group_size=args.group_size,
        prefix=args.prefix,
        system_prompt=None if args.system_prompt == "none" else args.system_prompt,
        **json.loads(args.config),
    )
    for task in tasks:
        sys.stdout.write(codec.encode(task, codec.Encoding.JSON).decode() + "\n")


if __name__ == "__main__":
    main()
