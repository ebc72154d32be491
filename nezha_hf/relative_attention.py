"""NEZHA's relative-position attention: every piece of the relative-position maths lives here.

For a head of size `d`, query position `i`, key position `j` and `K = max_relative_position`:

    r(i, j) = clip(j - i, -K, K) + K                       # a row of the table, 0 .. 2K
    s_ij    = (q_i . k_j + q_i . T[r(i, j)]) * scale + mask_ij
    out_i   = sum_j softmax_j(s_ij) (v_j + T[r(i, j)])

`T` is a fixed `(2K + 1) x d` sinusoid table shared by every head and layer. Two exact
implementations are provided, both with the transformers attention-function signature
`fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs) -> (out, probs)`:

- `gather_relative_attention`: builds the `L x L` scores, adds the key term by gathering
  `q @ T^T` (DeBERTa's c2p trick), and sums probabilities into the `2K + 1` buckets for the value
  term. Nothing of size `L x L x d`. The only path that returns attention probabilities and
  applies attention dropout. Fastest for short inputs.
- `three_region_attention`: linear memory. Each query row splits into a band `|j - i| < K`
  computed explicitly in blocks, and two tails (`j <= i - K`, `j >= i + K`) in which every key
  has the same relative vector, so each tail is a plain (shifted causal) attention computed by
  PyTorch's fused kernel, which also returns the row log-sum-exp used to merge the parts.

The mask is described by `RelativeAttentionMask` (key padding, causal or UniLM prefix) rather
than a dense `L x L` tensor, so the fast path never materialises one.
"""

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)

# Up to 512 tokens the gather formulation is faster on CPU (`benchmarks/results/attention-all-lengths.md`,
# 512 tokens: gather 1.14x BERT, three regions 1.37x); longer inputs use three regions.
THREE_REGIONS_MIN_LENGTH = 513
# Queries per block of the explicit band.
BAND_BLOCK_SIZE = 64
# Blocks of the band computed at once in the forward pass: bounds its memory, whatever the length.
BAND_BLOCKS_PER_CHUNK = 16

_flash_forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
FUSED_KERNEL_AVAILABLE = _flash_forward is not None and _flash_backward is not None
if not FUSED_KERNEL_AVAILABLE:
    logger.info("PyTorch has no fused CPU attention kernel returning log-sum-exp: NEZHA uses the gather path.")


def sinusoid_relative_table(max_relative_position: int, head_size: int) -> torch.Tensor:
    """The fixed `(2K + 1) x head_size` table `T`, computed exactly as transformers 4.x did (float32).

    Row `p` encodes the shifted index `p = clip(j - i) + K`, not the signed distance.
    """
    num_rows = 2 * max_relative_position + 1
    position = torch.arange(num_rows, dtype=torch.int64).float().unsqueeze(1)
    div_term = torch.exp(torch.arange(0, head_size, 2).float() * (-math.log(10000.0) / head_size))
    table = torch.zeros(num_rows, head_size)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term)
    return table


def relative_position_index(
    query_length: int, key_length: int, max_relative_position: int, query_offset: int = 0, device=None
) -> torch.Tensor:
    """`r(i, j) = clip(j - i, -K, K) + K` for query positions `query_offset + arange(query_length)`.

    Returns a `[query_length, key_length]` long tensor. With a KV cache the query positions start
    at the cache length, so the matrix is rectangular.
    """
    query_position = torch.arange(query_offset, query_offset + query_length, device=device)
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
        query_offset: position of the first query (the cache length while decoding).
    """

    key_is_valid: torch.Tensor | None = None
    causal: bool = False
    key_is_source: torch.Tensor | None = None
    query_offset: int = 0
    _additive: dict = field(default_factory=dict, repr=False, compare=False)

    def allowed(self, query_length: int, key_length: int, device) -> torch.Tensor | None:
        """Dense `[batch or 1, 1, query_length, key_length]` bool mask, or None if everything is visible."""
        allowed = None
        if self.causal:
            query_position = torch.arange(self.query_offset, self.query_offset + query_length, device=device)
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
        key = (query_length, key_length, dtype, str(device))
        if key not in self._additive:
            allowed = self.allowed(query_length, key_length, device)
            self._additive[key] = (
                None
                if allowed is None
                else torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
                    ~allowed, torch.finfo(dtype).min
                )
            )
        return self._additive[key]


def _relative_table(relative_table: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if relative_table is None:
        raise TypeError(
            "NEZHA relative attention needs `relative_table=` (passed down by NezhaModel): it only works inside "
            "a NEZHA model."
        )
    return relative_table.to(dtype)


def gather_relative_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    relative_table: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact NEZHA attention with `O(L^2)` memory per head (`attn_implementation="eager"`).

    Args:
        module: the calling `NezhaSelfAttention` (provides `max_relative_position` and `training`).
        query: `[batch, heads, query_length, head_size]`; key, value: `[batch, heads, key_length, head_size]`.
        attention_mask: a `RelativeAttentionMask` or None.
        scaling: score scale, `head_size ** -0.5`.
        dropout: attention-probability dropout, applied (to both value terms) as transformers 4.x did.
        relative_table: the model's `(2K + 1) x head_size` table.

    Returns:
        `(output [batch, query_length, heads, head_size], probabilities [batch, heads, query_length, key_length])`.
    """
    query_length, key_length = query.shape[-2], key.shape[-2]
    table = _relative_table(relative_table, query.dtype)
    offset = attention_mask.query_offset if attention_mask is not None else 0
    index = relative_position_index(query_length, key_length, module.max_relative_position, offset, query.device)
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


# ----------------------------------------------------------------------------------------------
# Three regions: band + two fused-kernel tails, exact forward and backward, linear memory.
# ----------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows `start .. stop - 1` of `[.., L, d]`, with zeros for the rows outside `0 .. L - 1`."""
    length = x.shape[-2]
    inside = x[..., max(start, 0) : min(stop, length), :]
    return nn.functional.pad(inside, (0, 0, max(0, -start), max(0, stop - length)))


class _Band:
    """The explicit band `|j - i| < K` in blocks of `BAND_BLOCK_SIZE` queries.

    Inside a block of `B` queries starting at `s`, the keys `s - K + 1 .. s + B + K - 2` form a
    window of `W = B + 2K - 2`; query `t` of the block sees window column `t + o` at relative offset
    `o - (K - 1)`, i.e. table row `o + 1` (`o = 0 .. 2K - 2`). Scores are kept in this relative
    layout `[.., blocks, B, 2K - 1]`.
    """

    def __init__(self, length: int, max_relative_position: int, mask: RelativeAttentionMask, device):
        K = max_relative_position
        self.length, self.K, self.width = length, K, 2 * K - 1
        self.block = min(BAND_BLOCK_SIZE, length)
        self.num_blocks = -(-length // self.block)
        self.window = self.block + 2 * K - 2
        offsets = torch.arange(self.width, device=device)
        rows = torch.arange(self.block, device=device)
        self.column = rows[:, None] + offsets[None, :]  # [B, 2K-1] window column of each band entry
        key_position = (
            torch.arange(self.num_blocks, device=device)[:, None, None] * self.block
            + self.column[None]
            - (K - 1)
        )  # [blocks, B, 2K-1]
        query_position = torch.arange(self.num_blocks * self.block, device=device).view(self.num_blocks, self.block, 1)
        allowed = (key_position >= 0) & (key_position < length) & (query_position < length)
        if mask.causal:
            allowed = allowed & (key_position <= query_position)
        allowed = allowed[None, None]  # [1, 1, blocks, B, 2K-1]
        key_index = key_position.clamp(0, length - 1).view(-1)

        def per_key(flags):  # [batch, L] -> [batch, 1, blocks, B, 2K-1]
            return flags[:, key_index].view(flags.shape[0], 1, self.num_blocks, self.block, self.width)

        if mask.causal and mask.key_is_source is not None:
            source_allowed = (key_position >= 0) & (key_position < length) & (query_position < length)
            allowed = allowed | (source_allowed[None, None] & per_key(mask.key_is_source))
        if mask.key_is_valid is not None:
            allowed = allowed & per_key(mask.key_is_valid)
        self.allowed = allowed
        # Scatter / fold positions: window column w of block n sits at padded position n * B + w.
        self.fold_index = (
            torch.arange(self.num_blocks, device=device)[:, None] * self.block + torch.arange(self.window, device=device)
        ).view(-1)

    def chunks(self):
        """Block ranges of at most `BAND_BLOCKS_PER_CHUNK` blocks covering the band."""
        return [slice(start, min(start + BAND_BLOCKS_PER_CHUNK, self.num_blocks))
                for start in range(0, self.num_blocks, BAND_BLOCKS_PER_CHUNK)]

    def blocks(self, x: torch.Tensor, part: slice = slice(None)) -> torch.Tensor:
        """`[.., L, d]` queries -> the blocks in `part` as `[.., blocks, B, d]`."""
        start, stop, _ = part.indices(self.num_blocks)
        x = _rows(x, start * self.block, stop * self.block)
        return x.view(*x.shape[:-2], stop - start, self.block, x.shape[-1])

    def windows(self, x: torch.Tensor, part: slice = slice(None)) -> torch.Tensor:
        """`[.., L, d]` keys or values -> the windows of the blocks in `part`, `[.., blocks, W, d]`."""
        start, stop, _ = part.indices(self.num_blocks)
        x = _rows(x, start * self.block - (self.K - 1), stop * self.block + self.K - 1)
        return x.unfold(-2, self.window, self.block).transpose(-1, -2)

    def to_relative(self, window_scores: torch.Tensor) -> torch.Tensor:
        """`[.., blocks, B, W]` -> `[.., blocks, B, 2K-1]`."""
        return window_scores.gather(-1, self.column.expand(*window_scores.shape[:-1], self.width))

    def to_window(self, relative: torch.Tensor) -> torch.Tensor:
        """`[.., blocks, B, 2K-1]` -> `[.., blocks, B, W]` with zeros outside the band."""
        out = relative.new_zeros(*relative.shape[:-1], self.window)
        return out.scatter_(-1, self.column.expand_as(relative), relative)

    def fold(self, windows: torch.Tensor) -> torch.Tensor:
        """Overlap-add `[.., blocks, W, d]` window gradients back to `[.., L, d]`."""
        lead = windows.shape[:-3]
        padded = windows.new_zeros(*lead, self.num_blocks * self.block + 2 * (self.K - 1), windows.shape[-1])
        padded.index_add_(-2, self.fold_index, windows.reshape(*lead, -1, windows.shape[-1]))
        return padded[..., self.K - 1 : self.K - 1 + self.length, :]

    def unblock(self, x: torch.Tensor) -> torch.Tensor:
        """`[.., blocks, B, ...]` -> `[.., L, ...]`."""
        x = x.reshape(*x.shape[:-3], -1, *x.shape[-1:])
        return x[..., : self.length, :]

    def scores(self, query, key, table, scaling, part: slice = slice(None)):
        """Masked band scores of the blocks in `part`, `[.., blocks, B, 2K-1]` (key term included, scaled)."""
        query_blocks = self.blocks(query, part)
        window_scores = torch.matmul(query_blocks, self.windows(key, part).transpose(-1, -2))
        scores = self.to_relative(window_scores) + torch.matmul(query_blocks, table[1 : 2 * self.K].T)
        return scores.mul_(scaling).masked_fill_(~self.allowed[..., part, :, :], float("-inf"))


def _key_padding(flags: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """`[batch, n]` bool -> additive `[batch, 1, 1, n]` mask for the fused kernel."""
    if flags is None:
        return None
    return torch.zeros(flags.shape, dtype=dtype, device=flags.device).masked_fill(~flags, float("-inf"))[:, None, None]


class _Tail:
    """One tail: queries `q_slice` against keys `k_slice` with a shifted causal mask, all at table row `row`.

    The left tail (`j <= i - K`, row 0) is causal between queries `K..L-1` and keys `0..L-1-K`; the
    right tail (`j >= i + K`, row 2K) is the same on flipped sequences. Inside a tail the key term
    is a per-query constant `c_i = q_i . T[row] * scale` and the value term is `T[row]`.
    """

    def __init__(self, side: str, length: int, K: int, mask: RelativeAttentionMask, dtype):
        self.side, self.length, self.K = side, length, K
        self.row = 0 if side == "left" else 2 * K
        keys = None
        if side == "left":
            if mask.key_is_valid is not None:
                keys = mask.key_is_valid[:, : length - K]
        else:
            # Right-tail keys lie after the query: visible only without a causal mask, or as source keys.
            keys = mask.key_is_source if mask.causal else None
            if mask.key_is_valid is not None:
                keys = mask.key_is_valid if keys is None else keys & mask.key_is_valid
            keys = None if keys is None else keys[:, K:].flip(-1)
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
        out, lse = _flash_forward(
            self.queries(query), self.keys(key), self.keys(value), 0.0, True, attn_mask=self.key_mask, scale=scaling
        )
        if self.row_has_keys is not None:
            lse = lse.masked_fill(~self.row_has_keys, float("-inf"))
        return out, lse

    def backward(self, grad_out, query, key, value, shifted_out, shifted_lse, scaling):
        return _flash_backward(
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


class _ThreeRegionFunction(torch.autograd.Function):
    """Exact three-region attention; backward recomputes the band and reuses the fused tail kernel."""

    @staticmethod
    def forward(ctx, query, key, value, table, mask, max_relative_position, scaling):
        K, length = max_relative_position, query.shape[-2]
        band = _Band(length, K, mask, query.device)
        tails = [_Tail("left", length, K, mask, query.dtype)]
        if not mask.causal or mask.key_is_source is not None:
            tails.append(_Tail("right", length, K, mask, query.dtype))
        keep_left = len(tails) == 2 and any(ctx.needs_input_grad[:3])  # the backward of two tails needs these

        tail_parts = []
        for tail in tails:
            out, tail_lse = tail.forward(query, key, value, scaling)
            tail_parts.append((tail, out, tail_lse.unsqueeze(-1)))  # read chunk by chunk below, never copied whole

        # The band chunk by chunk: its scores never exist for the whole sequence at once. The output
        # is laid out as [batch, L, heads, d], what the caller reshapes it to, so that costs no copy.
        output = query.new_empty(query.shape[0], length, query.shape[1], query.shape[-1]).transpose(1, 2)
        lse = query.new_empty(query.shape[:-1], dtype=torch.promote_types(query.dtype, torch.float32))
        left_mass = query.new_empty(*query.shape[:-1], 1) if keep_left else None
        left_values = torch.empty_like(query) if keep_left else None
        for part in band.chunks():
            rows = slice(part.start * band.block, min(part.stop * band.block, length))
            count = rows.stop - rows.start
            band_scores = band.scores(query, key, table, scaling, part)
            band_lse = torch.logsumexp(band_scores, -1).flatten(-2)[..., :count]
            tails_lse = [
                tail.take(tail_lse, rows.start, rows.stop, float("-inf")).squeeze(-1)
                + tail.constant(query[..., rows, :], table, scaling)
                for tail, _, tail_lse in tail_parts
            ]
            # Log-sum-exps are float32 even for bfloat16 inputs; probabilities go back to the input dtype.
            chunk_lse = torch.logsumexp(torch.stack([band_lse.to(lse.dtype), *tails_lse]), 0)
            safe_lse = torch.where(torch.isinf(chunk_lse), torch.zeros_like(chunk_lse), chunk_lse)  # masked rows -> 0
            block_lse = nn.functional.pad(safe_lse, (0, band_scores.shape[-3] * band.block - count))
            band_probs = torch.exp(band_scores - block_lse.view(*band_scores.shape[:-1], 1)).to(query.dtype)
            chunk = torch.matmul(band.to_window(band_probs), band.windows(value, part))
            chunk = band.unblock(chunk.add_(torch.matmul(band_probs, table[1 : 2 * K])))[..., :count, :]
            for (tail, out, _), tail_lse in zip(tail_parts, tails_lse):
                mass = torch.exp(tail_lse - safe_lse).unsqueeze(-1).to(query.dtype)
                out = tail.take(out, rows.start, rows.stop, 0.0)
                weighted_values = torch.where(mass > 0, mass * out, torch.zeros_like(chunk))
                chunk = chunk + weighted_values + mass * table[tail.row]
                if keep_left and tail.side == "left":
                    left_mass[..., rows, :], left_values[..., rows, :] = mass, weighted_values
            output[..., rows, :] = chunk
            lse[..., rows] = chunk_lse

        ctx.save_for_backward(query, key, value, table, output, lse, left_mass, left_values)
        ctx.band, ctx.tails, ctx.scaling = band, tails, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, table, output, lse, left_mass, left_values = ctx.saved_tensors
        band, tails, scaling = ctx.band, ctx.tails, ctx.scaling
        K = band.K
        grad_output = grad_output.contiguous()
        fully_masked = torch.isinf(lse)
        safe_lse = torch.where(fully_masked, torch.zeros_like(lse), lse)
        row_dot = (grad_output * output).sum(-1)  # D_i = dO_i . O_i

        # Band: recompute the probabilities, then the usual attention backward in the relative layout.
        band_scores = band.scores(query, key, table, scaling)
        band_probs = torch.exp(band_scores - band.blocks(safe_lse.unsqueeze(-1))).to(query.dtype)
        grad_blocks = band.blocks(grad_output)
        grad_probs = band.to_relative(torch.matmul(grad_blocks, band.windows(value).transpose(-1, -2)))
        grad_probs = grad_probs + torch.matmul(grad_blocks, table[1 : 2 * K].T)  # dO_i . T[p]
        grad_scores = band_probs * (grad_probs - band.blocks(row_dot.unsqueeze(-1)))  # dL/ds, before the scale
        grad_scores_window = band.to_window(grad_scores)
        grad_query = scaling * band.unblock(
            torch.matmul(grad_scores_window, band.windows(key)) + torch.matmul(grad_scores, table[1 : 2 * K])
        )
        grad_key = scaling * band.fold(torch.matmul(grad_scores_window.transpose(-1, -2), band.blocks(query)))
        grad_value = band.fold(torch.matmul(band.to_window(band_probs).transpose(-1, -2), grad_blocks))

        # Tails: the stock fused backward with out' = O - T[row] and lse' = LSE - c is exact
        # (it reads `out` only through rowsum(dO * out)); its gradients already include the scale.
        for tail in tails:
            constant = tail.constant(query, table, scaling)
            shifted_lse = torch.where(fully_masked, torch.full_like(lse, float("inf")), lse - constant)
            dq, dk, dv = tail.backward(grad_output, query, key, value, output - table[tail.row], shifted_lse, scaling)
            grad_query = grad_query + tail.take(dq, 0, tail.length, 0.0)
            grad_key = grad_key + tail.place_keys(dk)
            grad_value = grad_value + tail.place_keys(dv)

        # The per-row constants c = scale * q . T[row] also depend on q. Score gradients of a row sum
        # to zero, so with one tail its sum is minus the band's; with two, the left one comes from its
        # saved mass and weighted values, and the right one from the zero sum.
        band_sum = band.unblock(grad_scores.sum(-1, keepdim=True))
        if len(tails) == 1:
            grad_query = grad_query - scaling * band_sum * table[0]
        else:
            left_sum = (grad_output * left_values).sum(-1, keepdim=True) + left_mass * (
                torch.matmul(grad_output, table[:1].T) - row_dot.unsqueeze(-1)
            )
            grad_query = grad_query + scaling * (left_sum * table[0] - (band_sum + left_sum) * table[2 * K])
        return grad_query, grad_key, grad_value, None, None, None, None


def three_region_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: RelativeAttentionMask | None,
    scaling: float,
    dropout: float = 0.0,
    relative_table: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Exact NEZHA attention in linear memory (`attn_implementation="nezha_three_regions"`, the default).

    Uses three regions (a band computed in blocks, two tails computed by PyTorch's fused attention
    kernel) for inputs of `THREE_REGIONS_MIN_LENGTH` tokens or more, forward and backward. It falls
    back to `gather_relative_attention`, which gives the same result, where three regions do not
    apply or are not faster: short inputs, decoding with a cache (one query against the cache is
    already `O(L)`), attention dropout in training (the fused path cannot apply dropout exactly, so
    training with `attention_probs_dropout_prob > 0` runs the gather path), devices without the fused
    CPU kernel. Never returns attention probabilities (`output_attentions=True` selects eager).

    A row whose keys are all masked (a fully padded sequence) gets a zero output, with no NaN.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    query_length, key_length = query.shape[-2], key.shape[-2]
    if (
        not FUSED_KERNEL_AVAILABLE
        or query.device.type != "cpu"
        or query_length < THREE_REGIONS_MIN_LENGTH
        or query_length != key_length
        or mask.query_offset != 0
        or (dropout > 0.0 and module.training)
        or query_length <= module.max_relative_position
    ):
        output, _ = gather_relative_attention(
            module, query, key, value, attention_mask, scaling, dropout, relative_table=relative_table
        )
        return output, None
    table = _relative_table(relative_table, query.dtype)
    output = _ThreeRegionFunction.apply(query, key, value, table, mask, module.max_relative_position, scaling)
    return output.transpose(1, 2).contiguous(), None
