"""The autograd glue every custom NEZHA attention engine shares: a forward op, a backward op, and how they meet.

An engine (`fused_attention`, `chunked_attention`) writes two plain functions with the same arguments:

    forward(query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset, dropout, seed)
        -> output [batch, queries, heads, head_size], or (output, *saved)
    backward(grad_output, query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset,
             dropout, seed, output, *saved)
        -> (grad_query, grad_key, grad_value), each `[batch, heads, length, head_size]`

(`grad_output` and `output` reach the backward as `[batch, heads, queries, head_size]` views). `engine_op`
registers both as `torch.library` ops `nezha_hf::<name>_forward` / `_backward`, so `torch.compile` and
`torch.export` see one opaque node with known output shapes, connects them through autograd, refuses a
second derivative with a message, and returns the function the attention code calls. Masks are key flags
(`RelativeAttentionMask`'s), never an `L x L` tensor.

`gather_attention` is the same attention in standard PyTorch ops (`L x L` scores per head): the gather
engine, and the decomposition of every engine's forward op (`torch._decomp`), which exporters such as
`torch.onnx` and transformers' `OnnxExporter` substitute on their own for an op they cannot translate.
"""

from collections.abc import Callable

import torch
from torch import nn


def max_relative_position(table: torch.Tensor) -> int:
    """`K` of a `(2K + 1) x head_size` table."""
    return (table.shape[0] - 1) // 2


def query_positions(query_length: int, query_offset: int | torch.Tensor = 0, device=None) -> torch.Tensor:
    """Positions of the queries: `query_offset + arange(query_length)` (the offset is the KV-cache length)."""
    return torch.arange(query_length, device=device) + query_offset


def relative_position_index(
    query_length: int, key_length: int, max_relative_position: int, query_offset: int | torch.Tensor = 0, device=None
) -> torch.Tensor:
    """`r(i, j) = clip(j - i, -K, K) + K` for query positions `query_offset + arange(query_length)`.

    `query_offset` is an int or a 0-dim tensor (a static cache's length).

    Returns a `[query_length, key_length]` long tensor. With a KV cache the query positions start
    at the cache length, so the matrix is rectangular.
    """
    key_position = torch.arange(key_length, device=device)
    distance = key_position[None, :] - query_positions(query_length, query_offset, device)[:, None]
    return distance.clamp(-max_relative_position, max_relative_position) + max_relative_position


def visible_keys(query_length: int, key_length: int, causal: bool, key_is_valid, key_is_source, query_offset,
                 device) -> torch.Tensor | None:
    """Which keys each query sees, `[batch or 1, 1, query_length, key_length]` bool, from the key flags; None when
    every query sees every key. Under `causal` a query sees the keys at or before its position and the source
    keys (`key_is_source`, the UniLM prefix mask); padding (`key_is_valid` False) is never seen."""
    allowed = None
    if causal:
        query_position = query_positions(query_length, query_offset, device)
        allowed = (torch.arange(key_length, device=device)[None, :] <= query_position[:, None])[None, None]
        if key_is_source is not None:
            allowed = allowed | key_is_source[:, None, None, :]
    if key_is_valid is not None:
        valid = key_is_valid[:, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def gather_attention(query, key, value, table, scaling: float, allowed: torch.Tensor | None, query_offset=0,
                     dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NEZHA attention with `L x L` scores per head: the key term gathered from `q @ T^T`, the value term summed
    into `2K + 1` buckets. `allowed` from `visible_keys`. Returns `(output [batch, queries, heads, head_size],
    probabilities [batch, heads, queries, keys], lse [batch, heads, queries])`; a row that sees no key gives 0
    (lse -inf), as transformers 5's BERT does by default (sdpa)."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    index = relative_position_index(query_length, key_length, (table.shape[0] - 1) // 2, query_offset, query.device)
    index = index.expand(*query.shape[:2], query_length, key_length)
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores + torch.matmul(query, table.T).gather(-1, index)
    scores = scores * scaling
    if allowed is not None:
        # Masked scores become the dtype's minimum, as in transformers 4.x (whose rows that see no key then
        # average uniformly; here those rows are set to 0 below).
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = nn.functional.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    if allowed is not None:
        sees_something = allowed.any(-1)
        probs = probs.masked_fill(~sees_something[..., None], 0.0)
        lse = lse.masked_fill(~sees_something, float("-inf"))
    probs = nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    bucket_mass = probs.new_zeros(*probs.shape[:-1], table.shape[0]).scatter_add(-1, index, probs)
    output = torch.matmul(probs, value) + torch.matmul(bucket_mass, table)
    return output.transpose(1, 2).contiguous(), probs, lse


def _plain_forward(query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset, dropout,
                   seed):
    """An engine's forward in standard ops: `(output, lse)` (the decomposition exporters substitute)."""
    allowed = visible_keys(query.shape[-2], key.shape[-2], causal, key_is_valid, key_is_source, query_offset,
                           query.device)
    output, _, lse = gather_attention(query, key, value, table.to(query.dtype), scaling, allowed, query_offset,
                                      dropout)
    return output, lse.float()


def engine_op(name: str, forward: Callable, forward_fake: Callable, backward: Callable, backward_fake: Callable,
              device_types: str | None = None, saved_statistics: int = 0) -> Callable:
    """Register `forward` / `backward` as the ops `nezha_hf::{name}_forward` / `_backward`, with autograd.

    `forward_fake` / `backward_fake` give the outputs' shapes and dtypes from the inputs' (for tracing).
    `device_types` limits the ops to a device type (the compiled CPU kernel), None for any device.
    `saved_statistics`: 1 when `forward` returns `(output, lse)`, 0 when it returns the output alone.

    Returns `attention(query, key, value, table, scaling, causal, key_is_valid=None, key_is_source=None,
    query_offset=0, dropout=0.0, seed=None) -> output [batch, queries, heads, head_size]`.
    """
    forward_op = torch.library.custom_op(f"nezha_hf::{name}_forward", forward, mutates_args=(),
                                         device_types=device_types)
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(f"nezha_hf::{name}_backward", backward, mutates_args=(),
                                          device_types=device_types)
    backward_op.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset, dropout, seed = inputs
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(query, key, value, table, key_is_valid, key_is_source, query_offset, seed, *outputs)
        ctx.scaling, ctx.causal, ctx.dropout = scaling, causal, dropout

    def backward_step(ctx, grad_output, *grads_of_saved):  # nothing flows back through the saved statistics
        query, key, value, table, key_is_valid, key_is_source, query_offset, seed, output, *saved = ctx.saved_tensors
        grads = backward_op(grad_output.transpose(1, 2), query, key, value, table, ctx.scaling, ctx.causal,
                            key_is_valid, key_is_source, query_offset, ctx.dropout, seed, output.transpose(1, 2),
                            *saved)
        return (*grads, None, None, None, None, None, None, None, None)  # nothing for the table, mask, ...

    def no_double_backward(ctx, *grads):
        raise RuntimeError(
            f"NEZHA's {name} attention has no second derivative (e.g. a gradient penalty with create_graph=True): "
            'use attn_implementation="eager" for that.'
        )

    forward_op.register_autograd(backward_step, setup_context=setup_context)
    backward_op.register_autograd(no_double_backward)

    @torch._decomp.register_decomposition(forward_op._opoverload)
    def decomposed(*arguments):
        output, lse = _plain_forward(*arguments)
        return output if saved_statistics == 0 else (output, lse)

    def attention(query, key, value, table, scaling: float, causal: bool, key_is_valid=None, key_is_source=None,
                  query_offset=0, dropout: float = 0.0, seed=None) -> torch.Tensor:
        if not isinstance(query_offset, torch.Tensor):
            query_offset = torch.tensor(query_offset, dtype=torch.int64)
        if seed is None:
            seed = torch.zeros((), dtype=torch.int64)
        output = forward_op(query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset,
                            float(dropout), seed)
        return output[0] if isinstance(output, tuple) else output

    attention.forward_op, attention.backward_op = forward_op, backward_op
    return attention


__all__ = ["engine_op", "gather_attention", "max_relative_position", "relative_position_index", "visible_keys"]
