"""The gateway's settings."""

from pathlib import Path

from pydantic import ConfigDict, Field

from broker.subjects import NAME_PATTERN
from rollout.gateway.calls import CallLimits


class GatewaySettings(CallLimits):
    """The ``[gateway]`` section of a run config: everything but the model and the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port; 0: a free port")
    stop_token_ids: list[int] | None = Field(
        default=None, description="tokens that end generation; default: the model's eos ids"
    )
    session_cache_sessions: int = Field(default=4096, ge=1, description="sessions remembered")
    session_cache_tokens: int = Field(
        default=16_000_000, ge=1, description="token ids remembered over all sessions"
    )


class GatewayConfig(GatewaySettings):
    """The gateway's settings (its call limits included), the model it serves and its run."""

    model: str = Field(min_length=1, max_length=256, description="model name clients use")
    model_path: Path = Field(description="HF model folder (tokenizer, chat template, config)")
    run: str = Field(pattern=NAME_PATTERN, description="run whose gen/traj streams to use")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="prompt + output tokens; default: the model's max_position_embeddings",
    )
