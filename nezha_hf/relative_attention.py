"""NEZHA's relative-position attention: the relative-position maths lives here and in its compiled twin.

For a head of size `d`, query position `i`, key position `j` and `K = max_relative_position`:

    r(i, j) = clip(j - i, -K, K) + K                       # a row of the table, 0 .. 2K
    s_ij    = (q_i . k_j + q_i . T[r(i, j)]) * scale + mask_ij
    out_i   = sum_j softmax_j(s_ij) (v_j + T[r(i, j)])

`T` is a fixed `(2K + 1) x d` sinusoid table shared by every head and layer. Three exact
implementations are provided, all with the transformers attention-function signature
`fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs) -> (out, probs)`:

- `gather_relative_attention`: builds the `L x L` scores, adds the key term by gathering
  `q @ T^T` (DeBERTa's c2p trick), and sums probabilities into the `2K + 1` buckets for the value
  term. Nothing of size `L x L x d`. The only path that returns attention probabilities and
  applies attention dropout. Fastest for short inputs.
- `three_region_attention`: linear memory. Each query row splits into a band `|j - i| < K` and
  two tails (`j <= i - K`, `j >= i + K`). In a tail every key has the same relative vector, so it
  is a plain (shifted causal) attention; in the band the sinusoid table is rotary, so the relative
  terms become extra head dimensions and the band is a plain attention over sliding key windows.
  All three are calls of PyTorch's fused kernel, which also returns the row log-sum-exp used to
  merge them; the backward reuses the kernel's backward for all three.
- `fused_relative_attention`: the same maths as one compiled CPU kernel (`csrc/relative_attention.cpp`,
  built on first use): a flash-attention loop that adds the key term from `q @ T^T` and sums
  probabilities into the `2K + 1` buckets as it goes. Linear memory, about BERT-SDPA's speed;
  the default, falling back to `three_region_attention` where it does not run.

The mask is described by `RelativeAttentionMask` (key padding, causal or UniLM prefix) rather
than a dense `L x L` tensor, so the fast path never materialises one.
"""

import hashlib
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)

# Without the compiled kernel, up to 512 tokens the gather formulation is faster on CPU (512 tokens: gather
# 1.14x BERT, three regions 1.37x; `git show 8f60818:benchmarks/results/attention-all-lengths.md`).
THREE_REGIONS_MIN_LENGTH = 513
# Queries per block of the band; each block sees a window of keys a whole number of blocks wide.
BAND_BLOCK_SIZE = 64
# Blocks of the band computed at once: bounds the memory of its buffers, whatever the length.
BAND_BLOCKS_PER_CHUNK = 32

_flash_forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
FUSED_KERNEL_AVAILABLE = _flash_forward is not None and _flash_backward is not None
if not FUSED_KERNEL_AVAILABLE:
    logger.info("PyTorch has no fused CPU attention kernel returning log-sum-exp: NEZHA uses the gather path.")


def _sinusoid_frequencies(head_size: int) -> torch.Tensor:
    """The table's angular frequencies `w_m = 10000^(-2m / head_size)`, in float32 as transformers 4.x computed them."""
    return torch.exp(torch.arange(0, head_size, 2).float() * (-math.log(10000.0) / head_size))


def sinusoid_relative_table(max_relative_position: int, head_size: int) -> torch.Tensor:
    """The fixed `(2K + 1) x head_size` table `T`, computed exactly as transformers 4.x did (float32).

    Row `p` encodes the shifted index `p = clip(j - i) + K`, not the signed distance.
    """
    num_rows = 2 * max_relative_position + 1
    position = torch.arange(num_rows, dtype=torch.int64).float().unsqueeze(1)
    div_term = _sinusoid_frequencies(head_size)
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
    _regions: dict = field(default_factory=dict, repr=False, compare=False)

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


def _reflect(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None):
    """Map each pair `(x0, x1)` of the last dimension to `(x0 sin + x1 cos, x0 cos - x1 sin)`.

    `rotation` is `(sin, -sin, ... interleaved, cos, cos, ... interleaved)` from `_Band._query_rotation`.
    The 2 x 2 matrix is symmetric and orthogonal, so the map is its own transpose and inverse.
    """
    signed_sin, doubled_cos = rotation
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0)
    out = torch.mul(x, signed_sin, out=out)
    return out.addcmul_(swapped, doubled_cos)


class _Band:
    """The band `|j - i| < K`, computed by the fused kernel on sliding key windows.

    Inside the band the table row `p = j - i + K` is not clipped, and the sinusoid table is rotary:
    with `a_i = (K - i) w` and `E_j = (cos j w, sin j w)` per frequency pair,

        q_i . T[p]         = M(a_i) q_i . E_j            M(a) = [[sin a, cos a], [cos a, -sin a]]
        sum_j p_ij T[p]   = M(a_i) sum_j p_ij E_j

    so the band is plain attention of `[q, M q]` against keys `[k, E]` with values `[v, E]`, and the
    value term comes back through `M` (`_reflect`). Queries go in blocks of `S = BAND_BLOCK_SIZE`;
    block `n` sees the window of `W = (2 * reach + 1) * S` keys starting at `(n - reach) * S`, masked
    to the band. The angles are computed in float64, so `T[p]` here is the exact sinusoid; the float32
    table differs from it by at most about 4e-6 per entry for `K = 64`.

    Blocks of every sequence in the batch are laid end to end with `2 * reach` empty blocks between
    sequences, so all windows are one overlapping view of one buffer (no copies) and one kernel call
    serves the whole batch; the windows that straddle two sequences are fully masked.
    """

    def __init__(self, length: int, max_relative_position: int, mask: RelativeAttentionMask, head_size: int, device):
        K = max_relative_position
        self.length, self.K, self.mask = length, K, mask
        self.block = min(BAND_BLOCK_SIZE, length)
        self.reach = -(-(K - 1) // self.block)  # blocks on each side that hold band keys
        self.window = (2 * self.reach + 1) * self.block
        self.num_blocks = -(-length // self.block)
        self.frequency = _sinusoid_frequencies(head_size).double().to(device)
        self._plans = {}  # per chunk, batch size and dtype: shared by every layer and by the backward

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
        S, mask = self.block, self.mask
        query = (torch.arange(part.start, part.stop, device=device)[:, None] * S + torch.arange(S, device=device))[..., None]
        key = query - query % S - self.reach * S + torch.arange(self.window, device=device)
        inside = (key >= 0) & (key < self.length) & (query < self.length)
        allowed = inside & ((key - query).abs() < self.K)
        key_flag = lambda flags: flags[:, key.clamp(0, self.length - 1)]  # noqa: E731  [batch] + key.shape
        if mask.causal:
            visible = key <= query
            allowed = allowed & (visible if mask.key_is_source is None else visible | key_flag(mask.key_is_source))
        if mask.key_is_valid is not None:
            allowed = allowed & key_flag(mask.key_is_valid)
        return allowed if allowed.dim() == 4 else allowed[None]

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

    def _angles(self, positions: torch.Tensor):
        angles = positions.double()[:, None] * self.frequency  # [rows, d/2]
        return angles.sin()[:, None], angles.cos()[:, None]  # broadcast over heads

    def _query_rotation(self, rows: slice, dtype):
        """`_reflect`'s rotation for `a_i = (K - i) w` at the query rows, each `[rows, 1, d]`."""
        sin, cos = self._angles(self.K - torch.arange(rows.start, rows.stop, device=self.frequency.device))
        signed_sin = torch.stack((sin, -sin), -1).flatten(-2)
        return signed_sin.to(dtype), cos.repeat_interleave(2, -1).to(dtype)

    def _queries(self, x, plan: dict, rotation=None):
        """Query side `[x, M x]` (`[x, 0]` without `rotation`) of the chunk's blocks, as `[N, H, S, 2d]`."""
        rows = plan["rows"]
        extra = None if rotation is None else lambda rows_x, target: _reflect(rows_x, rotation, out=target)
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
        """Masks and rotations of the chunk `part` (computed once, then reused by every layer)."""
        key = (part.start, batch, dtype)
        if key not in self._plans:
            rows, first_key = self.rows(part), (part.start - self.reach) * self.block
            keys = slice(max(first_key, 0), min((part.stop + self.reach) * self.block, self.length))
            per_sequence = len(part) + 2 * self.reach  # blocks per sequence in the end-to-end buffer (P)
            windows = batch * per_sequence - 2 * self.reach  # N
            allowed = self._allowed(part, self.frequency.device)
            sin, cos = self._angles(torch.arange(keys.start, keys.stop, device=self.frequency.device))
            self._plans[key] = dict(
                batch=batch,
                per_sequence=per_sequence,
                windows=windows,
                rows=rows,
                count=rows.stop - rows.start,
                first_key=first_key,
                keys=keys,  # key positions the windows cover
                mask=self._mask(allowed, batch, per_sequence, windows, dtype),
                has_keys=allowed.any(-1).flatten(1)[:, None, : rows.stop - rows.start],
                rotation=self._query_rotation(rows, dtype),
                key_rotary=torch.stack((cos, sin), -1).flatten(-2).to(dtype),
            )
        return self._plans[key]

    def forward(self, query, key, value, scaling, part: range):
        """Band output (value term included) and log-sum-exp of the query rows of `part`.

        Returns `([B, H, rows, d], [B, H, rows])`; rows with no band key get lse `-inf`.
        """
        plan, size = self._plan(part, query.shape[0], query.dtype), query.shape[-1]
        out, lse = _flash_forward(
            self._queries(query, plan, plan["rotation"]),
            self._keys(key, plan),
            self._keys(value, plan),
            0.0,
            False,
            attn_mask=plan["mask"],
            scale=scaling,
        )
        out = self._unblock(out, plan)
        out = _reflect(out[..., size:], [r.transpose(0, 1) for r in plan["rotation"]]).add_(out[..., :size])
        lse = self._unblock(lse.unsqueeze(-1), plan).squeeze(-1)
        return out, lse.masked_fill(~plan["has_keys"], float("-inf"))

    def backward(self, grad_output, query, key, value, output, lse, scaling, part: range):
        """Band gradients for the query rows of `part`, given the whole rows' output and log-sum-exp.

        `lse` is the full row log-sum-exp (`+inf` on rows with no visible key). Returns
        `(dq [B, H, rows, d], dk, dv [B, H, keys, d], keys)` where `keys` are the key positions covered.
        """
        plan, size = self._plan(part, query.shape[0], query.dtype), query.shape[-1]
        # The kernel uses `out` only through rowsum(dO' * out'); with out' = [O, 0] that is dO . O.
        grad_query, grad_key, grad_value = _flash_backward(
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
        grad_query = _reflect(grad_query[..., size:], rotation).add_(grad_query[..., :size])
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
    """Exact three-region attention: the band and both tails are fused-kernel calls, merged by log-sum-exp.

    Backward reuses the fused kernel's backward for all three, with the whole row's log-sum-exp.
    """

    @staticmethod
    def forward(ctx, query, key, value, table, mask, max_relative_position, scaling):
        K, length = max_relative_position, query.shape[-2]
        regions_key = (length, K, query.shape[-1], query.dtype, str(query.device))
        if regions_key not in mask._regions:  # built once per model call: their masks serve every layer
            tails = [_Tail("left", length, K, mask, query.dtype)]
            if not mask.causal or mask.key_is_source is not None:
                tails.append(_Tail("right", length, K, mask, query.dtype))
            mask._regions[regions_key] = (_Band(length, K, mask, query.shape[-1], query.device), tails)
        band, tails = mask._regions[regions_key]
        keep = any(ctx.needs_input_grad[:3])  # the tail constants' gradients need each tail's share

        tail_parts = [(tail, *tail.forward(query, key, value, scaling)) for tail in tails]
        # The output is laid out as [batch, L, heads, d], what the caller reshapes it to, so that costs no copy.
        output = query.new_empty(query.shape[0], length, query.shape[1], query.shape[-1]).transpose(1, 2)
        lse = query.new_empty(query.shape[:-1], dtype=torch.promote_types(query.dtype, torch.float32))
        tail_shares = [(query.new_empty(*query.shape[:-1], 1), torch.empty_like(query)) for _ in tails] if keep else []
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
                if keep:
                    tail_shares[index][0][..., rows, :], tail_shares[index][1][..., rows, :] = mass, share
            output[..., rows, :] = chunk
            lse[..., rows] = row_lse

        ctx.save_for_backward(query, key, value, table, output, lse, *[t for pair in tail_shares for t in pair])
        ctx.band, ctx.tails, ctx.scaling = band, tails, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, table, output, lse, *shares = ctx.saved_tensors
        band, tails, scaling = ctx.band, ctx.tails, ctx.scaling
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
        return grad_query, grad_key, grad_value, None, None, None, None


def _whole_sequence_on_cpu(module, query, key, mask: RelativeAttentionMask, dropout: float) -> bool:
    """What both linear-memory paths need: CPU tensors, every query against every key (no KV cache),
    and no attention dropout in training (they cannot apply it exactly)."""
    return (
        query.device.type == "cpu"
        and query.shape[-2] == key.shape[-2]
        and mask.query_offset == 0
        and not (dropout > 0.0 and module.training)
    )


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
    """Exact NEZHA attention in linear memory from PyTorch ops (`attn_implementation="nezha_three_regions"`).

    Also what the default, `fused_relative_attention`, runs where its compiled kernel does not.

    Uses three regions (the band and two tails, each a call of PyTorch's fused attention kernel,
    see `_Band` and `_Tail`) for inputs of `THREE_REGIONS_MIN_LENGTH` tokens or more, forward and backward. It falls
    back to `gather_relative_attention`, which gives the same result, where three regions do not
    apply or are not faster: short inputs, decoding with a cache (one query against the cache is
    already `O(L)`), attention dropout in training (the fused path cannot apply dropout exactly, so
    training with `attention_probs_dropout_prob > 0` runs the gather path), devices without the fused
    CPU kernel. Never returns attention probabilities (`output_attentions=True` selects eager).

    A row whose keys are all masked (a fully padded sequence) gets a zero output, with no NaN. In the
    band the table rows are computed from the exact sinusoid (float64 angles), which differs from the
    float32 table the gather path uses by at most about 4e-6 per entry for `K = 64`.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    query_length = query.shape[-2]
    if (
        not FUSED_KERNEL_AVAILABLE
        or not _whole_sequence_on_cpu(module, query, key, mask, dropout)
        or query_length < THREE_REGIONS_MIN_LENGTH
        or query_length <= module.max_relative_position
    ):
        output, _ = gather_relative_attention(
            module, query, key, value, attention_mask, scaling, dropout, relative_table=relative_table
        )
        return output, None
    table = _relative_table(relative_table, query.dtype)
    output = _ThreeRegionFunction.apply(query, key, value, table, mask, module.max_relative_position, scaling)
    return output.transpose(1, 2).contiguous(), None


# ----------------------------------------------------------------------------------------------
# The compiled kernel: the whole relative attention in one flash-style pass (csrc/relative_attention.cpp).
# ----------------------------------------------------------------------------------------------

_KERNEL_SOURCE = Path(__file__).with_name("csrc") / "relative_attention.cpp"
# Query rows and keys per block of the kernel; 0 lets it choose (as PyTorch's flash kernel does).
KERNEL_BLOCK_SIZES = (0, 0)
_compiled_kernel = {}  # "module": the loaded extension or None once a build was tried


def compiled_kernel():
    """The compiled NEZHA attention kernel, built on first use (about 40 s, then cached); None if unavailable.

    It is built with PyTorch's `torch.utils.cpp_extension.load` (needs a C++ compiler and `ninja`)
    into `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), for the CPU it runs on. It is
    not used, and the pure PyTorch paths run instead, when the environment variable
    `NEZHA_HF_KERNEL=0` is set, the source file is absent (remote-code checkpoints copy only the
    Python files) or the build fails (logged once). A model that selects `"nezha_fused"` (the
    default) calls this when it is created, so the build happens then, not in the first forward pass.
    """
    if "module" not in _compiled_kernel:
        _compiled_kernel["module"] = None
        if os.environ.get("NEZHA_HF_KERNEL", "1") == "0" or not _KERNEL_SOURCE.is_file():
            return None
        from torch.utils.cpp_extension import load

        # -march=native: the build is for this CPU, so the name says which CPU and which source.
        digest = hashlib.sha1(_KERNEL_SOURCE.read_bytes() + platform.processor().encode() + torch.__version__.encode())
        try:
            logger.info("Loading NEZHA's attention kernel (building it takes about a minute the first time).")
            _compiled_kernel["module"] = load(
                name=f"nezha_hf_relative_attention_{digest.hexdigest()[:12]}",
                sources=[str(_KERNEL_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
        except Exception as error:  # no compiler, no ninja, no BLAS symbol: the PyTorch paths still work
            logger.warning(f"NEZHA's attention kernel is unavailable ({type(error).__name__}: {error}); using PyTorch ops.")
    return _compiled_kernel["module"]


def _kernel_mask(mask: RelativeAttentionMask) -> tuple:
    """The kernel's trailing arguments: causal, key padding flags, source flags, block sizes."""
    return mask.causal, mask.key_is_valid, mask.key_is_source if mask.causal else None, *KERNEL_BLOCK_SIZES


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _KernelFunction(torch.autograd.Function):
    """Exact NEZHA attention by the compiled kernel, forward and backward (float32 on CPU)."""

    @staticmethod
    def forward(ctx, query, key, value, table, mask, max_relative_position, scaling):
        query, key, value = (_last_dim_contiguous(x) for x in (query, key, value))
        output, lse = compiled_kernel().forward(
            query, key, value, table, max_relative_position, scaling, *_kernel_mask(mask)
        )
        output = output.transpose(1, 2)  # [batch, heads, L, d] view of [batch, L, heads, d]
        ctx.save_for_backward(query, key, value, table, output, lse)
        ctx.mask, ctx.max_relative_position, ctx.scaling = mask, max_relative_position, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, table, output, lse = ctx.saved_tensors
        grads = compiled_kernel().backward(
            _last_dim_contiguous(grad_output), query, key, value, output, lse, table,
            ctx.max_relative_position, ctx.scaling, *_kernel_mask(ctx.mask),
        )
        return (*(grad.transpose(1, 2) for grad in grads), None, None, None, None)


def fused_relative_attention(
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
    """Exact NEZHA attention by one compiled kernel (`attn_implementation="nezha_fused"`, the default).

    The kernel computes the relative key and value terms inside a flash-attention loop (query
    blocks against key blocks, online softmax), so memory is linear in the length and no
    `L x L` tensor exists; forward and backward are exact, with any padding, causal or UniLM
    prefix mask, and it uses the same float32 table as the gather path. It runs for float32 inputs
    on CPU without a KV cache and without attention dropout in training; everything else (other
    dtypes, cached decoding, dropout, a machine where the kernel cannot be built, see
    `compiled_kernel`) goes to `three_region_attention`, which gives the same result.
    """
    mask = attention_mask if attention_mask is not None else RelativeAttentionMask()
    if (
        query.dtype != torch.float32
        or not _whole_sequence_on_cpu(module, query, key, mask, dropout)
        or compiled_kernel() is None
    ):
        return three_region_attention(
            module, query, key, value, attention_mask, scaling, dropout, relative_table=relative_table
        )
    table = _relative_table(relative_table, query.dtype)
    output = _KernelFunction.apply(query, key, value, table, mask, module.max_relative_position, scaling)
    return output.transpose(1, 2), None
