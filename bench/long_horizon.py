"""What multi-turn costs per turn: long ``guess`` games (``rollout.agents.guess``) through the
real data plane (OpenAI SDK -> gateway -> NATS -> rollout worker subprocess -> engine).

``--games`` games run at once, each its built-in agent for ``--turns`` turns (a secret the model
does not find: every game runs to the cap), the environment sleeping ``--turn-delay`` per turn.
Per turn index (1st call of a game, 2nd, ...), from the client and the run's call records:

- gateway latency: the chat call's wall time at the client (p50, p99);
- prompt tokens, and of them the tokens already in the previous call's prompt + output (what a
  prefix cache could reuse) and the new ones (the feedback and the template's markers);
- the gateway's own tokenization: prompt ids reused from the session's earlier turns (token
  fidelity) vs tokenized (``sf_gateway_prompt_tokens_total``).

And for the whole run, the engine's own count: prompt tokens prefilled vs served from its
prefix cache (``sf_engine_prompt_tokens_total``, the worker's /metrics): the hf engine's keeps
whole prompts and finished calls (a turn reuses all of the previous call but its last token);
vLLM's caches whole KV blocks.

Usage: python -m bench.long_horizon [--engine hf|vllm] [--games 16] [--turns 8]
Prints a table and writes bench/results/long_horizon-<engine>.json.
"""

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import httpx
import openai
from nats.js.errors import NotFoundError

from bench.output import bench_broker, percentile, write_model_run
from broker import codec
from broker.client import session
from broker.config import ProvisionConfig
from broker.messages import CallRecorded
from broker.provision import provision_run
from broker.subjects import SESSION_HEADER, RunNames
from common.metrics import metric_sum, scrape
from common.models import resolve_model
from rollout.agents.agents import AgentContext
from rollout.agents.guess import guess_agent, guess_task
from rollout.agents.verifiers import bind
from rollout.gateway import Gateway, GatewayConfig
from rollout.gateway.metrics import REGISTRY as GATEWAY_METRICS
from seamlessflow.processes import worker_process

RUN = "bench-long-horizon"
SERVED = "bench"
SECRET, HIGH = 999_983, 1_000_000
"""A secret an untrained model does not guess: every game runs all its turns."""


class Timer:
    """httpx hooks: the wall time of every chat call, by session, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    async def request(self, request: httpx.Request) -> None:
        request.extensions["sent_at"] = time.perf_counter()

    async def response(self, response: httpx.Response) -> None:
        await response.aread()
        sid = response.request.headers.get(SESSION_HEADER, "")
        took = time.perf_counter() - response.request.extensions["sent_at"]
        self.seconds.setdefault(sid, []).append(took)


async def play(client: openai.AsyncOpenAI, sid: str, args: argparse.Namespace) -> None:
    task = guess_task(
        sid, SECRET, high=HIGH, group_size=1, max_turns=args.turns, turn_delay_s=args.turn_delay
    )
    ctx = AgentContext(
        task=task,
        session_id=sid,
        gateway_url=str(client.base_url),
        client=client.with_options(default_headers={SESSION_HEADER: sid}),
        model=SERVED,
        temperature=1.0,
        max_tokens=4,
        verify=bind(task.reward),
    )
    await guess_agent(ctx)


async def calls_of(js, names: RunNames, sid: str) -> list[CallRecorded]:
    """The session's call records, in stream order."""
    found, seq = [], 1
    while True:
        try:
            raw = await js.get_msg(names.traj_stream, seq, subject=names.traj_calls(sid), next=True)
        except NotFoundError:
            return found
        seq = raw.seq + 1
        found.append(codec.decode(CallRecorded, raw.data))


def gateway_tokens() -> dict[str, float]:
    return {
        source: GATEWAY_METRICS.get_sample_value(
            "sf_gateway_prompt_tokens_total", {"source": source}
        )
        or 0.0
        for source in ("reused", "tokenized")
    }


async def measure(nats_url: str, model: Path, args: argparse.Namespace) -> dict:
    names = RunNames(RUN)
    async with session(nats_url, "bench-provision") as nc:
        await provision_run(nc.jetstream(), RUN, ProvisionConfig())
    worker = worker_process(
        nats_url, RUN, model, "bench-w1", "--engine", args.engine, "--max-running", "64"
    )
    await asyncio.to_thread(worker.wait_ready, 600)
    try:
        config = GatewayConfig(model=SERVED, model_path=model, run=RUN, port=0)
        timer = Timer()
        hooks = {"request": [timer.request], "response": [timer.response]}
        async with (
            Gateway(config, nats_url) as gateway,
            httpx.AsyncClient(event_hooks=hooks, timeout=120) as http,
            session(nats_url, "bench-records") as nc,
        ):
            client = openai.AsyncOpenAI(
                base_url=gateway.url, api_key="x", max_retries=0, http_client=http
            )
            before = gateway_tokens()
            engine_before = await scrape(worker.metrics_url)
            sids = [f"g{i}-{time.time_ns()}" for i in range(args.games)]
            started = time.perf_counter()
            await asyncio.gather(*(play(client, sid, args) for sid in sids))
            wall = time.perf_counter() - started
            engine_after = await scrape(worker.metrics_url)
            after = gateway_tokens()
            js = nc.jetstream()
            records = {sid: await calls_of(js, names, sid) for sid in sids}
    finally:
        await asyncio.to_thread(worker.stop)

    def engine(source: str) -> float:
        name = "sf_engine_prompt_tokens_total"
        now = [s for s in engine_after if s.labels.get("source") == source]
        then = [s for s in engine_before if s.labels.get("source") == source]
        return metric_sum(now, name) - metric_sum(then, name)

    turns = []
    for t in range(args.turns):
        latency = [timer.seconds[sid][t] * 1e3 for sid in sids if len(timer.seconds[sid]) > t]
        prompt, reusable = [], []
        for sid in sids:
            calls = records[sid]
            if len(calls) <= t:
                continue
            prompt.append(len(calls[t].prompt_ids))
            previous = calls[t - 1].prompt_ids + calls[t - 1].output_ids if t else []
            shared = calls[t].prompt_ids[: len(previous)] == previous
            reusable.append(len(previous) if shared else 0)
        turns.append(
            {
                "turn": t + 1,
                "calls": len(latency),
                "latency_ms_p50": statistics.median(latency),
                "latency_ms_p99": percentile(latency, 99),
                "prompt_tokens": statistics.mean(prompt),
                "reusable_tokens": statistics.mean(reusable),
                "new_tokens": statistics.mean(prompt) - statistics.mean(reusable),
            }
        )
    calls = sum(len(c) for c in records.values())
    return {
        "turns": turns,
        "calls": calls,
        "wall_s": wall,
        "gateway_prompt_tokens": {k: after[k] - before[k] for k in after},
        "engine_prompt_tokens": {s: engine(s) for s in ("prefilled", "cached")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--games", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-delay", type=float, default=0.05)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = resolve_model(args.model)
    loadavg_before = os.getloadavg()[0]
    with bench_broker() as broker:
        measured = asyncio.run(measure(broker.url, model, args))
    print(
        f"engine {args.engine}: {args.games} games x {args.turns} turns, "
        f"{measured['calls']} calls in {measured['wall_s']:.1f}s "
        f"(environment {args.turn_delay * 1e3:.0f} ms per turn)"
    )
    print(f"\n{'turn':>5}{'p50 ms':>9}{'p99 ms':>9}{'prompt':>8}{'reusable':>10}{'new':>6}")
    for t in measured["turns"]:
        print(
            f"{t['turn']:>5}{t['latency_ms_p50']:>9.0f}{t['latency_ms_p99']:>9.0f}"
            f"{t['prompt_tokens']:>8.1f}{t['reusable_tokens']:>10.1f}{t['new_tokens']:>6.1f}"
        )
    g, e = measured["gateway_prompt_tokens"], measured["engine_prompt_tokens"]
    print(f"\ngateway prompt ids: {g['reused']:.0f} reused, {g['tokenized']:.0f} tokenized")
    print(f"engine prompt tokens: {e['prefilled']:.0f} prefilled, {e['cached']:.0f} cached")
    write_model_run(f"long_horizon-{args.engine}.json", args, model, measured, loadavg_before)


if __name__ == "__main__":
    main()
