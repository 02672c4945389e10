"""GPU check of the megatron backend against the torch (HF) backend: ``python -m
trainer.megatron.check [MODEL_FOLDER ...]``.

For each model (default: the tiny tied Llama and an untied grouped-query variant, built in a
temporary folder) both backends load the same weights in float32 on CUDA and see the same
right-padded batch. The table compares, on real tokens: logits, per-token logprobs, the
gradient of one loss (Megatron gradients renamed to HF names by ``megatron_to_hf``), the total
gradient norm ``apply`` reports, and the weights after that one AdamW step. Exit status 0 when
every row passes, 1 when one fails, 2 when this machine cannot run it (no CUDA, no megatron).
"""

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.backends.base import TokenBatch
from trainer.config import MegatronBackendConfig, TorchBackendConfig, TrainerConfig
from trainer.exceptions import BackendError

LR = 1e-4


@dataclass(frozen=True)
class Row:
    """One compared quantity: its largest absolute difference and the bound it must stay under."""

    model: str
    what: str
    diff: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.diff < self.bound


def build_untied_gqa_model(path: Path, *, seed: int = 0) -> Path:
    """An HF Llama folder with untied embeddings, 8 query heads in 2 groups, head_dim 32 and a
    non-default RoPE theta (no tokenizer: the backends need none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.models import TINY_VOCAB

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def sample_batch(vocab: int, lengths: tuple[int, ...] = (32, 20, 7), seed: int = 0) -> TokenBatch:
    """Random token ids, right-padded to the longest of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    positions = torch.arange(width).expand(len(lengths), -1)
    return TokenBatch(input_ids=ids * mask, position_ids=positions, attention_mask=mask)


def compare(name: str, folder: Path) -> list[Row]:
    """Both backends on ``folder``: the rows of the table (see the module docstring)."""
    from trainer.backends.megatron import MegatronBackend
    from trainer.backends.torch import TorchBackend
    from trainer.megatron.convert import megatron_to_hf

    config = TrainerConfig(backend=MegatronBackendConfig(), device="cuda", lr=LR, max_grad_norm=1e9)
    megatron = MegatronBackend(folder, config)  # first: on CPU its error names the reason
    try:
        reference = TorchBackend(
            folder, config.model_copy(update={"backend": TorchBackendConfig()})
        )
        batch = sample_batch(megatron.spec.vocab_size)
        real = batch.attention_mask.bool().cuda()
        with torch.no_grad():
            ids, mask = batch.input_ids.cuda(), batch.attention_mask.cuda()
            want = reference.model(input_ids=ids, attention_mask=mask).logits[real]
            got = megatron.logits(batch, grad=False)[real]
        rows = [Row(name, "logits", _max_diff(got, want), 1e-4)]

        lp_ref = reference.token_logprobs(batch, grad=True)
        lp_meg = megatron.token_logprobs(batch, grad=True)
        rows.append(Row(name, "token logprobs", _max_diff(lp_meg, lp_ref), 1e-4))

        loss_ref, loss_meg = -lp_ref.sum() / real.sum(), -lp_meg.sum() / real.sum()
        named = dict(megatron.model.named_parameters())
        grads = torch.autograd.grad(loss_meg, list(named.values()), retain_graph=True)
        grads_hf = megatron_to_hf(dict(zip(named, grads, strict=True)), megatron.spec)
        params_ref = dict(reference.model.named_parameters())
        grads_ref = torch.autograd.grad(loss_ref, list(params_ref.values()), retain_graph=True)
        grads_ref = dict(zip(params_ref, grads_ref, strict=True))
        scale = max(g.abs().max().item() for g in grads_ref.values())
        worst = max(_max_diff(g, grads_ref[k]) for k, g in grads_hf.items())
        rows.append(Row(name, "gradients / max |grad|", worst / scale, 1e-4))

        stats_ref, stats_meg = reference.apply(loss_ref), megatron.apply(loss_meg)
        norm_diff = abs(stats_meg.grad_norm - stats_ref.grad_norm) / stats_ref.grad_norm
        rows.append(Row(name, "grad norm (relative)", norm_diff, 1e-4))

        after_ref, after_meg = reference.hf_state_dict(), megatron.hf_state_dict()
        step = max(_max_diff(v, after_ref[k]) for k, v in after_meg.items())
        # Adam's first step moves a weight by about lr * sign(grad): a tiny gradient whose sign
        # differs between the two would show up as up to 2 * lr.
        rows.append(Row(name, "weights after one AdamW step", step, LR))
        return rows
    finally:
        megatron.close()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()


def print_table(rows: list[Row]) -> None:
    print(f"{'model':<14} {'quantity':<30} {'max |diff|':>12} {'bound':>10}  result")
    for row in rows:
        verdict = "ok" if row.ok else "FAIL"
        print(f"{row.model:<14} {row.what:<30} {row.diff:>12.3e} {row.bound:>10.1e}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.megatron.check", description=__doc__)
    parser.add_argument("models", nargs="*", type=Path, help="HF Llama folders (default: tiny)")
    args = parser.parse_args(argv)
    from trainer.backends.megatron import require_cuda, require_megatron

    try:
        require_cuda()
        require_megatron()
    except BackendError as exc:
        print(f"cannot run the megatron check here: {exc}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 with float32
    torch.backends.cudnn.allow_tf32 = False
    from common.models import build_tiny_model

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {str(m): m for m in args.models} or {
            "tiny (tied)": build_tiny_model(Path(tmp) / "tiny"),
            "untied GQA": build_untied_gqa_model(Path(tmp) / "untied"),
        }
        for name, folder in models.items():
            rows += compare(name, folder)
    print_table(rows)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
