"""The megatron-core backend: a ``GPTModel`` (local layer spec) converted from an HF Llama folder,
float32 with AdamW, tensor-parallel within ``ParallelConfig.tensor_parallel`` ranks and
data-parallel over the rest of the default ``torch.distributed`` group.

megatron-core's forward pass needs CUDA, so constructing this backend without a CUDA device fails
at once with ``BackendError``. Pipeline parallelism is not wired in (it needs megatron's pipeline
schedules); weights are published under HF names through ``trainer.megatron.convert``.
"""

import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.log import kv
from trainer.backends.base import ApplyStats, TokenBatch, logprobs_from_logits
from trainer.backends.torch import resolve_device
from trainer.config import MegatronBackendConfig, TrainerConfig
from trainer.exceptions import BackendError
from trainer.megatron import convert
from trainer.megatron.exceptions import MegatronError
from trainer.megatron.model import (
    ParallelConfig,
    build_gpt_model,
    gather_tp,
    load_hf_weights,
    load_megatron_tensors,
    megatron_parallel,
    megatron_tensors,
)

log = logging.getLogger(__name__)


def build(model: Path, config: TrainerConfig) -> "MegatronBackend":
    return MegatronBackend(model, config)


def require_cuda() -> None:
    """Raise ``BackendError`` unless torch sees a CUDA device (megatron-core's forward needs
    one: its rotary embedding and attention buffers live on ``torch.cuda.current_device()``)."""
    if torch.cuda.is_available():
        return
    why = (
        f"this torch ({torch.__version__}) is built without CUDA"
        if torch.version.cuda is None
        else "torch sees no CUDA device"
    )
    raise BackendError(
        f"the megatron backend needs a CUDA GPU: megatron-core's forward pass runs on CUDA only, "
        f'and {why}; use backend = "torch" on this machine'
    )


def require_megatron() -> None:
    """Raise ``BackendError`` unless megatron-core can be imported."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise BackendError(
            f"the megatron backend needs megatron-core: pip install 'seamlessflow[megatron]' "
            f"({exc})"
        ) from exc


class MegatronBackend:
    def __init__(self, model: Path, config: TrainerConfig) -> None:
        require_cuda()
        require_megatron()
        if not isinstance(config.backend, MegatronBackendConfig):
            raise BackendError(f"the megatron backend was given a {config.backend.kind!r} config")
        self._config = config
        self._parallel = ParallelConfig(tensor_parallel=config.backend.tensor_parallel)
        if self._parallel.pipeline_parallel > 1:
            raise BackendError(
                "the megatron backend does not support pipeline_parallel > 1 yet "
                "(it needs megatron-core's pipeline schedules)"
            )
        self._device = resolve_device("cuda")
        torch.cuda.set_device(self._device)
        self.spec, hf = _read_hf_folder(model)
        self._stack = ExitStack()
        try:
            self._stack.enter_context(megatron_parallel(self._parallel))
            self.model = self._load(hf)
            self._reference = self._load(hf).requires_grad_(False) if config.kl_coef > 0 else None
        except MegatronError as exc:
            self._stack.close()
            raise BackendError(f"cannot build the GPTModel of {model}: {exc}") from exc
        except BaseException:
            self._stack.close()
            raise
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self._params,
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        log.info(
            kv(
                "megatron_backend_ready",
                model=model,
                tp=self._parallel.tensor_parallel,
                dp=self.dp_size,
                device=self._device,
            )
        )

    def _load(self, hf: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = build_gpt_model(self.spec, self._parallel)
        load_hf_weights(model, hf, self.spec)
        return model.to(self._device).eval()  # eval: no dropout; gradients still flow

    def close(self) -> None:
        """Tear down megatron-core's parallel state (the default process group stays)."""
        self._stack.close()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    shares_prefixes = False

    @property
    def row_tokens(self) -> int:
        return 1  # one sample per row: the GPTModel gets a plain causal mask, not a packed one

    def logits(self, batch: TokenBatch, grad: bool) -> torch.Tensor:
        """``(B, T, vocab)`` logits of the right-padded ``batch`` (gathered over TP ranks)."""
        with torch.set_grad_enabled(grad):
            return _logits(self.model, batch, self._device)

    def token_logprobs(self, batch: TokenBatch, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return logprobs_from_logits(
                _logits(self.model, batch, self._device), batch, self._config.temperature
            )

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self._reference is None:
            raise BackendError("no reference model: it is loaded only when kl_coef > 0")
        with torch.no_grad():
            return logprobs_from_logits(
                _logits(self._reference, batch, self._device), batch, self._config.temperature
            )

    def apply(self, loss: torch.Tensor | None, scale: float = 1.0) -> ApplyStats:
        started = time.perf_counter()
        if loss is not None:
            loss.backward()
        backward_s = time.perf_counter() - started
        grads = []
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif scale != 1.0:
                p.grad.mul_(scale)
            grads.append(p.grad)
        if self.dp_size > 1:
            from megatron.core import parallel_state

            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        norm = self._clip_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return ApplyStats(
            grad_norm=norm, lr=self.optimizer.param_groups[0]["lr"], backward_s=backward_s
        )

    def _clip_grads(self) -> float:
        """Total gradient norm over the whole model (TP shards counted once), then clip as
        ``torch.nn.utils.clip_grad_norm_`` does."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), device=self._device)
        for p in self._params:
            if param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.float().pow(2).sum()
        if self._parallel.tensor_parallel > 1:
            dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        norm = squares.sqrt()
        coef = torch.clamp(self._config.max_grad_norm / (norm + 1e-6), max=1.0)
        for p in self._params:
            p.grad.mul_(coef)
        return float(norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def offload(self) -> None:
        raise BackendError(
            "the megatron backend cannot hand its GPU memory over yet: set [worker] "
            "lend_memory = false for a colocated worker that trains with it"
        )

    onload = offload

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {k: v.detach() for k, v in megatron_tensors(self.model).items()}
        if self._parallel.tensor_parallel > 1:
            tensors = convert.unshard_tp(gather_tp(tensors))
        hf = convert.megatron_to_hf(tensors, self.spec)
        return {k: v.to("cpu", copy=True) for k, v in hf.items()}

    def state(self) -> dict[str, Any]:
        return {
            "model": {k: v.cpu() for k, v in megatron_tensors(self.model).items()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        load_megatron_tensors(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _read_hf_folder(model: Path) -> tuple[convert.LlamaSpec, dict[str, torch.Tensor]]:
    """The Llama spec and the full HF state dict of an HF model folder."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read an HF config from {model}: {exc}") from exc
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise BackendError(f"{model} holds no *.safetensors weights")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        hf.update(load_file(file))
    try:
        return convert.LlamaSpec.from_hf_config(config), hf
    except MegatronError as exc:
        raise BackendError(f"cannot use {model} with the megatron backend: {exc}") from exc


def _logits(model: torch.nn.Module, batch: TokenBatch, device: torch.device) -> torch.Tensor:
    if batch.packed:
        raise BackendError("the megatron backend takes one sample per row, got a packed batch")
    # Causal attention, no mask: real tokens never attend to the right padding after them.
    return model(batch.input_ids.to(device), batch.position_ids.to(device), None)
