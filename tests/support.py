"""Helpers shared by the tests: which nats-servers to test on, and small run limits."""

import asyncio
import inspect
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
from nats.js import JetStreamContext
from prometheus_client.parser import text_string_to_metric_families

from broker import codec
from broker.config import EmbeddedBrokerConfig, MiB, ProvisionConfig, StreamLimits
from broker.messages import Message
from broker.server import find_nats_server, server_version


def _nats_binaries() -> dict[str, Path]:
    candidates = [find_nats_server()]
    candidates += [Path(p) for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if p]
    if on_path := shutil.which("nats-server"):
        candidates.append(Path(on_path))
    found: dict[str, Path] = {}
    for path in candidates:
        if path.is_file():
            version = "nats-" + ".".join(map(str, server_version(path)))
            found.setdefault(version, path)
    return found


NATS_BINARIES = _nats_binaries()
M = TypeVar("M", bound=Message)

# JetStream reserves each stream's max_bytes on disk; tests create many runs, so keep them small.
_SMALL = StreamLimits(
    max_bytes=4 * MiB,
    max_age_s=3600,
    max_msg_size=MiB,
    max_payload=64 << 10,
    duplicate_window_s=60,
)
SMALL_RUN = ProvisionConfig(
    tasks=_SMALL,
    gen=_SMALL,
    traj=_SMALL,
    samples=_SMALL,
    weights=_SMALL,
    dead=_SMALL,
    weights_store_max_bytes=32 * MiB,  # the tiny model is ~10 MB
)


def broker_config(state_dir: Path, binary: Path) -> EmbeddedBrokerConfig:
    return EmbeddedBrokerConfig(state_dir=state_dir, binary=binary, max_payload=2 << 20)


async def stream_messages(js: JetStreamContext, stream: str, schema: type[M]) -> list[M]:
    """Every message stored in ``stream``, decoded as ``schema``, oldest first."""
    state = (await js.stream_info(stream)).state
    if not state.messages:
        return []
    return [
        codec.decode(schema, (await js.get_msg(stream, seq)).data)
        for seq in range(state.first_seq, state.last_seq + 1)
    ]


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 20.0,
    watch: asyncio.Task | None = None,
) -> None:
    """Wait until ``condition()`` holds; fail at once if ``watch`` (a background task) ended."""
    async with asyncio.timeout(timeout):
        while True:
            result = condition()
            if await result if inspect.isawaitable(result) else result:
                return
            assert watch is None or not watch.done(), watch.exception()
            await asyncio.sleep(0.05)


def perturbed_weights(model_dir: Path, seed: int) -> bytes:
    """The model's weights with noise on the (tied) embedding, saved without lm_head."""
    import torch
    from safetensors.torch import load_file, save

    tensors = load_file(model_dir / "model.safetensors")
    tensors.pop("lm_head.weight", None)
    embed = tensors["model.embed_tokens.weight"]
    noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(seed))
    tensors["model.embed_tokens.weight"] = embed + 0.5 * noise
    return save(tensors)


def greedy(model_dir: Path, prompt: list[int], n: int, weights: bytes | None = None) -> list[int]:
    """Greedy continuation by transformers (no EOS stop), with ``weights`` if given."""
    import torch
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(load(weights), strict=False)  # tied: lm_head follows the embedding
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


async def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (with at least these labels) that ``url`` serves.
    Async, so it also reads a /metrics served by the test's own event loop."""
    async with httpx.AsyncClient(timeout=5) as http:
        body = (await http.get(url)).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
