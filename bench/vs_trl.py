"""SeamlessFlow against TRL's ``GRPOTrainer`` on the same model, task and batch, one after the
other in one invocation: speed, where the time goes, resources, and what each learned by the
same wall-clock.

Both train SmolLM2-135M-Instruct (the ``smollm2`` model, unpacked offline) on single-turn
arithmetic (``a+b=``, operands 0-9, reward 1 when the last number of the answer is the sum: the
``last_number`` verifier): 4 prompts x 8 generations per step, at most 16 new tokens,
temperature 1, lr 1e-5 (constant), no KL, one optimizer step per batch.

- ``trl``: ``GRPOTrainer`` (``trl==1.16.0``) in a bench-only venv this script creates under
  ``<state dir>/bench/trl-venv`` with the same torch (``torch==2.13.0``: pip takes the CPU wheel
  from this machine's wheel folder, and the torch pin keeps it from pulling a CUDA build).
  Generation (transformers ``generate``) and training alternate in one process (float32, no
  gradient checkpointing). It runs ``--steps`` steps; its wall-clock from ``train()`` to the
  end is the budget SeamlessFlow gets.
- ``seamlessflow``: ``seamlessflow run`` with the equivalent config (vLLM engine, ``--layout``,
  ``--dtype``) on a broker this script starts. It checkpoints only at stop
  (``trainer.checkpoint_every``), as TRL saves none (``save_strategy="no"``);
- ``seamlessflow-defaults`` (``--configs defaults``): what a new user gets: the run config sets
  only the task, the batch and the learning rate (and the model, no SFT warm start of this
  instruct model, its engine and the colocated layout); everything else is default,
  checkpoints every version included. Its clock starts
  when the scheduler admits the first task (engines loaded, as TRL's model is when ``train()``
  starts) and it is stopped when TRL's budget is spent. The weights it held then are kept (a
  hard link to the trainer's tmpfs copy, no copy).

Per system: seconds per step and trained samples/s (steady state: the first ``--skip`` steps
left out), generated tokens/s, the time per step by phase (TRL: generation with scoring,
forward+backward, optimizer; SeamlessFlow: rollout busy time, each training phase from
``sf_trainer_phase_seconds``, the in-step weight publish, the worker's weight load, and optimizer
step to every worker serving), CPU utilisation (CPU seconds of the process tree over wall x
cores) and peak RSS of the tree. Then greedy accuracy on the 100 prompts ``a+b=`` (a, b in 0-9:
the whole task, greedy where training sampled) of the initial model, TRL's final model, and
SeamlessFlow's model at TRL's wall-clock.

Usage: python -m bench.vs_trl [--steps 10] [--skip 2] [--only trl seamlessflow] [--layout
colocated] [--dtype float32] [--configs tuned defaults] [--setup]. Prints tables and writes
bench/results/vs_trl.json.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.machine import machine
from bench.output import write_results
from broker import codec
from broker.client import session
from broker.config import EmbeddedBrokerConfig
from broker.messages import WeightsPublished
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from broker.weights import host_id
from common.metrics import metric_sum, scrape
from common.models import smollm2_model
from common.paths import default_state_dir
from rollout.agents import arithmetic
from rollout.agents.verifiers import last_number
from rollout.gateway.keys import read_key_file
from trainer.step import PHASES

TRL = "trl==1.16.0"
TORCH = "torch==2.13.0"
PROMPTS, GROUP, NEW_TOKENS, LR, MAX_OPERAND = 4, 8, 16, 1e-5, 9
SAMPLES_PER_STEP = PROMPTS * GROUP
HELD_OUT = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]

TRL_SCRIPT = f"""
import json, random, re, sys, tempfile, time
from decimal import Decimal
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model, out, prompt = sys.argv[1], sys.argv[3], sys.argv[5]
steps, seed, save_to = int(sys.argv[2]), int(sys.argv[4]), sys.argv[6]
rng = random.Random(seed)
rows = []
for _ in range(steps * {PROMPTS} + {PROMPTS}):
    a, b = rng.randint(0, {MAX_OPERAND}), rng.randint(0, {MAX_OPERAND})
    content = prompt.format(a=a, b=b)
    rows.append({{"prompt": [{{"role": "user", "content": content}}], "total": str(a + b)}})
NUMBER = re.compile(r"[-+]?\\d+(?:\\.\\d+)?")


def reward(completions, total, **kwargs):  # rollout.agents.verifiers.last_number
    found = [NUMBER.findall(c[0]["content"]) for c in completions]
    return [float(bool(f) and Decimal(f[-1]) == Decimal(t)) for f, t in zip(found, total)]


class Timer(TrainerCallback):
    def __init__(self):
        self.started = self.optimizing = 0.0
        self.steps, self.optimizer = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.optimizing = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer.append(time.perf_counter() - self.optimizing)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self.started)


timer, generation, tokens = Timer(), [], []
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
    generate = trainer._generate_and_score_completions

    def timed(inputs):
        started = time.perf_counter()
        output = generate(inputs)
        generation.append(time.perf_counter() - started)
        tokens.append(int(output["completion_mask"].sum()))
        return output

    trainer._generate_and_score_completions = timed
    began = time.time()
    trainer.train()
    ended = time.time()
    trainer.save_model(save_to)
json.dump({{"step_seconds": timer.steps, "generation_seconds": generation,
           "optimizer_seconds": timer.optimizer, "generated_tokens": tokens,
           "wall_s": ended - began}}, open(out, "w"))
"""

TASKS_TOML = f"""[tasks]
max_operand = {MAX_OPERAND}
group_size = {GROUP}
max_turns = 1
max_tokens = {NEW_TOKENS}
"""
"""The task both configs train on: the same in each."""

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
[cpus]
placement = "{{placement}}"
{TASKS_TOML}backlog = {PROMPTS}
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
checkpoint_every = 1000000
[stop]
max_steps = {{steps}}
max_seconds = {{seconds}}
"""


DEFAULTS_TOML = f"""
run = "{{run}}"
output_dir = "{{out}}"
[model]
name = "smollm2"
[model.warm_start]
steps = 0
[worker.engine]
kind = "vllm"
[layout]
kind = "colocated"
{TASKS_TOML}[trainer]
lr = {LR}
groups_per_step = {PROMPTS}
[stop]
max_steps = {{steps}}
max_seconds = {{seconds}}
"""
CONFIGS = {"tuned": RUN_TOML, "defaults": DEFAULTS_TOML}
"""The run configs: this bench's (``RUN_TOML``) and a new user's (only task, batch and lr)."""


class Resources:
    """CPU seconds and peak resident memory of process trees, sampled every 0.5 s in a thread."""

    def __init__(self, *roots: int) -> None:
        self._roots = [psutil.Process(pid) for pid in roots]
        self._cpu: dict[int, float] = {}  # pid -> CPU seconds last seen
        self.peak_rss = 0
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            rss = 0
            for root in self._roots:
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for proc in tree:
                    try:
                        times, memory = proc.cpu_times(), proc.memory_info()
                    except psutil.Error:
                        continue
                    self._cpu[proc.pid] = times.user + times.system
                    rss += memory.rss
            self.peak_rss = max(self.peak_rss, rss)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._started
        cpu = sum(self._cpu.values())
        return {
            "cpu_util": cpu / (wall * (os.cpu_count() or 1)),
            "peak_rss_gb": self.peak_rss / 1e9,
        }


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


def run_trl(python: Path, model: Path, steps: int, seed: int, save_to: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "trl_grpo.py", Path(tmp) / "out.json"
        script.write_text(TRL_SCRIPT)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # TRL's venv only
        prompt = arithmetic.PROMPT
        args = [str(script), str(model), str(steps), str(out), str(seed), prompt, str(save_to)]
        proc = subprocess.Popen([str(python), *args], env=env)
        resources = Resources(proc.pid)
        if proc.wait() != 0:
            raise RuntimeError(f"TRL exited with code {proc.returncode}")
        result = json.loads(out.read_text())
    result["resources"] = resources.stop()
    return result


async def run_seamlessflow(
    steps: int,
    layout: str,
    dtype: str,
    placement: str,
    budget_s: float | None,
    keep: Path,
    template: str = RUN_TOML,
) -> dict:
    """A ``seamlessflow run``, stopped ``budget_s`` after its first admitted task (without a
    budget: after ``steps`` steps); the weights it held then are linked into ``keep``."""
    run = f"vstrl{int(time.time())}"
    names = RunNames(run)
    with tempfile.TemporaryDirectory() as tmp:
        config, out = Path(tmp) / "run.toml", Path(tmp) / "out"
        seconds = budget_s * 3 if budget_s else 60.0 * (steps + 10)
        config.write_text(
            template.format(
                run=run,
                out=out,
                steps=100_000,  # stopped here, after its metrics are read
                seconds=seconds,
                layout=layout,
                dtype=dtype,
                placement=placement,
            )
        )
        with EmbeddedBroker(
            EmbeddedBrokerConfig(state_dir=Path(tmp) / "broker", insecure=True)
        ) as broker:
            arrivals: list[float] = []
            started: list[float] = []
            held: list[Path] = []

            def elapsed() -> float:
                return time.perf_counter() - started[0] if started else 0.0

            async def on_weights(msg) -> None:
                event = codec.decode(WeightsPublished, msg.data)
                if event.version == 0 or event.host != host_id():
                    return  # the store's announcement of a version already seen locally
                if budget_s is not None and elapsed() > budget_s:
                    return
                arrivals.append(time.perf_counter())
                link = keep / f"v{event.version}.safetensors"
                try:
                    os.link(urlparse(event.location).path, link)
                except OSError:
                    return  # pruned already
                for old in held:
                    old.unlink(missing_ok=True)
                held[:] = [link]

            async def on_admitted(msg) -> None:
                if not started:
                    started.append(time.perf_counter())

            async with session(broker.url, "bench-vs-trl") as nc:
                await nc.subscribe(names.weights, cb=on_weights)
                await nc.subscribe(names.tasks_admitted, cb=on_admitted)
                command = [sys.executable, "-m", "seamlessflow.cli", "run", str(config)]
                proc = await asyncio.create_subprocess_exec(*command, "--nats", broker.url)
                resources = Resources(proc.pid, broker.pid)
                while proc.returncode is None:
                    if budget_s is not None and started and elapsed() >= budget_s:
                        break
                    if budget_s is None and len(arrivals) > steps:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(proc.wait(), 0.5)
                metrics = await _scrape_run(out)
                wall = elapsed()
                if proc.returncode is None:
                    proc.send_signal(signal.SIGINT)
                if await proc.wait() not in (0, -signal.SIGINT):
                    raise RuntimeError(f"seamlessflow run exited with code {proc.returncode}")
                used = resources.stop()
    return {
        "step_seconds": [b - a for a, b in itertools.pairwise(arrivals)],
        "metrics": metrics,
        "wall_s": wall,
        "weights": str(held[0]) if held else None,
        "resources": used,
    }


async def _scrape_run(out: Path) -> dict[str, float]:
    """Totals over the run's processes (its scrape targets) of what the breakdown needs."""
    try:
        groups = json.loads((out / "scrape_targets.json").read_text())
    except (OSError, ValueError):
        return {}
    key_file = out / "metrics.key"  # the gateway's /metrics wants the run's bearer key
    key = read_key_file(key_file) if key_file.exists() else None
    samples = []
    for group in groups:
        for target in group["targets"]:
            try:
                url = f"http://{target}{group['labels']['__metrics_path__']}"
                samples += await scrape(url, key)
            except OSError:
                continue
    totals = {
        "steps": metric_sum(samples, "sf_trainer_steps_total"),
        "generated_tokens": metric_sum(samples, "sf_rollout_tokens_total"),
        "rollout_busy_s": metric_sum(
            samples, "sf_worker_role_seconds_total", role="rollout", state="busy"
        ),
    }
    for phase in PHASES:
        totals[f"{phase}_s"] = metric_sum(samples, "sf_trainer_phase_seconds_total", phase=phase)
    for key, name, labels in (
        ("publish", "sf_trainer_weight_publish_seconds", {"path": "local"}),
        ("upload", "sf_trainer_weight_publish_seconds", {"path": "store"}),
        ("checkpoint_stall", "sf_trainer_checkpoint_stall_seconds", {}),
        ("checkpoint_write", "sf_trainer_checkpoint_seconds", {}),
        ("load", "sf_rollout_weight_load_seconds", {}),
        ("serving", "sf_trainer_weights_serving_seconds", {}),
        ("mismatch", "sf_trainer_mismatch_mean_abs", {}),
    ):
        count = metric_sum(samples, f"{name}_count", **labels)
        totals[f"{key}_count"] = count
        totals[f"{key}_s_mean"] = metric_sum(samples, f"{name}_sum", **labels) / max(count, 1)
    return totals


def accuracy(model: Path, weights: Path | None) -> float:
    """Greedy accuracy on ``HELD_OUT`` (chat template, as both trainers prompt)."""
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if weights is not None:
        net.load_state_dict(load_file(weights), strict=False)  # tied: lm_head follows
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": arithmetic.question(a, b)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for a, b in HELD_OUT
    ]
    batch = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = net.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    answers = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    right = [last_number(x, str(a + b)) for x, (a, b) in zip(answers, HELD_OUT, strict=True)]
    return sum(right) / len(right)


def _row(name: str, steps: list[float], skip: int, wall: float, tokens: float) -> dict:
    kept = steps[skip:] or steps
    mean = statistics.mean(kept)
    return {
        "system": name,
        "steps": len(steps) + 1,
        "steps_measured": len(kept),
        "step_s_mean": mean,
        "step_s_median": statistics.median(kept),
        "samples_per_s": SAMPLES_PER_STEP / mean,
        "generated_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "step_seconds": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="TRL's steps (sets the budget)")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--only", nargs="+", default=["trl", "seamlessflow"])
    parser.add_argument("--setup", action="store_true", help="only create the TRL venv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="colocated", help="SeamlessFlow's [layout] kind")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        help="SeamlessFlow's trainer and engine: a run each",
    )
    parser.add_argument("--placement", default="split", help="SeamlessFlow's [cpus] placement")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["tuned"],
        choices=sorted(CONFIGS),
        help="SeamlessFlow's run config: this bench's (with --dtype), a new user's (defaults)",
    )
    parser.add_argument("--budget-s", type=float, help="SeamlessFlow's wall-clock without TRL")
    parser.add_argument("--cache", type=Path, default=default_state_dir() / "bench" / "trl-venv")
    args = parser.parse_args()
    python = trl_venv(args.cache) if "trl" in args.only or args.setup else None
    if args.setup:
        print(f"TRL venv ready: {python}")
        return
    torch.set_num_threads(os.cpu_count() or 1)
    model = smollm2_model()
    rows, phases, accuracies = [], {}, {"initial": accuracy(model, None)}
    budget = args.budget_s
    with tempfile.TemporaryDirectory(dir="/dev/shm") as keep:
        for name in args.only:
            print(f"running {name} ...", flush=True)
            if name == "trl":
                trained = Path(keep) / "trl-model"
                r = run_trl(python, model, args.steps, args.seed, trained)
                budget = r["wall_s"]
                gen, opt = (
                    statistics.mean(r["generation_seconds"]),
                    statistics.mean(r["optimizer_seconds"]),
                )
                phases[name] = {
                    "generation (with scoring)": gen,
                    "forward + backward": statistics.mean(r["step_seconds"]) - gen - opt,
                    "optimizer": opt,
                }
                row = _row(name, r["step_seconds"], args.skip, r["wall_s"],
                           sum(r["generated_tokens"]))  # fmt: skip
                accuracies[name] = accuracy(trained, None)
                row |= r["resources"] | {"accuracy": accuracies[name]}
                rows.append(row)
                continue
            arms = [(c, d) for c in args.configs for d in (args.dtype if c == "tuned" else [""])]
            for config, dtype in arms:
                name = "-".join(
                    ["seamlessflow"]
                    + ([config] if config != "tuned" else [])
                    + ([dtype] if dtype not in ("float32", "") else [])
                )
                print(f"  {name} ...", flush=True)
                (where := Path(keep) / name).mkdir()
                r = asyncio.run(
                    run_seamlessflow(
                        args.steps,
                        args.layout,
                        dtype,
                        args.placement,
                        budget,
                        where,
                        CONFIGS[config],
                    )
                )
                m, steps = r["metrics"], max(r["metrics"].get("steps", 0), 1)
                phases[name] = {
                    "rollout busy (all workers)": m["rollout_busy_s"] / steps,
                    **{f"train {p}": m[f"{p}_s"] / steps for p in PHASES},
                    "checkpoint (in step)": m["checkpoint_stall_s_mean"]
                    * m["checkpoint_stall_count"]
                    / steps,
                    "checkpoint write (background)": m["checkpoint_write_s_mean"],
                    "weight publish (in step)": m["publish_s_mean"],
                    "weight upload to the store (background)": m["upload_s_mean"],
                    "weight load (worker)": m["load_s_mean"],
                    "step -> all serving": m["serving_s_mean"],
                }
                row = _row(name, r["step_seconds"], args.skip, r["wall_s"], m["generated_tokens"])
                row["mismatch_mean_abs"] = m["mismatch_s_mean"]  # a mean of logprobs, not seconds
                weights = Path(r["weights"]) if r["weights"] else None
                accuracies[name] = accuracy(model, weights)
                row |= r["resources"] | {"accuracy": accuracies[name]}
                rows.append(row)
    _show(rows, phases, accuracies, budget)
    result = {
        "machine": machine(),
        "trl": TRL,
        "seamlessflow": {"layout": args.layout, "dtype": args.dtype, "placement": args.placement},
        "steps": args.steps,
        "skip": args.skip,
        "budget_s": budget,
        "rows": rows,
        "phases_s_per_step": phases,
        "accuracy": accuracies,
    }
    path = write_results("vs_trl.json", result)
    print(f"\nwrote {path}")


def _show(rows: list[dict], phases: dict, accuracies: dict, budget: float | None) -> None:
    print(f"\nsteady state; SeamlessFlow stopped at TRL's wall-clock ({budget or 0:.0f} s)")
    cols = ("steps", "step s", "samples/s", "gen tok/s", "CPU util", "peak RSS GB", "accuracy")
    print(f"{'system':>13}" + "".join(f"{c:>12}" for c in cols))
    for r in rows:
        cells = (r["steps"], f"{r['step_s_mean']:.2f}", f"{r['samples_per_s']:.2f}",
                 f"{r['generated_tokens_per_s']:.1f}", f"{r['cpu_util']:.0%}",
                 f"{r['peak_rss_gb']:.2f}", f"{r['accuracy']:.2f}")  # fmt: skip
        print(f"{r['system']:>13}" + "".join(f"{c!s:>12}" for c in cells))
    by = {r["system"]: r for r in rows}
    for name, r in by.items():
        if "trl" in by and name != "trl":
            ratio = r["samples_per_s"] / by["trl"]["samples_per_s"]
            print(f"{name} / trl trained samples/s: {ratio:.2f}x, logprob mismatch "
                  f"{r['mismatch_mean_abs']:.1e}")  # fmt: skip
    print(f"initial model accuracy: {accuracies['initial']:.2f}")
    for name, parts in phases.items():
        print(f"\n{name}: seconds per step by phase")
        for part, seconds in parts.items():
            print(f"  {part:<28}{seconds:>8.2f}")


if __name__ == "__main__":
    main()
