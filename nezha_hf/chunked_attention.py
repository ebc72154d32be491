"""Exact NEZHA attention in linear memory from PyTorch ops only: queries in chunks, on any device.

For a chunk of queries at positions `[p0, p1)`, every key left of `p0 - K + 1` is in each row's
left tail, where its relative vector is the table's row 0, and every key from `p1 - 1 + K` on is in
each row's right tail (row 2K). There the relative terms are rank one, so they ride along in the
matrix products as extra head dimensions: keys and values get indicator columns (in the chunk's
left tail, in its right tail, and a column of ones) and a query gets `q . T[0]`, `q . T[2K]` and a
per-row constant, so `[q, q.T[0], q.T[2K], c] . [k_j, 1, 0, 1] = q . (k_j + T[0]) + c` (the backward
scores `dO . (v_j + T)` against values the same way). A weighted sum over keys is `p @ v` plus each
tail's probability mass (a row sum) times `T[0]` or `T[2K]`. Only the `C x (C + 2K - 2)` middle block
needs a per-entry lookup in `q T^T` and per-row bucket sums. A chunk's scores are
`[batch, heads, C, keys]` buffers (float32; float64 for float64 inputs), reused from chunk to chunk; no tensor
of `L x L` per head ever exists. `C` keeps the buffers of a call within `CHUNK_SCORES` numbers. A chunk holds whole
rows, so one fused softmax gives its probabilities.

The backward recomputes each chunk's probabilities the same way, in chunks of about half as many
queries (it holds two buffers: probabilities and their gradients). Attention dropout draws the
keep mask of each group of `MIN_CHUNK_ROWS` queries from a generator seeded with `(seed, group)`,
so the mask does not depend on the chunking and the backward redraws exactly the forward's without
storing it. Matrix products run in the inputs' dtype, scores and softmax in float32, or float64 (bfloat16 and
float16 work).

The forward and backward are the `torch.library` ops `nezha_hf::chunked_forward` and
`nezha_hf::chunked_backward` (any device; `attention_ops.engine_op`).
This module is an engine: `relative_attention.py` decides when it runs.
"""

import torch

from .attention_ops import (
    AttentionProblem,
    Engine,
    RelativeAttentionMask,
    engine_op,
    max_relative_position,
    query_positions,
    relative_position_index,
    sees_nothing,
    visible_keys,
)

# Scores a call holds at once, across batch and heads (float32: 64 MB): the forward in one chunk
# buffer, the backward in two of half as many rows (off the CPU the softmax's output is one more
# chunk-sized tensor). Longer chunks make the matrix products faster up to about MAX_CHUNK_ROWS
# queries on CPU (benchmarks/attention.py). Chunks are whole groups of MIN_CHUNK_ROWS queries,
# which is also the unit dropout masks are drawn in.
CHUNK_SCORES = 1 << 24
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 16, 256


def chunk_rows(batch: int, heads: int, queries: int, keys: int, buffers: int) -> int:
    """Queries per chunk: the most that keep `buffers` buffers of `batch * heads * rows * keys` scores within
    `CHUNK_SCORES`, at most `MAX_CHUNK_ROWS`, rounded down to whole groups of `MIN_CHUNK_ROWS` (at least one)."""
    fit = min(MAX_CHUNK_ROWS, CHUNK_SCORES // max(1, buffers * batch * heads * keys))
    rows = max(1, fit // MIN_CHUNK_ROWS) * MIN_CHUNK_ROWS
    return max(1, min(queries, rows))


class _Chunk:
    """The queries `[start, stop)` of one call (at positions `offset + start ..`), the keys they see
    (`[0, keys)`), and where the middle block lies in them (`[left_end, right_start)`)."""

    def __init__(self, start, stop, offset, key_length, K, causal, source_end):
        self.rows = slice(start, stop)
        self.size = stop - start
        self.offset, self.first = offset, offset + start  # position of the call's and the chunk's first query
        last = offset + stop - 1
        self.key_length, self.causal, self.source_end = key_length, causal, source_end
        self.keys = self.key_bound(last)
        self.left_end = min(max(self.first - K + 1, 0), self.keys)  # keys in every row's left tail
        self.right_start = max(min(last + K, self.keys), self.left_end)  # keys in every row's right tail
        self.K = K

    def key_bound(self, last: int) -> int:
        """Keys `[0, n)` past which no query up to position `last` sees anything, to skip work (which of them it sees is
        `visible_keys`): under a causal mask the keys after the last query, except source keys (UniLM)."""
        return min(self.key_length, max(last + 1, self.source_end)) if self.causal else self.key_length

    def positions(self, device) -> torch.Tensor:
        return query_positions(self.rows.stop, self.offset, device, start=self.rows.start)

    def middle_index(self, device) -> torch.Tensor:
        """Table rows `r(i, j)` of the middle block, `[rows, right_start - left_end]`."""
        return relative_position_index(self.positions(device), torch.arange(self.left_end, self.right_start,
                                                                             device=device), self.K)

    def mask(self, scores, mask: RelativeAttentionMask) -> None:
        """Set the scores of keys the chunk's queries do not see to -inf, in place."""
        allowed = visible_keys(mask, self.positions(scores.device), torch.arange(self.keys, device=scores.device))
        if allowed is not None:
            scores.masked_fill_(~allowed[:, None], float("-inf"))

    def keep(self, shape, dropout: float, seed: int, device) -> torch.Tensor:
        """Dropout factors `keep / (1 - p)` of the chunk's scores `shape`. Each group of `MIN_CHUNK_ROWS` queries
        draws its own keys' mask from a generator seeded by (seed, group), so the mask does not depend on how a
        call is chunked and the backward (in smaller chunks) redraws the forward's."""
        factors = torch.full(shape, 1.0 / (1.0 - dropout), device=device)  # keys a group cannot see: unused
        if device.type == "meta":
            return factors
        generator = torch.Generator(device=device)
        for start in range(self.rows.start, self.rows.stop, MIN_CHUNK_ROWS):
            stop = min(start + MIN_CHUNK_ROWS, self.rows.stop)
            keys = self.key_bound(self.offset + stop - 1)
            generator.manual_seed((seed * 1_000_003 + start) % (1 << 63))
            dropped = torch.rand(*shape[:2], stop - start, keys, generator=generator, device=device) < dropout
            rows = slice(start - self.rows.start, stop - self.rows.start)
            factors[..., rows, :keys].masked_fill_(dropped, 0.0)
        return factors


LEFT_TAIL, RIGHT_TAIL, ONES = -3, -2, -1  # the extra columns of keys and values


def _with_extra_columns(tensor: torch.Tensor) -> torch.Tensor:
    """`[..., L, d]` -> `[..., L, d + 3]`, contiguous; the new columns mark the current chunk's left tail
    (nothing before the first chunk), its right tail (everything before the first chunk), and ones."""
    out = tensor.new_zeros(*tensor.shape[:-1], tensor.shape[-1] + 3)
    out[..., :-3] = tensor
    out[..., [RIGHT_TAIL, ONES]] = 1
    return out


class _Operands:
    """Per call: its chunks and masks, keys and values with extra columns, the table in the compute dtype
    (float32, or float64 for float64 inputs), and `buffers` chunk buffers."""

    def __init__(self, query, key, value, table, problem: AttentionProblem, buffers: int):
        self.chunks = _chunks(query, key, table, problem, buffers)
        self.scaling, self.mask = problem.scaling, problem.mask
        self.dtype = torch.promote_types(query.dtype, torch.float32)  # scores, softmax and sums
        self.table = table.to(self.dtype)
        self.keys, self.values = _with_extra_columns(key), _with_extra_columns(value)
        self.left_end = self.right_start = 0
        batch, heads, length, _ = key.shape
        rows = self.chunks[0].size if self.chunks else 0
        self.buffers = [torch.empty(batch * heads * rows * length, dtype=self.dtype, device=key.device)
                        for _ in range(buffers)]

    def enter(self, chunk: _Chunk) -> None:
        """Move the tail columns to the chunk's tails. Both tails' starts only grow from chunk to chunk,
        so this writes just the keys that changed sides."""
        for tensor in (self.keys, self.values):
            tensor[..., self.left_end : chunk.left_end, LEFT_TAIL] = 1
            tensor[..., self.right_start : chunk.right_start, RIGHT_TAIL] = 0
        self.left_end, self.right_start = chunk.left_end, chunk.right_start

    def buffer(self, chunk: _Chunk, number: int) -> torch.Tensor:
        """Chunk buffer `number` as a contiguous `[batch * heads, C, keys]` tensor of the compute dtype."""
        batch, heads = self.keys.shape[:2]
        return self.buffers[number][: batch * heads * chunk.size * chunk.keys].view(batch * heads, chunk.size, chunk.keys)

    def products(self, chunk: _Chunk, rows: torch.Tensor, augmented: torch.Tensor, out: torch.Tensor,
                 constant: torch.Tensor | None = None) -> torch.Tensor:
        """`x_i . (y_j + T[r(i, j)]) + constant_i` for the chunk's `rows` x_i and its visible keys' y_j
        (`augmented`: the keys or the values with extra columns), written into the chunk buffer `out` and
        returned as `[batch, heads, C, keys]` in the compute dtype."""
        batch, heads, size, width = *rows.shape[:2], chunk.size, rows.shape[-1]
        per_row = torch.matmul(rows.to(self.dtype), self.table.T)  # x_i . T[r] for every r
        extra = [per_row[..., [0, -1]], torch.zeros_like(per_row[..., :1]) if constant is None else constant]
        with_extra = torch.cat([rows, torch.cat(extra, -1).to(rows.dtype)], -1).reshape(batch * heads, size, width + 3)
        keys = augmented.view(batch * heads, -1, width + 3)[:, : chunk.keys].transpose(1, 2)
        if rows.dtype == out.dtype:
            torch.bmm(with_extra, keys, out=out)
        else:
            out.copy_(torch.bmm(with_extra, keys))
        out = out.view(batch, heads, size, chunk.keys)
        index = chunk.middle_index(rows.device).expand(batch, heads, -1, -1)
        out[..., chunk.left_end : chunk.right_start] += per_row.gather(-1, index)
        return out

    def weighted_sum(self, chunk: _Chunk, weights: torch.Tensor, augmented: torch.Tensor) -> torch.Tensor:
        """`sum_j w_ij (y_j + T[r(i, j)])` over the chunk's visible keys: `[batch, heads, C, d]` in the compute
        dtype."""
        width = augmented.shape[-1] - 3
        # Without the extra columns: a product 67 wide is about 30% slower than 64 wide on CPU, and
        # the tails' two sums cost less than the difference.
        out = torch.matmul(weights.to(augmented.dtype), augmented[..., : chunk.keys, :width]).to(self.dtype)
        middle = weights[..., chunk.left_end : chunk.right_start]
        bucket = weights.new_zeros(*weights.shape[:-1], self.table.shape[0])  # weight per table row
        bucket.scatter_add_(-1, chunk.middle_index(weights.device).expand(*middle.shape), middle)
        bucket[..., 0] += weights[..., : chunk.left_end].sum(-1)  # the tails' masses
        bucket[..., -1] += weights[..., chunk.right_start :].sum(-1)
        return out + bucket @ self.table

    def probabilities(self, chunk: _Chunk, query_rows: torch.Tensor) -> torch.Tensor:
        """The chunk's attention probabilities, `[batch, heads, C, keys]` in chunk buffer 0 (a row that sees no
        key is all zeros; a row with a NaN score is NaN)."""
        scores = self.products(chunk, query_rows * self.scaling, self.keys, self.buffer(chunk, 0))
        chunk.mask(scores, self.mask)
        # In place on the CPU, where the tests check that the kernel's row-by-row passes make that safe;
        # on other devices, where nothing here has checked it, one more chunk-sized tensor instead.
        inplace = scores.device.type == "cpu"
        probs = torch.softmax(scores, -1, out=scores) if inplace else torch.softmax(scores, -1)
        nothing = sees_nothing(self.mask, chunk.positions(probs.device))
        if nothing is not None:  # softmax gives NaN for a row that sees no key: those rows are 0
            probs.masked_fill_(nothing[:, None, :, None], 0.0)
        return probs


def _chunks(query, key, table, problem: AttentionProblem, buffers: int) -> list[_Chunk]:
    """The chunks, in order, of one call that holds `buffers` chunk buffers."""
    batch, heads, queries, _ = query.shape
    keys, K = key.shape[-2], max_relative_position(table)
    query_offset, causal, key_is_source = problem.mask.query_offset, problem.mask.causal, problem.mask.key_is_source
    offset = int(query_offset) if not isinstance(query_offset, torch.Tensor) or query_offset.device.type != "meta" else 0
    source_end = 0
    if causal and key_is_source is not None:
        if key_is_source.device.type == "meta":
            source_end = keys
        else:
            visible = key_is_source.any(0).nonzero()
            source_end = int(visible.max()) + 1 if len(visible) else 0
    rows = chunk_rows(batch, heads, queries, keys, buffers)
    return [_Chunk(start, min(start + rows, queries), offset, keys, K, causal, source_end)
            for start in range(0, queries, rows)]


def forward_chunks(query, key, value, table, problem: AttentionProblem) -> list[torch.Tensor]:
    """NEZHA attention forward: `[output [batch, queries, heads, head_size]]`; see `attention_ops.engine_op`. Any
    device and floating dtype."""
    batch, heads, queries, size = query.shape
    operands = _Operands(query, key, value, table, problem, buffers=1)
    output = query.new_empty(batch, queries, heads, size)
    dropout = problem.dropout
    seed_value = int(problem.seed) if dropout > 0 else 0
    for chunk in operands.chunks:
        operands.enter(chunk)
        probs = operands.probabilities(chunk, query[..., chunk.rows, :])
        if dropout > 0:
            probs.mul_(chunk.keep(probs.shape, dropout, seed_value, query.device))
        out = operands.weighted_sum(chunk, probs, operands.values)
        output[:, chunk.rows] = out.transpose(1, 2).to(output.dtype)
    return [output]


def _forward_fake(query, key, value, table, problem):
    batch, heads, queries, size = query.shape
    return [query.new_empty(batch, queries, heads, size)]


def _add_product(target: torch.Tensor, chunk: _Chunk, weights: torch.Tensor, rows: torch.Tensor) -> None:
    """`target[..., :keys, :] += weights^T @ rows` (target `[batch, heads, L, d]` in the compute dtype), accumulated by the
    matrix product itself when the dtypes allow, so no `[keys, d]` temporary per chunk."""
    if rows.dtype != target.dtype:
        target[..., : chunk.keys, :] += torch.matmul(weights.transpose(-1, -2).to(rows.dtype), rows).to(target.dtype)
        return
    batch, heads, length, size = target.shape
    accumulated = target.view(batch * heads, length, size)[:, : chunk.keys]
    accumulated.baddbmm_(weights.reshape(batch * heads, chunk.size, chunk.keys).transpose(1, 2),
                         rows.reshape(batch * heads, chunk.size, size))


def backward_chunks(grad_output, query, key, value, table, problem: AttentionProblem,
                    output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value (`[batch, heads, length, head_size]`), recomputing each chunk; see
    `attention_ops.engine_op`."""
    operands = _Operands(query, key, value, table, problem, buffers=2)
    dropout, scaling = problem.dropout, problem.scaling
    grad_query = torch.empty(query.shape, dtype=operands.dtype, device=query.device)
    grad_key = torch.zeros(key.shape, dtype=operands.dtype, device=key.device)
    grad_value = torch.zeros(value.shape, dtype=operands.dtype, device=value.device)
    seed_value = int(problem.seed) if dropout > 0 else 0
    for chunk in operands.chunks:
        operands.enter(chunk)
        query_rows, grad_out = query[..., chunk.rows, :], grad_output[..., chunk.rows, :]
        out_rows = output[..., chunk.rows, :].to(operands.dtype)
        row_dot = (grad_out.to(operands.dtype) * out_rows).sum(-1, keepdim=True)  # D_i = dO_i . O_i
        probs = operands.probabilities(chunk, query_rows)
        # dP_ij = dO_i . (v_j + T[r(i, j)]), and dS = P (dP - D); without dropout the gemm subtracts D itself.
        constant = None if dropout > 0 else -row_dot
        grad_scores = operands.products(chunk, grad_out, operands.values, operands.buffer(chunk, 1), constant)
        kept = probs
        if dropout > 0:
            keep = chunk.keep(probs.shape, dropout, seed_value, query.device)
            grad_scores.mul_(keep).sub_(row_dot)
            kept = keep.mul_(probs)
        _add_product(grad_value, chunk, kept, grad_out)
        grad_scores.mul_(probs)
        grad_query[..., chunk.rows, :] = operands.weighted_sum(chunk, grad_scores, operands.keys)
        _add_product(grad_key, chunk, grad_scores, query_rows)
    grad_query.mul_(scaling)
    grad_key.mul_(scaling)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def _backward_fake(grad_output, query, key, value, table, problem, output):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous


chunked_attention = engine_op(Engine.CHUNKED, forward_chunks, _forward_fake, backward_chunks, _backward_fake)
chunked_attention.__doc__ = """NEZHA attention in chunks of queries, `[batch, queries, heads, head_size]`; arguments as
    `fused_attention.fused_attention`, on any device and floating dtype (float64 computed in float64)."""
