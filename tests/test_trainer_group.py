"""The trainer group (``trainer.group``, ``tagsched.group``): ranks on several workers.

1. Two ranks that met through a store (as group members do) and took rank 0's state give the
   loss, gradients and weights after one optimizer step of one rank on the same batch.
2. A colocated group of three ``seamlessflow worker`` processes forms by KV rendezvous (no
   address given), trains; one non-zero rank is killed with SIGKILL mid-run and training goes
   on within a bound; no sample is lost or trained twice over the whole run.
3. The multiplexed layout: a two-worker group plus a rollout worker; the scheduler lends the
   group's workers to rollout between batches and reclaims them; no sample lost or trained
   twice across the lends.
"""

from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from tests.test_trainer import DP_CONFIG, dp_items, group

TOLERANCE = 1e-5
"""float32 on CPU: two ranks sum two partial gradients where one rank sums them in one
backward, so values differ in the last bits; 1e-5 absolute bounds loss, gradients and weights
after one step (observed differences about 1e-7)."""


# -- 1. two ranks == one rank --------------------------------------------------------------------
def _warm(ranks, seed: int) -> None:
    """A solo step on other samples, so that the optimizer has state (rank 1's differs)."""
    samples = group(f"warm{seed}", 3, base=seed)
    from trainer.batcher import plan_step

    items, _, _ = plan_step([samples], 0, DP_CONFIG)
    ranks.step(items, 0)


def _loss_and_grads(backend, items) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard's loss and gradients, summed over the group (as ``apply`` sums)."""
    import torch.distributed as dist

    from trainer.batcher import collate
    from trainer.step import _loss_tokens, minibatch_loss

    total = sum(_loss_tokens(i) for i in items)
    rank, size = backend.dp_rank, backend.dp_size
    shard = collate(items[rank::size], backend.row_tokens, backend.shares_prefixes)
    terms, _ = minibatch_loss(backend, shard, total, DP_CONFIG)
    terms.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
    loss = terms.loss.detach().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(loss)
        dist.all_reduce(grads)
    backend.optimizer.zero_grad(set_to_none=True)
    return loss, grads


def _group_rank(rank: int, port: int, model: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.ranks import RankGroup

    torch.set_num_threads(1)
    ranks = RankGroup(Path(model), DP_CONFIG)
    _warm(ranks, seed=rank)  # rank 1 starts elsewhere: the join must give it rank 0's state
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    ranks.join(store, rank, 2, timeout)
    loss, grads = _loss_and_grads(ranks.backend, dp_items())
    if rank == 0:
        ranks.step(dp_items(), 0)
        ranks.leave()
    else:
        ranks.follow_group()  # until rank 0 leaves
    tensors = {"loss": loss, "grads": grads, **ranks.backend.hf_state_dict()}
    save_file(tensors, f"{out}/rank{rank}.safetensors")


def test_two_ranks_give_one_ranks_loss_gradients_and_step(tiny_model_dir, tmp_path):
    from tests.support import free_port
    from trainer.ranks import RankGroup

    torch.multiprocessing.spawn(
        _group_rank,
        args=(free_port(), str(tiny_model_dir), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    single = RankGroup(tiny_model_dir, DP_CONFIG)
    _warm(single, seed=0)
    before = single.backend.hf_state_dict()
    loss, grads = _loss_and_grads(single.backend, dp_items())
    single.step(dp_items(), 0)
    one = {"loss": loss, "grads": grads, **single.backend.hf_state_dict()}
    ranks = [load((tmp_path / f"rank{r}.safetensors").read_bytes()) for r in range(2)]
    moved = max(float((one[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-3  # the step did something, so the comparison below means something
    assert float(grads.abs().max()) > 1e-3
    for name, tensor in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], tensor, atol=TOLERANCE, rtol=0), name
