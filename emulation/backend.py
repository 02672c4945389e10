"""For benchmarks only: a trainer backend that spends modelled time instead of training.

With the emulated engine (``emulation.engine``) it lets the real trainer, scheduler and
weight path run at a cluster's timing on a few cores. The model, and its assumptions:

- A step costs ``workload.trainer.step_s(tokens, devices)`` seconds (the trainer calls
  backends off its event loop), where ``tokens`` are the loss tokens (``TokenBatch.read``: the
  sampled ones, not the prompt's or a tool's) of its training forwards, the tokens the
  simulator and ``seamlessflow plan`` count a step's cost by: each training forward sleeps its
  tokens' part, ``apply`` the fixed part (optimizer, all-reduce). A step computed ahead in
  parts (the trainer's ``overlap``) spends the per-token part as its groups arrive. In a
  trainer group of several workers (``trainer.group``) each rank models ``devices`` devices
  and trains its shard.
- The policy is one float32 vector of ``weight_floats`` values that never moves; every token's
  logprob is its first value, ``-log(16)``: the emulated engine's at its default cycle, so
  behaviour and proximal logprobs agree. Losses and gradient norms are computed for real from
  that, so the trainer's stats are of the usual kind; the optimizer step does nothing.
- ``hf_state_dict`` is that vector under the name ``emulated.weight``: a small blob that goes
  the whole weight path (safetensors, object store, worker fetch); the emulated engine loads it
  without reading it.
"""

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from emulation.config import EmulatedBackendConfig
from trainer.backends.base import ApplyStats, TokenBatch
from trainer.config import TrainerConfig
from trainer.exceptions import BackendError

LOGPROB = -math.log(16)
"""Every token's logprob: the emulated engine's at its default cycle of 16 letters."""


def build(model: Path, config: TrainerConfig) -> "EmulatedBackend":
    """``model`` is not read."""
    return EmulatedBackend(config)


class EmulatedBackend:
    def __init__(self, config: TrainerConfig) -> None:
        if not isinstance(config.backend, EmulatedBackendConfig):
            raise BackendError(f"the emulated backend was given a {config.backend.kind!r} config")
        self._config = config
        self._options = config.backend
        self._weight = torch.nn.Parameter(torch.full((self._options.weight_floats,), LOGPROB))

    @property
    def dp_rank(self) -> int:
        return dist.get_rank() if self._grouped else 0

    @property
    def dp_size(self) -> int:
        return dist.get_world_size() if self._grouped else 1

    @property
    def _grouped(self) -> bool:
        """A trainer group (``trainer.group``) formed: each rank spends its shard's time."""
        return dist.is_initialized() and dist.get_world_size() > 1

    shares_prefixes = False

    @property
    def row_tokens(self) -> int:
        return 1 << 20  # packing changes nothing here: one row fits all

    def token_logprobs(self, batch: TokenBatch, grad: bool) -> torch.Tensor:
        if grad:
            cost = self._options.workload.trainer
            read = batch.attention_mask if batch.read is None else batch.read
            time.sleep(cost.s_per_token * int(read.sum()) / self._options.devices)
        with torch.set_grad_enabled(grad):
            scored = (batch.attention_mask > 0) & (batch.position_ids > 0)
            return torch.where(scored, self._weight[0], 0.0)

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self._config.kl_coef <= 0:
            raise BackendError("no reference model: it is loaded only when kl_coef > 0")
        return self.token_logprobs(batch, grad=False)

    def apply(self, loss: torch.Tensor | None, scale: float = 1.0) -> ApplyStats:
        if loss is not None:
            loss.backward()
        grad = self._weight.grad
        norm = 0.0 if grad is None else float(grad.norm()) * scale
        self._weight.grad = None
        time.sleep(self._options.workload.trainer.step_s(0, self._options.devices))
        return ApplyStats(grad_norm=norm, lr=self._config.lr, backward_s=0.0)  # all modelled

    def zero_grad(self) -> None:
        self._weight.grad = None

    def offload(self) -> None:
        """(Its weights hold no device memory.)"""

    def onload(self) -> None:
        """(Its weights hold no device memory.)"""

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {"emulated.weight": self._weight.detach()}

    def state(self) -> dict[str, Any]:
        """The layout a trainer group sends its members (``trainer.ranks``); no optimizer."""
        weight = self._weight.detach().clone()
        return {"model": {"weight": weight}, "optimizer": {"state": {}, "param_groups": []}}

    def load_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self._weight.copy_(state["model"]["weight"])
