"""The warm start's loss (``trainer.warmstart.batch_loss``): demonstrations drawn several times
are computed once, weighted by their draws, and the loss is the causal LM's own over the batch
with every draw in it."""

from collections import Counter
from pathlib import Path

import pytest


def test_a_batch_with_repeated_draws_has_the_whole_batchs_loss_and_gradient(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.warmstart import batch_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # (prompt ids, answer ids): one drawn 3 times, one twice, one once; answers of unequal length
    a, b, c = ((5, 6, 7), (8, 9)), ((10, 11), (12, 13, 14, 15)), ((16,), (17,))
    draws = Counter({a: 3, b: 2, c: 1})
    batch = [a, a, a, b, b, c]
    width = max(len(p) + len(r) for p, r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for row, (prompt, answer) in enumerate(batch):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)

    def gradient(loss) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = model(input_ids=ids, labels=labels).loss
    want = (whole.item(), gradient(whole))
    weighted = batch_loss(model, draws, 0)
    assert weighted.item() == pytest.approx(want[0], rel=1e-5)
    torch.testing.assert_close(gradient(weighted), want[1], rtol=1e-4, atol=1e-6)
    # each draw once: another loss (the weights are what makes it the batch's)
    assert batch_loss(model, Counter([a, b, c]), 0).item() != pytest.approx(want[0], rel=1e-3)
