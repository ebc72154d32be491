"""NEZHA attention on GPUs: the Triton kernels of `triton_kernels.py` as the engine `nezha_triton`.

FlashAttention-2 with NEZHA's relative terms, its tiles by class (the kernels' docstring says how), forward and
backward, for float32, bfloat16 and float16 tensors on CUDA (and ROCm) GPUs, with any padding, causal or UniLM prefix
mask, a KV cache and attention dropout. A decoding step (at most 16 queries) splits its keys over the GPU's
multiprocessors and merges the splits by their log-sum-exps. With `TRITON_INTERPRET=1` set before Triton is imported,
the same kernels run on CPU tensors through Triton's interpreter when `nezha_triton` is asked for by name (slowly: that
is how they are tested without a GPU).

Registered as the `torch.library` ops `nezha_hf::triton_forward` / `_backward` (`attention_ops.engine_op`), which
`triton_attention` calls. Memory besides the inputs, outputs and gradients: the log-sum-exp and `D_i` per query, and
a decoding step's partial outputs; nothing per (query, table row).

- Launches: one grid axis of (head, block) programs (CUDA allows 65,535 on the others), on the tensors' GPU.
- Failures: an out-of-memory error reaches the caller as PyTorch's own, and the engine stays usable. A kernel that
  fails to compile (or launch) is set aside for its `Switches` and part (forward, decoding forward or backward) only,
  with one warning naming them: those calls raise `TritonKernelFailed` (an `EngineUnavailable`), which
  `relative_attention` hands to the next engine of the chain (`attention_ops.Engine`); calls with other switches still
  run the kernels. Before the first forward of a kind of call that needs gradients, the kernels its backward will
  launch are compiled (Triton's warmup through the backward's launchers), so that a backward that cannot compile is
  found while another engine can still take the call.
- float32: every product is made in the kernels in IEEE float32, whatever `torch.backends.cuda.matmul.allow_tf32` or
  `torch.set_float32_matmul_precision` say: no PyTorch matrix product is on the path (PyTorch computes only the
  elementwise `D_i = dO_i . O_i`, the key bounds and flags).
- No host synchronisation: nothing on the path reads a GPU tensor on the host. A static cache's offset (a tensor on
  the GPU) is read by the kernels; the dropout seed is a CPU tensor (`relative_attention` draws it there). The one
  exception: whether a bfloat16 / float16 call's table is the exact sinusoid (the band by rotation, forward and
  backward) is compared once per table tensor and version (`relative_attention` passes the model's own table, not a
  copy per call).
"""

import contextlib
import importlib.util
import math
import os
import sys
import weakref
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .attention_ops import (
    AttentionProblem,
    Engine,
    EngineUnavailable,
    RelativeAttentionMask,
    engine_op,
    fallback_words,
    sinusoid_relative_table,
    tracing,
)

logger = logging.get_logger(__name__)

DEVICES = ("cuda",)  # ROCm GPUs are "cuda" devices to PyTorch
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = math.log2(math.e)  # the kernels keep scores in base 2
# The interpreter has no multiprocessors to fill: a decoding step splits its keys as if there were this many, so that
# tests run the split path.
INTERPRETER_PROCESSORS = 4


class TritonKernelFailed(EngineUnavailable):
    """A Triton kernel failed to compile or launch here for a call's switches (the message names them and the
    error); calls with those switches raise it from then on, without trying again."""


@dataclass(frozen=True)
class Switches:
    """What a call's kernels are compiled for, besides their tuned block sizes: a kernel that fails to compile is set
    aside for these switches only."""

    dtype: torch.dtype
    head_size: int
    padding: bool
    causal: bool
    source_keys: bool  # UniLM's prefix mask (under `causal`)
    dropout: bool
    offset_on_device: bool  # the queries' offset is a tensor the kernels read

    @classmethod
    def of(cls, query: torch.Tensor, problem: AttentionProblem) -> "Switches":
        mask = problem.mask
        return cls(query.dtype, query.shape[-1], mask.key_is_valid is not None, bool(mask.causal),
                   problem.mask.key_is_source is not None, problem.dropout > 0,
                   _offset_on_device(mask.query_offset, query.device))

    def __str__(self) -> str:
        named = (("padding", self.padding), ("causal", self.causal), ("UniLM source keys", self.source_keys),
                 ("dropout", self.dropout), ("the offset on the GPU", self.offset_on_device))
        return ", ".join([str(self.dtype).removeprefix("torch."), f"head size {self.head_size}",
                          *(name for name, on in named if on)])

    def constexprs(self, kernels) -> dict:
        """The kernels' compile-time arguments."""
        return dict(HAS_VALID=self.padding, CAUSAL=self.causal, HAS_SOURCE=self.source_keys, DROPOUT=self.dropout,
                    OFFSET_IN_MEMORY=self.offset_on_device, WIDEN=kernels.INTERPRETING and self.dtype == torch.bfloat16,
                    IEEE=self.dtype == torch.float32, BLOCK_D=max(16, 1 << (self.head_size - 1).bit_length()))


_set_aside: dict[tuple[str, Switches], str] = {}  # (part, switches) whose kernel failed here, and why
_checked_backwards: set[tuple] = set()  # the kinds of call whose backward kernels compiled here (`_check_backward`)


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (`TRITON_INTERPRET=1`), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_installed() -> bool:
    """Whether Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


def unusable_reason(device: str, named: bool = True) -> str | None:
    """Why the Triton engine cannot run on `device` here, or None when it can: it runs on CUDA / ROCm GPUs, and on CPU
    tensors under `TRITON_INTERPRET=1` when asked for by name (`named`; slow, so never as another engine's fallback);
    it needs Triton installed (else one warning). While the `TritonKernelFailed` of a call is being handled (the
    engines' contract: `relative_attention` chooses again inside its `except EngineUnavailable`), its reason: that call
    goes to the next engine, while calls with other switches still run the kernels."""
    if device == "cpu" and not (interpreting() and named):
        return "the Triton kernel runs on CUDA GPUs (on the CPU only under TRITON_INTERPRET=1, asked for by name)"
    if device not in (*DEVICES, "cpu"):
        return f"the Triton kernel runs on CUDA and ROCm GPUs, not {device}"
    if not triton_installed():
        reason = "Triton is not installed (pip install triton)"
        logger.warning_once(f"NEZHA attention: {reason}; {fallback_words(Engine.TRITON)}.")
        return reason
    failure = sys.exc_info()[1]
    return str(failure) if isinstance(failure, TritonKernelFailed) else None


def _kernels():
    """`triton_kernels`, imported when first needed (it imports Triton). Written as `from .triton_kernels import`, the
    form transformers follows to copy a remote-code checkpoint's files."""
    from .triton_kernels import __name__ as name

    return sys.modules[name]


def _refuse_set_aside(part: str, switches: Switches) -> None:
    """Raise `TritonKernelFailed` when the `part` kernels failed to compile here for `switches`."""
    reason = _set_aside.get((part, switches))
    if reason is not None:
        raise TritonKernelFailed(reason)


@contextlib.contextmanager
def _launching(part: str, switches: Switches, device: torch.device):
    """Launch the `part` kernels on `device` (Triton launches on the current CUDA device). An out-of-memory error
    passes as it is; any other sets the part aside for `switches` (one warning) and becomes `TritonKernelFailed`."""
    with _device_guard(device):
        try:
            yield
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            reason = (f"the Triton kernel failed to compile for the {part} with {switches} ({type(error).__name__}: "
                      f"{error})")
            if (part, switches) not in _set_aside:
                _set_aside[(part, switches)] = reason
                logger.warning(f"NEZHA attention: {reason}; from now on, for such calls, "
                               f"{fallback_words(Engine.TRITON)}.")
            raise TritonKernelFailed(reason) from error


def _device_guard(device: torch.device):
    """A context in which `device` is the current CUDA device (nothing to do for the CPU's interpreted kernels)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _offset_on_device(offset: int | torch.Tensor, device: torch.device) -> bool:
    """Whether the kernels read the queries' offset from memory: a tensor on the queries' device, whose value the host
    would have to wait for. An int, or a tensor on the CPU (where `attention_ops.flatten` puts an int), is read here."""
    return isinstance(offset, torch.Tensor) and offset.device == device


def _decoding_splits(programs: int, queries: int, keys: int, device: torch.device, kernels) -> tuple[int, int]:
    """`(splits, keys per split)` of a forward with `programs` heads: a decoding step (one block of queries) splits
    its keys into chunks of whole `SPLIT_GRANULE`s, enough for about two programs per multiprocessor (FlashDecoding);
    other calls `(1, keys)`."""
    if queries > kernels.DECODING_BLOCK_M:
        return 1, keys
    processors = (INTERPRETER_PROCESSORS if device.type == "cpu"
                  else torch.cuda.get_device_properties(device).multi_processor_count)
    wanted = -(-2 * processors // programs)
    chunk = kernels.SPLIT_GRANULE * max(1, -(-keys // (wanted * kernels.SPLIT_GRANULE)))
    return -(-keys // chunk), chunk


def _forward_part(splits: int) -> str:
    return "decoding forward" if splits > 1 else "forward"


def _key_flags(flags: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor | None:
    """Key flags as the kernels read them: `[batch, keys]` int8, contiguous."""
    return None if flags is None else flags.to(device=key.device, dtype=torch.int8).contiguous()


def _key_bounds(problem: AttentionProblem, key: torch.Tensor) -> torch.Tensor | None:
    """`[batch, 3]` int32 per sequence: its first valid key, last valid key + 1, and last valid source key + 1 (0 when
    none), so that the kernels skip the key blocks no query sees; None without padding or source keys."""
    valid, source = problem.mask.key_is_valid, problem.mask.key_is_source
    if valid is None and source is None:
        return None
    batch, _, keys, _ = key.shape
    position = torch.arange(keys, device=key.device)
    valid = (torch.ones(batch, keys, dtype=torch.bool, device=key.device) if valid is None
             else valid.to(key.device, torch.bool))
    first = torch.where(valid, position, keys).amin(1)
    end = torch.where(valid, position + 1, 0).amax(1)
    sources = (torch.zeros_like(end) if source is None
               else torch.where(valid & source.to(key.device, torch.bool), position + 1, 0).amax(1))
    return torch.stack((first, end, sources), 1).to(torch.int32)


def _strides(tensor: torch.Tensor, name: str, row: str, heads_first: bool = True) -> dict:
    """The kernels' stride arguments `stride_{name}b`, `...h`, `...{row}`, `...d` of a `[batch, heads, length, d]`
    tensor (`heads_first`) or a `[batch, length, heads, d]` one."""
    b, first, second, d = tensor.stride()
    heads, length = (first, second) if heads_first else (second, first)
    return {f"stride_{name}b": b, f"stride_{name}h": heads, f"stride_{name}{row}": length, f"stride_{name}d": d}


def _arguments(query, key, value, table, problem: AttentionProblem, switches: Switches, kernels) -> dict:
    """The arguments every kernel of a call takes, by name: the table (in the queries' dtype, contiguous), the mask's
    flags and bounds, the offset, the strides of `query`, `key` and `value`, the sizes, the scale, dropout's seed and
    threshold, and the switches."""
    _, heads, queries, size = query.shape
    keys, dropout, offset = key.shape[-2], problem.dropout, problem.mask.query_offset
    if not problem.scaling > 0:  # the kernels take a row's maximum before the scale (plain FlashAttention-2's way)
        raise TritonKernelFailed(f"the Triton kernels take a positive score scale, not {problem.scaling}")
    return dict(
        Table=table.to(query.dtype).contiguous(), KeyValid=_key_flags(problem.mask.key_is_valid, key),
        KeyIsSource=_key_flags(problem.mask.key_is_source, key), KeyBounds=_key_bounds(problem, key),
        Offset=offset if switches.offset_on_device else None, offset=0 if switches.offset_on_device else int(offset),
        **_strides(query, "q", "m"), **_strides(key, "k", "n"), **_strides(value, "v", "n"),
        heads=heads, Lq=queries, Lk=keys, D=size, K=(table.shape[0] - 1) // 2, scale_log2=problem.scaling * LOG2E,
        seed=int(problem.seed) if dropout > 0 else 0, **_dropout_draws(dropout),
        LQ_CLASS=kernels.length_class(queries), LK_CLASS=kernels.length_class(keys), **switches.constexprs(kernels),
    )


def _keep_rate(keep_scale: float) -> float:
    """`1 - p` of a dropout's `keep_scale` (`_dropout_draws`): 0 where every pair is dropped (`keep_scale` 0)."""
    return 1 / keep_scale if keep_scale else 0.0


def _dropout_draws(dropout: float) -> dict:
    """The kernels' `threshold` and `keep_scale` for a dropout rate: a pair is dropped when its 8-bit draw is below
    `threshold = round(256 p)` (FlashAttention-2's 8-bit draws), so the rate runs as `threshold / 256`, and kept
    pairs are scaled by `256 / (256 - threshold)` (the expectation stays the output without dropout). A rate that
    rounds to 0 or 1 but is not one is the next engine's (`TritonKernelFailed`), never dropped silently or wholly."""
    threshold = math.floor(dropout * 256 + 0.5)
    if dropout == 0 or dropout == 1:
        return dict(threshold=threshold, keep_scale=1.0 if dropout == 0 else 0.0)
    if threshold in (0, 256):
        raise TritonKernelFailed(f"the Triton kernels draw dropout in steps of 1/256, and a rate of {dropout} rounds to "
                                 f"{threshold // 256}")
    if threshold != dropout * 256:
        logger.warning_once(f"NEZHA attention: the Triton kernels draw dropout in steps of 1/256 (FlashAttention-2's "
                            f"8-bit draws): a rate of {dropout} runs as {threshold}/256 = {threshold / 256:.4f}.")
    return dict(threshold=threshold, keep_scale=256 / (256 - threshold))


# Tables compared with the sinusoid: (id, dtype) -> (a weak reference to the table, its version, whether it is).
_exact_tables: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, bool]] = {}
_sinusoids: dict[tuple, torch.Tensor] = {}  # (K, head size, dtype, device) -> the kernels' `Sinusoid`


def _is_exact_sinusoid(table: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `table` in `dtype` is, entry for entry, the sinusoid `sinusoid_relative_table` makes (NEZHA's table):
    then the band tiles, forward and backward, go by rotation (`triton_kernels._rotated_band`), which holds for that
    table only; any other table takes the table's window. Compared once per table tensor and version (the comparison
    waits for the GPU), the answer kept while the table lives."""
    key = (id(table), dtype)
    version = None if table.is_inference() else table._version  # an inference tensor counts no versions: no reuse
    known = _exact_tables.get(key)
    if known is not None and known[0]() is table and version is not None and known[1] == version:
        return known[2]
    rows, size = table.shape
    exact = rows % 2 == 1 and size % 2 == 0 and torch.equal(
        table.to(dtype), sinusoid_relative_table((rows - 1) // 2, size).to(table.device, dtype))
    _exact_tables[key] = (weakref.ref(table, lambda _: _exact_tables.pop(key, None)), version, exact)
    return exact


def _rotation(table: torch.Tensor, dtype: torch.dtype, kernels) -> dict:
    """The kernels' `ROTATE` and `Sinusoid` (the sinusoid continued to `2K + ROTATION_ROWS` rows, in `dtype`, made
    once per size): by rotation for bfloat16 and float16 with the exact sinusoid; float32, whose products must stay
    as exact as the table's own rows, and any other table, by the table's window."""
    if dtype == torch.float32 or not _is_exact_sinusoid(table, dtype):
        return dict(ROTATE=False, Sinusoid=None)
    K, size = (table.shape[0] - 1) // 2, table.shape[1]
    key = (K, size, dtype, table.device)
    if key not in _sinusoids:
        _sinusoids[key] = sinusoid_relative_table(K + -(-kernels.ROTATION_ROWS // 2), size).to(table.device, dtype)
    return dict(ROTATE=True, Sinusoid=_sinusoids[key])


def _blocks(length: int, block: int) -> int:
    """Blocks of `block` rows that cover `length`."""
    return -(-length // block)


def triton_forward(query, key, value, table, problem: AttentionProblem) -> list[torch.Tensor]:
    """NEZHA attention forward by the Triton kernels: `[output [batch, queries, heads, head_size], lse [batch, heads,
    queries] float32]`; see `attention_ops.engine_op`. Raises `TritonKernelFailed` where the forward failed to compile
    for the call's switches."""
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    output = query.new_empty(batch, queries, heads, size)
    lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)
    if queries == 0 or keys == 0:
        return [output.zero_(), lse.fill_(float("-inf"))]
    switches = Switches.of(query, problem)
    splits, chunk = _decoding_splits(batch * heads, queries, keys, query.device, kernels)
    part = _forward_part(splits)
    _refuse_set_aside(part, switches)
    arguments = _arguments(query, key, value, table, problem, switches, kernels)
    outputs = dict(Out=output, Lse=lse, **_strides(output, "o", "m", heads_first=False))
    arguments.update(_rotation(table, query.dtype, kernels))
    grid = lambda meta: (_blocks(queries, meta["BLOCK_M"]) * splits * batch * heads,)  # noqa: E731
    with _launching(part, switches, query.device):
        if splits == 1:
            kernels.nezha_forward_kernel[grid](Q=query, Kx=key, V=value, Partial=None, PartialStats=None, **outputs,
                                               **arguments, splits=1, key_chunk=keys, SPLIT=False)
        else:
            rows = batch * heads * splits * queries
            partial = torch.empty(rows, arguments["BLOCK_D"], dtype=torch.float32, device=query.device)
            statistics = torch.empty(rows, 2, dtype=torch.float32, device=query.device)
            kernels.nezha_forward_kernel[grid](Q=query, Kx=key, V=value, Partial=partial, PartialStats=statistics,
                                               **outputs, **arguments, splits=splits, key_chunk=chunk, SPLIT=True)
            kernels.nezha_merge_kernel[(_blocks(queries, kernels.DECODING_BLOCK_M) * batch * heads,)](
                Partial=partial, PartialStats=statistics, **outputs, heads=heads, Lq=queries, D=size, splits=splits,
                BLOCK_D=arguments["BLOCK_D"], BLOCK_M=kernels.DECODING_BLOCK_M)
    return [output, lse]


def _launch(kernel, grid, warmup: bool, **arguments) -> None:
    """Launch `kernel` on `grid`, or (`warmup`) only compile what that launch would launch: Triton's own warmup, through
    the same autotuner pruning and JIT specialisation."""
    if warmup:
        kernel.warmup(grid=grid, **arguments)
    else:
        kernel[grid](**arguments)


def triton_backward(grad_output, query, key, value, table, problem: AttentionProblem, output,
                    lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value (`[batch, heads, length, head_size]`) by the Triton kernels; see
    `attention_ops.engine_op` (`grad_output` and `output` are `[batch, heads, queries, head_size]` views)."""
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    grad_query = torch.zeros(batch, heads, queries, size, dtype=query.dtype, device=query.device)
    grad_key = torch.zeros(batch, heads, keys, size, dtype=key.dtype, device=key.device)
    grad_value = torch.zeros(batch, heads, keys, size, dtype=value.dtype, device=value.device)
    if queries == 0 or keys == 0:
        return grad_query, grad_key, grad_value
    switches = Switches.of(query, problem)
    _refuse_set_aside("backward", switches)
    with _launching("backward", switches, query.device):
        _backward_kernels(grad_output, query, key, value, table, problem, output, lse, switches,
                          (grad_query, grad_key, grad_value), warmup=False)
    return grad_query, grad_key, grad_value


def _backward_kernels(grad_output, query, key, value, table, problem: AttentionProblem, output, lse,
                      switches: Switches, grads: tuple, warmup: bool) -> None:
    """Launch the backward's kernels into `grads` (`(grad_query, grad_key, grad_value)`), or (`warmup`) compile them
    only (`_check_backward`)."""
    kernels = _kernels()
    grad_query, grad_key, grad_value = grads
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    arguments = _arguments(query, key, value, table, problem, switches, kernels)
    rotation = _rotation(table, query.dtype, kernels)
    arguments.update(rotation)
    # Per query and tile class: the log-sum-exp less a tail's key term, D_i = dO_i . O_i less its output term; for the
    # band by rotation, its clipped pairs' terms and the queries and output gradients turned.
    row_lse, row_dot = (torch.empty(batch, heads, 3, queries, dtype=torch.float32, device=query.device)
                        for _ in range(2))
    turned = dict(RowTerms=None, RotQ=None, RotDO=None)
    if rotation["ROTATE"]:
        turned = dict(RowTerms=torch.empty(batch, heads, 4, queries, dtype=torch.float32, device=query.device),
                      RotQ=torch.empty(batch, heads, queries, size, dtype=query.dtype, device=query.device),
                      RotDO=torch.empty(batch, heads, queries, size, dtype=query.dtype, device=query.device))
    shared = dict(Q=query, Kx=key, V=value, DO=grad_output, RowLse=row_lse, RowDot=row_dot, scale=problem.scaling,
                  **turned, **arguments, **_strides(grad_output, "o", "m"))
    block = kernels.STATISTICS_BLOCK_M
    _launch(kernels.nezha_row_statistics_kernel, (_blocks(queries, block) * batch * heads,), warmup,
            Q=query, DO=grad_output, O=output, Table=arguments["Table"], Sinusoid=rotation["Sinusoid"], Lse=lse,
            RowLse=row_lse, RowDot=row_dot, **turned,
            **_strides(query, "q", "m"), **_strides(grad_output, "o", "m"), **_strides(output, "y", "m"), heads=heads,
            Lq=queries, D=size, K=arguments["K"], scale_log2=arguments["scale_log2"],
            keep_rate=_keep_rate(arguments["keep_scale"]), DROPOUT=switches.dropout,
            ROTATE=rotation["ROTATE"], BLOCK_D=arguments["BLOCK_D"], BLOCK_M=block)
    _launch(kernels.nezha_key_value_grad_kernel, lambda meta: (_blocks(keys, meta["BLOCK_N"]) * batch * heads,),
            warmup, DK=grad_key, DV=grad_value, **shared)
    _launch(kernels.nezha_query_grad_kernel, lambda meta: (_blocks(queries, meta["BLOCK_M"]) * batch * heads,),
            warmup, DQ=grad_query, **shared)


def _forward_fake(query, key, value, table, problem):
    batch, heads, queries, size = query.shape
    return [query.new_empty(batch, queries, heads, size),
            torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)]


def _backward_fake(grad_output, query, key, value, table, problem, output, lse):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


_attention_op = engine_op(Engine.TRITON, triton_forward, _forward_fake, triton_backward, _backward_fake)


def triton_attention(query, key, value, table, problem: AttentionProblem) -> torch.Tensor:
    """NEZHA attention by the Triton kernels, `[batch, queries, heads, head_size]`; arguments as
    `fused_attention.fused_attention`. float32, bfloat16 and float16 on CUDA GPUs (CPU tensors under
    TRITON_INTERPRET=1). Before the first call of a kind that needs gradients, the kernels its backward will launch
    are compiled (`_check_backward`); raises `TritonKernelFailed` where a kernel the call needs failed to compile
    here."""
    if not tracing() and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        _check_backward(query, key, value, table, problem)
    return _attention_op(query, key, value, table, problem)


def _check_backward(query, key, value, table, problem: AttentionProblem) -> None:
    """Compile the kernels this call's backward will launch, before its forward runs, so that a backward that cannot
    compile is found while another engine can still take the call: Triton's warmup through the backward's own
    launchers (`_backward_kernels`), with the call's tensors and table (its `K`, whether it goes by rotation), the
    configurations the autotuner keeps for its lengths and switches, and the seed's type. Once per kind of call
    (switches, device, length classes, table size and rotation); a backward whose arguments Triton specialises
    otherwise (a gradient of other strides) compiles at its launch, as any kernel does."""
    switches = Switches.of(query, problem)
    _refuse_set_aside("backward", switches)
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    if queries == 0 or keys == 0:
        return
    rotate = query.dtype != torch.float32 and _is_exact_sinusoid(table, query.dtype)
    kind = (switches, query.device, kernels.length_class(queries), kernels.length_class(keys), table.shape[0], rotate)
    if kind in _checked_backwards:
        return
    # The forward's outputs as the backward receives them (`engine_op`): `[batch, heads, queries, d]` views.
    output = query.new_empty(batch, queries, heads, size).transpose(1, 2)
    lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)
    grads = tuple(torch.empty(batch, heads, length, size, dtype=query.dtype, device=query.device)
                  for length in (queries, keys, keys))
    with _launching("backward", switches, query.device):
        _backward_kernels(output, query, key, value, table, problem, output, lse, switches, grads, warmup=True)
    _checked_backwards.add(kind)


__all__ = ["Switches", "TritonKernelFailed", "interpreting", "triton_attention", "triton_installed",
           "unusable_reason"]
