"""A rollout worker's settings (``[worker]``)."""

from pydantic import BaseModel, ConfigDict, Field

from broker.config import Tags
from broker.messages import NAME_PATTERN, Role, RoleField
from broker.registry import default_worker_id
from rollout.engines import EngineSettings, HFEngineConfig


class WorkerConfig(BaseModel):
    """One rollout worker process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker_id: str = Field(
        default_factory=default_worker_id,
        pattern=NAME_PATTERN,
        description="this worker's key in the worker registry; default: <host>-<pid>",
    )
    tags: Tags = Field(
        default_factory=lambda: ["rollout"],
        description="capability tags, comma-separated; node=<host> and gpu=<model> (nvidia-smi) "
        "are added unless given",
    )
    max_running: int = Field(default=32, ge=1, description="requests generated at once")
    max_waiting: int = Field(
        default=4,
        ge=1,
        description="requests held that the engine has not started (no token out yet, e.g. "
        "queued for its KV cache): the worker takes more only below this, and below 1 once a "
        "request waited several of the engine's steps to start, so a backlog waits on the "
        "shared queue for whichever worker's engine has room",
    )
    role: RoleField = Field(
        default=Role.ROLLOUT,
        description="the role it takes at start, until the scheduler asks for another",
    )
    keepalive_s: float = Field(
        default=1.0, gt=0, description="a chunk (the tokens held, else empty) after this silence"
    )
    stream_interval_s: float = Field(
        default=0.01,
        ge=0,
        description="tokens generated within this long of the last tokens sent wait and go in "
        "one chunk (the first and the last go at once); 0: a chunk per engine step",
    )
    heartbeat_s: float = Field(default=5.0, gt=0, description="worker KV renewal period")
    weight_waves: int = Field(
        default=1,
        ge=1,
        description="rolling weight updates: rollout workers (by id) load a version in this many "
        "waves, each once the waves before it serve it, so not all capacity pauses at once",
    )
    wave_timeout_s: float = Field(
        default=30.0, gt=0, description="a wave loads anyway after waiting this long"
    )
    weight_load_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="an engine still loading weights after this is quarantined: routing stops, "
        "its generations continue elsewhere, and it rejoins serving the newest version",
    )
    lend_memory: bool | None = Field(
        default=None,
        description="a worker that also trains (tagged train): hand the device's memory over at "
        "each role switch, the engine asleep while it trains (its KV cache freed, its weights "
        "in host memory) and the trainer's model and optimizer state in host memory while it "
        "generates; unset: on where it trains on CUDA with the torch backend",
    )
    engine: EngineSettings = Field(
        default_factory=HFEngineConfig, description="the engine (its kind) and its own options"
    )
