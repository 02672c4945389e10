"""The trainer's typed configuration: the ``[trainer]`` section of a run's TOML. Backends of
other packages join through the entry point group ``seamlessflow.trainer_backends``
(``common.plugins``)."""

import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Self, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.config import Tags
from broker.registry import default_worker_id
from broker.subjects import NAME_PATTERN
from broker.worker_messages import TrainerShape
from common.plugins import BACKEND_GROUP, PartConfig, part_configs
from common.precision import Precision
from common.staleness import StalenessMode


def _memory_folder() -> Path:
    shm = Path("/dev/shm")
    return shm / "seamlessflow" if shm.is_dir() else Path(tempfile.gettempdir()) / "seamlessflow"


class Advantage(StrEnum):
    """How a sample's reward becomes its advantage within its group."""

    GRPO = "grpo"  # (reward - group mean) / (group std + eps)
    BASELINE = "baseline"  # reward - group mean


class LossAggregation(StrEnum):
    """How a minibatch's per-token losses are averaged."""

    TOKEN = "token"  # every loss token weighs the same: a longer sample weighs more
    SAMPLE = "sample"  # every sample weighs the same, shared out over its loss tokens


class TorchBackendConfig(PartConfig):
    """An HF causal LM trained with torch, data-parallel over torch.distributed."""

    implementation: ClassVar[str] = "trainer.backends.torch"
    kind: Literal["torch"] = "torch"
    pack_tokens: int = Field(
        default=256,
        ge=1,
        le=1 << 20,
        description="samples are packed into rows of up to this many tokens, each attending "
        "only to itself (a longer sample gets a row of its own); 1: one padded row per sample",
    )
    dtype: Precision = Field(
        default=Precision.FLOAT32,
        description="compute dtype of forward and backward; bfloat16 autocasts them (weights "
        "and optimizer stay float32) and needs a CPU with AVX512-BF16/AMX or a bf16 GPU",
    )


class MegatronBackendConfig(PartConfig):
    """A megatron-core ``GPTModel`` (CUDA only), tensor-parallel within ``tensor_parallel``
    ranks and data-parallel over the rest."""

    implementation: ClassVar[str] = "trainer.backends.megatron"
    kind: Literal["megatron"] = "megatron"
    tensor_parallel: int = Field(
        default=1, ge=1, le=64, description="tensor-parallel ranks (must divide world_size)"
    )


BACKEND_CONFIGS = part_configs(BACKEND_GROUP, (TorchBackendConfig, MegatronBackendConfig))
"""Backend kind -> its config, built in or from an entry point; the backend itself is the
module its config names (``implementation``)."""

BackendConfig = Annotated[Union[*BACKEND_CONFIGS.values()], Field(discriminator="kind")]
"""One trainer backend's config, chosen by its ``kind``."""


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: BackendConfig = Field(
        default_factory=TorchBackendConfig, description="the backend and its own options"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: cuda when available, else cpu"
    )
    world_size: int = Field(
        default=1, ge=1, le=1024, description="data-parallel train ranks (local processes)"
    )
    threads: int | None = Field(
        default=None, ge=1, le=1024, description="torch threads per rank; None: OMP_NUM_THREADS"
    )

    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient clipping norm")

    temperature: float = Field(
        default=1.0,
        gt=0,
        description="the rollout sampling temperature: logits are divided by it, so proximal "
        "logprobs are those of the distribution sampled from (the behaviour logprobs' own)",
    )
    groups_per_step: int = Field(
        default=4, ge=1, le=1 << 16, description="complete groups per training step"
    )
    minibatches: int = Field(
        default=1, ge=1, le=1024, description="optimizer steps per training step (batch split)"
    )
    advantage: Advantage = Field(default=Advantage.GRPO, description="grpo or baseline")
    std_eps: float = Field(default=1e-6, gt=0, description="added to the group std (grpo)")
    loss_aggregation: LossAggregation = Field(
        default=LossAggregation.TOKEN,
        description="'token': the loss is the mean over a minibatch's loss tokens; 'sample': the "
        "mean over its samples of each one's token mean (multi-turn tasks whose failures run "
        "more turns: under a token mean their many tokens outweigh the successes' and push down "
        "what every turn emits)",
    )
    clip_eps_low: float = Field(default=0.2, ge=0, lt=1, description="ratio floor is 1 - this")
    clip_eps_high: float = Field(default=0.28, ge=0, description="ratio ceiling is 1 + this")
    importance_cap: float = Field(
        default=5.0, gt=0, description="cap of the behaviour->proximal importance weight"
    )
    kl_coef: float = Field(
        default=0.0, ge=0, description="k3 KL to a frozen reference model; 0: none loaded"
    )

    max_staleness: int = Field(
        default=4, ge=0, description="versions a sample's oldest loss token may lag the trainer"
    )
    staleness_mode: StalenessMode = Field(
        default=StalenessMode.DROP, description="drop or downweight samples past max_staleness"
    )
    stale_weight: float = Field(
        default=0.5, ge=0, le=1, description="loss multiplier of stale samples (downweight)"
    )

    checkpoint_dir: Path | None = Field(
        default=None, description="checkpoint here (see checkpoint_every); None: no checkpoints"
    )
    checkpoint_every: int = Field(
        default=100,
        ge=1,
        description="checkpoint at least every this many versions (and at stop): model and "
        "AdamW state copied into memory in the step, written in the background (one write at a "
        "time); that step's samples are acked once it is durable, the steps between at once. A "
        "crash loses the steps since the last durable checkpoint (the samples of the steps "
        "between checkpoints with them: they were acked; those of a checkpoint's own step are "
        "trained again) and training goes on from it under new versions",
    )
    checkpoint_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="and at the first version this long after the last checkpoint (or the "
        "trainer's start), whichever comes first: a crash loses under 2 x this much training "
        "(or 2 x checkpoint_every versions); 0: every version (exactly once across a crash)",
    )
    keep_trained_steps: int = Field(
        default=64, ge=1, description="steps whose sample ids a checkpoint remembers (dedup)"
    )
    weights_dir: Path | None = Field(
        default=None, description="shared folder for weight blobs; None: the run's object store"
    )
    local_weights: bool = Field(
        default=True,
        description="also write each version to local_weights_dir, where rollout workers on "
        "this host load it in place (no fetch); workers elsewhere use the store",
    )
    local_weights_dir: Path = Field(
        default_factory=_memory_folder,
        description="host-local weight copies (the newest 3 versions, in <instance>/<run>/: "
        "apart from a run of the same name on another broker): tmpfs, so they stay in memory; "
        "/dev/shm/seamlessflow where /dev/shm exists",
    )
    group_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="a group still incomplete this long after its first sample is trained with "
        "the sessions it has (a session can end without samples)",
    )
    order_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="in drop mode, how long a step may wait for an earlier admitted task's group "
        "that it would put past max_staleness (trainer.order); 0: steps never wait",
    )
    overlap: bool = Field(
        default=False,
        description="compute a step's gradients as its groups complete (every complete group "
        "waiting in one pass), the oldest first, and commit once groups_per_step are computed: "
        "the wait for a step's last (longest) groups overlaps its compute, and order_wait_s "
        "bounds only idle waiting; needs "
        "minibatches = 1. The scheduler then lends the trainer's workers only where they are "
        "all the rollout (colocated)",
    )
    max_pending_samples: int = Field(
        default=4096, ge=1, description="samples held un-acked while their groups fill"
    )
    worker_id: str = Field(
        default_factory=lambda: default_worker_id("trainer-"),
        pattern=NAME_PATTERN,
        description="this trainer's key in the worker registry",
    )
    tags: Tags = Field(
        default_factory=lambda: ["train"],
        description="capability tags, comma-separated; node=<host> and gpu=<model> (nvidia-smi) "
        "are added unless given",
    )
    heartbeat_s: float = Field(default=5.0, gt=0, description="worker registry renewal period")
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="trainer group of workers: how long its rendezvous and each collective may "
        "wait for a member before the group re-forms (rank 0 pings an idle group every third "
        "of it)",
    )

    def shape(self) -> TrainerShape:
        """What the scheduler admits by (the trainer's registry entry carries it)."""
        return TrainerShape(
            groups_per_step=self.groups_per_step,
            max_staleness=self.max_staleness,
            staleness_mode=self.staleness_mode.value,
            overlap=self.overlap,
        )

    @model_validator(mode="after")
    def _backend_fits(self) -> Self:
        backend = self.backend
        if isinstance(backend, MegatronBackendConfig):
            if self.device == "cpu":
                raise ValueError("the megatron backend runs on CUDA only: set device to cuda/auto")
            if self.world_size % backend.tensor_parallel:
                raise ValueError(
                    f"backend.tensor_parallel={backend.tensor_parallel} does not divide "
                    f"world_size={self.world_size}"
                )
        return self

    @model_validator(mode="after")
    def _minibatches_fit(self) -> Self:
        if self.minibatches > self.groups_per_step:
            raise ValueError(
                f"minibatches={self.minibatches} exceeds groups_per_step={self.groups_per_step}: "
                "each minibatch needs at least one group"
            )
        if self.overlap and self.minibatches > 1:
            raise ValueError(
                f"overlap needs minibatches = 1 (got {self.minibatches}): a step computed ahead "
                "takes one optimizer step"
            )
        return self
