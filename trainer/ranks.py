"""The train ranks of one trainer: rank 0 (the process that talks to NATS) drives, the others
follow. With ``world_size > 1`` rank 0 starts the followers as local processes that join a
``torch.distributed`` group (gloo on CPU, nccl on CUDA). Rank 0 broadcasts each command (load a
checkpoint, train these items, stop); every rank then runs the same ``train_step`` on its shard.

Commands travel as JSON bytes in a uint8 tensor (samples as their JSON form): no pickle.
"""

import json
import logging
import multiprocessing
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from broker.messages import SampleReady
from common.log import kv, setup_logging
from trainer.backends import TrainerBackend, build_backend
from trainer.batcher import TrainItem
from trainer.checkpoint import Checkpoint, load_file
from trainer.config import TrainerConfig
from trainer.step import StepStats, train_step

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(minutes=30)


def set_threads(config: TrainerConfig) -> None:
    """torch intra-op threads: ``config.threads``, else ``OMP_NUM_THREADS`` (torch's default)."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)


class RankGroup:
    """Rank 0's handle on every rank. Blocking methods: call them off the event loop."""

    def __init__(self, model: Path, config: TrainerConfig) -> None:
        self._config = config
        self._followers: list[multiprocessing.Process] = []
        if config.world_size > 1:
            init = f"tcp://127.0.0.1:{_free_port()}"
            ctx = multiprocessing.get_context("spawn")
            for rank in range(1, config.world_size):
                p = ctx.Process(
                    target=follow,
                    args=(rank, init, model, config, os.getpid()),
                    name=f"trainer-rank{rank}",
                    daemon=True,
                )
                p.start()
                self._followers.append(p)
            _init(0, init, config)
        self.backend: TrainerBackend = build_backend(model, config)

    @property
    def distributed(self) -> bool:
        return bool(self._followers)

    def load(self, checkpoint: Checkpoint | None, path: Path | None) -> None:
        """Every rank loads ``checkpoint`` (followers read it from ``path``, on this machine)."""
        if self.distributed:
            _broadcast({"kind": "load", "path": str(path) if path else None}, self._comm)
        if checkpoint is not None:
            self.backend.load_state(checkpoint.backend)

    def step(self, items: list[TrainItem], version: int) -> StepStats:
        if self.distributed:
            command = {
                "kind": "step",
                "version": version,
                "items": [[i.sample.model_dump_json(), i.advantage, i.weight] for i in items],
            }
            _broadcast(command, self._comm)
        return train_step(self.backend, items, version, self._config)

    def close(self) -> None:
        if self.distributed:
            _broadcast({"kind": "stop"}, self._comm)
            for p in self._followers:
                p.join(timeout=30)
            dist.destroy_process_group()

    @property
    def _comm(self) -> torch.device:
        return _comm_device()


def follow(rank: int, init: str, model: Path, config: TrainerConfig, parent: int) -> None:
    """A follower rank's whole life: join, build the backend, run rank 0's commands."""
    setup_logging()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    set_threads(config)
    _init(rank, init, config)
    backend = build_backend(model, config)
    comm = _comm_device()
    while True:
        command = _broadcast(None, comm)
        if command["kind"] == "stop":
            break
        if command["kind"] == "load":
            if command["path"]:
                backend.load_state(load_file(Path(command["path"])).backend)
            continue
        items = [
            TrainItem(SampleReady.model_validate_json(sample), advantage, weight)
            for sample, advantage, weight in command["items"]
        ]
        train_step(backend, items, command["version"], config)
    dist.destroy_process_group()
    log.info(kv("trainer_rank_stopped", rank=rank))


def _init(rank: int, init: str, config: TrainerConfig) -> None:
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=init,
        rank=rank,
        world_size=config.world_size,
        timeout=JOIN_TIMEOUT,
    )
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _comm_device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def _broadcast(command: dict | None, device: torch.device) -> dict:
    """Rank 0 sends ``command``; every other rank receives and returns it."""
    if dist.get_rank() == 0:
        data = json.dumps(command).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, 0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), 0)
        return command
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return json.loads(buf.cpu().numpy().tobytes())


def _exit_with_parent(parent: int) -> None:
    """A follower must not outlive rank 0 (killed rank 0: nobody would ever send 'stop')."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
