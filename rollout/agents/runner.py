"""The agent runner: tasks from ``sf.<run>.tasks`` -> agents against the gateway -> rewards on
``sf.<run>.traj.end``.

Per task (``TaskSubmitted``), taken through the validated tasks ingress, up to ``max_tasks`` at
once:

1. refuse what cannot be run (unknown verifier, unusable reference, no agent for the env): the
   ingress dead-letters it with the reason, before any agent runs;
2. check the gateway serves (``/health``): if not, ``GatewayUnavailableError`` pauses the
   ingress, which holds the task (its delivery not spent, never dead-lettered for the outage)
   and runs it again once the gateway serves; it is never scored against an outage;
3. run ``group_size`` attempts at once, each in its own session (``session_id``), and verify
   each final answer. An agent that raises, exits non-zero or times out ends its attempt with
   reward 0.0 and ``{"failed": 1}``; a gateway failure in any attempt cancels the others and
   the whole task is run again as in 2, in new sessions (nothing is published for it);
4. publish one ``SessionEnded`` per attempt (``Nats-Msg-Id`` = session id); the ingress acks the
   task once all are stored.

On stop, no new task is taken; running ones get ``shutdown_grace_s`` to finish, then their
attempts are cancelled (commands killed) and the tasks handed back (nak) unpublished.
"""

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import httpx
import openai
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker import codec
from broker.client import session
from broker.config import ProvisionConfig, StreamLimits
from broker.exceptions import InvalidMessageError
from broker.ingress import Delivery, tasks_ingress
from broker.messages import SessionEnded, TaskSubmitted
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.provision import durable_info
from broker.retry import retry
from broker.subjects import SESSION_HEADER, Durable, RunNames
from common.log import kv
from common.metrics import serve_metrics
from common.ready import announce_ready
from rollout.agents.agents import (
    Agent,
    AgentContext,
    AgentResult,
    CommandAgent,
    chat_agent,
    load_agent,
)
from rollout.agents.arithmetic import ENV as ARITHMETIC
from rollout.agents.arithmetic import arithmetic_agent, arithmetic_reward
from rollout.agents.config import AgentsConfig
from rollout.agents.exceptions import (
    GatewayUnavailableError,
    InvalidTaskError,
    RunnerStoppingError,
)
from rollout.agents.verifiers import binary_reward, bind

log = logging.getLogger(__name__)

GATEWAY_DOWN_STATUS = frozenset({502, 503, 504})
"""Gateway answers that mean it (or the rollout behind it) cannot serve now: the attempt waits
for it. Any other error status fails the attempt (a 500 is a worker's error on this prompt)."""

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

TASKS = Counter(
    "sf_agents_tasks",
    "Tasks by outcome: done (every attempt's SessionEnded stored), retried (gateway unavailable: "
    "held and run again; or runner stopping: handed back), rejected (cannot be run: "
    "dead-lettered)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("done", "retried", "rejected"):  # exported from the start, at 0
    TASKS.labels(_outcome)
ATTEMPTS = Counter(
    "sf_agents_attempts",
    "Attempts by outcome: correct, wrong, failed (the agent raised or exited non-zero), "
    "timed_out, unavailable (the gateway failed: the task is retried)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("correct", "wrong", "failed", "timed_out", "unavailable"):  # at 0 from the start
    ATTEMPTS.labels(_outcome)
REWARD = Histogram(
    "sf_agents_reward",
    "Reward of each scored attempt",
    buckets=(0.0, 0.25, 0.5, 0.75, 1.0),
    registry=REGISTRY,
)
TURNS = Histogram(
    "sf_agents_turns",
    "Turns of each finished attempt",
    buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64),
    registry=REGISTRY,
)
ATTEMPT_SECONDS = Histogram(
    "sf_agents_attempt_seconds",
    "Wall time of each attempt, failed ones included",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
RUNNING = Gauge("sf_agents_tasks_running", "Tasks whose attempts are running", registry=REGISTRY)

Reward = Callable[[bool, int], float]
"""``(correct, turns) -> reward``."""


@dataclass(frozen=True)
class Environment:
    """An env's built-in agent and how it turns a verdict into a reward."""

    agent: Agent
    reward: Reward


ENVIRONMENTS: dict[str, Environment] = {
    "chat": Environment(chat_agent, binary_reward),
    ARITHMETIC: Environment(arithmetic_agent, arithmetic_reward),
}
"""Built-in envs. A configured agent (``agent`` or ``command``) runs any env; an env not listed
here is then scored with ``binary_reward``."""


def session_id(task_id: str, attempt: int, delivery: int = 1, retry: int = 0) -> str:
    """The session of attempt ``attempt`` at a task: ``<task_id>-<attempt>``, with ``-d<n>`` for
    the ``n``-th delivery of the task and ``-r<k>`` for its ``k``-th run after an outage on one
    delivery (a retried task starts fresh sessions). A task id too long to fit the 64-character
    id is cut and completed with its hash."""
    return _suffixed(task_id, f"-{attempt}{_retried(delivery, retry)}")


def group_id(task_id: str, delivery: int = 1, retry: int = 0) -> str:
    """The group of a task's attempts: the task id, with ``-d<n>``/``-r<k>`` once it is retried
    (so a retried task's fresh sessions never join the sessions of an earlier run)."""
    suffix = _retried(delivery, retry)
    return _suffixed(task_id, suffix) if suffix else task_id


def _retried(delivery: int, retry: int) -> str:
    return (f"-d{delivery}" if delivery > 1 else "") + (f"-r{retry}" if retry > 0 else "")


def _suffixed(task_id: str, suffix: str) -> str:
    if len(task_id) + len(suffix) <= 64:
        return task_id + suffix
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:24]
    return f"{task_id[: 64 - len(suffix) - 25]}-{digest}{suffix}"


def gateway_base(url: str) -> str:
    """The gateway's OpenAI base URL (``.../v1``), given it with or without ``/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def scored(
    task: TaskSubmitted,
    sid: str,
    result: AgentResult,
    correct: bool,
    reward: Reward,
    seconds: float,
) -> SessionEnded:
    """The ``SessionEnded`` of an attempt that finished."""
    metrics = {
        **result.metrics,
        "turns": float(result.turns),
        "correct": 1.0 if correct else 0.0,
        "latency_s": seconds,
    }
    return _ended(task, sid, reward(correct, result.turns), metrics)


def failed(task: TaskSubmitted, sid: str, seconds: float) -> SessionEnded:
    """The ``SessionEnded`` of an attempt whose agent failed: reward 0.0, so its group still
    completes."""
    return _ended(task, sid, 0.0, {"failed": 1.0, "latency_s": seconds})


def _ended(task: TaskSubmitted, sid: str, reward: float, metrics: dict[str, float]) -> SessionEnded:
    return SessionEnded(
        session_id=sid,
        reward=reward,
        task_id=task.task_id,
        group_id=task.task_id,
        metrics=dict(list(metrics.items())[:64]),
        group_size=task.group_size,
    )


class AgentRunner:
    """Runs agents on a run's tasks until stopped (see the module docstring)."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        tasks_limits: StreamLimits,
        config: AgentsConfig,
        gateway_url: str,
    ) -> None:
        self._js = js
        self._names = names
        self._limits = tasks_limits
        self._config = config
        self.gateway_url = gateway_base(gateway_url)
        self._health_url = self.gateway_url.removesuffix("/v1") + "/health"
        self._agent: Agent | None = None
        if config.agent is not None:
            self._agent = load_agent(config.agent)
        elif config.command is not None:
            self._agent = CommandAgent(config.command)
        self._http = httpx.AsyncClient(timeout=config.request_timeout_s)
        self._client = openai.AsyncOpenAI(
            base_url=self.gateway_url, api_key="unused", max_retries=0, http_client=self._http
        )
        self._model = config.model
        self._stop = asyncio.Event()
        self._abort = asyncio.Event()

    async def run(self, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        """Take tasks until ``stop`` is set; then let running tasks finish within
        ``shutdown_grace_s`` and hand back the rest."""
        try:
            await self._consume(stop, on_ready)
        finally:
            await self._client.close()
            log.info(kv("agents_stopped", run=self._names.run))

    async def _consume(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        names = self._names
        await durable_info(self._js, names, names.tasks_stream, Durable.AGENTS)
        self._stop = stop
        ingress = tasks_ingress(
            self._js,
            self._names,
            self._handle,
            self._limits,
            durable=Durable.AGENTS,
            batch=self._config.max_tasks,
            concurrency=self._config.max_tasks,
            retry_delay=self._config.retry_delay_s,
        )
        # 1. Consume until stopped (or the ingress fails).
        consuming = asyncio.create_task(ingress.run(stop))
        log.info(kv("agents_started", run=self._names.run, gateway=self.gateway_url))
        on_ready()
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({consuming, stopping}, return_when=asyncio.FIRST_COMPLETED)
            # 2. Stopped: running tasks get the grace period, then are cancelled and handed back.
            if not consuming.done():
                await asyncio.wait({consuming}, timeout=self._config.shutdown_grace_s)
            if not consuming.done():
                log.info(kv("agents_cancelling", after_s=self._config.shutdown_grace_s))
        finally:
            stopping.cancel()
            self._abort.set()
            await consuming

    # -- one task ---------------------------------------------------------------------------
    async def _handle(self, task: TaskSubmitted, delivery: Delivery) -> None:
        # 1. Refuse what cannot be run: the ingress dead-letters it.
        try:
            verify = bind(task.reward)
            agent, reward = self._agent_for(task.env)
        except InvalidTaskError as exc:
            TASKS.labels("rejected").inc()
            raise InvalidMessageError(str(exc)) from exc
        RUNNING.inc()
        try:
            if self._stop.is_set():  # fetched while stopping: hand it back at once
                raise RunnerStoppingError(f"task {task.task_id}: not started, runner stopping")
            # 2. No attempt is scored against a gateway that is down.
            model = await self._check_gateway()
            # 3. Run and score the attempts.
            ended = await self._attempts(task, delivery, agent, reward, verify, model)
        except GatewayUnavailableError:
            if delivery.retry == 0:  # counted once per task held; the ingress logs the pause
                TASKS.labels("retried").inc()
            raise
        except RunnerStoppingError as exc:
            TASKS.labels("retried").inc()
            log.warning(
                kv("task_retried", task=task.task_id, delivered=delivery.num_delivered, error=exc)
            )
            raise
        finally:
            RUNNING.dec()
        # 4. Store every SessionEnded; the ingress acks the task after.
        await asyncio.gather(*(self._publish(message) for message in ended))
        TASKS.labels("done").inc()
        log.info(
            kv(
                "task_done",
                task=task.task_id,
                attempts=len(ended),
                rewards=",".join(f"{m.reward:g}" for m in ended),
            )
        )

    def _agent_for(self, env: str) -> tuple[Agent, Reward]:
        builtin = ENVIRONMENTS.get(env)
        if self._agent is not None:
            return self._agent, builtin.reward if builtin else binary_reward
        if builtin is None:
            raise InvalidTaskError(
                f"env: no agent for env {env!r} (built-in: {', '.join(sorted(ENVIRONMENTS))}; "
                "configure agents.agent or agents.command for others)"
            )
        return builtin.agent, builtin.reward

    async def _check_gateway(self) -> str:
        """The model name to call, once the gateway says it serves."""
        try:
            health = await self._http.get(self._health_url)
            if health.status_code != 200:
                raise GatewayUnavailableError(
                    f"gateway {self._health_url} answered {health.status_code}: {health.text[:200]}"
                )
            if self._model is None:
                models = await self._client.models.list()
                self._model = models.data[0].id
        except (httpx.HTTPError, openai.APIError, IndexError) as exc:
            raise GatewayUnavailableError(
                f"gateway {self.gateway_url} unavailable: {type(exc).__name__}: {exc}"
            ) from exc
        return self._model

    async def _attempts(
        self,
        task: TaskSubmitted,
        delivery: Delivery,
        agent: Agent,
        reward: Reward,
        verify: Callable[[str], bool],
        model: str,
    ) -> list[SessionEnded]:
        """Every attempt's ``SessionEnded``; raises ``RunnerStoppingError`` when aborted and
        ``GatewayUnavailableError`` (other attempts cancelled) when the gateway failed."""

        async def group() -> list[SessionEnded]:
            async with asyncio.TaskGroup() as tg:
                attempts = [
                    tg.create_task(
                        self._attempt(
                            task,
                            session_id(task.task_id, i, delivery.num_delivered, delivery.retry),
                            agent,
                            reward,
                            verify,
                            model,
                        )
                    )
                    for i in range(task.group_size)
                ]
            return [a.result() for a in attempts]

        running = asyncio.create_task(group())
        aborted = asyncio.create_task(self._abort.wait())
        try:
            await asyncio.wait({running, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not running.done():
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        if running.cancelled():
            raise RunnerStoppingError(f"task {task.task_id}: attempts cancelled, runner stopping")
        try:
            ended = running.result()
        except ExceptionGroup as group_error:
            unavailable = [
                e for e in group_error.exceptions if isinstance(e, GatewayUnavailableError)
            ]
            if unavailable:
                raise unavailable[0] from None
            raise
        group = group_id(task.task_id, delivery.num_delivered, delivery.retry)
        return [e.model_copy(update={"group_id": group}) for e in ended]

    def _context(
        self, task: TaskSubmitted, sid: str, verify: Callable[[str], bool], model: str
    ) -> AgentContext:
        """What one attempt's agent is given: a client that sends the session id, and so on."""
        return AgentContext(
            task=task,
            session_id=sid,
            gateway_url=self.gateway_url,
            client=self._client.with_options(default_headers={SESSION_HEADER: sid}),
            model=model,
            temperature=self._config.temperature,
            max_tokens=self._config.max_tokens,
            verify=verify,
        )

    async def _attempt(
        self,
        task: TaskSubmitted,
        sid: str,
        agent: Agent,
        reward: Reward,
        verify: Callable[[str], bool],
        model: str,
    ) -> SessionEnded:
        ctx = self._context(task, sid, verify, model)
        started = time.monotonic()
        outcome, reason = "failed", ""
        try:
            async with asyncio.timeout(self._config.attempt_timeout_s):
                result = await agent(ctx)
            if not isinstance(result, AgentResult):
                raise TypeError(f"the agent returned {type(result).__name__}, not AgentResult")
        except GatewayUnavailableError:
            ATTEMPTS.labels("unavailable").inc()
            raise
        except openai.APITimeoutError as exc:
            reason = f"a gateway call timed out: {exc}"
        except (openai.APIConnectionError, openai.APIStatusError) as exc:
            status = getattr(exc, "status_code", None)
            if status is not None and status not in GATEWAY_DOWN_STATUS:
                # e.g. 500, a worker failed generating: this attempt failed, the gateway serves
                reason = f"the gateway answered {status}: {exc}"
            else:
                ATTEMPTS.labels("unavailable").inc()
                raise GatewayUnavailableError(
                    f"session {sid}: gateway failed: {type(exc).__name__}: {exc}"
                ) from exc
        except TimeoutError:
            outcome, reason = "timed_out", f"timed out after {self._config.attempt_timeout_s:g}s"
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            seconds = time.monotonic() - started
            correct = verify(result.answer)
            ended = scored(task, sid, result, correct, reward, seconds)
            ATTEMPTS.labels("correct" if correct else "wrong").inc()
            REWARD.observe(ended.reward)
            TURNS.observe(result.turns)
            ATTEMPT_SECONDS.observe(seconds)
            return ended
        seconds = time.monotonic() - started
        ATTEMPTS.labels(outcome).inc()
        ATTEMPT_SECONDS.observe(seconds)
        log.warning(
            kv("attempt_failed", task=task.task_id, session=sid, outcome=outcome, reason=reason)
        )
        return failed(task, sid, seconds)

    async def _publish(self, message: SessionEnded) -> None:
        """Store ``message``, trying again across a broker outage (a copy is de-duplicated by its
        session id): giving up would have the task run again in new sessions, its group then
        holding more than ``group_size``. Only the end of the shutdown grace stops the tries."""
        await retry(
            lambda: self._js.publish(
                self._names.traj_end,
                codec.encode(message),
                headers=codec.headers(msg_id=message.session_id),
            ),
            what="session_end_publish",
            stop=self._abort,
        )


async def serve_agents(
    url: str,
    run: str,
    provision: ProvisionConfig,
    config: AgentsConfig,
    gateway_url: str,
    metrics_port: int,
    stop: asyncio.Event,
) -> None:
    """Run the agent runner of ``run`` until ``stop`` is set, serving /metrics."""
    metrics = serve_metrics(REGISTRY, INGRESS_METRICS, port=metrics_port)
    try:
        async with session(url, "seamlessflow-agents") as nc:
            runner = AgentRunner(
                nc.jetstream(), RunNames(run), provision.tasks, config, gateway_url
            )
            await runner.run(stop, on_ready=partial(announce_ready, "agents", metrics.url, run=run))
    finally:
        metrics.close()
    print("agents stopped", flush=True)
