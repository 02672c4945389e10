"""The agent runner: tasks from ``sf.<run>.tasks`` -> agents against the gateway -> rewards on
``sf.<run>.traj.end``.

Per task (``TaskSubmitted``), taken through the validated tasks ingress, up to ``max_tasks`` at
once:

1. refuse what cannot be run (unknown verifier, unusable reference, no agent for the env, a
   reward function not allowed or not importable): the ingress dead-letters it with the
   reason, before any agent runs;
2. check the gateway serves (``/health``, one answer for the tasks starting within a second:
   ``GatewayClients.serving``): if not, ``GatewayUnavailableError`` pauses the
   ingress, which holds the task (its delivery not spent, never dead-lettered for the outage)
   and runs it again once the gateway serves; it is never scored against an outage;
3. run ``group_size`` attempts at once, each in its own session (``session_id``), and score
   each (``rewards``: the task's reward function, else the agent's own reward, else the
   verifier on the final answer). An agent that raises, exits non-zero or times out ends its
   attempt with reward 0.0 and ``{"failed": 1}``; an unusable reward (not finite, outside
   ``rewards.range``, a reward function that raised) ends it with reward 0.0 and
   ``{"unscored": 1}``; a gateway failure in any attempt (502-504, or no answer to a call
   within ``request_timeout_s``: the rollout behind it cannot serve now; a call to another
   address is the agent's, its failure the attempt's; an agent failing any other way, or timing
   out, after the gateway told it could not serve one of its calls (``rollout.agents.outage``:
   a 503 a client other than the SDK reports its own way) or while ``/health`` fails) cancels
   the others and the whole task is run again as in 2, in new sessions (nothing is published);
4. publish one ``SessionEnded`` per attempt (``Nats-Msg-Id`` = session id); the ingress acks the
   task once all are stored. A task delivered again to the same runner (an outage lost its
   in-progress signals or its ack, or it was admitted again) runs one group: the copy waits for
   the running one, or is acked at once when it is done (``rollout.agents.once``).

On stop, no new task is taken; running ones get ``shutdown_grace_s`` to finish, then their
attempts are cancelled (commands killed) and the tasks handed back (nak) unpublished.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial

import openai
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker import codec
from broker.client import session
from broker.config import ProvisionConfig, StreamLimits
from broker.exceptions import InvalidMessageError
from broker.ingress import Delivery, tasks_ingress
from broker.messages import SessionEnded, TaskSubmitted
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.permissions import Principal
from broker.provision import durable_info
from broker.retry import retry
from broker.subjects import Durable, RunNames
from common.log import kv
from common.metrics import serve_metrics
from common.ready import announce_ready
from common.rewards import RewardsConfig
from rollout.agents.agents import Agent, AgentContext, AgentResult, CommandAgent, load_agent
from rollout.agents.clients import GatewayClients
from rollout.agents.config import AgentsConfig
from rollout.agents.environments import agent_for
from rollout.agents.exceptions import (
    GatewayUnavailableError,
    InvalidTaskError,
    RunnerStoppingError,
    UnscoredError,
)
from rollout.agents.once import OncePerTask
from rollout.agents.outage import REGISTRY as OUTAGE_METRICS
from rollout.agents.outage import GatewayOutage
from rollout.agents.rewards import CallLog, Scoring, Transcript, ended, scoring_for
from rollout.agents.sessions import (
    gateway_base,
    gateway_headers,
    group_id,
    same_origin,
    session_id,
)
from rollout.gateway.keys import read_key_file

log = logging.getLogger(__name__)

GATEWAY_DOWN_STATUS = frozenset({401, 502, 503, 504})
"""Gateway answers that mean it (or the rollout behind it) cannot serve now, or not us (401: it
refused the runner's key, ``gateway_key_file``): the attempt waits for it, unscored. Any other
error status fails the attempt (a 500 is a worker's error on this prompt)."""

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

TASKS = Counter(
    "sf_agents_tasks",
    "Tasks by outcome: done (every attempt's SessionEnded stored), retried (gateway unavailable: "
    "held and run again; or runner stopping: handed back), rejected (cannot be run: "
    "dead-lettered), duplicate (delivered again while or after this runner ran it: acked once "
    "the first delivery's attempts were stored, not run again)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("done", "retried", "rejected", "duplicate"):  # exported from the start, at 0
    TASKS.labels(_outcome)
ATTEMPTS = Counter(
    "sf_agents_attempts",
    "Attempts by outcome: correct, wrong (the verifier scored), rewarded (a reward function or "
    "the agent scored), unscored (the reward was unusable), failed (the agent raised or exited "
    "non-zero), timed_out, unavailable (the gateway failed: the task is retried)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("correct", "wrong", "rewarded", "unscored", "failed", "timed_out", "unavailable"):
    ATTEMPTS.labels(_outcome)  # at 0 from the start
UNSCORED = Counter(
    "sf_agents_unscored",
    "Attempts left unscored (reward 0.0), by scorer (function:<module:function>, agent, "
    "verifier) and reason (raised, not_a_number, not_finite, out_of_range, no_reward)",
    ["scorer", "reason"],
    registry=REGISTRY,
)
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


class AgentRunner:
    """Runs agents on a run's tasks until stopped (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        names: RunNames,
        tasks_limits: StreamLimits,
        config: AgentsConfig,
        gateway_url: str,
        rewards: RewardsConfig | None = None,
    ) -> None:
        self._js = nc.jetstream()
        self._reward_range = (rewards or RewardsConfig()).range
        self._names = names
        self._limits = tasks_limits
        self._config = config
        self.gateway_url = gateway_base(gateway_url)
        self._api_key = "unused"  # a gateway without keys takes any
        if config.gateway_key_file is not None:
            self._api_key = read_key_file(config.gateway_key_file)
        self._agent: Agent | None = None
        if config.agent is not None:
            self._agent = load_agent(config.agent)
        elif config.command is not None:
            self._agent = CommandAgent(config.command)
        self._calls = CallLog()  # the calls of sessions whose task has a reward function
        self._clients = GatewayClients(
            self.gateway_url,
            self._api_key,
            max_tasks=config.max_tasks,
            timeout_s=config.request_timeout_s,
            on_request=self._calls.on_request,
            model=config.model,
        )
        self._outage = GatewayOutage(nc, names, self._clients)
        self._stop = asyncio.Event()
        self._abort = asyncio.Event()
        self._once = OncePerTask()

    async def run(self, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        """Take tasks until ``stop`` is set; then let running tasks finish within
        ``shutdown_grace_s`` and hand back the rest."""
        await self._outage.start()
        try:
            await self._consume(stop, on_ready)
        finally:
            await self._outage.stop()
            await self._clients.aclose()
            log.info(kv("agents_stopped", run=self._names.run))

    async def _consume(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        names = self._names
        await durable_info(self._js, names, names.tasks_stream, Durable.AGENTS, stop=stop)
        self._stop = stop
        ingress = tasks_ingress(
            self._js,
            self._names,
            self._handle_once,
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
    async def _handle_once(self, task: TaskSubmitted, delivery: Delivery) -> None:
        """``_handle``, once per task id in this runner (``rollout.agents.once``)."""
        await self._once.run(
            task.task_id,
            partial(self._handle, task, delivery),
            partial(self._duplicate, task, delivery),
        )

    def _duplicate(self, task: TaskSubmitted, delivery: Delivery, state: str) -> None:
        TASKS.labels("duplicate").inc()
        log.warning(
            kv(
                "task_delivered_again",
                task=task.task_id,
                state=state,
                delivered=delivery.num_delivered,
            )
        )

    async def _handle(self, task: TaskSubmitted, delivery: Delivery) -> None:
        # 1. Refuse what cannot be run: the ingress dead-letters it.
        try:
            agent, reward = agent_for(task.env, self._agent)
            scoring = scoring_for(
                task.reward,
                reward,
                agent_may_reward=self._agent is not None,
                reward_range=self._reward_range,
                reward_modules=self._config.reward_modules,
            )
        except InvalidTaskError as exc:
            TASKS.labels("rejected").inc()
            raise InvalidMessageError(str(exc)) from exc
        RUNNING.inc()
        try:
            if self._stop.is_set():  # fetched while stopping: hand it back at once
                raise RunnerStoppingError(f"task {task.task_id}: not started, runner stopping")
            # 2. No attempt is scored against a gateway that is down.
            model = await self._clients.serving()
            # 3. Run and score the attempts.
            sessions = await self._attempts(task, delivery, agent, scoring, model)
        except GatewayUnavailableError:
            self._clients.down()
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
        await asyncio.gather(*(self._publish(message) for message in sessions))
        TASKS.labels("done").inc()
        log.info(
            kv(
                "task_done",
                task=task.task_id,
                attempts=len(sessions),
                rewards=",".join(f"{m.reward:g}" for m in sessions),
            )
        )

    async def _attempts(
        self,
        task: TaskSubmitted,
        delivery: Delivery,
        agent: Agent,
        scoring: Scoring,
        model: str,
    ) -> list[SessionEnded]:
        """Every attempt's ``SessionEnded``; raises ``RunnerStoppingError`` when aborted and
        ``GatewayUnavailableError`` (other attempts cancelled) when the gateway failed."""

        sids = [
            session_id(task.task_id, i, delivery.num_delivered, delivery.retry)
            for i in range(task.group_size)
        ]

        async def group() -> list[SessionEnded]:
            async with asyncio.TaskGroup() as tg:
                attempts = [
                    tg.create_task(self._attempt(task, sid, agent, scoring, model)) for sid in sids
                ]
            return [a.result() for a in attempts]

        with self._outage.watching(sids):  # the gateway's notices of their calls
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
            results = running.result()
        except ExceptionGroup as group_error:
            unavailable = [
                e for e in group_error.exceptions if isinstance(e, GatewayUnavailableError)
            ]
            if unavailable:
                raise unavailable[0] from None
            raise
        group = group_id(task.task_id, delivery.num_delivered, delivery.retry)
        return [e.model_copy(update={"group_id": group}) for e in results]

    def _context(
        self, task: TaskSubmitted, sid: str, verify: Callable[[str], bool], model: str
    ) -> AgentContext:
        """What one attempt's agent is given: a client that sends the session id, and so on."""
        return AgentContext(
            task=task,
            session_id=sid,
            gateway_url=self.gateway_url,
            api_key=self._api_key,
            client=self._clients.for_task(task.task_id).with_options(
                default_headers=gateway_headers(sid, task.task_id)
            ),
            model=model,
            temperature=self._config.temperature,
            max_tokens=self._config.max_tokens,
            verify=verify,
        )

    async def _attempt(
        self, task: TaskSubmitted, sid: str, agent: Agent, scoring: Scoring, model: str
    ) -> SessionEnded:
        ctx = self._context(task, sid, scoring.verifier(task.task_id), model)
        started = time.monotonic()
        outcome, reason = "failed", ""
        if scoring.records:
            self._calls.open(sid)
        try:
            async with asyncio.timeout(self._config.attempt_timeout_s):
                result = await agent(ctx)
            if not isinstance(result, AgentResult):
                raise TypeError(f"the agent returned {type(result).__name__}, not AgentResult")
        except GatewayUnavailableError:
            ATTEMPTS.labels("unavailable").inc()
            raise
        except (openai.APIConnectionError, openai.APIStatusError) as exc:
            status = getattr(exc, "status_code", None)
            if not same_origin(exc.request.url, self.gateway_url):
                # the agent's own call to another service (a judge, a tool's API): its failure
                reason = f"{type(exc).__name__} from {exc.request.url}: {exc}"
            elif status is not None and status not in GATEWAY_DOWN_STATUS:
                # e.g. 500, a worker failed generating: this attempt failed, the gateway serves
                reason = f"the gateway answered {status}: {exc}"
            else:  # 502-504, or no answer (refused, cut off, none within request_timeout_s)
                ATTEMPTS.labels("unavailable").inc()
                raise GatewayUnavailableError(
                    f"session {sid}: gateway failed: {type(exc).__name__}: {exc}"
                ) from exc
        except TimeoutError:
            outcome, reason = "timed_out", f"timed out after {self._config.attempt_timeout_s:g}s"
        except UnscoredError as exc:  # a command printed an SF_REWARD that is not a number
            seconds = time.monotonic() - started
            return self._unscored(task, sid, "agent", exc, {"latency_s": seconds})
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            transcript = Transcript.of(task, sid, result, self._calls.close(sid))
            return await self._score(task, transcript, result, scoring, started)
        finally:
            self._calls.close(sid)
        seconds = time.monotonic() - started
        try:  # a client other than the SDK (raw httpx, a command's) fails its own way
            await self._outage.check(sid, reason)
        except GatewayUnavailableError:
            ATTEMPTS.labels("unavailable").inc()
            raise
        ATTEMPTS.labels(outcome).inc()
        ATTEMPT_SECONDS.observe(seconds)
        log.warning(
            kv("attempt_failed", task=task.task_id, session=sid, outcome=outcome, reason=reason)
        )
        return ended(task, sid, 0.0, {"failed": 1.0, "latency_s": seconds})

    async def _score(
        self,
        task: TaskSubmitted,
        transcript: Transcript,
        result: AgentResult,
        scoring: Scoring,
        started: float,
    ) -> SessionEnded:
        """The ``SessionEnded`` of an attempt whose agent finished: scored, or unscored."""
        seconds = time.monotonic() - started
        metrics = {**result.metrics, "turns": float(result.turns), "latency_s": seconds}
        TURNS.observe(result.turns)
        ATTEMPT_SECONDS.observe(seconds)
        try:
            reward, verdict = await scoring.score(task, transcript)
        except UnscoredError as exc:
            scorer = scoring.scorer(transcript)
            return self._unscored(task, transcript.session_id, scorer, exc, metrics)
        if "correct" in verdict:
            ATTEMPTS.labels("correct" if verdict["correct"] else "wrong").inc()
        else:
            ATTEMPTS.labels("rewarded").inc()
        REWARD.observe(reward)
        return ended(task, transcript.session_id, reward, {**metrics, **verdict})

    def _unscored(
        self,
        task: TaskSubmitted,
        sid: str,
        scorer: str,
        error: UnscoredError,
        metrics: dict[str, float],
    ) -> SessionEnded:
        """An attempt without a usable reward: reward 0.0, counted and logged with the reason."""
        ATTEMPTS.labels("unscored").inc()
        UNSCORED.labels(scorer, error.kind).inc()
        log.warning(
            kv(
                "attempt_unscored",
                task=task.task_id,
                session=sid,
                scorer=scorer,
                reason=error.kind,
                error=error.reason,
            )
        )
        return ended(task, sid, 0.0, {**metrics, "unscored": 1.0})

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
    rewards: RewardsConfig,
    gateway_url: str,
    metrics_port: int,
    stop: asyncio.Event,
) -> None:
    """Run the agent runner of ``run`` until ``stop`` is set, serving /metrics."""
    metrics = serve_metrics(REGISTRY, INGRESS_METRICS, OUTAGE_METRICS, port=metrics_port)
    try:
        async with session(url, "seamlessflow-agents", stop=stop, principal=Principal.AGENTS) as nc:
            runner = AgentRunner(nc, RunNames(run), provision.tasks, config, gateway_url, rewards)
            await runner.run(stop, on_ready=partial(announce_ready, "agents", metrics.url, run=run))
    finally:
        metrics.close()
    print("agents stopped", flush=True)
