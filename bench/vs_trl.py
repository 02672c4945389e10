"""SeamlessFlow against TRL's ``GRPOTrainer`` on the same model and batch: trained samples per
second, steady state (the first ``--skip`` steps of each are left out).

Both train SmolLM2-135M-Instruct (float32; the ``smollm2`` model, unpacked offline) on
single-turn arithmetic (``a+b=``, operands 0-9, reward 1 when the sum appears in the answer):
4 prompts x 8 generations per step, at most 16 new tokens, temperature 1, lr 1e-5, no KL.

- ``trl``: ``GRPOTrainer`` (``trl==1.16.0``) in a bench-only venv this script creates under
  ``<state dir>/bench/trl-venv`` with the same torch (``torch==2.13.0``: pip takes the CPU wheel
  from this machine's wheel folder, and the torch pin keeps it from pulling a CUDA build).
  Generation (transformers ``generate``) and training alternate in one process; constant lr
  and no gradient checkpointing (TRL's defaults decay the lr and recompute activations).
- ``seamlessflow``: ``seamlessflow run`` with the equivalent config (vLLM engine, one rollout
  worker, CPU placement split) on a broker this script starts; each weight version's arrival
  time is recorded, so startup is not counted.

Usage: python bench/vs_trl.py [--steps 10] [--skip 2] [--only trl seamlessflow] [--setup]
Prints a table and writes bench/results/vs_trl.json.
"""

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from broker import codec
from broker.client import session
from broker.config import EmbeddedBrokerConfig
from broker.messages import WeightsPublished
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from common.models import smollm2_model
from common.paths import default_state_dir
from rollout.agents import arithmetic

RESULTS = Path(__file__).parent / "results"
TRL = "trl==1.16.0"
TORCH = "torch==2.13.0"
PROMPTS, GROUP, NEW_TOKENS, LR, MAX_OPERAND = 4, 8, 16, 1e-5, 9
SAMPLES_PER_STEP = PROMPTS * GROUP

TRL_SCRIPT = f"""
import json, random, sys, tempfile, time
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model, out, prompt = sys.argv[1], sys.argv[3], sys.argv[5]
steps, seed = int(sys.argv[2]), int(sys.argv[4])
rng = random.Random(seed)
rows = []
for _ in range(steps * {PROMPTS} + {PROMPTS}):
    a, b = rng.randint(0, {MAX_OPERAND}), rng.randint(0, {MAX_OPERAND})
    content = prompt.format(a=a, b=b)
    rows.append({{"prompt": [{{"role": "user", "content": content}}], "total": str(a + b)}})


def reward(completions, total, **kwargs):
    return [float(t in c[0]["content"]) for c, t in zip(completions, total)]


class Timer(TrainerCallback):
    def __init__(self):
        self.started, self.seconds = 0.0, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)


timer = Timer()
with tempfile.TemporaryDirectory() as tmp:
    config = GRPOConfig(
        output_dir=tmp, max_steps=steps, per_device_train_batch_size={SAMPLES_PER_STEP},
        num_generations={GROUP}, max_completion_length={NEW_TOKENS}, learning_rate={LR},
        beta=0.0, temperature=1.0, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, seed=seed, shuffle_dataset=False,
        lr_scheduler_type="constant", gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
        callbacks=[timer],
    )
    trainer.train()
json.dump({{"step_seconds": timer.seconds}}, open(out, "w"))
"""

RUN_TOML = f"""
run = "{{run}}"
output_dir = "{{out}}"
[model]
name = "smollm2"
max_model_len = 512
[model.warm_start]
steps = 0
[worker]
max_running = 64
[worker.engine]
kind = "vllm"
dtype = "{{dtype}}"
[layout]
kind = "{{layout}}"
[tasks]
max_operand = {MAX_OPERAND}
group_size = {GROUP}
max_turns = 1
max_tokens = {NEW_TOKENS}
backlog = {PROMPTS}
[scheduler]
steps_ahead = 2
[agents]
temperature = 1.0
[trainer]
lr = {LR}
backend = {{{{ kind = "torch", dtype = "{{dtype}}" }}}}
temperature = 1.0
groups_per_step = {PROMPTS}
max_staleness = 8
[stop]
max_steps = {{steps}}
max_seconds = {{seconds}}
"""


def trl_venv(cache: Path) -> Path:
    """The bench-only venv with TRL and this machine's CPU torch; created once."""
    python = cache / "bin" / "python"
    if (cache / ".complete").is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(cache)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)  # first and alone: the CPU wheel
    subprocess.run([*pip, TORCH, TRL], check=True)  # the pin keeps that torch
    (cache / ".complete").touch()
    return python


def run_trl(python: Path, model: Path, steps: int, seed: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "trl_grpo.py", Path(tmp) / "out.json"
        script.write_text(TRL_SCRIPT)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # TRL's venv only
        prompt = arithmetic.PROMPT
        args = [str(python), str(script), str(model), str(steps), str(out), str(seed), prompt]
        subprocess.run(args, check=True, env=env)
        return json.loads(out.read_text())["step_seconds"]


async def run_seamlessflow(steps: int, layout: str, dtype: str) -> list[float]:
    """Seconds between consecutive weight versions of a ``seamlessflow run``."""
    run = f"vstrl{int(time.time())}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "run.toml"
        out = Path(tmp) / "out"
        config.write_text(
            RUN_TOML.format(
                run=run,
                out=out,
                steps=steps,
                seconds=60.0 * (steps + 10),
                layout=layout,
                dtype=dtype,
            )
        )
        with EmbeddedBroker(EmbeddedBrokerConfig(state_dir=Path(tmp) / "broker")) as broker:
            arrivals: list[float] = []
            async with session(broker.url, "bench-vs-trl") as nc:

                async def on_weights(msg) -> None:
                    event = codec.decode(WeightsPublished, msg.data)
                    if event.version > 0:
                        arrivals.append(time.perf_counter())

                await nc.subscribe(RunNames(run).weights, cb=on_weights)
                command = [sys.executable, "-m", "seamlessflow.cli", "run", str(config)]
                proc = await asyncio.create_subprocess_exec(*command, "--nats", broker.url)
                if await proc.wait() != 0:
                    raise RuntimeError(f"seamlessflow run exited with code {proc.returncode}")
    return [b - a for a, b in itertools.pairwise(arrivals)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--only", nargs="+", default=["trl", "seamlessflow"])
    parser.add_argument("--setup", action="store_true", help="only create the TRL venv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="colocated", help="SeamlessFlow's [layout] kind")
    parser.add_argument("--dtype", default="float32", help="SeamlessFlow's trainer and engine")
    parser.add_argument("--cache", type=Path, default=default_state_dir() / "bench" / "trl-venv")
    args = parser.parse_args()
    python = trl_venv(args.cache) if "trl" in args.only or args.setup else None
    if args.setup:
        print(f"TRL venv ready: {python}")
        return
    model = smollm2_model()
    rows = []
    for name in args.only:
        print(f"running {name} for {args.steps} steps ...", flush=True)
        if name == "trl":
            steps = run_trl(python, model, args.steps, args.seed)
        else:
            steps = asyncio.run(run_seamlessflow(args.steps, args.layout, args.dtype))
        kept = steps[args.skip :] or steps
        mean = statistics.mean(kept)
        rows.append(
            {
                "system": name,
                "steps_measured": len(kept),
                "step_s_mean": mean,
                "step_s_median": statistics.median(kept),
                "samples_per_s": SAMPLES_PER_STEP / mean,
                "step_seconds": steps,
            }
        )
    print("\nsteady-state seconds per step; trained samples/s = 32 / mean step (machine shared)")
    print(f"{'system':>13}{'steps':>7}{'mean s':>9}{'median s':>10}{'samples/s':>11}")
    for r in rows:
        print(
            f"{r['system']:>13}{r['steps_measured']:>7}{r['step_s_mean']:>9.2f}"
            f"{r['step_s_median']:>10.2f}{r['samples_per_s']:>11.2f}"
        )
    by = {r["system"]: r for r in rows}
    if {"trl", "seamlessflow"} <= by.keys():
        ratio = by["seamlessflow"]["samples_per_s"] / by["trl"]["samples_per_s"]
        print(f"seamlessflow / trl trained samples/s: {ratio:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg()[0],
        },
        "trl": TRL,
        "steps": args.steps,
        "skip": args.skip,
        "rows": rows,
    }
    path = RESULTS / "vs_trl.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
