"""What a weights folder must hold to be loaded into a running vLLM engine, checked before vLLM
sees it: a reload that fails inside vLLM leaves a half-loaded model and kills the engine."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rollout.exceptions import EngineError

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True)
class WeightLayout:
    """The tensors a weights folder must hold: HF name -> shape."""

    shapes: dict[str, tuple[int, ...]]
    tied: dict[str, str]
    """Name -> the name whose tensor it shares (``lm_head.weight`` -> the embedding). vLLM
    loads only the second, so the first may be absent, and if present must be equal."""

    @classmethod
    def of_model(cls, model: Path) -> "WeightLayout":
        """The layout of the checkpoint in the HF model folder ``model``."""
        shapes = {name: shape for name, (shape, _, _) in _headers(model).items()}
        config = json.loads((model / "config.json").read_text())
        embed = shapes.get("model.embed_tokens.weight")
        if config.get("tie_word_embeddings") and embed is not None:
            shapes["lm_head.weight"] = embed
            return cls(shapes, {"lm_head.weight": "model.embed_tokens.weight"})
        return cls(shapes, {})

    def check(self, folder: Path) -> list[Path]:
        """The safetensors files (absolute paths) of ``folder`` if they hold exactly this
        layout in a float dtype, else ``EngineError`` saying what is wrong. Reads the headers,
        and the tensors of tied names given twice."""
        found = _headers(folder)
        problems = []
        missing = sorted(set(self.shapes) - set(self.tied) - set(found))
        if missing:
            problems.append(f"missing {_some(missing)}")
        unknown = sorted(set(found) - set(self.shapes))
        if unknown:
            problems.append(f"unknown {_some(unknown)}")
        for name, (shape, dtype, _) in sorted(found.items()):
            expected = self.shapes.get(name)
            if expected is not None and shape != expected:
                problems.append(f"{name} has shape {list(shape)}, expected {list(expected)}")
            if dtype not in FLOAT_DTYPES:
                problems.append(f"{name} has dtype {dtype}, expected a float dtype")
        if not problems:  # every tied source is there
            problems = [
                f"tied weights {name} and {source} differ"
                for name, source in self.tied.items()
                if name in found and not _same(found, name, source)
            ]
        if problems:
            raise EngineError(f"weights in {folder} do not fit the model: {'; '.join(problems)}")
        return sorted(folder.resolve().glob("*.safetensors"))


_Header = tuple[tuple[int, ...], str, Path]
"""Shape, dtype and file of a tensor in a safetensors file."""


def _headers(folder: Path) -> dict[str, _Header]:
    """Name -> header of every tensor in the ``*.safetensors`` files of ``folder``."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {folder}")
    found: dict[str, _Header] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (not a dict)
                    if name in found:
                        raise EngineError(f"tensor {name} appears twice in {folder}")
                    tensor = f.get_slice(name)
                    found[name] = (tuple(tensor.get_shape()), tensor.get_dtype(), file)
        except (SafetensorError, OSError) as exc:
            raise EngineError(f"cannot read {file} as safetensors: {exc}") from exc
    return found


def _same(found: dict[str, _Header], a: str, b: str) -> bool:
    """Whether the tensors named ``a`` and ``b`` hold the same values."""
    tensor_a, tensor_b = (_tensor(found, name) for name in (a, b))
    return torch.equal(tensor_a.to(tensor_b.dtype), tensor_b)


def _tensor(found: dict[str, _Header], name: str) -> torch.Tensor:
    with safe_open(found[name][2], framework="pt") as f:
        return f.get_tensor(name)


def _some(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
