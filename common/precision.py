"""The number format a model computes in (trainer forward/backward, engine inference), and whether
this machine can run it. torch is imported inside the functions: importing this module is cheap.

``bfloat16`` halves the bytes every matmul moves and, on CPUs with AVX512-BF16 or AMX (or CUDA
GPUs that have it), runs them on bf16 instructions; the price is precision, which the trainer's
mismatch metric (behaviour vs proximal logprobs of the same weights) shows.
"""

from enum import StrEnum


class Precision(StrEnum):
    """A compute dtype."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    def torch_dtype(self):
        import torch

        return torch.float32 if self is Precision.FLOAT32 else torch.bfloat16


def unsupported(precision: Precision, device: str) -> str | None:
    """Why ``precision`` cannot run on ``device`` (a torch device type: ``cpu``, ``cuda``), or
    None when it can. A CPU without AVX512-BF16 or AMX would emulate bf16, slower than float32."""
    import torch

    if precision is Precision.FLOAT32:
        return None
    if device == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return None
        return "this CUDA device has no bfloat16 support"
    if device == "cpu":
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            return None
        capability = torch.backends.cpu.get_cpu_capability()
        return f"this CPU ({capability}) has neither AVX512-BF16 nor AMX"
    return f"bfloat16 is not checked for device {device!r}"
