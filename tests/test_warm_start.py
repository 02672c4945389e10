"""The warm start's loss (``trainer.warmstart.batch_loss``): demonstrations drawn several times
are computed once, weighted by their draws, and the loss is the causal LM's own over the batch
with every draw in it."""

from collections import Counter
from pathlib import Path

import pytest


def test_a_batch_with_repeated_draws_has_the_whole_batchs_loss_and_gradient(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.warmstart import batch_loss, padded

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # (prompt ids, answer ids): one drawn 3 times, one twice, one once; answers of unequal length
    a, b, c = ((5, 6, 7), (8, 9)), ((10, 11), (12, 13, 14, 15)), ((16,), (17,))
    draws = Counter({a: 3, b: 2, c: 1})
    ids, labels = padded([a, a, a, b, b, c], 0)

    def gradient(loss) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = model(input_ids=ids, labels=labels).loss  # the causal LM's own, every draw in it
    loss = whole.item()
    want = gradient(whole)
    weighted = batch_loss(model, draws, 0)
    assert weighted.item() == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(gradient(weighted), want, rtol=1e-4, atol=1e-6)
    # each draw once: another loss (the weights are what makes it the batch's)
    assert batch_loss(model, Counter([a, b, c]), 0).item() != pytest.approx(loss, rel=1e-3)
