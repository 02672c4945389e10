"""Helpers shared by the tests: which nats-servers to test on, small run limits, and a gateway
stack (provisioned run, rollout worker, gateway) for tests that generate."""

import asyncio
import functools
import inspect
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import openai
import pytest
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from broker import codec
from broker.auth import IDENTITIES_ENV, Authority
from broker.client import session
from broker.config import (
    AccountLimits,
    EmbeddedBrokerConfig,
    MiB,
    ProvisionConfig,
    StreamLimits,
)
from broker.messages import (
    Admitted,
    CallRecorded,
    FinishReason,
    GenerationCancelled,
    GenerationRequested,
    Message,
    TokensGenerated,
)
from broker.permissions import Principal
from broker.provision import provision_run
from broker.server import EmbeddedBroker, find_nats_server, server_version
from broker.subjects import Durable, RunNames
from broker.tls import throwaway_pki
from broker.worker_messages import WorkerRegistered
from common.metrics import metric_sum, scrape
from rollout.gateway import Gateway, GatewayConfig
from seamlessflow.processes import ServiceProcess, worker_process
from tagsched.admission import Admission
from trajectory.config import TrajectoryConfig
from trajectory.manager import TrajectoryManager


def _nats_binaries() -> dict[str, Path]:
    candidates = [find_nats_server()]
    candidates += [Path(p) for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if p]
    if on_path := shutil.which("nats-server"):
        candidates.append(Path(on_path))
    found: dict[str, Path] = {}
    for path in candidates:
        if path.is_file():
            version = "nats-" + ".".join(map(str, server_version(path)))
            found.setdefault(version, path)
    return found


NATS_BINARIES = _nats_binaries()
M = TypeVar("M", bound=Message)

# JetStream reserves each stream's max_bytes on disk; tests create many runs, so keep them small.
_SMALL = StreamLimits(
    max_bytes=4 * MiB,
    max_age_s=3600,
    max_msg_size=MiB,
    max_payload=64 << 10,
    duplicate_window_s=60,
)
SMALL_RUN = ProvisionConfig(
    tasks=_SMALL,
    gen=_SMALL,
    traj=_SMALL,
    samples=_SMALL,
    weights=_SMALL,
    dead=_SMALL,
    weights_store_max_bytes=32 * MiB,  # the tiny model is ~10 MB
)


SECURE_LIMITS = AccountLimits(
    max_file=96 * MiB, max_memory=16 * MiB, max_streams=32, max_consumers=64
)
"""Each run's account on a test broker: SMALL_RUN fits, a runaway stream does not. Small, as
nats-server reserves each account's limits from its own (75% of the free disk and memory)."""


def broker_config(state_dir: Path, binary: Path, **settings) -> EmbeddedBrokerConfig:
    """A test broker, with authorization on (every run an account with ``SECURE_LIMITS``, every
    process an identity) unless ``insecure=True``."""
    settings = {"account": SECURE_LIMITS, "max_payload": 2 << 20, **settings}
    return EmbeddedBrokerConfig(state_dir=state_dir, binary=binary, **settings)


class RunPool:
    """Runs whose identities a test broker has loaded, issued a batch at a time (a configuration
    reload per batch, not per test: a reload takes about a second with 300 runs)."""

    def __init__(self, broker: EmbeddedBroker, batch: int = 32) -> None:
        self.broker, self.batch = broker, batch
        self._free: list[str] = []

    def take(self) -> str:
        if not self._free:
            fresh = ["t" + uuid.uuid4().hex[:12] for _ in range(self.batch)]
            for run in fresh:
                self.broker.authority.issue_run(run)
            self.broker.reload()
            self._free = fresh
        return self._free.pop()

    def identities(self, run: str) -> Path:
        """The folder of ``run``'s identity files (``$SEAMLESSFLOW_NATS_IDENTITIES``)."""
        return self.admin(run).parent

    def admin(self, run: str) -> Path:
        return self.broker.authority.path(run, Principal.ADMIN)

    @contextmanager
    def joined(self, run: str) -> Iterator[None]:
        """While open, what this process starts (a service in a thread, a child process)
        connects as its own principal of ``run``."""
        with pytest.MonkeyPatch.context() as env:
            env.setenv(IDENTITIES_ENV, str(self.identities(run)))
            yield


def own_run(broker: EmbeddedBroker, run: str, env: pytest.MonkeyPatch | None = None) -> Path:
    """Issue ``run``'s identities on a test's own ``broker`` (before it starts: no reload); with
    ``env``, what the test starts connects as its principals of ``run``. The admin's file."""
    admin = broker.authority.issue_run(run)[Principal.ADMIN]
    if env is not None:
        env.setenv(IDENTITIES_ENV, str(admin.parent))
    return admin


async def secure_run(broker: EmbeddedBroker, run: str) -> RunNames:
    """Issue ``run``'s identities on ``broker``, have it apply them, and provision the run as
    its admin (for a run of a fixed name; the others come from ``RunPool``)."""
    broker.authority.issue_run(run)
    await asyncio.to_thread(broker.reload)
    admin = broker.authority.path(run, Principal.ADMIN)
    ca = broker.tls.ca if broker.tls else None
    async with session(broker.url, "test-admin", identity_file=admin, ca_file=ca) as nc:
        await provision_run(nc.jetstream(), run, SMALL_RUN)
    return RunNames(run)


async def stream_messages(
    js: JetStreamContext, stream: str, schema: type[M], subject: str | None = None
) -> list[M]:
    """Every message stored in ``stream`` (on ``subject`` only, if given), decoded as
    ``schema``, oldest first. A work queue's acked messages leave gaps: skipped."""
    state = (await js.stream_info(stream)).state
    if not state.messages:
        return []
    found = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except NotFoundError:
            continue
        if subject is None or msg.subject == subject:
            found.append(codec.decode(schema, msg.data))
    return found


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 20.0,
    watch: asyncio.Task | None = None,
) -> None:
    """Wait until ``condition()`` holds; fail at once if ``watch`` (a background task) ended."""
    async with asyncio.timeout(timeout):
        while True:
            result = condition()
            if await result if inspect.isawaitable(result) else result:
                return
            assert watch is None or not watch.done(), watch.exception()
            await asyncio.sleep(0.05)


@asynccontextmanager
async def frozen(pid: int) -> AsyncIterator[None]:
    """``pid`` stopped (SIGSTOP) inside the block: connections stay up, nothing answers, as on a
    cut link. The block starts once every thread has stopped (``kill`` returns before: under
    load one could still answer, seen in make test)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await eventually(lambda: _stopped(pid), timeout=5)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (state ``T`` in /proc)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)


async def consumer_settled(js: JetStreamContext, stream: str, durable: str) -> bool:
    """``durable`` has acked every message stored on its subject so far. Not ``num_pending ==
    0`` alone: a consumer learns of a new message asynchronously, so just after a publish its
    ``num_pending`` can still read 0; the stream's last message on the subject is the truth."""
    info = await js.consumer_info(stream, durable)
    if info.num_ack_pending:
        return False
    try:
        last = await js.get_msg(stream, subject=info.config.filter_subject)
    except NotFoundError:  # none stored, or a work queue that removed every acked one
        return True
    return info.ack_floor.stream_seq >= last.seq


async def registered(js, names: RunNames, worker_id: str) -> WorkerRegistered | None:
    """``worker_id``'s registry entry; None when it has none (never written, or deleted). Any
    other failure (the broker, a bad entry) is raised."""
    bucket = await js.key_value(names.workers_kv)
    try:
        entry = await bucket.get(worker_id)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    return codec.decode(WorkerRegistered, entry.value)


async def serving_trainer(
    broker_url: str, js, names: RunNames, config, model_dir: Path, stop: asyncio.Event
) -> asyncio.Task:
    """A trainer (``trainer.serve``, a ``TrainerConfig``) serving ``names.run`` in this process
    until ``stop`` is set, returned once it has registered; await the task to see how it ended."""
    from trainer.serve import serve_trainer  # torch: only for the tests that train

    serving = asyncio.create_task(
        serve_trainer(broker_url, names.run, ProvisionConfig(), config, model_dir, 0, stop)
    )
    await eventually(lambda: registered(js, names, config.worker_id), watch=serving, timeout=60)
    return serving


def perturbed_weights(model_dir: Path, seed: int) -> bytes:
    """The model's weights with noise on the (tied) embedding, saved without lm_head."""
    import torch
    from safetensors.torch import load_file, save

    tensors = load_file(model_dir / "model.safetensors")
    tensors.pop("lm_head.weight", None)
    embed = tensors["model.embed_tokens.weight"]
    noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(seed))
    tensors["model.embed_tokens.weight"] = embed + 0.5 * noise
    return save(tensors)


def greedy(model_dir: Path, prompt: list[int], n: int, weights: bytes | None = None) -> list[int]:
    """Greedy continuation by transformers (no EOS stop), with ``weights`` if given."""
    import torch
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(load(weights), strict=False)  # tied: lm_head follows the embedding
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


async def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (with at least these labels) that ``url`` serves.
    Async, so it also reads a /metrics served by the test's own event loop."""
    return metric_sum(await scrape(url), name, **labels)


# -- a gateway stack ------------------------------------------------------------------------

MODEL = "tiny"
"""The model name the test gateways serve."""


def gateway_config(model_dir: Path, run: str, **fields) -> GatewayConfig:
    return GatewayConfig(model=MODEL, model_path=model_dir, run=run, port=0, **fields)


class GatewayThread:
    """A gateway served from its own thread and event loop, so that sync clients can call it
    and async tests can share it."""

    def __init__(self, config: GatewayConfig, nats_url: str) -> None:
        self.config, self.nats_url = config, nats_url
        self.url = ""
        self.app = None
        """The gateway's HTTP app (``rollout.gateway.app.build_app``)."""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with Gateway(self.config, self.nats_url) as gateway:
                self.url, self.app = gateway.url, gateway.app
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def __enter__(self) -> "GatewayThread":
        self._thread.start()
        assert self._ready.wait(60), "the gateway did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@dataclass
class Stack:
    """A provisioned run with one rollout worker and a gateway in front of it."""

    names: RunNames
    url: str
    worker: ServiceProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0)


@contextmanager
def gateway_stack(runs: RunPool, model_dir: Path, *worker_args: str) -> Iterator[Stack]:
    """A fresh run, one ``seamlessflow worker`` on ``model_dir`` (extra command-line
    ``worker_args``: ``--max-model-len 1024``) and a ``GatewayThread``, each with its identity."""
    names = RunNames(runs.take())
    url = runs.broker.url

    async def provision() -> None:
        async with session(url, "pytest-provision", identity_file=runs.admin(names.run)) as nc:
            await provision_run(nc.jetstream(), names.run, SMALL_RUN)

    asyncio.run(provision())
    with ExitStack() as started:
        with runs.joined(names.run):
            worker = worker_process(url, names.run, model_dir, f"{names.run}-w1", *worker_args)
            started.callback(worker.stop)
            worker.wait_ready()
            config = gateway_config(model_dir, names.run)
            gateway = started.enter_context(GatewayThread(config, url))
        yield Stack(names, gateway.url, worker)


# -- token ids by hand -----------------------------------------------------------------------


def byte_tokens(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: what a model emitting byte by byte produces."""
    ids = []
    for char in text:
        for byte in char.encode():
            ids.append(tok.convert_tokens_to_ids(_BYTE_TO_UNICODE[byte]))
    return ids


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the token string of each single byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_BYTE_TO_UNICODE = _bytes_to_unicode()


class InjectedWorkerWire:
    """Fault injection: takes generation requests off the queue and answers with hand-made
    chunks (duplicates, stale attempts, gaps) that a real worker does not send on demand, or
    with scripted output (tool calls, chosen special tokens and bytes) that the random tiny
    model does not write on demand. A fake worker, named as such."""

    def __init__(self, nc, js, names: RunNames) -> None:
        self.nc, self.js, self.names = nc, js, names

    async def __aenter__(self) -> "InjectedWorkerWire":
        self.sub = await self.js.pull_subscribe_bind(Durable.ROLLOUT, stream=self.names.gen_stream)
        self.cancels: list[GenerationCancelled] = []
        self.cancel_sub = await self.nc.subscribe(
            self.names.gen_cancel_all,
            cb=self._on_cancel,
        )
        return self

    async def _on_cancel(self, msg) -> None:
        self.cancels.append(codec.decode(GenerationCancelled, msg.data))

    async def __aexit__(self, *exc) -> None:
        await self.cancel_sub.unsubscribe()
        await self.sub.unsubscribe()

    async def take(self, timeout: float = 10) -> GenerationRequested:
        (msg,) = await self.sub.fetch(1, timeout=timeout)
        await msg.ack()
        return codec.decode(GenerationRequested, msg.data)

    async def send(self, request: GenerationRequested, seq: int, ids=(), **fields) -> None:
        chunk = TokensGenerated(
            call_id=request.call_id,
            attempt=fields.pop("attempt", request.attempt),
            seq=seq,
            worker_id=fields.pop("worker_id", "injector"),
            version=fields.pop("version", 0),
            token_ids=list(ids),
            logprobs=[-0.5] * len(ids),
            **fields,
        )
        await self.nc.publish(request.reply_to, codec.encode(chunk))
        await self.nc.flush()


@asynccontextmanager
async def serving(run: Callable[[asyncio.Event], Awaitable[None]]) -> AsyncIterator[asyncio.Task]:
    """``run(stop)`` as a task on this event loop while the block runs; then ``stop`` is set and
    the task awaited."""
    stop = asyncio.Event()
    running = asyncio.create_task(run(stop))
    try:
        yield running
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


@asynccontextmanager
async def admitting(js, names: RunNames, *, limit: int = 1024) -> AsyncIterator[Admission]:
    """The scheduler's admission (the real one, on this event loop), so tasks published on
    ``names.tasks`` reach the agent runners; the limit is wide unless a test is about it. Tickets
    count from 1 here, at version 0 (the scheduler stores its count and reads the workers')."""
    admission = Admission(js, names, SMALL_RUN.tasks, limit=limit)
    tickets = itertools.count(1)

    async def stamp() -> Admitted:
        return Admitted(ticket=next(tickets), version=0)

    async with serving(functools.partial(admission.run, stamp=stamp)):
        yield admission


def record(session: str, call_id: str, prompt: list[int], output: list[int], version: int = 0):
    """A finished call of ``session`` as the gateway records it."""
    return CallRecorded(
        session_id=session,
        call_id=call_id,
        model="tiny",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.25] * len(output),
        output_versions=[version] * len(output),
        finish_reason=FinishReason.STOP,
        started_at=1.0,
        finished_at=2.0,
    )


async def publish_call(js, names: RunNames, call: CallRecorded) -> None:
    """As the gateway does: msgpack, de-duplicated by call id, on the session's subject."""
    await js.publish(
        names.traj_calls(call.session_id),
        codec.encode(call),
        headers=codec.headers(msg_id=call.call_id),
    )


@asynccontextmanager
async def building(js, names: RunNames) -> AsyncIterator[asyncio.Task]:
    """The trajectory manager (the real one, on this event loop): ended sessions become samples.
    Yields its task (to ``watch``)."""
    manager = TrajectoryManager(js, names, SMALL_RUN.traj, TrajectoryConfig(concurrency=2))
    async with serving(manager.run) as running:
        yield running


# -- a NATS cluster ---------------------------------------------------------------------------


class NatsCluster:
    """``size`` real nats-servers with JetStream, clustered on loopback ports (each with its own
    store), for tests of replicated streams. ``kill(i)`` SIGKILLs node ``i``. With ``run``, the
    cluster is secured as ``seamlessflow broker`` secures one server: authorization on (the
    run's identities in ``identities``) and TLS on client connections and routes (a throwaway
    CA, ``ca``)."""

    def __init__(self, binary: Path, state_dir: Path, size: int = 3, run: str | None = None):
        self.binary, self.state_dir = binary, state_dir
        self.ports = [free_port() for _ in range(size)]
        self.routes = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.url = ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)
        self.identities: Path | None = None
        self.ca: Path | None = None
        self._secured: dict = {}
        if run is not None:
            authority = Authority(state_dir / "auth", AccountLimits())
            self.identities = authority.issue(run, Principal.ADMIN).parent
            authority.issue_run(run)
            tls = throwaway_pki(state_dir / "tls")
            self.ca = tls.ca
            files = {"cert_file": str(tls.cert), "key_file": str(tls.key), "ca_file": str(tls.ca)}
            self._secured = {
                "accounts": authority.accounts(),
                "tls": {**files, "timeout": 2},
                "routes_tls": {**files, "timeout": 2},
            }

    def session(self, name: str, **kwargs):
        """A client session as the run's admin (when secured)."""
        admin = self.identities / "admin.toml" if self.identities else None
        return session(self.url, name, identity_file=admin, ca_file=self.ca, **kwargs)

    async def start(self) -> "NatsCluster":
        """Start every node; return once the cluster's JetStream answers."""
        for i in range(len(self.ports)):
            node = self.state_dir / f"n{i}"
            node.mkdir(parents=True, exist_ok=True)
            conf = {
                "server_name": f"n{i}",
                "listen": f"127.0.0.1:{self.ports[i]}",
                "max_payload": 2 << 20,
                "jetstream": {"store_dir": str(node / "jetstream")},
                "cluster": {
                    "name": "sf-test",
                    "listen": f"127.0.0.1:{self.routes[i]}",
                    "routes": [f"nats-route://127.0.0.1:{r}" for r in self.routes],
                },
            }
            if self._secured:
                conf["accounts"] = self._secured["accounts"]
                conf["tls"] = self._secured["tls"]
                conf["cluster"]["tls"] = self._secured["routes_tls"]
            (node / "nats.conf").write_text(json.dumps(conf))
            with open(node / "nats.log", "ab") as log_file:
                self.procs[i] = subprocess.Popen(
                    [str(self.binary), "-c", str(node / "nats.conf")],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        try:
            await self._wait_jetstream()
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_jetstream(self, timeout: float = 60.0) -> None:
        """Until the cluster has a JetStream meta leader: account info answers."""
        async with self.session("pytest-cluster", give_up_after=timeout) as nc:
            js = nc.jetstream()
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        await js.account_info()
                        return
                    except NatsError:  # no JetStream meta leader yet
                        await asyncio.sleep(0.2)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


LOWEST_TEST_PORT = 10000


def _port_slice() -> range:
    """This test process's ports: below the kernel's ephemeral range, where every bind to port 0
    (another test's server, a client's connection) lands, split between the xdist workers."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    width = (ephemeral - LOWEST_TEST_PORT) // count
    if width < 100:
        raise RuntimeError(f"ephemeral ports start at {ephemeral}: no room for test ports")
    start = LOWEST_TEST_PORT + index * width
    return range(start, start + width)


_PORTS = itertools.cycle(_port_slice())


def free_port() -> int:
    """A loopback port free now that no other test of this run is handed: from this process's
    slice (``_port_slice``), each once before any comes again, skipping ports in use. A port taken
    from port 0 could be bound by a test beside this one before its server binds it."""
    for _ in range(1000):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free test port in 1000 tries")


def status_workers(stdout: str) -> dict[str, dict[str, str]]:
    """``seamlessflow status``'s worker table: each worker's cells by column header. Every cell
    is one word up to "busy/idle s" (a two-word header); "written" (``1.2s ago`` and more) and
    "clock" follow."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("worker "))
    header = lines[start].split()
    at = header.index("busy/idle")
    rows: dict[str, dict[str, str]] = {}
    for line in lines[start + 1 :]:
        if line.startswith("scheduler:"):
            break
        cells = line.split()
        row = dict(zip(header[:at], cells[:at], strict=True))
        row |= {"busy/idle s": cells[at], "written": " ".join(cells[at + 1 : -1])}
        rows[cells[0]] = row | {"clock": cells[-1]}
    return rows
