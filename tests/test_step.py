"""The trainer step on the tiny model: packed rows and shared prefixes train exactly as padded
rows (loss, gradients, samples isolated), the one-forward proximal equals a separate forward,
a step computed in parts (``Accumulation``) makes the whole batch's update,
the mismatch against a real engine's logprobs, and the bfloat16 option."""

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from broker.messages import SampleReady, SamplingParams
from common.precision import Precision, unsupported
from rollout.engines import EngineConfig, HFEngineConfig, start_engine
from tests.test_losses import sample
from trainer.backends import build_backend
from trainer.backends.torch import TorchBackend
from trainer.batcher import TrainItem, collate, pack, plan_step
from trainer.config import LossAggregation, TorchBackendConfig, TrainerConfig
from trainer.exceptions import BackendError
from trainer.step import (
    PHASES,
    Accumulation,
    equal_sample_weights,
    minibatch_loss,
    proximal_logprobs,
    train_step,
)

BF16 = unsupported(Precision.BFLOAT16, "cpu")


def config(pack_tokens: int = 64, dtype: Precision = Precision.FLOAT32, **kw) -> TrainerConfig:
    backend = TorchBackendConfig(pack_tokens=pack_tokens, dtype=dtype)
    return TrainerConfig(backend=backend, max_staleness=100, **kw)


def items(n: int = 7, seed: int = 0) -> list[TrainItem]:
    """``n`` samples of different lengths, random tokens and behaviour logprobs, one group."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        s = sample(
            f"s{i}",
            prompt=tuple(rng.randrange(3, 500) for _ in range(rng.randint(2, 12))),
            completion=tuple(rng.randrange(3, 500) for _ in range(rng.randint(1, 9))),
            reward=float(i % 3),
            group_size=n,
        )
        logprobs = [0.0 if m == 0 else -rng.uniform(0.5, 8) for m in s.loss_mask]
        samples.append(s.model_copy(update={"logprobs": logprobs}))
    planned, _, _ = plan_step([samples], 0, config())
    return planned


def grads(backend: TorchBackend, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in backend.model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params))


def per_sample(batch, values: torch.Tensor) -> list[list[float]]:
    """``values`` (the batch's layout) cut back into one list per sample, in row order."""
    out = []
    for r in range(values.shape[0]):
        positions = batch.tokens.position_ids[r].tolist()
        real = batch.tokens.attention_mask[r].tolist()
        starts = [t for t, p in enumerate(positions) if p == 0 and real[t]]
        ends = [*starts[1:], sum(real)]
        out += [values[r, a:b].tolist() for a, b in zip(starts, ends, strict=True)]
    return out


def test_packing_fills_rows_longest_first_and_never_splits_a_sample():
    lengths = [5, 30, 12, 9, 40, 3]
    # 40 > 32 tokens: a row of its own; 30 leaves room for none of the rest; 12 + 9 + 5 + 3.
    assert pack(lengths, 32) == [[4], [1], [2, 3, 0, 5]]
    assert pack(lengths, 1) == [[4], [1], [2], [3], [0], [5]]  # one per row
    # Lengths alike: 10 rows filled to 63 tokens hold more than 15 rows of 33: not packed.
    assert pack([33] * 10 + [30] * 5, 64) == [[i] for i in range(15)]
    # Nor when it saves fewer tokens than a packed token costs more: 6 rows of 248 hold 11%
    # fewer than 32 rows of 52, but cost more.
    alike = [52] * 16 + [40] * 16
    assert len(pack(alike, 256)) == 32
    assert len(pack([60] + [10] * 9, 64)) == 3  # 180 tokens packed against 600 padded


def test_packed_rows_give_the_padded_loss_gradients_and_logprobs(tiny_model_dir):
    train = items(16, seed=1)  # lengths unlike enough for packing to pay
    padded_backend = build_backend(tiny_model_dir, config(pack_tokens=1))
    packed_backend = build_backend(tiny_model_dir, config(pack_tokens=64))
    padded = collate(train, padded_backend.row_tokens)
    packed = collate(train, packed_backend.row_tokens)
    assert packed.tokens.packed and not padded.tokens.packed
    assert packed.tokens.input_ids.numel() < padded.tokens.input_ids.numel()
    total = padded.loss_tokens
    assert packed.loss_tokens == total

    loss_padded, _ = minibatch_loss(padded_backend, padded, total, padded_backend._config)
    loss_packed, prox_packed = minibatch_loss(packed_backend, packed, total, config())
    assert float(loss_packed.loss.detach()) == pytest.approx(
        float(loss_padded.loss.detach()), rel=1e-5, abs=1e-7
    )
    for a, b in zip(
        grads(packed_backend, loss_packed.loss),
        grads(padded_backend, loss_padded.loss),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # Sample by sample the packed logprobs are the padded ones: no sample sees another.
    prox_padded = proximal_logprobs(padded_backend, padded)
    want = dict(
        zip(
            map(tuple, per_sample(padded, padded.tokens.input_ids)),
            zip(per_sample(padded, prox_padded), per_sample(padded, padded.mask), strict=True),
            strict=True,
        )
    )
    got = zip(
        per_sample(packed, packed.tokens.input_ids), per_sample(packed, prox_packed), strict=True
    )
    for ids, logprobs in got:  # on the tokens the loss reads
        expected, read = want[tuple(ids)]
        assert [x for x, r in zip(logprobs, read, strict=True) if r] == pytest.approx(
            [x for x, r in zip(expected, read, strict=True) if r], abs=1e-5
        )


def grouped(seed: int = 2) -> list[TrainItem]:
    """Three groups of four completions of one prompt each (two prompts of one length, one
    longer), a two-turn sample that shares the first group's prompt (its second prompt is read by
    nothing), and a sample alone."""
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 500) for _ in range(n))

    prompts = [tokens(6), tokens(6), tokens(11)]
    samples = [
        sample(f"g{g}s{i}", f"g{g}", prompt=p, completion=tokens(rng.randint(1, 7)), group_size=4)
        for g, p in enumerate(prompts)
        for i in range(4)
    ]
    two_turns = sample("turns", "t", prompt=prompts[0], completion=tokens(9))
    mask = list(two_turns.loss_mask)
    mask[9:12] = [0, 0, 0]  # the tool's answer, then the second turn
    samples += [two_turns.model_copy(update={"loss_mask": mask}), sample("alone", "a")]
    samples = [
        s.model_copy(update={"logprobs": [-rng.uniform(0.5, 8) * m for m in s.loss_mask]})
        for s in samples
    ]
    by_group: dict[str, list[SampleReady]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    planned, _, _ = plan_step(list(by_group.values()), 0, config())
    return planned


def test_a_shared_prefix_runs_once_and_gives_the_padded_loss_gradients_and_logprobs(
    tiny_model_dir,
):
    train = grouped()
    backend = build_backend(tiny_model_dir, config(pack_tokens=1))
    assert backend.shares_prefixes
    padded = collate(train, backend.row_tokens)
    shared = collate(train, backend.row_tokens, share_prefixes=True)
    assert not padded.tokens.prefixes
    # Rows by item: 0-3, 4-7, 8-11 the groups, 12 the two-turn sample (first prompt), 13 alone.
    lengths = {p.length: p.groups for p in shared.tokens.prefixes}
    assert lengths == {6: ((0, 1, 2, 3, 12), (4, 5, 6, 7)), 11: ((8, 9, 10, 11),)}
    torch.testing.assert_close(shared.mask, padded.mask[shared_order(padded, shared)])

    total = padded.loss_tokens
    want, _ = minibatch_loss(backend, padded, total, config())
    got, got_logprobs = minibatch_loss(backend, shared, total, config())
    assert float(got.loss.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-5)
    for a, b in zip(grads(backend, got.loss), grads(backend, want.loss), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    want_logprobs = proximal_logprobs(backend, padded)[shared_order(padded, shared)]
    read = shared.mask > 0
    torch.testing.assert_close(got_logprobs[read], want_logprobs[read], rtol=0, atol=1e-5)


def shared_order(padded, shared) -> list[int]:
    """The padded batch's row of each of ``shared``'s rows (same tokens)."""
    rows = [tuple(r) for r in padded.tokens.input_ids.tolist()]
    return [rows.index(tuple(r)) for r in shared.tokens.input_ids.tolist()]


def test_prefixes_are_shared_only_where_they_save_tokens():
    train = grouped()
    one_each = [train[0], train[4], train[8], train[13]]  # no two share a prompt
    assert not collate(one_each, 1, share_prefixes=True).tokens.prefixes
    # a long completion next to short ones: padding every row to it outweighs the prompt saved
    long = train[0].sample.model_copy(
        update={
            "token_ids": train[0].sample.token_ids + [7] * 200,
            "loss_mask": train[0].sample.loss_mask + [1] * 200,
            "logprobs": train[0].sample.logprobs + [-1.0] * 200,
            "versions": train[0].sample.versions + [0] * 200,
        }
    )
    lopsided = [replace(train[0], sample=long), *train[1:4]]
    assert not collate(lopsided, 512, share_prefixes=True).tokens.prefixes
    assert collate(train[:4], 512, share_prefixes=True).tokens.prefixes


def test_logits_only_where_a_read_token_is_predicted_give_the_same_logprobs(tiny_model_dir):
    backend = build_backend(tiny_model_dir, config(pack_tokens=1))
    batch = collate(items(), backend.row_tokens)
    read = batch.tokens.read
    assert read is not None and read.any() and not read.all()
    every = backend.token_logprobs(replace(batch.tokens, read=None), grad=False)
    some = backend.token_logprobs(batch.tokens, grad=False)
    torch.testing.assert_close(some[read], every[read], rtol=0, atol=1e-6)
    # prompt positions no row reads got no logits
    assert 0 < int((some != 0).sum()) < int((every != 0).sum())


def test_one_minibatch_reads_proximal_logprobs_off_the_training_forward(tiny_model_dir):
    backend = build_backend(tiny_model_dir, config())
    batch = collate(items(), backend.row_tokens)
    total = batch.loss_tokens
    separate = proximal_logprobs(backend, batch)
    fused_terms, fused = minibatch_loss(backend, batch, total, config())
    apart_terms, _ = minibatch_loss(backend, batch, total, config(), proximal=separate)
    torch.testing.assert_close(fused, separate, rtol=0, atol=1e-6)
    assert float(fused_terms.loss.detach()) == pytest.approx(
        float(apart_terms.loss.detach()), rel=1e-6
    )
    for a, b in zip(
        grads(backend, fused_terms.loss), grads(backend, apart_terms.loss), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_step_says_where_its_time_went(tiny_model_dir, minibatches):
    cfg = config(minibatches=minibatches)
    stats = train_step(build_backend(tiny_model_dir, cfg), items(), 0, cfg)
    assert set(stats.seconds) == set(PHASES)
    assert all(stats.seconds[p] > 0 for p in ("forward", "backward", "optimizer"))
    assert stats.seconds["reference"] == 0  # no KL term
    # the separate proximal forward runs only when a later minibatch sees updated weights
    assert (stats.seconds["proximal"] > 0) == (minibatches > 1)


@pytest.fixture(scope="module")
def engine_groups(tiny_model_dir) -> list[list[SampleReady]]:
    """Two groups of 6 samples generated by the real hf engine (float32) at temperature 0.7."""
    samples = asyncio.run(engine_samples(tiny_model_dir, 12, temperature=0.7))
    return [
        [
            s.model_copy(update={"group_id": g, "group_size": 6, "reward": float(i % 3)})
            for i, s in enumerate(samples[6 * n : 6 * n + 6])
        ]
        for n, g in enumerate("ab")
    ]


async def engine_samples(
    model, n: int, temperature: float, dtype: Precision = Precision.FLOAT32
) -> list[SampleReady]:
    """``n`` samples generated by the real hf engine on ``model``, version 0."""
    settings = HFEngineConfig(dtype=dtype)
    engine = await start_engine(EngineConfig(model=model, max_model_len=64, settings=settings))
    out = []
    try:
        for i in range(n):
            prompt = [5 + i, 6, 7 + 2 * i, 8, 9 + i][: 2 + i % 4]
            params = SamplingParams(max_tokens=6 + i % 5, temperature=temperature, seed=i)
            chunks = [c async for c in engine.generate(f"r{i}", prompt, params)]
            tokens = [t for c in chunks for t in c.token_ids]
            logprobs = [lp for c in chunks for lp in c.logprobs]
            s = sample(f"e{i}", prompt=tuple(prompt), completion=tuple(tokens), group_size=n)
            out.append(s.model_copy(update={"logprobs": [0.0] * len(prompt) + logprobs}))
    finally:
        await engine.close()
    return out


@pytest.mark.parametrize("pack_tokens", [1, 64])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_fp32_mismatch_with_the_engine_is_below_1e_5_before_and_between_updates(
    tiny_model_dir, engine_groups, minibatches, pack_tokens
):
    """Every minibatch is scored with the weights before the step's first update, so the
    engine's logprobs (of those weights) match them, also after the first minibatch's update."""
    cfg = config(pack_tokens, temperature=0.7, lr=1e-3, groups_per_step=2, minibatches=minibatches)
    backend = build_backend(tiny_model_dir, cfg)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    planned, _, _ = plan_step(engine_groups, 0, cfg)
    stats = train_step(backend, planned, 0, cfg)
    assert (
        stats.mismatch.tokens
        == stats.loss_tokens
        == sum(sum(s.loss_mask) for g in engine_groups for s in g)
    )
    assert stats.mismatch.max_abs < 1e-5
    assert any(not torch.equal(before[k], v) for k, v in backend.model.state_dict().items())
    # Scored with the updated weights, they would not match.
    batch = collate(planned, backend.row_tokens)
    moved = (proximal_logprobs(backend, batch) - batch.behaviour)[batch.mask > 0]
    assert float(moved.abs().max()) > 1e-3


@pytest.mark.skipif(BF16 is not None, reason=f"no bfloat16 here: {BF16}")
def test_bfloat16_mismatch_shows_its_cost(tiny_model_dir, engine_groups):
    fp32, bf16 = (config(temperature=0.7, dtype=d) for d in Precision)
    planned, _, _ = plan_step(engine_groups, 0, fp32)
    exact = train_step(build_backend(tiny_model_dir, fp32), planned, 0, fp32).mismatch
    rounded = train_step(build_backend(tiny_model_dir, bf16), planned, 0, bf16).mismatch
    assert rounded.tokens == exact.tokens
    assert rounded.max_abs > 10 * exact.max_abs and rounded.kl > exact.kl


@pytest.mark.skipif(BF16 is not None, reason=f"no bfloat16 here: {BF16}")
def test_bfloat16_computes_in_bf16_and_keeps_float32_weights(tiny_model_dir):
    cfg = config(dtype=Precision.BFLOAT16, lr=1e-3)
    backend = build_backend(tiny_model_dir, cfg)
    batch = collate(items(), backend.row_tokens)
    fp32 = proximal_logprobs(build_backend(tiny_model_dir, config()), batch)
    bf16 = proximal_logprobs(backend, batch)
    diff = (bf16 - fp32).abs()[batch.mask > 0]
    assert 1e-4 < float(diff.max()) < 1.0  # rounded, not wrong
    stats = train_step(backend, items(), 0, cfg)
    assert stats.grad_norm > 0
    assert {p.dtype for p in backend.model.parameters()} == {torch.float32}


@pytest.mark.skipif(BF16 is not None, reason=f"no bfloat16 here: {BF16}")
async def test_a_bfloat16_engine_shows_its_cost_in_the_float32_trainers_mismatch(tiny_model_dir):
    cfg = config(temperature=0.7)
    backend = build_backend(tiny_model_dir, cfg)
    seen = {}
    for dtype in Precision:
        samples = await engine_samples(tiny_model_dir, 6, 0.7, dtype)
        planned, _, _ = plan_step([samples], 0, cfg)
        batch = collate(planned, backend.row_tokens)
        diff = (proximal_logprobs(backend, batch) - batch.behaviour)[batch.mask > 0].abs()
        seen[dtype] = float(diff.max())
    assert seen[Precision.FLOAT32] < 1e-5
    assert seen[Precision.BFLOAT16] > max(1e-4, 10 * seen[Precision.FLOAT32])


def test_bfloat16_where_unsupported_is_a_clear_error(tiny_model_dir):
    assert unsupported(Precision.FLOAT32, "cpu") is None
    if not torch.cuda.is_available():
        assert "CUDA" in unsupported(Precision.BFLOAT16, "cuda")
    if BF16 is not None:
        with pytest.raises(BackendError, match=r"trainer\.backend\.dtype = 'bfloat16'"):
            build_backend(tiny_model_dir, config(dtype=Precision.BFLOAT16))


def test_sample_aggregation_weighs_every_sample_the_same():
    """``loss_aggregation = "sample"``: in the token-normalised loss each sample's tokens share
    one equal part, whatever its length; staleness weights stay relative."""
    planned = items(9)
    planned[0] = replace(planned[0], weight=0.5)
    tokens = [sum(i.sample.loss_mask[1:]) for i in planned]
    assert len(set(tokens)) > 2  # samples of several lengths
    weighted = equal_sample_weights(planned)
    mean = sum(tokens) / len(tokens)
    shares = [w.weight * t for w, t in zip(weighted, tokens, strict=True)]
    assert shares[0] == pytest.approx(0.5 * mean)
    assert shares[1:] == pytest.approx([mean] * (len(shares) - 1))
    assert [w.sample for w in weighted] == [i.sample for i in planned]


@pytest.mark.parametrize(
    "aggregation, kl_coef",
    [(LossAggregation.TOKEN, 0.0), (LossAggregation.SAMPLE, 0.0), (LossAggregation.TOKEN, 0.1)],
)
def test_a_step_computed_in_parts_makes_the_whole_batchs_update(
    tiny_model_dir, aggregation, kl_coef
):
    """The trainer's ``overlap``: each part's gradients are kept, scaled at the commit by the
    whole step's loss tokens (or samples): the same weights and stats as ``train_step``."""
    cfg = config(loss_aggregation=aggregation, kl_coef=kl_coef)
    planned = items(9, seed=3)
    whole_backend, parts_backend = (build_backend(tiny_model_dir, cfg) for _ in range(2))
    whole = train_step(whole_backend, planned, 0, cfg)
    accumulation = Accumulation()
    for part in (planned[:2], planned[2:3], planned[3:]):
        accumulation.add(parts_backend, part, cfg)
    parts = accumulation.commit(parts_backend, 0, cfg)
    assert (parts.samples, parts.loss_tokens) == (whole.samples, whole.loss_tokens)
    assert parts.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    assert parts.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert parts.kl == pytest.approx(whole.kl, rel=1e-5, abs=1e-9)
    assert parts.mismatch.tokens == whole.mismatch.tokens
    assert parts.mismatch.mean_abs == pytest.approx(whole.mismatch.mean_abs, rel=1e-5)
    after = dict(parts_backend.model.named_parameters())
    before = dict(build_backend(tiny_model_dir, cfg).model.named_parameters())
    for name, param in whole_backend.model.named_parameters():
        torch.testing.assert_close(after[name], param, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(p, before[n]) for n, p in after.items())  # the step moved them
