"""Exact NEZHA attention in linear memory from PyTorch's fused CPU attention kernel: three regions.

Each query row `i` splits into the band `|j - i| < K` and two tails, `j <= i - K` (every key at
table row 0) and `j >= i + K` (row 2K). In a tail every key has the same relative vector, so the
tail is a plain, shifted-causal attention with a per-row constant added to its scores. In the band
the sinusoid table is rotary, so the relative terms become extra head dimensions and the band is a
plain attention over sliding key windows. All three are calls of PyTorch's fused kernel, which
also returns the row log-sum-exp used to merge them; the backward reuses the kernel's backward.

It is the op `nezha_hf::three_regions_forward` / `_backward` (`attention_ops.engine_op`), built per call from
the call's `AttentionProblem`; which keys a query sees is `attention_ops.visible_keys`. This module is an engine:
it takes tensors and knows nothing of models; `relative_attention.py` decides when it runs (where the fused kernel
is not built, for long inputs on the CPU: the fastest engine there, docs/performance.md).
"""

import torch
from torch import nn

from .attention_ops import (
    AttentionProblem,
    Engine,
    RelativeAttentionMask,
    engine_op,
    max_relative_position,
    sinusoid_frequencies,
    visible_keys,
)

# Queries per block of the band; each block sees a window of keys a whole number of blocks wide.
BAND_BLOCK_SIZE = 64
# Blocks of the band computed at once: bounds the memory of its buffers, whatever the length.
BAND_BLOCKS_PER_CHUNK = 32

# PyTorch's CPU flash-attention kernel and its backward, which both take and return the row
# log-sum-exp. They are private to PyTorch: `AVAILABLE` is False where this build lacks them.
flash_forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
AVAILABLE = flash_forward is not None and flash_backward is not None


def reflect(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None):
    """Map each pair `(x0, x1)` of the last dimension to `(x0 sin + x1 cos, x0 cos - x1 sin)`.

    `rotation` is `(sin, -sin, ... interleaved, cos, cos, ... interleaved)` from `Band.query_rotation`.
    The 2 x 2 matrix is symmetric and orthogonal, so the map is its own transpose and inverse.
    """
    signed_sin, doubled_cos = rotation
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0)
    out = torch.mul(x, signed_sin, out=out)
    return out.addcmul_(swapped, doubled_cos)


class Band:
    """The band `|j - i| < K`, computed by the fused kernel on sliding key windows.

    Inside the band the table row `p = j - i + K` is not clipped, and the sinusoid table is rotary:
    with `a_i = (K - i) w` and `E_j = (cos j w, sin j w)` per frequency pair,

        q_i . T[p]         = M(a_i) q_i . E_j            M(a) = [[sin a, cos a], [cos a, -sin a]]
        sum_j p_ij T[p]   = M(a_i) sum_j p_ij E_j

    so the band is plain attention of `[q, M q]` against keys `[k, E]` with values `[v, E]`, and the
    value term comes back through `M` (`reflect`). Queries go in blocks of `S = BAND_BLOCK_SIZE`;
    block `n` sees the window of `W = (2 * reach + 1) * S` keys starting at `(n - reach) * S`, masked
    to the band. The angles are computed in float64, so `T[p]` here is the exact sinusoid; the float32
    table differs from it by at most about 4e-6 per entry for `K = 64`.

    Blocks of every sequence in the batch are laid end to end with `2 * reach` empty blocks between
    sequences, so all windows are one overlapping view of one buffer (no copies) and one kernel call
    serves the whole batch; the windows that straddle two sequences are fully masked.
    """

    def __init__(self, length: int, K: int, frequency: torch.Tensor, mask: RelativeAttentionMask):
        self.length, self.K, self.mask = length, K, mask
        self.block = min(BAND_BLOCK_SIZE, length)
        self.reach = -(-(K - 1) // self.block)  # blocks on each side that hold band keys
        self.window = (2 * self.reach + 1) * self.block
        self.num_blocks = -(-length // self.block)
        self.frequency = frequency.double()

    def chunks(self):
        """Block ranges of at most `BAND_BLOCKS_PER_CHUNK` blocks covering the band: bounds its memory."""
        return [
            range(start, min(start + BAND_BLOCKS_PER_CHUNK, self.num_blocks))
            for start in range(0, self.num_blocks, BAND_BLOCKS_PER_CHUNK)
        ]

    def rows(self, part: range) -> slice:
        """Query positions of the blocks in `part`."""
        return slice(part.start * self.block, min(part.stop * self.block, self.length))

    def _allowed(self, part: range, device) -> torch.Tensor:
        """`[batch or 1, blocks, S, W]` bool: which window keys each query of the blocks in `part` sees."""
        S = self.block
        query = (torch.arange(part.start, part.stop, device=device)[:, None] * S + torch.arange(S, device=device))[..., None]
        key = query - query % S - self.reach * S + torch.arange(self.window, device=device)
        inside = (key >= 0) & (key < self.length) & (query < self.length)
        allowed = (inside & ((key - query).abs() < self.K))[None]  # in the sequence and in the band
        visible = visible_keys(self.mask, query[..., 0], key[:, 0].clamp(0, self.length - 1))
        return allowed if visible is None else allowed & visible

    def _buffer(self, x, first: int, per_sequence: int, rows: slice, extra) -> torch.Tensor:
        """`[B, H, L, d]` -> zero buffer `[B * P * S, H, 2d]` in which row `r` of a sequence is position `first + r`.

        Only the positions `rows` are filled: `x` in the first `d` columns; the last `d` get zeros, or
        `extra` (`[rows, 1, d]`, broadcast over batch and heads), or are written by `extra(x_rows, target)`.
        """
        batch, heads, _, size = x.shape
        buffer = x.new_empty(batch, per_sequence * self.block, heads, 2 * size)
        inside = slice(rows.start - first, rows.stop - first)
        buffer[:, : inside.start].zero_()  # masked positions, but they must hold no NaN
        buffer[:, inside.stop :].zero_()
        buffer[:, inside, :, :size] = x[..., rows, :].transpose(1, 2)
        if extra is None:
            buffer[:, inside, :, size:].zero_()
        elif callable(extra):
            extra(x[..., rows, :].transpose(1, 2), buffer[:, inside, :, size:])
        else:
            buffer[:, inside, :, size:] = extra
        return buffer.view(-1, heads, 2 * size)

    def angles(self, positions: torch.Tensor):
        angles = positions.double()[:, None] * self.frequency  # [rows, d/2]
        return angles.sin()[:, None], angles.cos()[:, None]  # broadcast over heads

    def query_rotation(self, rows: slice, dtype):
        """`reflect`'s rotation for `a_i = (K - i) w` at the query rows, each `[rows, 1, d]`."""
        sin, cos = self.angles(self.K - torch.arange(rows.start, rows.stop, device=self.frequency.device))
        signed_sin = torch.stack((sin, -sin), -1).flatten(-2)
        return signed_sin.to(dtype), cos.repeat_interleave(2, -1).to(dtype)

    def _queries(self, x, plan: dict, rotation=None):
        """Query side `[x, M x]` (`[x, 0]` without `rotation`) of the chunk's blocks, as `[N, H, S, 2d]`."""
        rows = plan["rows"]
        extra = None if rotation is None else lambda rows_x, target: reflect(rows_x, rotation, out=target)
        buffer = self._buffer(x, rows.start - self.reach * self.block, plan["per_sequence"], rows, extra)
        blocks = buffer[self.reach * self.block : (self.reach + plan["windows"]) * self.block]
        return blocks.view(plan["windows"], self.block, *buffer.shape[1:]).transpose(1, 2)

    def _keys(self, x, plan: dict):
        """Key side `[x, E]` of the chunk's windows, as overlapping windows `[N, H, W, 2d]` (a view, no copy)."""
        buffer = self._buffer(x, plan["first_key"], plan["per_sequence"], plan["keys"], plan["key_rotary"])
        return buffer.unfold(0, self.window, self.block).permute(0, 1, 3, 2)

    def _unblock(self, x: torch.Tensor, plan: dict) -> torch.Tensor:
        """Kernel output `[N, H, S, e]` -> `[B, H, rows, e]` (the windows' query rows, per sequence)."""
        x = x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])
        x = nn.functional.pad(x, (0, 0, 0, 0, 0, 2 * self.reach * self.block))
        return x.view(-1, plan["per_sequence"] * self.block, *x.shape[1:])[:, : plan["count"]].transpose(1, 2)

    def _mask(self, allowed: torch.Tensor, batch: int, per_sequence: int, windows: int, dtype) -> torch.Tensor:
        """`[batch or 1, blocks, S, W]` bool -> the kernel's additive mask `[N, 1, S, W]`."""
        placed = allowed.new_zeros(batch, per_sequence, *allowed.shape[2:])
        placed[:, : allowed.shape[1]] = allowed
        additive = torch.zeros(placed.shape, dtype=dtype, device=allowed.device).masked_fill_(~placed, float("-inf"))
        return additive.flatten(0, 1)[:windows, None]

    def _plan(self, part: range, batch: int, dtype) -> dict:
        """Masks and rotations of the chunk `part`."""
        rows, first_key = self.rows(part), (part.start - self.reach) * self.block
        keys = slice(max(first_key, 0), min((part.stop + self.reach) * self.block, self.length))
        per_sequence = len(part) + 2 * self.reach  # blocks per sequence in the end-to-end buffer (P)
        windows = batch * per_sequence - 2 * self.reach  # N
        allowed = self._allowed(part, self.frequency.device)
        sin, cos = self.angles(torch.arange(keys.start, keys.stop, device=self.frequency.device))
        return dict(
            batch=batch,
            per_sequence=per_sequence,
            windows=windows,
            rows=rows,
            count=rows.stop - rows.start,
            first_key=first_key,
            keys=keys,  # key positions the windows cover
            mask=self._mask(allowed, batch, per_sequence, windows, dtype),
            has_keys=allowed.any(-1).flatten(1)[:, None, : rows.stop - rows.start],
            rotation=self.query_rotation(rows, dtype),
            key_rotary=torch.stack((cos, sin), -1).flatten(-2).to(dtype),
        )

    def forward(self, query, key, value, scaling, part: range):
        """Band output (value term included) and log-sum-exp of the query rows of `part`.

        Returns `([B, H, rows, d], [B, H, rows])`; rows with no band key get lse `-inf`.
        """
        plan, size = self._plan(part, query.shape[0], query.dtype), query.shape[-1]
        out, lse = flash_forward(
            self._queries(query, plan, plan["rotation"]),
            self._keys(key, plan),
            self._keys(value, plan),
            0.0,
            False,
            attn_mask=plan["mask"],
            scale=scaling,
        )
        out = self._unblock(out, plan)
        out = reflect(out[..., size:], [r.transpose(0, 1) for r in plan["rotation"]]).add_(out[..., :size])
        lse = self._unblock(lse.unsqueeze(-1), plan).squeeze(-1)
        return out, lse.masked_fill(~plan["has_keys"], float("-inf"))

    def backward(self, grad_output, query, key, value, output, lse, scaling, part: range):
        """Band gradients for the query rows of `part`, given the whole rows' output and log-sum-exp.

        `lse` is the full row log-sum-exp (`+inf` on rows with no visible key). Returns
        `(dq [B, H, rows, d], dk, dv [B, H, keys, d], keys)` where `keys` are the key positions covered.
        """
        plan, size = self._plan(part, query.shape[0], query.dtype), query.shape[-1]
        # The kernel uses `out` only through rowsum(dO' * out'); with out' = [O, 0] that is dO . O.
        grad_query, grad_key, grad_value = flash_backward(
            self._queries(grad_output, plan, plan["rotation"]),
            self._queries(query, plan, plan["rotation"]),
            self._keys(key, plan),
            self._keys(value, plan),
            self._queries(output, plan),
            self._queries(lse[..., None], plan)[..., 0].contiguous(),
            0.0,
            False,
            attn_mask=plan["mask"],
            scale=scaling,
        )
        grad_query = self._unblock(grad_query, plan)
        rotation = [r.transpose(0, 1) for r in plan["rotation"]]
        grad_query = reflect(grad_query[..., size:], rotation).add_(grad_query[..., :size])
        fold = lambda windows: self._fold(windows[..., :size], plan)  # noqa: E731
        return grad_query, fold(grad_key), fold(grad_value), plan["keys"]

    def _fold(self, windows: torch.Tensor, plan: dict) -> torch.Tensor:
        """Overlap-add window gradients `[N, H, W, d]` back to the chunk's key positions, `[B, H, keys, d]`."""
        S, count, heads, size = self.block, plan["windows"], windows.shape[1], windows.shape[-1]
        keys = plan["keys"]
        windows = windows.transpose(1, 2)  # [N, W, H, d]
        buffer = windows.new_zeros(plan["batch"] * plan["per_sequence"] * S, heads, size)
        for piece in range(2 * self.reach + 1):
            buffer[piece * S : (piece + count) * S] += windows[:, piece * S : (piece + 1) * S].reshape(-1, heads, size)
        buffer = buffer.view(plan["batch"], plan["per_sequence"] * S, heads, size)
        offset = keys.start - plan["first_key"]
        return buffer[:, offset : offset + keys.stop - keys.start].transpose(1, 2)


def _key_padding(flags: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """`[batch, n]` bool -> additive `[batch, 1, 1, n]` mask for the fused kernel."""
    if flags is None:
        return None
    return torch.zeros(flags.shape, dtype=dtype, device=flags.device).masked_fill(~flags, float("-inf"))[:, None, None]


class Tail:
    """One tail: queries `q_slice` against keys `k_slice` with a shifted causal mask, all at table row `row`.

    The left tail (`j <= i - K`, row 0) is causal between queries `K..L-1` and keys `0..L-1-K`; the
    right tail (`j >= i + K`, row 2K) is the same on flipped sequences. Inside a tail the key term
    is a per-query constant `c_i = q_i . T[row] * scale` and the value term is `T[row]`.
    """

    def __init__(self, side: str, length: int, K: int, mask: RelativeAttentionMask, dtype, device):
        self.side, self.length, self.K = side, length, K
        self.row = 0 if side == "left" else 2 * K
        # Which of the tail's keys its queries see: every left-tail key lies before its queries, every right-tail key
        # after them (the causal order inside the tail is the kernel's own causal mask).
        if side == "left":
            seen = visible_keys(mask, torch.tensor([length], device=device), torch.arange(length - K, device=device))
        else:
            seen = visible_keys(mask, torch.tensor([-1], device=device), torch.arange(K, length, device=device))
        keys = None if seen is None else seen[:, 0] if side == "left" else seen[:, 0].flip(-1)
        if keys is not None and bool(keys.all()):
            keys = None  # e.g. a UniLM prompt that is all source: no mask lets the kernel run unmasked
        self.key_mask = _key_padding(keys, dtype)
        # The kernel reports lse = 0 for a row with no visible key; such rows must weigh nothing.
        self.row_has_keys = None if keys is None else (keys.cumsum(-1) > 0)[:, None, :]

    def queries(self, x):  # [.., L, *] -> the tail's queries (flipped for the right tail)
        return x[..., self.K :, :] if self.side == "left" else x[..., : self.length - self.K, :].flip(-2)

    def keys(self, x):
        return x[..., : self.length - self.K, :] if self.side == "left" else x[..., self.K :, :].flip(-2)

    def constant(self, query, table, scaling):
        """The tail's per-query key term `c_i = q_i . T[row] * scale` for the given query rows."""
        return torch.matmul(query, table[self.row]) * scaling

    def take(self, x, start: int, stop: int, fill):
        """Per-query tail values `[.., n, *]` at query positions `start .. stop - 1` (`fill` where the tail has none).

        `take(x, 0, length, fill)` puts them all back at their query positions.
        """
        if self.side == "left":
            first = max(start, self.K)
            inside = x[..., first - self.K : max(stop - self.K, 0), :]
            pad = (first - start, 0) if stop > self.K else (stop - start, 0)
        else:
            end = self.length - self.K
            last = min(stop, end)
            inside = x[..., max(end - last, 0) : max(end - start, 0), :].flip(-2)
            pad = (0, stop - last) if start < end else (0, stop - start)
        return nn.functional.pad(inside, (0, 0, *pad), value=fill)

    def place_keys(self, x):
        """Key gradients `[.., n, d]` back at key positions `[.., L, d]`."""
        pad = x.new_zeros(*x.shape[:-2], self.K, x.shape[-1])
        return torch.cat([x, pad], -2) if self.side == "left" else torch.cat([pad, x.flip(-2)], -2)

    def forward(self, query, key, value, scaling):
        out, lse = flash_forward(
            self.queries(query), self.keys(key), self.keys(value), 0.0, True, attn_mask=self.key_mask, scale=scaling
        )
        if self.row_has_keys is not None:
            lse = lse.masked_fill(~self.row_has_keys, float("-inf"))
        return out, lse

    def backward(self, grad_out, query, key, value, shifted_out, shifted_lse, scaling):
        return flash_backward(
            self.queries(grad_out),
            self.queries(query),
            self.keys(key),
            self.keys(value),
            self.queries(shifted_out),
            self.queries(shifted_lse.unsqueeze(-1)).squeeze(-1),
            0.0,
            True,
            attn_mask=self.key_mask,
            scale=scaling,
        )


def _regions(query, table, problem: AttentionProblem) -> tuple[Band, list[Tail]]:
    """The band and the tails of one call (the right tail only where keys after a query can be seen)."""
    length, K, mask = query.shape[-2], max_relative_position(table), problem.mask
    frequency = sinusoid_frequencies(query.shape[-1]).to(query.device)
    band = Band(length, K, frequency, mask)
    tails = [Tail("left", length, K, mask, query.dtype, query.device)]
    if not mask.causal or mask.key_is_source is not None:
        tails.append(Tail("right", length, K, mask, query.dtype, query.device))
    return band, tails


def _forward(query, key, value, table, problem: AttentionProblem) -> list[torch.Tensor]:
    """`[output [batch, length, heads, head_size], lse, (mass, share) per tail]`: the band and both tails are fused-kernel
    calls, merged by log-sum-exp; each tail's probability mass and its share of the output are what its backward
    needs."""
    band, tails = _regions(query, table, problem)
    scaling, length = problem.scaling, query.shape[-2]
    tail_parts = [(tail, *tail.forward(query, key, value, scaling)) for tail in tails]
    # The output is laid out as [batch, L, heads, d], what the caller reshapes it to, so that costs no copy.
    output = query.new_empty(query.shape[0], length, query.shape[1], query.shape[-1]).transpose(1, 2)
    lse = query.new_empty(query.shape[:-1], dtype=torch.promote_types(query.dtype, torch.float32))
    tail_shares = [(query.new_empty(*query.shape[:-1], 1), torch.empty_like(query)) for _ in tails]
    for part in band.chunks():  # bounds the memory of the band's buffers, whatever the length
        rows = band.rows(part)
        band_out, band_lse = band.forward(query, key, value, scaling, part)
        # Log-sum-exps stay in float32 even for bfloat16 inputs.
        region_lse = [band_lse.to(lse.dtype)] + [
            tail.take(tail_lse.unsqueeze(-1), rows.start, rows.stop, float("-inf")).squeeze(-1)
            + tail.constant(query[..., rows, :], table, scaling)
            for tail, _, tail_lse in tail_parts
        ]
        row_lse = torch.logsumexp(torch.stack(region_lse), 0)
        safe_lse = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)  # masked rows -> 0
        chunk = torch.exp(region_lse[0] - safe_lse).unsqueeze(-1).to(query.dtype) * band_out
        for index, ((tail, tail_out, _), tail_lse) in enumerate(zip(tail_parts, region_lse[1:])):
            mass = torch.exp(tail_lse - safe_lse).unsqueeze(-1).to(query.dtype)
            share = mass * (tail.take(tail_out, rows.start, rows.stop, 0.0) + table[tail.row])
            chunk = chunk + share
            tail_shares[index][0][..., rows, :], tail_shares[index][1][..., rows, :] = mass, share
        output[..., rows, :] = chunk
        lse[..., rows] = row_lse
    return [output.transpose(1, 2), lse, *(t for pair in tail_shares for t in pair)]


def _forward_fake(query, key, value, table, problem: AttentionProblem) -> list[torch.Tensor]:
    batch, heads, length, size = query.shape
    tails = 1 if problem.mask.causal and problem.mask.key_is_source is None else 2
    shares = [query.new_empty(batch, heads, length, 1), query.new_empty(query.shape)] * tails
    return [query.new_empty(batch, length, heads, size),
            query.new_empty(batch, heads, length, dtype=torch.promote_types(query.dtype, torch.float32)), *shares]


def _backward(grad_output, query, key, value, table, problem: AttentionProblem, output, lse, *shares):
    """Gradients of query, key and value, `[batch, heads, length, head_size]`: the fused kernel's backward for the
    band and both tails, with the whole row's log-sum-exp."""
    band, tails = _regions(query, table, problem)
    scaling = problem.scaling
    grad_output = grad_output.contiguous()
    # Rows with no visible key: lse = +inf makes every recomputed probability zero.
    lse = lse.masked_fill(torch.isinf(lse), float("inf"))
    row_dot = (grad_output * output).sum(-1, keepdim=True)  # D_i = dO_i . O_i

    grad_query, grad_key, grad_value = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for part in band.chunks():
        dq, dk, dv, keys = band.backward(grad_output, query, key, value, output, lse, scaling, part)
        grad_query[..., band.rows(part), :] += dq
        grad_key[..., keys, :] += dk
        grad_value[..., keys, :] += dv

    # Tails: the fused backward with out' = O - T[row] and lse' = LSE - c is exact (it reads `out`
    # only through rowsum(dO * out)). The constant c_i = scale * q_i . T[row] also depends on q_i:
    # its gradient is the row's sum of the tail's score gradients, mass * (dO . (out + T[row]) - D).
    for tail, (mass, share) in zip(tails, zip(shares[0::2], shares[1::2])):
        shifted_lse = lse - tail.constant(query, table, scaling)
        dq, dk, dv = tail.backward(grad_output, query, key, value, output - table[tail.row], shifted_lse, scaling)
        score_sum = (grad_output * share).sum(-1, keepdim=True) - mass * row_dot
        grad_query += tail.take(dq, 0, tail.length, 0.0) + scaling * score_sum * table[tail.row]
        grad_key += tail.place_keys(dk)
        grad_value += tail.place_keys(dv)
    return [grad_query, grad_key, grad_value]


def _backward_fake(grad_output, query, key, value, table, problem, output, lse, *shares):
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)]


three_regions_attention = engine_op(Engine.THREE_REGIONS, _forward, _forward_fake, _backward, _backward_fake,
                                    device_types="cpu")
three_regions_attention.__doc__ = """NEZHA attention in three regions, `[batch, queries, heads, head_size]`: queries and
    keys of one length on the CPU (no KV cache, no dropout; `relative_attention` decides when it runs). Arguments as
    `fused_attention.fused_attention`."""
