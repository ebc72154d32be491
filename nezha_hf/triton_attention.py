"""NEZHA attention on GPUs: the Triton kernels of `triton_kernels.py` as the engine `nezha_triton`.

Flash attention's scheme with NEZHA's relative terms (the kernels' docstring says how), forward and backward, for
float32, bfloat16 and float16 tensors on CUDA (and ROCm) GPUs, with any padding, causal or UniLM prefix mask, a KV
cache and attention dropout. With `TRITON_INTERPRET=1` set before Triton is imported, the same kernels run on CPU
tensors through Triton's interpreter when `nezha_triton` is asked for by name (slowly: that is how they are tested
without a GPU).

Registered as the `torch.library` ops `nezha_hf::triton_forward` / `_backward` (`attention_ops.engine_op`). Where
Triton is not installed or its kernels fail to compile, `unusable_reason` says so with one warning and the chunked
engine runs instead (`relative_attention.py` decides). Besides the inputs, a call holds two float32 tensors of
`[batch, heads, queries, 2K + 1]` (the queries' and output gradients' products with the table, and the band's
scores): memory linear in the length.
"""

import importlib.util
import os
import sys

import torch
from transformers.utils import logging

from .attention_ops import AttentionProblem, EngineUnavailable, RelativeAttentionMask, engine_op

logger = logging.get_logger(__name__)

DEVICES = ("cuda",)  # ROCm GPUs are "cuda" devices to PyTorch
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_R = 16  # table rows per block product of the band's term
_failure: list[str] = []  # why the kernels cannot run in this process, once they failed


class TritonKernelFailed(EngineUnavailable):
    """The Triton kernels failed to compile or launch here (the message says why; `unusable_reason` says it from now
    on)."""


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (`TRITON_INTERPRET=1`), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_installed() -> bool:
    """Whether Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


def unusable_reason(device: str, named: bool = True) -> str | None:
    """Why the Triton engine cannot run on `device` here, or None when it can: it runs on CUDA / ROCm GPUs, and on CPU
    tensors under `TRITON_INTERPRET=1` when asked for by name (`named`; slow, so never as another engine's fallback);
    it needs Triton installed, and kernels that compiled. A missing Triton on a GPU, or kernels that failed, are one
    warning."""
    if device == "cpu" and not (interpreting() and named):
        return "the Triton kernel runs on CUDA GPUs (on the CPU only under TRITON_INTERPRET=1, asked for by name)"
    if device not in (*DEVICES, "cpu"):
        return f"the Triton kernel runs on CUDA and ROCm GPUs, not {device}"
    if not triton_installed():
        reason = "Triton is not installed (pip install triton)"
        logger.warning_once(f"NEZHA attention: {reason}; the chunked engine runs instead, with the same results.")
        return reason
    return _failure[0] if _failure else None


def _kernels():
    """`triton_kernels`, imported when first needed (it imports Triton). Written as `from .triton_kernels import`, the
    form transformers follows to copy a remote-code checkpoint's files."""
    from .triton_kernels import __name__ as name

    return sys.modules[name]


def _failed(error: Exception) -> TritonKernelFailed:
    """Record that the kernels failed here, warn once, and return the error to raise."""
    reason = f"the Triton kernel failed to compile or run here ({type(error).__name__}: {error})"
    if not _failure:
        _failure.append(reason)
        logger.warning(f"NEZHA attention: {reason}; the chunked engine runs from now on, with the same results.")
    return TritonKernelFailed(reason)


def _flags(query, problem: AttentionProblem, kernels) -> dict:
    """The kernels' compile-time switches for a call."""
    mask = problem.mask
    return dict(
        HAS_VALID=mask.key_is_valid is not None, CAUSAL=bool(mask.causal), HAS_SOURCE=problem.key_is_source is not None,
        DROPOUT=problem.dropout > 0, WIDEN=kernels.INTERPRETING and query.dtype == torch.bfloat16,
        IEEE=query.dtype == torch.float32, BLOCK_D=max(16, 1 << (query.shape[-1] - 1).bit_length()),
    )


def _scalars(query, key, table, problem: AttentionProblem) -> tuple:
    """`(H, Lq, Lk, D, R, offset, scale, dropout, seed)` as the kernels take them."""
    _, heads, queries, size = query.shape
    seed = int(problem.seed) if problem.dropout > 0 else 0
    return (heads, queries, key.shape[-2], size, table.shape[0], int(problem.mask.query_offset), problem.scaling,
            problem.dropout, seed)


def _key_flags(flags: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """Key flags as the kernels read them: `[batch, keys]` int8, contiguous (one byte when there are none)."""
    if flags is None:
        return torch.zeros(1, dtype=torch.int8, device=key.device)
    return flags.to(device=key.device, dtype=torch.int8).contiguous()


def _strides(tensor: torch.Tensor, layout: str) -> tuple:
    """Strides in the order batch, heads, rows, head dimension for a `"bhld"` or `"blhd"` tensor."""
    b, first, second, d = tensor.stride()
    return (b, first, second, d) if layout == "bhld" else (b, second, first, d)


def _table_products(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`rows @ T^T` in float32, `[batch * heads, length, 2K + 1]` contiguous: what the kernels look the relative key
    term (and its gradient's) up in."""
    return torch.matmul(rows.float(), table.float().T).flatten(0, 1).contiguous()


def _blocks(length: int, block: int) -> int:
    """Blocks of `block` rows that cover `length`."""
    return -(-length // block)


def triton_forward(query, key, value, table, problem: AttentionProblem) -> list[torch.Tensor]:
    """NEZHA attention forward by the Triton kernel: `[output [batch, queries, heads, head_size], lse [batch, heads,
    queries] float32]`; see `attention_ops.engine_op`."""
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    table = table.contiguous()
    output = query.new_empty(batch, queries, heads, size)
    lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)
    if queries == 0 or key.shape[-2] == 0:
        return [output.zero_(), lse.fill_(float("-inf"))]
    band = torch.full((batch * heads, queries, table.shape[0]), float("-inf"), device=query.device)
    flags = _flags(query, problem, kernels)
    grid = lambda meta: (_blocks(queries, meta["BLOCK_M"]), batch * heads)  # noqa: E731
    try:
        kernels.nezha_forward_kernel[grid](
            query, key, value, _table_products(query, table), table, band, output, lse,
            _key_flags(problem.mask.key_is_valid, key), _key_flags(problem.key_is_source, key),
            *_strides(query, "bhld"), *_strides(key, "bhld"), *_strides(value, "bhld"), *_strides(output, "blhd"),
            *_scalars(query, key, table, problem), kernels.length_class(queries), kernels.length_class(key.shape[-2]),
            **flags, BLOCK_R=BLOCK_R,
        )
    except Exception as error:  # compilation or launch: the engine falls back (`relative_attention.py`)
        raise _failed(error) from error
    return [output, lse]


def triton_backward(grad_output, query, key, value, table, problem: AttentionProblem, output,
                    lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value (`[batch, heads, length, head_size]`) by the Triton kernels; see
    `attention_ops.engine_op` (`grad_output` and `output` are `[batch, heads, queries, head_size]` views)."""
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    table = table.contiguous()
    grad_query = torch.zeros(batch, heads, queries, size, dtype=torch.float32, device=query.device)
    grad_key = torch.zeros(batch, heads, keys, size, dtype=torch.float32, device=key.device)
    grad_value = torch.zeros_like(grad_key)
    if queries and keys:
        row_dot = (grad_output.float() * output.float()).sum(-1).contiguous()  # D_i = dO_i . O_i
        query_table, output_table = _table_products(query, table), _table_products(grad_output, table)
        band = torch.zeros(batch * heads, queries, table.shape[0], device=query.device)
        flags = _flags(query, problem, kernels)
        block_m, block_n = kernels.BACKWARD_BLOCKS
        shared = (*_strides(query, "bhld"), *_strides(key, "bhld"), *_strides(value, "bhld"),
                  *_strides(grad_output, "bhld"), *_scalars(query, key, table, problem))
        key_valid, key_is_source = _key_flags(problem.mask.key_is_valid, key), _key_flags(problem.key_is_source, key)
        try:
            kernels.nezha_key_value_grad_kernel[(_blocks(keys, block_n), batch * heads)](
                query, key, value, grad_output, query_table, output_table, lse, row_dot, grad_key, grad_value,
                key_valid, key_is_source, *shared, **flags, BLOCK_M=block_m, BLOCK_N=block_n)
            kernels.nezha_query_grad_kernel[(_blocks(queries, block_m), batch * heads)](
                query, key, value, grad_output, query_table, output_table, lse, row_dot, table, band, grad_query,
                key_valid, key_is_source, *shared, **flags, BLOCK_R=BLOCK_R, BLOCK_M=block_m, BLOCK_N=block_n)
        except Exception as error:
            raise _failed(error) from error
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def _forward_fake(query, key, value, table, problem):
    batch, heads, queries, size = query.shape
    return [query.new_empty(batch, queries, heads, size),
            torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)]


def _backward_fake(grad_output, query, key, value, table, problem, output, lse):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


triton_attention = engine_op("triton", triton_forward, _forward_fake, triton_backward, _backward_fake)
triton_attention.__doc__ = """NEZHA attention by the Triton kernels, `[batch, queries, heads, head_size]`; arguments as
    `fused_attention.fused_attention`. float32, bfloat16 and float16 on CUDA GPUs (CPU tensors under
    TRITON_INTERPRET=1)."""


_checked_backwards: set = set()


def check_backward(dtype: torch.dtype, head_size: int, device: str) -> None:
    """Compile and run the backward kernels once per process for `dtype`, `head_size` and `device` on a small
    problem, so that a backward that cannot compile here is found at the forward, where the chunked engine can still
    take over; raises `TritonKernelFailed`."""
    if (dtype, head_size, device) in _checked_backwards:
        return
    generator = torch.Generator().manual_seed(0)
    query, key, value, grad_output = (torch.randn(1, 1, 32, head_size, generator=generator).to(device, dtype)
                                      for _ in range(4))
    table = torch.zeros(9, head_size, device=device, dtype=dtype)
    problem = AttentionProblem(RelativeAttentionMask(), head_size**-0.5)
    output, lse = triton_forward(query, key, value, table, problem)
    triton_backward(grad_output, query, key, value, table, problem, output.transpose(1, 2), lse)
    _checked_backwards.add((dtype, head_size, device))


__all__ = ["TritonKernelFailed", "check_backward", "interpreting", "triton_attention", "triton_installed", "unusable_reason"]
