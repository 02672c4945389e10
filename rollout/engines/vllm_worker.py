"""The worker side of the vLLM engine: a worker extension that reloads weights in place.

vLLM mixes this class into its worker (``worker_extension_cls``), in the worker process, so
``rollout.engines.vllm`` reaches it with ``collective_rpc("sf_reload_weights", ...)``. The files
arrive as paths: tensors passed through ``collective_rpc`` arrive as lists.
"""

from collections.abc import Iterator

import torch
from safetensors import safe_open


def _tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (not a dict)
                yield name, f.get_tensor(name)


class WeightReloader:
    """Worker extension: reload checkpoint-format (HF-named) weights from safetensors files."""

    def sf_reload_weights(self, files: list[str]) -> None:
        """Load every tensor of ``files`` into the running model, in place.

        The CPU matmul keeps its own packed copy of each linear weight. A tied ``lm_head``
        shares its weight with the embedding, so the reload refreshes the weight but not the
        packed copy: pack it again.
        """
        self.reload_weights(weights_iterator=_tensors(files))
        lm_head = self.model_runner.model.lm_head
        lm_head.quant_method.process_weights_after_loading(lm_head)
