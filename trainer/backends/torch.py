"""The torch backend: a Hugging Face causal LM in float32 with AdamW; data-parallel over the
default ``torch.distributed`` group (gloo on CPU, nccl on CUDA) by summing gradients with
``all_reduce`` after each backward."""

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.backends.base import ApplyStats, TokenBatch, logprobs_from_logits
from trainer.config import TrainerConfig
from trainer.exceptions import BackendError


def build(model: Path, config: TrainerConfig) -> "TorchBackend":
    return TorchBackend(model, config)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise BackendError("device 'cuda' asked for, but torch sees no CUDA device")
        index = dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0
        return torch.device("cuda", index)
    return torch.device(name)


class TorchBackend:
    def __init__(self, model: Path, config: TrainerConfig) -> None:
        from transformers import AutoModelForCausalLM

        self._config = config
        self._device = resolve_device(config.device)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot load an HF causal LM from {model}: {exc}") from exc
        self.model.to(self._device).eval()  # eval: no dropout; gradients still flow
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self._reference = None
        if config.kl_coef > 0:
            self._reference = copy.deepcopy(self.model).requires_grad_(False)
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1

    @property
    def dp_rank(self) -> int:
        return dist.get_rank() if self._distributed else 0

    @property
    def dp_size(self) -> int:
        return dist.get_world_size() if self._distributed else 1

    def token_logprobs(self, batch: TokenBatch, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return _logprobs(self.model, batch, self._device, self._config.temperature)

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self._reference is None:
            raise BackendError("no reference model: it is loaded only when kl_coef > 0")
        with torch.no_grad():
            return _logprobs(self._reference, batch, self._device, self._config.temperature)

    def apply(self, loss: torch.Tensor | None) -> ApplyStats:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if loss is not None:
            loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._distributed:
            # One flat buffer: one collective instead of one per tensor.
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
        norm = torch.nn.utils.clip_grad_norm_(params, self._config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return ApplyStats(grad_norm=float(norm), lr=self.optimizer.param_groups[0]["lr"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        if self._tied:
            state.pop("lm_head.weight", None)  # the engines tie it to the embedding
        return state

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _logprobs(
    model: torch.nn.Module, batch: TokenBatch, device: torch.device, temperature: float
) -> torch.Tensor:
    ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
    logits = model(input_ids=ids, attention_mask=attention).logits
    return logprobs_from_logits(logits, batch, temperature)
