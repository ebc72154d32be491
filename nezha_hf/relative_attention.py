"""NEZHA's relative-position attention: the maths, the mask, and the table of engines that compute it.

For a head of size `d`, query position `i`, key position `j` and `K = max_relative_position`:

    r(i, j) = clip(j - i, -K, K) + K                       # a row of the table, 0 .. 2K
    s_ij    = (q_i . k_j + q_i . T[r(i, j)]) * scale + mask_ij
    out_i   = sum_j softmax_j(s_ij) (v_j + T[r(i, j)])

`T` is a fixed `(2K + 1) x d` sinusoid table shared by every head and layer; `K` is read off its
shape. Four engines compute it exactly: `ENGINES` declares each one (what it is, when it cannot run
and what runs instead), `relative_attention` is the one function every `attn_implementation` goes
through, and `implementation_table()` renders the declarations as the table of which engine runs
where (docs/attention.md holds it; a test keeps the two equal). The engine that ran is logged once
per situation at INFO and recorded for `recorded_attention_calls()`.

The mask is a `RelativeAttentionMask` (key padding, causal or UniLM prefix) rather than a dense
`L x L` tensor, so the linear-memory engines never build one. Each call is described once, as an
`attention_ops.AttentionProblem`, and every engine is an op that takes it (`attention_ops.engine_op`).
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging

from .attention_ops import (
    AttentionProblem,
    Engine,
    EngineUnavailable,
    RelativeAttentionMask,
    gather_attention,
    max_relative_position,
    relative_position_index,
    sinusoid_frequencies,
    sinusoid_relative_table,
    tracing,
    values_known,
)
from .chunked_attention import chunked_attention
from .fused_attention import fused_attention, fused_kernel, fused_kernel_loaded
from .three_regions import AVAILABLE as THREE_REGIONS_AVAILABLE
from .three_regions import three_regions_attention
from .triton_attention import triton_attention
from .triton_attention import DTYPES as TRITON_DTYPES
from .triton_attention import unusable_reason as triton_unusable_reason

logger = logging.get_logger(__name__)

# Below this length three regions are slower than the chunked path on CPU (benchmarks/attention.py).
THREE_REGIONS_MIN_LENGTH = 513


DEFAULT_ENGINE = Engine.FUSED
# The dtypes the fused kernel takes (all computed in float32); float64 runs exactly on the chunked engine.
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_built(situation: "Situation") -> bool:
    # While tracing nothing may be built: only an already loaded kernel counts.
    return fused_kernel_loaded() if situation.tracing else fused_kernel() is not None


@dataclass(frozen=True)
class Situation:
    """What decides which engine can run one attention call."""

    device: str
    dtype: torch.dtype
    query_length: int
    key_length: int
    K: int
    cached: bool  # queries continue a KV cache (they start after position 0)
    dropout: bool  # attention dropout in training
    tracing: bool  # torch.compile, torch.export or torch.jit.trace
    wants_probabilities: bool  # output_attentions=True
    requested: "Engine | None" = None  # the engine asked for by name
    kernel_built: Callable[["Situation"], bool] = field(default=_kernel_built, compare=False)
    # Why the Triton kernel cannot run on a device (None when it can), asked for by name or not.
    triton_unusable: Callable[[str, bool], str | None] = field(default=triton_unusable_reason, compare=False)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: what it is, the function that runs it, and why it cannot run a call (the next engine of `Engine`
    then takes it). `run(query, key, value, table, problem)` returns `(output [batch, queries, heads, head_size],
    probabilities or None)`; `unusable(situation)` returns a reason, or None when it runs."""

    summary: str
    run: Callable
    unusable: Callable[[Situation], str | None]


def _no_probabilities(situation: Situation) -> str | None:
    if situation.wants_probabilities:
        return "output_attentions=True needs the attention probabilities, which only the gather engine computes"
    return None


def _fused_unusable(situation: Situation) -> str | None:
    if situation.device != "cpu":
        return "the fused kernel runs on the CPU"
    if situation.dtype not in FUSED_DTYPES:
        return "the fused kernel computes in float32 (it takes float32, bfloat16 and float16)"
    if not situation.kernel_built(situation):
        return "the fused kernel is not built (see the warning logged when it was tried)"
    return _no_probabilities(situation)


def _triton_unusable(situation: Situation) -> str | None:
    if situation.dtype not in TRITON_DTYPES:
        return "the Triton kernel takes float32, bfloat16 and float16"
    named = situation.requested is Engine.TRITON
    return situation.triton_unusable(situation.device, named) or _no_probabilities(situation)


def _three_regions_unusable(situation: Situation) -> str | None:
    if not THREE_REGIONS_AVAILABLE:
        return "this PyTorch lacks the CPU flash-attention kernel three regions are made of"
    if situation.device != "cpu":
        return "three regions run on the CPU"
    if situation.dtype == torch.float64:
        return "three regions compute the band from the exact sinusoid, not the model's float32-rounded table"
    if situation.dropout:
        return "three regions have no attention dropout"
    if situation.cached:
        return "three regions need queries and keys of one length (no KV cache)"
    if situation.query_length < THREE_REGIONS_MIN_LENGTH or situation.query_length <= situation.K:
        return f"three regions are slower than the chunked engine below {THREE_REGIONS_MIN_LENGTH} tokens"
    if situation.tracing:
        return "inductor cannot compile the calls three regions make"
    return _no_probabilities(situation)


def _dropout_seed(dropout: float, device: torch.device | None = None) -> torch.Tensor | None:
    """The seed of one call's dropout mask, drawn from torch's generator on `device` (the CPU's when None; so
    `torch.manual_seed` reproduces it), or None without dropout."""
    if dropout == 0:
        return None
    return torch.randint(0, 1 << 62, (), dtype=torch.int64, device=device)


def _op_engine(attention: Callable) -> Callable:
    """An engine's `run` from its op (`attention_ops.engine_op`): no probabilities."""

    def run(query, key, value, table, problem):
        return attention(query, key, value, table, problem), None

    return run


def _triton(query, key, value, table, problem):
    """The Triton engine (`triton_attention` compiles a call's backward before the first forward that needs it, so that
    a backward that cannot compile is found while another engine can still take the call)."""
    return triton_attention(query, key, value, table, problem), None


def _gather(query, key, value, table, problem):
    """`attention_ops.gather_attention`: the output and the probabilities."""
    output, probs, _ = gather_attention(query, key, value, table, problem)
    return output, probs


# Every engine, in the order of `Engine`: the fallback chain, which ends at the gather engine (it runs everywhere).
ENGINES = {
    Engine.FUSED: EngineSpec(
        "Linear memory, the fastest on CPU: a compiled C++ kernel (`csrc/fused_attention.cpp`), flash attention with "
        "the relative terms as per-row lookups and bucket sums; bfloat16 blocks multiplied in bfloat16 where the CPU "
        "has AMX or AVX512-BF16 (float16: AMX-FP16).",
        _op_engine(fused_attention), _fused_unusable,
    ),
    Engine.TRITON: EngineSpec(
        "Linear memory on CUDA and ROCm GPUs: Triton kernels (`triton_kernels.py`), flash attention whose tiles "
        "left and right of the band `|j - i| < K` are plain FlashAttention-2 tiles (a per-row key constant, the value "
        "term as row sums) and whose band tiles multiply by the table on chip; decoding steps split over the keys. "
        "Needs Triton; correct on an H100 (its speed there: docs/performance.md).",
        _triton, _triton_unusable,
    ),
    # Where the kernel is not built (remote code, no compiler), the fastest for long inputs on the CPU
    # (docs/performance.md); otherwise the chunked engine.
    Engine.THREE_REGIONS: EngineSpec(
        "Linear memory from PyTorch's CPU flash kernel: the band `|j - i| < K` and the two tails are plain "
        "attentions merged by their log-sum-exps.",
        _op_engine(three_regions_attention), _three_regions_unusable,
    ),
    Engine.CHUNKED: EngineSpec(
        "Linear memory from PyTorch ops only, on any device and dtype: queries in chunks, the tails' relative "
        "terms as extra head dimensions.",
        _op_engine(chunked_attention), _no_probabilities,
    ),
    Engine.GATHER: EngineSpec(
        "`L x L` scores per head, the relative terms gathered from `q @ T^T`; the reference, and the only engine "
        "that returns attention probabilities.",
        _gather, lambda situation: None,
    ),
}


def choose_engine(requested: Engine, situation: Situation) -> tuple[Engine, str]:
    """The engine that runs `situation` when `requested` is asked for, and why the requested one does not ("" if it
    does): the first usable one of `requested` and its fallbacks (the gather engine always is)."""
    engine, why = requested, ""
    while (reason := ENGINES[engine].unusable(situation)) is not None:
        why = why or reason
        engine = engine.fallbacks[0]
    return engine, why


@dataclass(frozen=True)
class AttentionCall:
    """A record of one attention call: which engine was asked for, which ran, and why they differ."""

    requested: Engine
    ran: Engine
    why: str
    device: str
    dtype: torch.dtype
    dropout: bool
    cached: bool


_recorders: list[list] = []
_logged: set = set()


@contextlib.contextmanager
def recorded_attention_calls() -> Iterator[list[AttentionCall]]:
    """Collect an `AttentionCall` for every attention call made inside the block (not while tracing).

    ```python
    with recorded_attention_calls() as calls:
        model(input_ids)
    {call.ran for call in calls}  # {Engine.FUSED}
    ```
    """
    calls = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


def _record(call: AttentionCall) -> None:
    for calls in _recorders:
        calls.append(call)
    if call not in _logged:
        _logged.add(call)
        where = (f"{call.device}, {call.dtype}, attention dropout {'on' if call.dropout else 'off'}, "
                 f"{'with' if call.cached else 'no'} KV cache")
        because = f": {call.why}" if call.why else ""
        logger.info(f"NEZHA attention {call.requested.value!r} runs the {call.ran.label} engine ({where}){because}.")


def relative_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    relative_table: torch.Tensor,
    requested: Engine = DEFAULT_ENGINE,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact NEZHA attention by the engine `requested` or, where it cannot run, the one `choose_engine` picks.

    The transformers attention signature, registered under every `Engine`'s name.

    Args:
        module: the calling `NezhaSelfAttention` (provides `training`).
        query: `[batch, heads, query_length, head_size]`; key, value: `[batch, heads, key_length, head_size]`.
        attention_mask: a `RelativeAttentionMask` or None.
        scaling: score scale, `head_size ** -0.5`.
        dropout: attention-probability dropout (applied only in training, to both value terms, as transformers
            4.x did).
        relative_table: the model's `(2K + 1) x head_size` table.
        requested: the engine asked for.
        kwargs: `output_attentions=True` asks for the probabilities (only the gather engine has them).

    Returns:
        `(output [batch, query_length, heads, head_size], probabilities [batch, heads, query_length, key_length]
        or None)`.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    dropout = dropout if module.training else 0.0
    situation = Situation(
        device=query.device.type, dtype=query.dtype, query_length=query.shape[-2], key_length=key.shape[-2],
        K=max_relative_position(relative_table),
        cached=not (isinstance(mask.query_offset, int) and mask.query_offset == 0) or query.shape[-2] != key.shape[-2],
        dropout=dropout > 0, tracing=tracing(), wants_probabilities=bool(kwargs.get("output_attentions")),
        requested=requested,
    )
    engine, why = choose_engine(requested, situation)
    # Traced for the Triton kernels, the seed is drawn on the queries' device, where the kernels read it: a compiled
    # graph that made it on the CPU would not be captured by CUDA graphs (and a graph drawn once would keep its mask).
    seed_device = query.device if situation.tracing and engine is Engine.TRITON else None
    problem = AttentionProblem(mask, scaling, dropout, _dropout_seed(dropout, seed_device))
    if situation.wants_probabilities and requested is not Engine.GATHER:
        logger.warning_once(f"NEZHA attention {requested.value!r}: {why}; these calls run the gather engine.")
    # The Triton engine takes the model's table itself (it converts it, and checks once per table that it is the
    # exact sinusoid: a copy made per call would be checked at every call).
    table = relative_table if engine is Engine.TRITON else relative_table.to(query.dtype)
    try:
        result = ENGINES[engine].run(query, key, value, table, problem)
    except EngineUnavailable:  # it found it cannot run here, and its `unusable` now says so: choose again
        engine, why = choose_engine(requested, situation)
        result = ENGINES[engine].run(query, key, value, relative_table.to(query.dtype), problem)
    if not situation.tracing:
        _record(AttentionCall(requested, engine, why, situation.device, situation.dtype, situation.dropout,
                              situation.cached))
    return result


def engine_function(engine: Engine) -> Callable:
    """`relative_attention` asking for `engine`: what is registered with transformers under its name."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return relative_attention(module, query, key, value, attention_mask, scaling, dropout, requested=engine,
                                  **kwargs)

    attention.__name__ = attention.__qualname__ = f"relative_attention_{engine.name.lower()}"
    attention.__doc__ = f"`relative_attention` with `requested=Engine.{engine.name}`."
    return attention


def _documented(device="cpu", dtype=torch.float32, length=4096, cached=False, dropout=False, tracing=False,
                wants_probabilities=False, kernel_built=True, triton_installed=True) -> Situation:
    """A situation of the docs' table: 4,096 tokens, K = 64, the kernel built, Triton installed (PyTorch's CUDA wheels
    bring it), no TRITON_INTERPRET, unless said otherwise."""

    def triton_unusable(device: str, named: bool) -> str | None:
        if device != "cuda":
            return "the Triton kernel runs on CUDA GPUs"
        return None if triton_installed else "Triton is not installed"

    return Situation(device, dtype, 1 if cached else length, length, 64, cached, dropout, tracing, wants_probabilities,
                     None, kernel_built=lambda situation: kernel_built, triton_unusable=triton_unusable)


# The situations the docs' table of which engine runs where shows.
DOCUMENTED_SITUATIONS = {
    "CPU, float32, 4,096 tokens": _documented(),
    "CPU, float32, 300 tokens": _documented(length=300),
    "CPU, float32, decoding with a KV cache": _documented(cached=True),
    "CPU, float32, training with attention dropout": _documented(dropout=True),
    "CPU, bfloat16 or float16": _documented(dtype=torch.bfloat16),
    "CPU, float64": _documented(dtype=torch.float64),
    "CPU, kernel not built (`NEZHA_HF_KERNEL=0`, no compiler, remote code)": _documented(kernel_built=False),
    "inside `torch.compile` / `torch.export`": _documented(tracing=True),
    "CUDA or ROCm GPU, float32 / bfloat16 / float16": _documented(device="cuda"),
    "CUDA or ROCm GPU, float64": _documented(device="cuda", dtype=torch.float64),
    "CUDA or ROCm GPU without Triton": _documented(device="cuda", triton_installed=False),
    "MPS, XPU or any other device": _documented(device="mps"),
    "`output_attentions=True`": _documented(wants_probabilities=True),
}


def implementation_table() -> str:
    """The Markdown table of which engine runs for each `attn_implementation` in `DOCUMENTED_SITUATIONS`,
    computed from `ENGINES` (docs/attention.md holds its output)."""
    header = "| situation | " + " | ".join(f"`{engine.value}`" for engine in Engine) + " |"
    lines = [header, "|---" * (len(Engine) + 1) + "|"]
    for label, situation in DOCUMENTED_SITUATIONS.items():
        cells = [choose_engine(engine, situation)[0].label for engine in Engine]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def engine_descriptions() -> str:
    """The Markdown list of what each engine is, from `ENGINES` (docs/attention.md holds its output under the table)."""
    return "\n".join(f"- **{engine.label}** (`{engine.value}`): {spec.summary}" for engine, spec in ENGINES.items())


def prepare_attention(implementation: str | None, device: torch.device | str | None) -> str:
    """Check an `attn_implementation` name (None: the default) and get it ready for a model on `device`.

    For the fused engine on the CPU this loads (the first time: builds) the kernel now, so that it happens
    when the model is created rather than inside its first forward pass. A model being built on the meta
    device (inside `from_pretrained`, which calls this again once the weights are placed) or for another
    device builds nothing. Any other name is a `ValueError`. Returns the name.
    """
    implementation = implementation or DEFAULT_ENGINE.value
    if implementation not in {engine.value for engine in Engine}:
        raise ValueError(
            f'NEZHA does not support attn_implementation="{implementation}": its relative value term needs '
            f"the attention probabilities, which sdpa, flash and flex attention do not expose. Use one of "
            f"{sorted(engine.value for engine in Engine)} (default {DEFAULT_ENGINE.value!r})."
        )
    if implementation == Engine.FUSED.value and torch.device(device or "cpu").type == "cpu":
        fused_kernel()
    return implementation


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "AttentionCall",
    "Engine",
    "EngineSpec",
    "RelativeAttentionMask",
    "Situation",
    "choose_engine",
    "engine_descriptions",
    "engine_function",
    "implementation_table",
    "max_relative_position",
    "prepare_attention",
    "recorded_attention_calls",
    "relative_attention",
    "relative_position_index",
    "sinusoid_frequencies",
    "sinusoid_relative_table",
    "tracing",
    "values_known",
]
