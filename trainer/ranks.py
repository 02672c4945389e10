"""The train ranks of one trainer: rank 0 (the process that talks to NATS) drives, the others
follow. With ``world_size > 1`` rank 0 starts the followers as local processes that join a
``torch.distributed`` group (gloo on CPU, nccl on CUDA). Rank 0 broadcasts each command (load a
checkpoint, train these items, stop); every rank then runs the same ``train_step`` on its shard.

Commands travel as JSON bytes in a uint8 tensor (samples as their JSON form): no pickle.

The same ranks also span workers: a trainer group (``trainer.group``) joins this process to the
other members' as one ``torch.distributed`` group (``join``), rank 0 sends its committed state
(safetensors bytes and JSON, no pickle) and then drives each step as above; a
follower member runs ``follow_group``. A collective that fails in such a group (a member died)
raises ``GroupBrokenError`` with the backend restored to its state before the step.
"""

import copy
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from broker.messages import SampleReady
from common.log import kv, setup_logging
from trainer.backends import TrainerBackend, build_backend
from trainer.batcher import TrainItem
from trainer.checkpoint import Checkpoint, load_file
from trainer.config import TrainerConfig
from trainer.exceptions import GroupBrokenError
from trainer.metrics import RANK_STEP_SECONDS
from trainer.step import Accumulation, StepStats, train_step

log = logging.getLogger(__name__)

T = TypeVar("T")

JOIN_TIMEOUT = timedelta(minutes=30)


def set_threads(config: TrainerConfig) -> None:
    """torch intra-op threads: ``config.threads``, else ``OMP_NUM_THREADS`` (torch's default)."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)


class RankGroup:
    """Rank 0's handle on every rank. Blocking methods: call them off the event loop."""

    def __init__(self, model: Path, config: TrainerConfig) -> None:
        self._config = config
        self._lock = threading.Lock()  # one sequence of collectives at a time
        self.grouped = False  # joined to a trainer group of workers (``join``)
        # Set while this process holds the train role: a follower member lent to rollout trains
        # rank 0's next step only once it is reclaimed too (or after half the collective
        # timeout, before rank 0's wait for it runs out).
        self.training = threading.Event()
        self.training.set()
        self._followers: list[multiprocessing.Process] = []
        if config.world_size > 1:
            # rank 0's store, on a loopback port the OS picks as it binds it: a port chosen
            # first and bound later could be taken by another process in between
            self._store = dist.TCPStore(
                "127.0.0.1",
                0,
                config.world_size,
                is_master=True,
                timeout=JOIN_TIMEOUT,
                wait_for_workers=False,
            )
            ctx = multiprocessing.get_context("spawn")
            for rank in range(1, config.world_size):
                p = ctx.Process(
                    target=follow,
                    args=(rank, self._store.port, model, config, os.getpid()),
                    name=f"trainer-rank{rank}",
                    daemon=True,
                )
                p.start()
                self._followers.append(p)
            _init(0, self._store, config)
        self.backend: TrainerBackend = build_backend(model, config)
        self._accumulation = Accumulation()  # rank 0's part of a step computed ahead

    @property
    def local_world_size(self) -> int:
        return self._config.world_size

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()

    def load(self, checkpoint: Checkpoint | None, path: Path | None) -> None:
        """Every rank loads ``checkpoint`` (followers read it from ``path``, on this machine)."""
        if self.distributed:
            _broadcast({"kind": "load", "path": str(path) if path else None}, self._comm)
        if checkpoint is not None:
            self.backend.load_state(checkpoint.backend)

    def step(self, items: list[TrainItem], version: int) -> StepStats:
        # With several minibatches an earlier one's update may land before a later collective
        # fails: keep the committed state to go back to (a copy of the model and AdamW state
        # per step, in groups of several workers only).
        several = self.grouped and self._config.minibatches > 1
        before = copy.deepcopy(self.backend.state()) if several else None
        return self._command(
            {"kind": "step", "version": version, "items": _wire(items)},
            lambda: train_step(self.backend, items, version, self._config),
            before,
        )

    def accumulate(self, items: list[TrainItem]) -> None:
        """Compute ``items``' gradients on every rank, for the step ``commit`` takes."""
        self._command(
            {"kind": "accumulate", "items": _wire(items)},
            lambda: self._accumulation.add(self.backend, items, self._config),
        )

    def commit(self, version: int) -> StepStats:
        """The optimizer step over everything ``accumulate`` computed since the last commit."""
        accumulation, self._accumulation = self._accumulation, Accumulation()
        return self._command(
            {"kind": "commit", "version": version},
            lambda: accumulation.commit(self.backend, version, self._config),
        )

    def offload(self) -> None:
        """This rank's state to host memory (``TrainerBackend.offload``), between commands."""
        with self._lock:
            self.backend.offload()

    def onload(self) -> None:
        with self._lock:
            self.backend.onload()

    def discard(self) -> None:
        """Drop what ``accumulate`` computed (rank 0; the others drop theirs when a group forms:
        ``join``)."""
        with self._lock:
            self._accumulation = Accumulation()
            self.backend.zero_grad()

    def _command(self, command: dict, run: Callable[[], T], before: dict | None = None) -> T:
        """``command`` to every other rank, then ``run`` here. In a trainer group a failed
        collective raises ``GroupBrokenError``, with the backend as the last commit left it
        (``before``, if given) and no gradients kept."""
        with self._lock:
            if not self.distributed:
                return run()
            if not self.grouped:
                _broadcast(command, self._comm)
                return run()
            started = time.monotonic()
            try:
                _broadcast(command, self._comm)
                result = run()
            except RuntimeError as exc:  # gloo and nccl raise their failures as RuntimeError
                if before is not None:
                    self.backend.load_state(before)
                self._accumulation = Accumulation()
                self.backend.zero_grad()
                self._destroy()
                raise GroupBrokenError(f"{command['kind']} abandoned: {exc}") from exc
            RANK_STEP_SECONDS.observe(time.monotonic() - started)
            return result

    # -- a trainer group of workers ----------------------------------------------------------
    def join(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        """Join the group that meets at ``store`` (every member calls this; blocks until all
        have, at most ``timeout``). Rank 0 then sends its state to every other rank."""
        if self._followers:
            raise GroupBrokenError(
                f"trainer.world_size = {self._config.world_size} (local ranks) cannot join a "
                "trainer group of several workers"
            )
        with self._lock:
            use_cuda = self._device().type == "cuda"
            if use_cuda:
                torch.cuda.set_device(self._device())
            _init_default_group(rank, store, world_size, timeout, use_cuda)
            self.grouped = True
            self._accumulation = Accumulation()  # a new group computes every step afresh
            self.backend.zero_grad()
            try:
                if rank == 0:
                    self._send_state()
                else:
                    self._receive_state(_broadcast(None, self._comm))
            except RuntimeError as exc:
                self._destroy()
                raise GroupBrokenError(f"state transfer failed: {exc}") from exc

    def _device(self) -> torch.device:
        """Where the torch backend's model is; a backend without one (``emulation``) is on CPU."""
        model = getattr(self.backend, "model", None)
        return torch.device("cpu") if model is None else next(model.parameters()).device

    def ping(self) -> None:
        """Rank 0, between steps: a command that does nothing, so that the others' wait for the
        next one never reaches the collective timeout, and a member gone is found before the
        next step. Raises ``GroupBrokenError``."""
        with self._lock:
            if not self.grouped:
                return
            try:
                _broadcast({"kind": "ping"}, self._comm)
            except RuntimeError as exc:
                self._destroy()
                raise GroupBrokenError(f"ping failed: {exc}") from exc

    def leave(self) -> None:
        """Rank 0: tell the other members the group is over (they wait for the next), then
        leave it. A member gone already is no error: the group is over either way. Not joined,
        nothing to leave: a join in progress holds the lock until every member came or its
        timeout ran out (a minute), and a stopping process must not wait for it."""
        if not self.grouped:
            return
        with self._lock:
            if not self.grouped or dist.get_rank() != 0:
                return
            try:
                _broadcast({"kind": "leave"}, self._comm)
            except RuntimeError as exc:
                log.info(kv("trainer_group_leave_failed", error=exc))
            self._destroy()

    def follow_group(self, busy: Callable[[bool], None] = lambda _: None) -> None:
        """A member other than rank 0, after ``join``: run rank 0's commands until it says
        ``leave`` (returns) or a collective fails (raises ``GroupBrokenError``); left either way.
        ``busy`` is told when each training command starts (True) and ends (False)."""
        accumulation = Accumulation()
        try:
            while True:
                command = _broadcast(None, self._comm)
                if command["kind"] == "leave":
                    return
                if command["kind"] in TRAINING:
                    wait_s = self._config.collective_timeout_s / 2
                    if not self.training.wait(wait_s):
                        log.warning(kv("trainer_rank_not_reclaimed", waited_s=wait_s))
                    started = time.monotonic()
                    busy(True)
                    try:
                        accumulation = _obey(self.backend, command, self._config, accumulation)
                    finally:
                        busy(False)
                    RANK_STEP_SECONDS.observe(time.monotonic() - started)
        except RuntimeError as exc:
            raise GroupBrokenError(f"lost rank 0: {exc}") from exc
        finally:
            self._destroy()

    def _destroy(self) -> None:
        self.grouped = False
        if dist.is_initialized():
            dist.destroy_process_group()

    def _send_state(self) -> None:
        """The committed model and optimizer state, to every other rank."""
        state = self.backend.state()
        tensors = {f"model.{k}": v.detach().cpu().clone() for k, v in state["model"].items()}
        optimizer = state["optimizer"]
        for index, entries in optimizer["state"].items():
            for name, value in entries.items():
                tensors[f"optimizer.{index}.{name}"] = value.detach().cpu().clone()
        _broadcast({"kind": "state", "param_groups": optimizer["param_groups"]}, self._comm)
        _broadcast_bytes(save_tensors(tensors), self._comm)

    def _receive_state(self, command: dict) -> None:
        tensors = load_tensors(_broadcast_bytes(None, self._comm))
        model, optimizer = {}, {}
        for key, value in tensors.items():
            part, name = key.split(".", 1)
            if part == "model":
                model[name] = value
            else:
                index, entry = name.split(".", 1)
                optimizer.setdefault(int(index), {})[entry] = value
        groups = command["param_groups"]
        self.backend.load_state(
            {"model": model, "optimizer": {"state": optimizer, "param_groups": groups}}
        )

    def close(self) -> None:
        self.leave()
        if self._followers:
            _broadcast({"kind": "stop"}, self._comm)
            for p in self._followers:
                p.join(timeout=30)
            dist.destroy_process_group()

    @property
    def _comm(self) -> torch.device:
        return _comm_device()


def follow(rank: int, port: int, model: Path, config: TrainerConfig, parent: int) -> None:
    """A follower rank's whole life: join (rank 0's store on ``port``), build the backend, run
    rank 0's commands."""
    setup_logging()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    set_threads(config)
    store = dist.TCPStore("127.0.0.1", port, config.world_size, timeout=JOIN_TIMEOUT)
    _init(rank, store, config)
    backend = build_backend(model, config)
    comm = _comm_device()
    accumulation = Accumulation()
    while True:
        command = _broadcast(None, comm)
        if command["kind"] == "stop":
            break
        if command["kind"] == "load":
            if command["path"]:
                backend.load_state(load_file(Path(command["path"])).backend)
            continue
        accumulation = _obey(backend, command, config, accumulation)
    dist.destroy_process_group()
    log.info(kv("trainer_rank_stopped", rank=rank))


TRAINING = ("step", "accumulate", "commit")
"""The commands a rank other than 0 trains by (``_obey``)."""


def _obey(
    backend: TrainerBackend, command: dict, config: TrainerConfig, accumulation: Accumulation
) -> Accumulation:
    """Run a ``TRAINING`` command on this rank; returns the step being computed ahead."""
    if command["kind"] == "accumulate":
        accumulation.add(backend, _items(command), config)
    elif command["kind"] == "commit":
        accumulation.commit(backend, command["version"], config)
        return Accumulation()
    else:
        train_step(backend, _items(command), command["version"], config)
    return accumulation


def _wire(items: list[TrainItem]) -> list:
    return [[i.sample.model_dump_json(), i.advantage, i.weight] for i in items]


def _items(command: dict) -> list[TrainItem]:
    return [
        TrainItem(SampleReady.model_validate_json(sample), advantage, weight)
        for sample, advantage, weight in command["items"]
    ]


def uses_cuda(config: TrainerConfig) -> bool:
    """Whether ``config``'s trainer runs on CUDA (``device`` cuda, or auto with a GPU)."""
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def _init_default_group(
    rank: int, store: dist.Store, world_size: int, timeout: timedelta, use_cuda: bool
) -> None:
    """Join the default process group that meets at ``store``, named by its ranks (torch's
    ``_ranks``). Unnamed, torch names it by a count of the groups this process made, which a
    failed ``init_process_group`` advances: a member whose join timed out would wait for a fresh
    one at other keys of the store."""
    backend = "nccl" if use_cuda else "gloo"
    ranks = list(range(world_size))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, _ranks=ranks
    )


def _init(rank: int, store: dist.Store, config: TrainerConfig) -> None:
    use_cuda = uses_cuda(config)
    _init_default_group(rank, store, config.world_size, JOIN_TIMEOUT, use_cuda)
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _comm_device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def _broadcast(command: dict | None, device: torch.device) -> dict:
    """Rank 0 sends ``command``; every other rank receives and returns it."""
    data = _broadcast_bytes(None if command is None else json.dumps(command).encode(), device)
    return command if command is not None else json.loads(data)


def _broadcast_bytes(data: bytes | None, device: torch.device) -> bytes:
    """Rank 0 sends ``data``; every other rank receives and returns it."""
    if dist.get_rank() == 0:
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, 0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), 0)
        return data
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return buf.cpu().numpy().tobytes()


def _exit_with_parent(parent: int) -> None:
    """A follower must not outlive rank 0 (killed rank 0: nobody would ever send 'stop')."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
