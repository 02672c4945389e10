"""The configs of the ``emulated`` engine and trainer backend (for benchmarks only), which join
the engine and backend kinds as plugins (``common.plugins``, this package's entry points). Pure
pydantic, and nothing from the services they plug into: those read them while loading their own
configs."""

from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field

from common.plugins import PartConfig
from emulation.workload import Workload

WorkloadOption = Annotated[Workload, BeforeValidator(Workload.parse)]
"""A config field's workload: a table, or JSON text (a flag's value)."""


class EmulatedEngineConfig(PartConfig):
    """For benchmarks only: an engine that spends the time ``workload`` models instead of
    computing (``emulation.engine``); its tokens mean nothing."""

    implementation: ClassVar[str] = "emulation.engine"
    benchmark_only: ClassVar[str] = (
        "emulated engine: it spends modelled time, its tokens mean nothing"
    )
    kind: Literal["emulated"] = "emulated"
    seed: int = Field(default=0, ge=0, description="draws of requests that carry no sampling seed")
    workload: WorkloadOption = Field(
        default_factory=Workload,
        description="lengths and durations (emulation.workload.Workload, as a table or JSON); "
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


class EmulatedBackendConfig(PartConfig):
    """For benchmarks only: a backend that spends the step time ``workload.trainer`` models
    instead of training (``emulation.backend``); its weights are a small blob."""

    implementation: ClassVar[str] = "emulation.backend"
    benchmark_only: ClassVar[str] = (
        "emulated trainer backend: it spends modelled time, its weights never learn"
    )
    kind: Literal["emulated"] = "emulated"
    workload: WorkloadOption = Field(
        default_factory=Workload,
        description="its trainer cost (emulation.workload.Workload, as a table or JSON); unknown "
        "keys are refused",
    )
    devices: int = Field(
        default=1,
        ge=1,
        le=1 << 16,
        description="devices the modelled trainer spans (data parallel)",
    )
    weight_floats: int = Field(
        default=1024, ge=1, le=1 << 28, description="float32 values in each published weight blob"
    )
