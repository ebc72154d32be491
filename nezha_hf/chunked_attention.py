"""Exact NEZHA attention in linear memory from PyTorch ops only: queries in chunks, on any device.

For a chunk of queries at positions `[p0, p1)`, every key left of `p0 - K + 1` is in each row's
left tail, where its relative vector is the table's row 0, and every key from `p1 - 1 + K` on is in
each row's right tail (row 2K). There the relative terms fold into the matrix products:
`q_i . k_j + q_i . T[0] = q_i . (k_j + T[0])` and `p_ij (v_j + T[0])`, so the tails are plain
attention against shifted keys and values. Only the `C x (C + 2K - 2)` middle block needs a
per-entry lookup in `q T^T` and per-row bucket sums for the value term. A chunk holds its `C x L`
scores in three pieces (left tail, middle, right tail) with one softmax across them; no tensor of
`L x L` per head ever exists. `C` keeps a chunk's scores within `CHUNK_SCORES` numbers across batch
and heads.

The backward recomputes each chunk's probabilities from the saved row log-sum-exp. Attention
dropout draws each chunk's keep mask from a generator seeded with `(seed, first query)`, so the
backward redraws exactly the forward's mask without storing it. Matrix products run in the inputs'
dtype, scores and softmax in float32 (bfloat16 and float16 work).

The forward and backward are the `torch.library` ops `nezha_hf::chunked_forward` and
`nezha_hf::chunked_backward` (any device): `torch.compile` and `torch.export` see one opaque node.
This module is an engine: `relative_attention.py` decides when it runs.
"""

import torch

# Scores held at once per chunk, across batch and heads (float32: 16 MB); fastest on CPU in benchmarks/attention.py.
CHUNK_SCORES = 1 << 22
MIN_CHUNK_ROWS = 32
LEFT, MIDDLE, RIGHT = "left tail", "middle", "right tail"


def chunk_rows(batch: int, heads: int, queries: int, keys: int) -> int:
    """Queries per chunk: as many as keep `batch * heads * rows * keys` within `CHUNK_SCORES`."""
    rows = max(MIN_CHUNK_ROWS, CHUNK_SCORES // max(1, batch * heads * keys))
    return max(1, min(queries, rows))


class _Chunk:
    """The queries `[start, stop)` of one call (at positions `offset + start ..`) and the keys they see, in pieces."""

    def __init__(self, start, stop, offset, key_length, K, causal, source_end):
        self.rows = slice(start, stop)
        self.first = offset + start  # position of the chunk's first query
        last = offset + stop - 1
        # Under a causal mask keys after the last query are invisible, except source keys (UniLM).
        self.keys = min(key_length, max(last + 1, source_end)) if causal else key_length
        left_end = min(max(self.first - K + 1, 0), self.keys)  # keys in every row's left tail
        right_start = max(min(last + K, self.keys), left_end)  # keys in every row's right tail
        pieces = ((LEFT, slice(0, left_end)), (MIDDLE, slice(left_end, right_start)),
                  (RIGHT, slice(right_start, self.keys)))
        self.pieces = [(kind, columns) for kind, columns in pieces if columns.stop > columns.start]
        self.K = K

    def middle_index(self, columns: slice, device) -> torch.Tensor:
        """Table rows `clip(j - i, -K, K) + K` of the middle block, `[rows, columns]`."""
        query = self.first + torch.arange(self.rows.stop - self.rows.start, device=device)[:, None]
        key = torch.arange(columns.start, columns.stop, device=device)[None, :]
        return (key - query).clamp(-self.K, self.K) + self.K

    def mask(self, scores, columns: slice, key_is_valid, causal, key_is_source) -> None:
        """Set the scores of invisible keys (padding; later non-source keys under a causal mask) to -inf, in place."""
        if key_is_valid is not None:
            scores.masked_fill_(~key_is_valid[:, None, None, columns], float("-inf"))
        start = max(columns.start, self.first + 1)  # keys after the chunk's first query
        if causal and start < columns.stop:
            rows = self.rows.stop - self.rows.start
            later = torch.arange(start, columns.stop, device=scores.device)[None, :]
            future = later > self.first + torch.arange(rows, device=scores.device)[:, None]
            if key_is_source is not None:
                future = future & ~key_is_source[:, None, None, start : columns.stop]
            scores[..., start - columns.start :].masked_fill_(future, float("-inf"))

    def keep(self, shape, dropout: float, seed: int, device, part: int) -> torch.Tensor:
        """Dropout factors `keep / (1 - p)` of one piece, from a generator seeded by (seed, first row, piece)."""
        if device.type == "meta":
            return torch.empty(shape, device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed((seed * 1_000_003 + self.rows.start * 3 + part) % (1 << 63))
        return (torch.rand(shape, generator=generator, device=device) >= dropout).float().div_(1.0 - dropout)


class _Operands:
    """Per call: the table in float32, and the keys and values shifted by the tails' table rows."""

    def __init__(self, key, value, table):
        self.table = table.float()
        first, last = table[0].to(key.dtype), table[-1].to(key.dtype)
        # Contiguous [batch, heads, keys, head_size]: the batched matrix products are much faster on them.
        key, value = key.contiguous(), value.contiguous()
        self.keys = {LEFT: key + first, MIDDLE: key, RIGHT: key + last}
        self.values = {LEFT: value + first, MIDDLE: value, RIGHT: value + last}

    def scores(self, chunk, query, scaling, key_is_valid, causal, key_is_source):
        """Masked float32 scores of the chunk's queries, one `[batch, heads, rows, columns]` tensor per piece."""
        scaled = (query[..., chunk.rows, :] * scaling).contiguous()
        pieces = []
        for kind, columns in chunk.pieces:
            scores = torch.matmul(scaled, self.keys[kind][..., columns, :].transpose(-1, -2)).float()
            if kind == MIDDLE:  # + scale * q_i . T[r(i, j)]
                per_row = torch.matmul(scaled.float(), self.table.T)
                index = chunk.middle_index(columns, query.device)
                scores += per_row.gather(-1, index.expand(*per_row.shape[:-1], -1))
            chunk.mask(scores, columns, key_is_valid, causal, key_is_source)
            pieces.append(scores)
        return pieces

    def bucket_value(self, chunk, weights, kind_columns) -> torch.Tensor:
        """`sum_j weights_ij T[r(i, j)]` over the middle block: `[batch, heads, rows, head_size]` float32."""
        columns = kind_columns
        index = chunk.middle_index(columns, weights.device)
        bucket = weights.new_zeros(*weights.shape[:-1], self.table.shape[0])
        bucket.scatter_add_(-1, index.expand(*weights.shape), weights)
        return bucket @ self.table


def _chunks(query, key, table, causal, key_is_source, query_offset):
    batch, heads, queries, _ = query.shape
    keys, K = key.shape[-2], (table.shape[0] - 1) // 2
    offset = int(query_offset) if query_offset.device.type != "meta" else 0
    source_end = 0
    if causal and key_is_source is not None:
        if key_is_source.device.type == "meta":
            source_end = keys
        else:
            visible = key_is_source.any(0).nonzero()
            source_end = int(visible.max()) + 1 if len(visible) else 0
    rows = chunk_rows(batch, heads, queries, keys)
    return [_Chunk(start, min(start + rows, queries), offset, keys, K, causal, source_end)
            for start in range(0, queries, rows)]


def forward_chunks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor, scaling: float, causal: bool,
    key_is_valid: torch.Tensor | None, key_is_source: torch.Tensor | None, query_offset: torch.Tensor,
    dropout: float, seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NEZHA attention forward: `(out [batch, queries, heads, head_size], lse [batch, heads, queries] float32)`.

    Arguments as `attention_kernel.kernel_forward`; any device and floating dtype. The op
    `nezha_hf::chunked_forward` runs this."""
    batch, heads, queries, size = query.shape
    operands = _Operands(key, value, table)
    output = query.new_empty(batch, queries, heads, size)
    lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)
    seed_value = int(seed) if dropout > 0 else 0
    for chunk in _chunks(query, key, table, causal, key_is_source, query_offset):
        pieces = operands.scores(chunk, query, scaling, key_is_valid, causal, key_is_source)
        row_max = torch.stack([piece.amax(-1) for piece in pieces]).amax(0).unsqueeze(-1)
        row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)  # rows with nothing visible
        total = 0
        for piece in pieces:
            total = total + piece.sub_(row_max).exp_().sum(-1, keepdim=True)
        lse[..., chunk.rows] = (row_max + torch.log(total)).squeeze(-1)  # -inf where nothing is visible
        out = 0
        for part, ((kind, columns), weights) in enumerate(zip(chunk.pieces, pieces)):
            if dropout > 0:
                weights = weights.mul_(chunk.keep(weights.shape, dropout, seed_value, query.device, part))
            out = out + torch.matmul(weights.to(value.dtype), operands.values[kind][..., columns, :]).float()
            if kind == MIDDLE:
                out = out + operands.bucket_value(chunk, weights, columns)
        out = out / total.clamp_min(torch.finfo(torch.float32).tiny)
        output[:, chunk.rows] = out.transpose(1, 2).to(output.dtype)
    return output, lse


chunked_forward = torch.library.custom_op("nezha_hf::chunked_forward", forward_chunks, mutates_args=())


@chunked_forward.register_fake
def _(query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset, dropout, seed):
    batch, heads, queries, size = query.shape
    return query.new_empty(batch, queries, heads, size), query.new_empty(batch, heads, queries, dtype=torch.float32)


def backward_chunks(
    grad_output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
    lse: torch.Tensor, table: torch.Tensor, scaling: float, causal: bool, key_is_valid: torch.Tensor | None,
    key_is_source: torch.Tensor | None, query_offset: torch.Tensor, dropout: float, seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value (`[batch, heads, length, head_size]`), recomputing each chunk.

    `grad_output` and `output` are `[batch, heads, queries, head_size]` (any strides). The op
    `nezha_hf::chunked_backward` runs this."""
    operands = _Operands(key, value, table)
    grad_query = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    grad_key = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    row_dot = (grad_output.float() * output.float()).sum(-1, keepdim=True)  # D_i = dO_i . O_i
    row_lse = lse.masked_fill(torch.isinf(lse), float("inf")).unsqueeze(-1)  # nothing visible: every probability 0
    seed_value = int(seed) if dropout > 0 else 0
    for chunk in _chunks(query, key, table, causal, key_is_source, query_offset):
        rows = chunk.rows
        pieces = operands.scores(chunk, query, scaling, key_is_valid, causal, key_is_source)
        grad_out = grad_output[..., rows, :]
        q = query[..., rows, :]
        grad_q = 0
        for part, ((kind, columns), probs) in enumerate(zip(chunk.pieces, pieces)):
            probs = probs.sub_(row_lse[..., rows, :]).exp_()
            # dP~_ij = dO_i . (v_j + T[r(i, j)]): the tails' values are shifted already, the middle looks T up.
            grad_probs = torch.matmul(grad_out, operands.values[kind][..., columns, :].transpose(-1, -2)).float()
            if kind == MIDDLE:
                per_row = torch.matmul(grad_out.float(), operands.table.T)
                index = chunk.middle_index(columns, query.device)
                grad_probs += per_row.gather(-1, index.expand(*per_row.shape[:-1], -1))
            kept = probs
            if dropout > 0:
                keep = chunk.keep(probs.shape, dropout, seed_value, query.device, part)
                grad_probs.mul_(keep)
                kept = probs * keep
            grad_value[..., columns, :] += torch.matmul(kept.transpose(-1, -2).to(grad_out.dtype), grad_out).float()
            grad_scores = probs.mul_(grad_probs.sub_(row_dot[..., rows, :]))  # dS = P (dP - D)
            grad_q = grad_q + torch.matmul(grad_scores.to(key.dtype), operands.keys[kind][..., columns, :]).float()
            if kind == MIDDLE:
                grad_q = grad_q + operands.bucket_value(chunk, grad_scores, columns)
            grad_key[..., columns, :] += torch.matmul(grad_scores.transpose(-1, -2).to(q.dtype), q).float()
        grad_query[..., rows, :] = grad_q
    grad_query.mul_(scaling)
    grad_key.mul_(scaling)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


chunked_backward = torch.library.custom_op("nezha_hf::chunked_backward", backward_chunks, mutates_args=())


@chunked_backward.register_fake
def _(grad_output, query, key, value, output, lse, table, scaling, causal, key_is_valid, key_is_source, query_offset,
      dropout, seed):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous


def _save_for_backward(ctx, inputs, output):
    query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset, dropout, seed = inputs
    ctx.save_for_backward(query, key, value, table, output[0], output[1], key_is_valid, key_is_source, query_offset, seed)
    ctx.scaling, ctx.causal, ctx.dropout = scaling, causal, dropout


def _backward(ctx, grad_output, grad_lse):
    query, key, value, table, output, lse, key_is_valid, key_is_source, query_offset, seed = ctx.saved_tensors
    grads = chunked_backward(grad_output.transpose(1, 2), query, key, value, output.transpose(1, 2), lse, table,
                             ctx.scaling, ctx.causal, key_is_valid, key_is_source, query_offset, ctx.dropout, seed)
    return (*grads, None, None, None, None, None, None, None, None)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "NEZHA's chunked attention has no second derivative (e.g. a gradient penalty with create_graph=True): "
        'use attn_implementation="eager" for that.'
    )


chunked_forward.register_autograd(_backward, setup_context=_save_for_backward)
chunked_backward.register_autograd(_no_double_backward)


def chunked_attention(query, key, value, table, scaling: float, causal: bool, key_is_valid=None, key_is_source=None,
                      query_offset=0, dropout: float = 0.0, seed=None) -> torch.Tensor:
    """NEZHA attention in chunks of queries, `[batch, queries, heads, head_size]`; arguments as
    `attention_kernel.kernel_attention`, on any device, float32, bfloat16 or float16."""
    if not isinstance(query_offset, torch.Tensor):
        query_offset = torch.tensor(query_offset, dtype=torch.int64)
    if seed is None:
        seed = torch.zeros((), dtype=torch.int64)
    output, _ = chunked_forward(query, key, value, table, scaling, causal, key_is_valid, key_is_source, query_offset,
                                float(dropout), seed)
    return output
