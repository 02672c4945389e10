"""The configuration of a local run: one typed model read from TOML; each part gets its section."""

import json
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.config import EmbeddedBrokerConfig, ProvisionConfig, Tags
from broker.subjects import NAME_PATTERN
from common.rewards import RewardsConfig
from rollout.agents.config import AgentsConfig
from rollout.gateway.config import GatewaySettings, ToolSettings
from rollout.worker_config import WorkerConfig
from seamlessflow.exceptions import ConfigError
from seamlessflow.processes import SuperviseConfig
from tagsched.admission import admission_limit
from tagsched.config import LayoutConfig, SchedulerConfig
from tagsched.exceptions import AdmissionError
from trainer.config import TrainerConfig
from trainer.warmstart import WarmStartConfig
from trajectory.config import TrajectoryConfig

DEFAULT_RUN = "quickstart"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section, ToolSettings):
    """The policy: a built-in model or an HF folder, optionally warm-started, and how the
    gateway renders tools for it and reads its tool calls (``tool_template``, ``tool_parser``)."""

    name: str = Field(
        default="tiny",
        description="'tiny', 'smollm2' or an HF model folder",
        json_schema_extra={"flag": "model"},
    )
    served_name: str = Field(
        default="policy",
        min_length=1,
        max_length=256,
        description="the model name clients (agents) ask the gateway for",
        json_schema_extra={"flag": "served-model-name"},
    )
    max_model_len: int = Field(
        default=512, ge=16, description="prompt + output tokens, at most (engines and gateway)"
    )
    warm_start: WarmStartConfig = Field(
        default_factory=lambda: WarmStartConfig(steps=70),
        description="SFT on the task's demonstrations before RL (cached)",
    )


class RolloutConfig(_Section):
    """How many rollout workers ``seamlessflow run`` starts (each configured by ``[worker]``)."""

    workers: int = Field(
        default=1,
        ge=0,
        le=64,
        description="rollout worker processes; colocated layout: workers tagged train and rollout "
        "(at least one), of which the scheduler's spec picks the trainer group",
    )
    threads: int = Field(
        default=1,
        ge=1,
        description="torch threads per worker (with cpus.placement = 'none'); colocated layout: "
        "its engine's (unless [worker.engine] threads is set), while it trains on its share of "
        "the CPUs",
    )


class Placement(StrEnum):
    """How ``seamlessflow run`` places its trainer and rollout workers on CPUs."""

    SPLIT = "split"  # disjoint CPU sets for the trainer and the rollout workers
    NONE = "none"  # no affinity: every process may run on every CPU


class CpusConfig(_Section):
    """CPU placement of ``seamlessflow run`` (``seamlessflow.placement``): the trainer and the
    rollout workers on disjoint CPU sets (Linux affinity, inherited by their child processes),
    one torch thread per CPU; broker, gateway, trajectory manager and agents run anywhere."""

    placement: Placement = Field(
        default=Placement.SPLIT,
        description="split: disjoint CPU sets, threads sized to them (trainer.threads and "
        "rollout.threads unused); none: no affinity, threads from those two",
    )
    trainer: list[int] = Field(
        default_factory=list,
        description="CPU ids of the trainer (all its ranks); empty: the first trainer_share "
        "of this machine's CPUs",
    )
    rollout: list[int] = Field(
        default_factory=list,
        description="CPU ids the rollout workers share out; empty: those the trainer does not get",
    )
    trainer_share: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="the trainer's part of the CPUs when split automatically",
    )

    @model_validator(mode="after")
    def _disjoint(self) -> "CpusConfig":
        for key, ids in (("trainer", self.trainer), ("rollout", self.rollout)):
            if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
                raise ValueError(f"cpus.{key} = {ids}: CPU ids must be distinct and >= 0")
        if both := sorted(set(self.trainer) & set(self.rollout)):
            raise ValueError(
                f"cpus.trainer and cpus.rollout share CPUs {both}: they must be disjoint"
            )
        return self


class TasksConfig(_Section):
    """The built-in task feed of ``seamlessflow run`` (tasks may also come from any client)."""

    env: Literal["arithmetic", "calculator", "guess", "none"] = Field(
        default="arithmetic",
        description="'arithmetic': a+b=; 'calculator': a 3-digit times a 2-digit number, with a "
        "calculator tool (rollout.agents.calculator); 'guess': find a number, higher/lower "
        "(rollout.agents.guess); 'none': submit no tasks (publish your own)",
    )
    max_operand: int = Field(
        default=4, ge=0, le=10**6, description="arithmetic: a, b in [0, max_operand]"
    )
    tools: bool = Field(
        default=True, description="calculator: offer the tool (false: the no-tool baseline)"
    )
    max_number: int = Field(
        default=16, ge=1, le=10**6, description="guess: the secret is in [1, max_number]"
    )
    turn_delay_s: float = Field(
        default=0.0, ge=0, le=60, description="guess: the environment's latency per turn"
    )
    group_size: int = Field(default=8, ge=1, le=1024, description="attempts per task")
    max_turns: int = Field(default=2, ge=1, le=64)
    max_tokens: int = Field(
        default=8, ge=1, le=4096, description="tokens per answer (a number needs few)"
    )
    backlog: int = Field(
        default=16, ge=1, description="tasks kept queued for the scheduler's admission, at most"
    )
    seed: int = Field(default=0, ge=0)


class StopConfig(_Section):
    """When ``seamlessflow run`` ends (whichever comes first)."""

    max_steps: int = Field(default=150, ge=1, description="trainer steps (weight versions)")
    max_seconds: float = Field(default=600.0, gt=0, description="wall-clock limit of RL")


class SlurmNodeKind(_Section):
    """One kind of node of a Slurm job; the trainer's and the rollout workers' kinds differ in
    any of these, and the job is heterogeneous (a het-group each)."""

    partition: str | None = Field(default=None, description="None: the cluster's default")
    constraint: str | None = Field(default=None, description="node features (sbatch --constraint)")
    gpus_per_node: int = Field(default=0, ge=0, le=64, description="sbatch --gpus-per-node")
    mem: str | None = Field(default=None, description="memory per node (sbatch --mem); '0': all")
    tags: Tags = Field(
        default_factory=list,
        description="the workers' capability tags on these nodes (besides train/rollout and "
        "node=<host>), e.g. gpu=h100",
    )


class SlurmRollout(SlurmNodeKind):
    """The rollout workers' nodes: the first nodes of the job (NATS and the single parts run
    on the first of them)."""

    nodes: int = Field(default=1, ge=0, le=4096, description="0: the trainer's node only")
    workers_per_node: int = Field(
        default=1, ge=1, le=64, description="rollout workers per node (GPUs shared out evenly)"
    )


class SlurmConfig(_Section):
    """``seamlessflow slurm``: the sbatch script of a run (``seamlessflow.slurm``). The trainer
    runs on one node of its own kind (a trainer group, ``[layout.train] count``: a worker a GPU
    on as many such nodes as that fills), the rollout workers on theirs."""

    job_name: str = Field(default="seamlessflow", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    time: str = Field(default="1-00:00:00", description="the job's time limit (sbatch --time)")
    account: str | None = Field(default=None, description="sbatch --account")
    log_dir: Path = Field(
        default=Path("slurm-logs"),
        description="a folder on a shared filesystem: <log_dir>/<job id>/<part>.log, the config "
        "and the NATS config of the job",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="shell lines run first on the batch node, inherited by every step (module "
        "load ..., source .venv/bin/activate)",
    )
    sbatch: list[str] = Field(
        default_factory=list, description="more sbatch options for every node kind"
    )
    nats_servers: int = Field(
        default=0,
        ge=0,
        le=5,
        description="NATS servers on the first nodes (1, 3 or 5: a quorum needs an odd number); "
        "0: 3 with 3 nodes or more, else 1",
    )
    nats_server: str = Field(default="nats-server", description="the nats-server on the nodes")
    nats_store: str = Field(
        default="/tmp/seamlessflow-nats", description="node-local JetStream store (per job)"
    )
    nats_max_file_store: str = Field(default="64G", description="JetStream file store per server")
    trainer: SlurmNodeKind = Field(
        default_factory=SlurmNodeKind, description="the trainer's node(s)"
    )
    rollout: SlurmRollout = Field(default_factory=SlurmRollout)

    @model_validator(mode="after")
    def _odd_nats(self) -> "SlurmConfig":
        if self.nats_servers % 2 == 0 and self.nats_servers:
            raise ValueError(f"slurm.nats_servers = {self.nats_servers}: 0 (auto), 1, 3 or 5")
        return self


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(
        default=DEFAULT_RUN, pattern=NAME_PATTERN, description="run name; namespaces every subject"
    )
    broker: EmbeddedBrokerConfig = Field(default_factory=EmbeddedBrokerConfig)
    provision: ProvisionConfig = Field(default_factory=ProvisionConfig)
    agents: AgentsConfig = Field(default_factory=AgentsConfig)
    trajectory: TrajectoryConfig = Field(default_factory=TrajectoryConfig)
    rewards: RewardsConfig = Field(
        default_factory=RewardsConfig,
        description="usable rewards: one range for the agent runner and the trajectory manager",
    )
    trainer: TrainerConfig = Field(
        # The quickstart's tiny model learns at a higher rate than the library default.
        default_factory=lambda: TrainerConfig(lr=1e-4, groups_per_step=8, threads=1),
        description="the trainer (defaults tuned for the quickstart)",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    cpus: CpusConfig = Field(default_factory=CpusConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
    stop: StopConfig = Field(default_factory=StopConfig)
    supervise: SuperviseConfig = Field(
        default_factory=SuperviseConfig, description="restarting the run's processes"
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="seamlessflow slurm")

    @model_validator(mode="after")
    def _one_temperature(self) -> "RunConfig":
        if self.trainer.temperature != self.agents.temperature:
            raise ValueError(
                f"trainer.temperature ({self.trainer.temperature}) must equal agents.temperature "
                f"({self.agents.temperature}): the trainer scores tokens at the temperature they "
                "were sampled at"
            )
        return self

    @model_validator(mode="after")
    def _admission_within_staleness(self) -> "RunConfig":
        try:
            admission_limit(
                steps_ahead=self.scheduler.steps_ahead,
                groups_per_step=self.trainer.groups_per_step,
                max_staleness=self.trainer.max_staleness,
            )
        except AdmissionError as exc:
            raise ValueError(str(exc)) from exc
        return self

    @model_validator(mode="after")
    def _one_rank_a_group_member(self) -> "RunConfig":
        """A trainer group of several workers takes one rank each (``trainer.group`` refuses a
        member with local ranks)."""
        count = self.layout.train.count
        if isinstance(count, int) and count > 1 and self.trainer.world_size > 1:
            raise ValueError(
                f"[layout.train] count = {count} is a trainer group of that many workers, one "
                f"rank each: it needs trainer.world_size = 1 (it is {self.trainer.world_size})"
            )
        return self

    @model_validator(mode="after")
    def _memory_lent_whole(self) -> "RunConfig":
        """A worker asked to lend the device's memory hands all of its trainer's over."""
        if not self.worker.lend_memory:
            return self
        if self.trainer.backend.kind == "megatron":
            raise ValueError(
                "worker.lend_memory: the megatron backend cannot hand its GPU memory over yet "
                "(set lend_memory = false)"
            )
        if self.trainer.world_size > 1:
            raise ValueError(
                "worker.lend_memory hands over this process's memory only: it needs "
                f"trainer.world_size = 1 (it is {self.trainer.world_size}), one rank per worker"
            )
        return self

    output_dir: Path | None = Field(
        default=None, description="summary and reward curve; default: <state dir>/runs/<run>"
    )


def load_config(path: Path | None) -> RunConfig:
    """Defaults when ``path`` is None; else the file, validated, with errors that name it: TOML,
    or JSON for a ``.json`` file (the resolved configs ``seamlessflow run`` gives its children)."""
    if path is None:
        return RunConfig()
    try:
        return override(RunConfig(), read_table(path))
    except ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def read_table(path: Path) -> dict[str, Any]:
    """The file's contents as nested tables, unvalidated: TOML, or JSON for a ``.json`` file."""
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        text = path.read_text()
        table = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid {kind}: {exc}") from exc
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: a run config is a table, not {type(table).__name__}")
    return table


def override(config: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """``config`` with ``changes`` (nested like the TOML) applied key by key, so a partial section
    keeps the rest, and validated as a whole; raises pydantic's ``ValidationError``."""
    return RunConfig.model_validate(_merge(config.model_dump(), changes))


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    if changes.get("kind", base.get("kind")) != base.get("kind"):
        return dict(changes)  # another kind of engine or backend: none of the old options apply
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = _merge(base[key], value)
        else:
            out[key] = value
    return out
