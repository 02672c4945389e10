"""A colocated worker hands the device's memory over at each role switch (``[worker]
lend_memory``): which workers do, and the trainer's side of it on CUDA. The engine's side is in
the engine contract (``check_sleep_aborts_holds_requests_and_refuses_resume_and_loads``),
the worker's in ``tests/test_worker.py`` (a lend that sleeps) and ``tests/test_run.py`` (a
colocated run lending at every switch). What frees memory only does so on a GPU: the CUDA tests
here run where one is."""

from pathlib import Path

import pytest
import torch

from broker.config import ProvisionConfig
from colocate.worker import Colocated, lends_memory
from rollout.engines import EngineConfig
from rollout.worker_config import WorkerConfig
from seamlessflow.config import load_config
from seamlessflow.exceptions import ConfigError
from tests.test_step import items
from trainer.backends import build_backend
from trainer.config import MegatronBackendConfig, TrainerConfig
from trainer.step import train_step

NO_CUDA = "needs a CUDA GPU"


def _colocated(tmp_path: Path, worker: dict, trainer: dict) -> Colocated:
    return Colocated(
        url="nats://127.0.0.1:4222",
        run="r",
        provision=ProvisionConfig(),
        engine=EngineConfig(model=tmp_path, max_model_len=64),
        worker=WorkerConfig(**worker),
        trainer=TrainerConfig(**trainer),
    )


def test_which_colocated_workers_lend_the_devices_memory(tmp_path: Path) -> None:
    unset, on, off = {}, {"lend_memory": True}, {"lend_memory": False}
    cpu = {"device": "cpu"}
    assert lends_memory(_colocated(tmp_path, unset, cpu)) is False  # nothing to hand over
    assert lends_memory(_colocated(tmp_path, on, cpu)) is True  # asked: the engine sleeps
    assert lends_memory(_colocated(tmp_path, off, cpu)) is False
    auto = {"device": "auto"}
    assert lends_memory(_colocated(tmp_path, unset, auto)) is torch.cuda.is_available()
    megatron = {"device": "auto", "backend": MegatronBackendConfig()}
    assert lends_memory(_colocated(tmp_path, unset, megatron)) is False  # it cannot offload
    several = {"device": "auto", "world_size": 2}
    assert lends_memory(_colocated(tmp_path, unset, several)) is False  # the others' would stay


@pytest.mark.parametrize(
    ("trainer", "error"),
    [
        ("[trainer.backend]\nkind = 'megatron'", "the megatron backend cannot hand its GPU memory"),
        ("[trainer]\nworld_size = 2", r"needs trainer.world_size = 1 \(it is 2\)"),
    ],
)
def test_lending_memory_that_cannot_be_lent_whole_is_refused(
    tmp_path: Path, trainer: str, error: str
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f"[worker]\nlend_memory = true\n{trainer}\n")
    with pytest.raises(ConfigError, match=error):
        load_config(config)
    config.write_text(f"[worker]\nlend_memory = false\n{trainer}\n")
    load_config(config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_the_torch_backend_offloads_to_host_memory_and_trains_on_exactly(
    tiny_model_dir: Path,
) -> None:
    """Offloaded between two steps, the model and AdamW state leave the GPU (its allocated bytes
    fall by at least the model's), and the next step gives what it gives without the trip."""
    config = TrainerConfig(device="cuda", max_staleness=100)
    batch = items()
    lent, kept = (build_backend(tiny_model_dir, config) for _ in range(2))
    for backend in (lent, kept):
        train_step(backend, batch, 1, config)
    model_bytes = sum(p.numel() * p.element_size() for p in lent.model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    lent.offload()
    assert before - torch.cuda.memory_allocated() >= model_bytes
    assert all(p.device.type == "cpu" for p in lent.model.parameters())
    lent.onload()
    for backend in (lent, kept):
        train_step(backend, batch, 2, config)
    kept_state = kept.model.state_dict()
    for name, value in lent.model.state_dict().items():
        assert value.device.type == "cuda", name
        torch.testing.assert_close(value, kept_state[name], rtol=0, atol=1e-6, msg=name)
