"""The compiled NEZHA attention kernel (`csrc/relative_attention.cpp`): loading it, and calling it.

The kernel computes the whole relative attention in one flash-style pass, forward and backward,
for float32 tensors on CPU. It is built with `torch.utils.cpp_extension` the first time it is
needed and cached on disk. This module is an engine: it takes tensors and key flags and knows
nothing of models; `relative_attention.py` decides when it runs.
"""

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("csrc") / "relative_attention.cpp"
# Query rows and keys per block of the kernel; 0 lets it choose (as PyTorch's flash kernel does).
KERNEL_BLOCK_SIZES = (0, 0)


@functools.cache
def compiled_kernel():
    """The compiled NEZHA attention kernel, built on first use and then cached; None if unavailable.

    It is built with PyTorch's `torch.utils.cpp_extension.load` (needs a C++ compiler and `ninja`)
    into `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), for the CPU it runs on. It is
    not used when the environment variable `NEZHA_HF_KERNEL=0` is set, the source file is absent
    (remote-code checkpoints copy only the Python files) or the build fails (logged once).
    `compiled_kernel.cache_clear()` forgets the result, so the next call tries again.
    """
    if os.environ.get("NEZHA_HF_KERNEL", "1") == "0" or not KERNEL_SOURCE.is_file():
        return None
    from torch.utils.cpp_extension import load

    # -march=native: the build is for this CPU, so the name says which CPU and which source.
    digest = hashlib.sha1(KERNEL_SOURCE.read_bytes() + platform.processor().encode() + torch.__version__.encode())
    try:
        logger.info("Loading NEZHA's attention kernel (it is compiled the first time, which takes a while).")
        return load(
            name=f"nezha_hf_relative_attention_{digest.hexdigest()[:12]}",
            sources=[str(KERNEL_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler, no ninja, no BLAS symbol: the PyTorch paths still work
        logger.warning(f"NEZHA's attention kernel is unavailable ({type(error).__name__}: {error}); using PyTorch ops.")
        return None


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class KernelFunction(torch.autograd.Function):
    """Exact NEZHA attention by the compiled kernel, forward and backward (float32 on CPU)."""

    @staticmethod
    def forward(ctx, query, key, value, table, scaling, causal, key_is_valid, key_is_source):
        query, key, value = (_last_dim_contiguous(x) for x in (query, key, value))
        K = (table.shape[0] - 1) // 2
        flags = (causal, key_is_valid, key_is_source, *KERNEL_BLOCK_SIZES)
        output, lse = compiled_kernel().forward(query, key, value, table, K, scaling, *flags)
        output = output.transpose(1, 2)  # [batch, heads, L, d] view of [batch, L, heads, d]
        ctx.save_for_backward(query, key, value, table, output, lse)
        ctx.scaling, ctx.flags = scaling, flags
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, table, output, lse = ctx.saved_tensors
        K = (table.shape[0] - 1) // 2
        grads = compiled_kernel().backward(
            _last_dim_contiguous(grad_output), query, key, value, output, lse, table, K, ctx.scaling, *ctx.flags
        )
        return (*(grad.transpose(1, 2) for grad in grads), None, None, None, None, None)


def kernel_attention(query, key, value, table, scaling: float, causal: bool, key_is_valid, key_is_source) -> torch.Tensor:
    """NEZHA attention by the compiled kernel: `[batch, heads, length, head_size]` in, the same shape out.

    `table` is the `(2K + 1) x head_size` float32 table; `key_is_valid` (`[batch, length]`, False on
    padding) and `key_is_source` (keys every query sees under a `causal` mask) may be None.
    Call only when `compiled_kernel()` is not None.
    """
    return KernelFunction.apply(query, key, value, table, scaling, causal, key_is_valid, key_is_source)
