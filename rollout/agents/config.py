"""The agent runner's settings: the ``[agents]`` section of the run TOML."""

from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.messages import CALLABLE_REF


class AgentsConfig(BaseModel):
    """What the agent runner runs, how many at once, and how long it waits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: str | None = Field(
        default=None,
        pattern=CALLABLE_REF,
        description="'module:function', an `async def agent(ctx) -> AgentResult` run for every "
        "task; default: the built-in agent of the task's env",
        json_schema_extra={"replaces": ["command"]},
    )
    command: list[str] | None = Field(
        default=None,
        min_length=1,
        description="an external command (argv) run once per attempt instead of a Python agent",
        json_schema_extra={"replaces": ["agent"]},
    )
    gateway: str | None = Field(
        default=None,
        pattern=r"^https?://",
        max_length=2048,
        description="the gateway's URL (with or without /v1); required to run agents",
        json_schema_extra={"flag": "gateway"},
    )
    gateway_key_file: Path | None = Field(
        default=None,
        description="a file (mode 0600) holding the gateway key (scope openai) agents call "
        "with, the key alone; unset: no key (a gateway without keys)",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="model name sent to the gateway; default: the first one it lists",
        json_schema_extra={"flag": "served-model-name"},
    )
    max_tasks: int = Field(default=8, ge=1, le=4096, description="tasks run at once")
    attempt_timeout_s: float = Field(
        default=300.0, gt=0, description="an attempt still running then fails (command killed)"
    )
    request_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="HTTP timeout of one gateway call; a call unanswered by then is the gateway "
        "not serving (as a 503): the task is held and run again, not scored",
    )
    temperature: float = Field(default=1.0, ge=0, le=2, description="sampling temperature")
    max_tokens: int = Field(
        default=256, ge=1, description="max_tokens of the built-in chat agent's reply"
    )
    retry_delay_s: float = Field(
        default=5.0,
        gt=0,
        description="a task whose run failed is retried this much later (a gateway outage is "
        "not a failure: the task waits for the gateway)",
    )
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, running tasks get this long to finish; then they are cancelled "
        "and handed back to the stream",
    )

    reward_modules: tuple[str, ...] = Field(
        default=("rollout.agents",),
        max_length=64,
        description="modules (and their submodules) whose functions a task may name as its "
        "reward.function; a task naming another is dead-lettered",
    )

    @model_validator(mode="after")
    def _one_agent_kind(self) -> Self:
        if self.agent is not None and self.command is not None:
            raise ValueError("set at most one of agent ('module:function') and command")
        return self
