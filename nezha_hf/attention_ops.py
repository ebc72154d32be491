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
"""

from collections.abc import Callable

import torch


def engine_op(name: str, forward: Callable, forward_fake: Callable, backward: Callable, backward_fake: Callable,
              device_types: str | None = None) -> Callable:
    """Register `forward` / `backward` as the ops `nezha_hf::{name}_forward` / `_backward`, with autograd.

    `forward_fake` / `backward_fake` give the outputs' shapes and dtypes from the inputs' (for tracing).
    `device_types` limits the ops to a device type (the compiled CPU kernel), None for any device.

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


__all__ = ["engine_op"]
