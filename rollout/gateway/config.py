"""The gateway's settings."""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.subjects import NAME_PATTERN
from rollout.gateway.calls import CallLimits


class GatewaySettings(CallLimits):
    """The ``[gateway]`` section of a run config: everything but the model and the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port; 0: a free port")
    keys_file: Path | None = Field(
        default=None,
        description="bearer keys file (TOML, mode 0600; docs/protocol.md 'Gateway keys'); "
        "unset: no keys (open, allowed on a loopback host only, with a warning)",
    )
    stop_token_ids: list[int] | None = Field(
        default=None, description="tokens that end generation; default: the model's eos ids"
    )
    keep_alive_s: float = Field(
        default=120.0,
        gt=0,
        description="an idle HTTP connection is closed after this long: longer than clients "
        "keep one in their pools (httpx 5 s, Go 90 s), or a call sent as the gateway closes it "
        "fails as if the gateway were down",
    )
    session_cache_sessions: int = Field(default=4096, ge=1, description="sessions remembered")
    session_cache_tokens: int = Field(
        default=16_000_000, ge=1, description="token ids remembered over all sessions"
    )


class ToolSettings(BaseModel):
    """How the gateway puts tools into the model's prompts and reads its tool calls: part of the
    ``[model]`` section (they are the model's, as vLLM's ``--chat-template`` and
    ``--tool-call-parser``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tool_template: str | None = Field(
        default=None,
        min_length=1,
        description="chat template for requests that carry tools, instead of the model's: a "
        "Jinja file, or 'hermes' (shipped: ChatML, <tool_call> calls); default: the model's "
        "(a request with tools gets a 400 if that does not render tools, as SmolLM2's)",
    )
    tool_parser: Literal["hermes", "none"] = Field(
        default="hermes",
        description="how tool calls are read from outputs: 'hermes' (<tool_call>{json}"
        "</tool_call>) or 'none' (never: it is all content)",
        json_schema_extra={"flag": "tool-call-parser"},
    )


class GatewayConfig(GatewaySettings, ToolSettings):
    """The gateway's settings (its call limits included), the model it serves and its run."""

    model: str = Field(min_length=1, max_length=256, description="model name clients use")
    model_path: Path = Field(description="HF model folder (tokenizer, chat template, config)")
    run: str = Field(pattern=NAME_PATTERN, description="run whose gen/traj streams to use")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="prompt + output tokens; default: the model's max_position_embeddings",
    )
