"""NEZHA's relative-position attention: the maths, the mask, the gather path, and which path runs.

For a head of size `d`, query position `i`, key position `j` and `K = max_relative_position`:

    r(i, j) = clip(j - i, -K, K) + K                       # a row of the table, 0 .. 2K
    s_ij    = (q_i . k_j + q_i . T[r(i, j)]) * scale + mask_ij
    out_i   = sum_j softmax_j(s_ij) (v_j + T[r(i, j)])

`T` is a fixed `(2K + 1) x d` sinusoid table shared by every head and layer; `K` is read off its
shape. The attention functions here have the transformers signature
`fn(module, query, key, value, attention_mask, scaling, dropout, *, relative_table, **kwargs) -> (out, probs)`
and are registered under the names in `ATTENTION_IMPLEMENTATIONS`; `gather_relative_attention`
(`"eager"`) is the reference. What each implementation is and where it runs is the table
"Attention implementations" in the README, and nowhere else.

The mask is a `RelativeAttentionMask` (key padding, causal or UniLM prefix) rather than a dense
`L x L` tensor, so the linear-memory paths never build one.
"""

import contextvars
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging

from .attention_kernel import compiled_kernel, kernel_attention, kernel_loaded
from .chunked_attention import chunked_attention
from .three_regions import AVAILABLE as THREE_REGIONS_AVAILABLE
from .three_regions import ThreeRegions

logger = logging.get_logger(__name__)

FAST_ATTENTION = "nezha_fused"
CHUNKED_ATTENTION = "nezha_chunked"
THREE_REGION_ATTENTION = "nezha_three_regions"
# Below this length three regions are slower than the chunked path on CPU (benchmarks/attention.py).
THREE_REGIONS_MIN_LENGTH = 513
# False while a model is being built for a device other than the CPU: its kernel would never run.
KERNEL_WANTED = contextvars.ContextVar("nezha_kernel_wanted", default=True)


def tracing() -> bool:
    """True under `torch.compile`, `torch.export` or `torch.jit.trace`: code must not branch on tensor values."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def values_known(tensor: torch.Tensor) -> bool:
    """Whether code may read `tensor`'s values: not while tracing, and never on the meta device (shapes only)."""
    return not tracing() and tensor.device.type != "meta"


def sinusoid_frequencies(head_size: int) -> torch.Tensor:
    """The table's angular frequencies `w_m = 10000^(-2m / head_size)`, in float32 as transformers 4.x computed them."""
    return torch.exp(torch.arange(0, head_size, 2).float() * (-math.log(10000.0) / head_size))


def sinusoid_relative_table(max_relative_position: int, head_size: int) -> torch.Tensor:
    """The fixed `(2K + 1) x head_size` table `T`, computed exactly as transformers 4.x did (float32).

    Row `p` encodes the shifted index `p = clip(j - i) + K`, not the signed distance.
    """
    num_rows = 2 * max_relative_position + 1
    position = torch.arange(num_rows, dtype=torch.int64).float().unsqueeze(1)
    div_term = sinusoid_frequencies(head_size)
    table = torch.zeros(num_rows, head_size)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term)
    return table


def max_relative_position(table: torch.Tensor) -> int:
    """`K` of a `(2K + 1) x head_size` table."""
    return (table.shape[0] - 1) // 2


def relative_position_index(
    query_length: int, key_length: int, max_relative_position: int, query_offset: int | torch.Tensor = 0, device=None
) -> torch.Tensor:
    """`r(i, j) = clip(j - i, -K, K) + K` for query positions `query_offset + arange(query_length)`.

    `query_offset` is an int or a 0-dim tensor (a static cache's length).

    Returns a `[query_length, key_length]` long tensor. With a KV cache the query positions start
    at the cache length, so the matrix is rectangular.
    """
    query_position = torch.arange(query_length, device=device) + query_offset
    key_position = torch.arange(key_length, device=device)
    distance = key_position[None, :] - query_position[:, None]
    return distance.clamp(-max_relative_position, max_relative_position) + max_relative_position


@dataclass
class RelativeAttentionMask:
    """Which keys each query may attend to, without an `L x L` tensor.

    Attributes:
        key_is_valid: `[batch, key_length]` bool, False on padding; None when nothing is padded.
        causal: queries see only keys at their position or before.
        key_is_source: `[batch, key_length]` bool for the UniLM prefix mask: with `causal`, a source
            key is visible to every query (source tokens see the whole source, target tokens see
            the source and the targets before them). None for a plain causal or bidirectional mask.
        query_offset: position of the first query (the cache length while decoding): an int, or a
            0-dim tensor when a static cache reports it as one.
    """

    key_is_valid: torch.Tensor | None = None
    causal: bool = False
    key_is_source: torch.Tensor | None = None
    query_offset: int | torch.Tensor = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: tuple, build):
        """`build()`, computed once per mask (so once per model call, not once per layer) for each `key`.

        While tracing (compile, export, jit) nothing is cached: the key may hold symbolic sizes.
        """
        if tracing():
            return build()
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def allowed(self, query_length: int, key_length: int, device) -> torch.Tensor | None:
        """Dense `[batch or 1, 1, query_length, key_length]` bool mask, or None if everything is visible."""
        allowed = None
        if self.causal:
            query_position = torch.arange(query_length, device=device) + self.query_offset
            allowed = torch.arange(key_length, device=device)[None, :] <= query_position[:, None]
            allowed = allowed[None, None]
            if self.key_is_source is not None:
                allowed = allowed | self.key_is_source[:, None, None, :]
        if self.key_is_valid is not None:
            valid = self.key_is_valid[:, None, None, :]
            allowed = valid if allowed is None else allowed & valid
        return allowed

    def additive(self, query_length: int, key_length: int, dtype: torch.dtype, device) -> torch.Tensor | None:
        """The dense mask as additive scores (0 or the dtype's minimum, as transformers 4.x), cached per dtype."""

        def build():
            allowed = self.allowed(query_length, key_length, device)
            if allowed is None:
                return None
            return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

        return self.cached(("additive", query_length, key_length, dtype, str(device)), build)


_reported = set()


def _report(requested: str, ran: str, query: torch.Tensor, dropout: float, mask: "RelativeAttentionMask") -> None:
    """Log once, at INFO, which implementation ran for a kind of call (device, dtype, dropout, cache)."""
    cached = not (isinstance(mask.query_offset, int) and mask.query_offset == 0)
    situation = (requested, ran, query.device.type, query.dtype, dropout > 0, cached)
    if situation not in _reported and not tracing():
        _reported.add(situation)
        logger.info(
            f"NEZHA attention {requested!r} runs {ran} ({query.device.type}, {query.dtype}, "
            f"attention dropout {'on' if dropout > 0 else 'off'}, {'with' if cached else 'no'} KV cache)."
        )


def gather_relative_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    relative_table: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact NEZHA attention with `O(L^2)` memory per head (`attn_implementation="eager"`).

    Args:
        module: the calling `NezhaSelfAttention` (provides `training`).
        query: `[batch, heads, query_length, head_size]`; key, value: `[batch, heads, key_length, head_size]`.
        attention_mask: a `RelativeAttentionMask` or None.
        scaling: score scale, `head_size ** -0.5`.
        dropout: attention-probability dropout, applied (to both value terms) as transformers 4.x did.
        relative_table: the model's `(2K + 1) x head_size` table.

    Returns:
        `(output [batch, query_length, heads, head_size], probabilities [batch, heads, query_length, key_length])`.
    """
    query_length, key_length = query.shape[-2], key.shape[-2]
    _report("eager", "the gather path", query, dropout if module.training else 0.0, attention_mask or RelativeAttentionMask())
    table = relative_table.to(query.dtype)
    offset = attention_mask.query_offset if attention_mask is not None else 0
    index = relative_position_index(query_length, key_length, max_relative_position(table), offset, query.device)
    index = index.expand(*query.shape[:2], query_length, key_length)

    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores + torch.matmul(query, table.T).gather(-1, index)
    scores = scores * scaling
    if attention_mask is not None:
        additive = attention_mask.additive(query_length, key_length, scores.dtype, scores.device)
        if additive is not None:
            scores = scores + additive
    probs = nn.functional.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)

    bucket_mass = probs.new_zeros(*probs.shape[:-1], table.shape[0]).scatter_add_(-1, index, probs)
    output = torch.matmul(probs, value) + torch.matmul(bucket_mass, table)
    return output.transpose(1, 2).contiguous(), probs


def _dropout_seed(dropout: float) -> torch.Tensor:
    """The seed of one call's dropout mask, drawn from torch's generator (so `torch.manual_seed` reproduces it)."""
    if dropout == 0:
        return torch.zeros((), dtype=torch.int64)
    return torch.randint(0, 1 << 62, (), dtype=torch.int64)


def _linear_memory(engine, module, query, key, value, mask, scaling, dropout, relative_table):
    """Run `kernel_attention` or `chunked_attention` with the mask's flags: `[batch, queries, heads, head_size]`."""
    dropout = dropout if module.training else 0.0
    return engine(
        query, key, value, relative_table.to(query.dtype), scaling, mask.causal, mask.key_is_valid,
        mask.key_is_source if mask.causal else None, mask.query_offset, dropout, _dropout_seed(dropout),
    )


def chunked_relative_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    relative_table: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Exact NEZHA attention in linear memory from PyTorch ops (`attn_implementation="nezha_chunked"`).

    `chunked_attention.chunked_attention` on any device and dtype, with attention dropout and KV caches.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    _report(CHUNKED_ATTENTION, "the chunked path", query, dropout if module.training else 0.0, mask)
    return _linear_memory(chunked_attention, module, query, key, value, mask, scaling, dropout, relative_table), None


def three_region_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    relative_table: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Exact NEZHA attention in linear memory from PyTorch's CPU flash kernel (`attn_implementation="nezha_three_regions"`).

    Runs `three_regions.ThreeRegions` where it applies (see the README's table of implementations) and
    `chunked_relative_attention` elsewhere. A row whose keys are all masked gets a zero output.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    length, K = query.shape[-2], max_relative_position(relative_table)
    applies = (
        THREE_REGIONS_AVAILABLE
        and query.device.type == "cpu"
        and not (dropout > 0 and module.training)
        and length == key.shape[-2]
        and isinstance(mask.query_offset, int)
        and mask.query_offset == 0
        and THREE_REGIONS_MIN_LENGTH <= length
        and K < length
        and not tracing()  # inductor cannot compile its fused-kernel calls
    )
    if not applies:
        _report(THREE_REGION_ATTENTION, "the chunked path", query, dropout if module.training else 0.0, mask)
        return _linear_memory(chunked_attention, module, query, key, value, mask, scaling, dropout, relative_table), None
    _report(THREE_REGION_ATTENTION, "three regions", query, 0.0, mask)
    regions = mask.cached(
        ("three_regions", length, K, query.shape[-1], query.dtype, str(query.device)),
        lambda: ThreeRegions(
            length, K, sinusoid_frequencies(query.shape[-1]).to(query.device), mask.key_is_valid, mask.causal,
            mask.key_is_source, query.dtype,
        ),
    )
    output = regions(query, key, value, relative_table.to(query.dtype), scaling)
    return output.transpose(1, 2).contiguous(), None


def fused_relative_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    relative_table: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Exact NEZHA attention in linear memory, by the compiled kernel where it runs (`attn_implementation="nezha_fused"`, the default).

    `attention_kernel.kernel_attention` for float32 on CPU, `chunked_attention.chunked_attention`
    elsewhere (see the README's table of implementations); the same result either way.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    on_kernel = (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and (kernel_loaded() if tracing() else compiled_kernel() is not None)
    )
    _report(FAST_ATTENTION, "the compiled kernel" if on_kernel else "the chunked path", query,
            dropout if module.training else 0.0, mask)
    engine = kernel_attention if on_kernel else chunked_attention
    return _linear_memory(engine, module, query, key, value, mask, scaling, dropout, relative_table), None


# Every implementation NEZHA accepts as `attn_implementation`, and its function.
ATTENTION_IMPLEMENTATIONS = {
    FAST_ATTENTION: fused_relative_attention,
    CHUNKED_ATTENTION: chunked_relative_attention,
    THREE_REGION_ATTENTION: three_region_attention,
    "eager": gather_relative_attention,
}


def prepare_attention(implementation: str | None) -> str:
    """Check an `attn_implementation` name (None: the default) and get it ready; returns the name.

    For `"nezha_fused"` this loads (the first time: builds) the compiled kernel now, so that it
    happens when the model is created rather than inside its first forward pass; not when the
    model is being built for another device (`torch.set_default_device`, a `torch.device` context,
    or `from_pretrained(device_map=...)` away from the CPU), where the kernel would never run. Any
    other name is a `ValueError`.
    """
    implementation = implementation or FAST_ATTENTION
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f'NEZHA does not support attn_implementation="{implementation}": its relative value term needs '
            f"the attention probabilities, which sdpa, flash and flex attention do not expose. Use one of "
            f"{sorted(ATTENTION_IMPLEMENTATIONS)} (default {FAST_ATTENTION!r})."
        )
    if implementation == FAST_ATTENTION and KERNEL_WANTED.get() and torch.get_default_device().type in ("cpu", "meta"):
        compiled_kernel()
    return implementation


__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "CHUNKED_ATTENTION",
    "FAST_ATTENTION",
    "THREE_REGION_ATTENTION",
    "RelativeAttentionMask",
    "chunked_relative_attention",
    "fused_relative_attention",
    "gather_relative_attention",
    "max_relative_position",
    "prepare_attention",
    "relative_position_index",
    "sinusoid_frequencies",
    "sinusoid_relative_table",
    "three_region_attention",
    "tracing",
    "values_known",
]
