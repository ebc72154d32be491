"""NEZHA attention as Triton kernels: FlashAttention-2 tile by tile, the relative terms only where they differ.

For query position `i`, key position `j` and `r = clip(j - i, -K, K) + K`, a score adds the key term `q_i . T[r]`
and a probability adds `p_ij T[r]` to the output. A (query block, key block) tile falls in one of three classes:

- **left tail** (every pair `j - i <= -K`) and **right tail** (every pair `j - i >= K`): every pair of the tile uses
  one table row, `T[0]` or `T[2K]`. Such a tile is a plain FlashAttention-2 tile: the key term is a per-row constant
  (`q_i . T[0]` or `q_i . T[2K]`, made once per query block) added to `q k^T`, and the value term is a row sum of the
  probabilities, a mass rescaled with the online softmax like its normaliser and multiplied by the row at the end.
- **band** (the rest: about `(BLOCK_M + 2K) / BLOCK_N + 1` key blocks per query block): the pairs of a tile use the
  table rows of a window of `BLOCK_M + BLOCK_N - 1` consecutive distances (one per diagonal of the tile), clipped to
  `[0, 2K]`, taken in parts of `BLOCK_N` rows. For each part the kernel multiplies `q` by it on chip (`[BLOCK_M,
  BLOCK_N]`, a product like `q k^T`) and gathers each pair's entry along its diagonal (`tl.gather`); the value term
  goes the other way: the probabilities are gathered into place by diagonal and multiplied by the part. With two or
  three parts, a band tile costs about three to four tail tiles; nothing per (query, table row) leaves the chip.
  With NEZHA's own table (the exact sinusoid, `T[p] = (sin p w, cos p w)` per frequency pair; checked once per table
  by `triton_attention`), bfloat16 and float16 forwards take the band without gathers (`ROTATE`): `T[t - s]` is
  `E[t]` turned by the angle `s w`, so with `s = i - m0` and `t = j - offset - m0 + K` a pair's key term is
  `q~_i . E[t_j]`, `q~` the block's queries turned once, pairwise, by `s w`, and the value term is `sum_j p_ij
  E[t_j]` turned back once after the band: one more product each way per tile, clipped pairs (`|j - i| >= K`) taking
  the tails' rows (`_rotated_band`; three_regions.py uses the same identity on the CPU). `K` is a compile-time
  constant: where `2K >= BLOCK_N`, a row's distances in a tile span at most `2K`, so its clipped pairs lie on one
  side, told by one compare per pair against a threshold per row (`_clip_masks`; the forward's and `dQ`'s tiles),
  computed again after the products rather than kept (ptxas would pack the predicates into registers).

The key loop of a query block runs over the left tail tiles, the band tiles and the right tail tiles in three loops
(FlashAttention-2's stages, a constexpr class each), from the first key block any query of the block sees to the
last: padding before the first valid key and after the last one, and under a causal mask the keys after the block's
last query (unless they are UniLM source keys), are skipped by whole blocks (`KeyBounds`). A tail's key term, the same
for a whole row, is folded into the row's running maximum, and only the block that may end past the last key is
masked, so that a tail tile is a plain FlashAttention-2 tile (`make gpu-gates` compares their instructions). The
backward is FlashAttention-2's: a kernel of row statistics (the log-sum-exp and `D_i = dO_i . O_i` per tile class, a
tail's terms folded in), one kernel per key block for `dK`, `dV` computing `S^T = K Q^T` (its query loop runs over
left tail, band and right tail tiles) and one per query block for `dQ`, both recomputing the probabilities. A
decoding step (a block of at most 16 queries) splits its keys over several programs per head (FlashDecoding): each
writes its partial maximum, sum and output, and `nezha_merge_kernel` merges them by their log-sum-exps.

Dropout (FlashAttention-2's rule: Philox4x32 with 7 rounds, 8-bit draws, 16 per call): query `i` and key `j` of head
`h` (`batch x heads` flattened) are dropped when their byte is below `threshold = round(256 p)` (the rate runs as
`threshold / 256`; kept pairs are scaled by `256 / (256 - threshold)`, once per output sum). Their byte is byte
`2 (k mod 2) + e` of output `2 (i div 8 mod 2) + k div 2` of Philox4x32-7, keyed by the 64-bit seed, on the 32-bit
counter words `(8 (i div 16) + i mod 8, 4 (j div 32) + (j mod 8) div 2, h, 0)`, where `k = (j div 8) mod 4` and
`e = j mod 2`: one call serves the 16 pairs of queries `i, i + 8` and keys `32a + 2c + {0, 1, 8, 9, 16, 17, 24, 25}`,
which are the pairs one thread holds of a Hopper product's tile (wgmma's accumulator layout), so that the forward
and `dQ` draw without exchanging numbers between threads (`dK`, `dV`, whose products are transposed, exchange them
through shared memory). Each counter word stays below 2^32 for any call of fewer than 2^31 queries, keys and heads,
so masks never repeat within a call. The backward kernels draw the same numbers, so no mask is stored.

Every product accumulates in float32. float32 inputs multiply in IEEE float32 (`input_precision="ieee"`, never TF32)
everywhere, the table's too, whatever `torch.backends.cuda.matmul.allow_tf32` says; bfloat16 and float16 inputs
multiply in their type (probabilities and the table rounded to it), tail key terms and masses in float32 (dQ's tail
masses sum `dS` rounded to the type, by a product, as its product with the keys takes it: `_add_row_sums`).

Imported only where Triton is installed and a kernel can run (`triton_attention.py` checks).
"""

import functools

try:
    import triton
    import triton.language as tl
except ImportError as error:  # transformers' remote-code check skips imports inside `try`: Triton stays optional
    raise ImportError("nezha_hf's Triton kernels need Triton: pip install triton") from error


# Triton 3.9's interpreter multiplies bfloat16 `tl.dot` operands as their raw 16-bit integers (it keeps bfloat16 as
# uint16 for numpy), so under TRITON_INTERPRET=1 the kernels widen them to float32 first: exact (every bfloat16 is a
# float32), and the float32 sums are what the GPU's bfloat16 products accumulate into.
INTERPRETING = triton.knobs.runtime.interpret  # what Triton decided when it was imported (TRITON_INTERPRET)

# The classes of a tile (the module docstring), as the loops' constexpr switch.
LEFT, BAND, RIGHT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
LN2 = tl.constexpr(0.6931471805599453)  # scores are kept in base 2 (`exp2`), FlashAttention-2's way
LOG2E = tl.constexpr(1.4426950408889634)
PHILOX_ROUNDS = tl.constexpr(7)  # dropout's Philox4x32 rounds: FlashAttention-2's (Random123's default is 10)

DECODING_BLOCK_M = 16  # the query block of a decoding step (the smallest `tl.dot` takes)
DROPOUT_QUERIES, DROPOUT_KEYS = 16, 32  # a dropout call's blocks are whole multiples of these (`_kept`'s Philox calls)
STATISTICS_BLOCK_M = 16 if INTERPRETING else 64  # the query block of `nezha_row_statistics_kernel`
MASS_COLUMNS = tl.constexpr(16)  # the columns of dQ's tail masses (`_add_row_sums`): the narrowest product


def _config(block_m: int, block_n: int, stages: int = 1, warps: int = 4) -> "triton.Config":
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_stages=stages, num_warps=warps)


# FlashAttention-2's Triton sets, and the decoding step's block of 16 queries. No block of 64 rows (the products' rows:
# queries in the forward and `dQ`, keys in `dK`, `dV`) runs on 8 warps: a Hopper wgmma gives each warp group of 4 warps
# 64 rows, so the second group would compute the same products again (Triton's tutorial filters such sets out;
# `make gpu-gates` checks). The forward runs 64-row blocks on 4 warps, two blocks per multiprocessor: a 128-row block
# on 8 warps runs one (255 registers), or two held to 128 registers a thread, at which its band loop spills (`make
# gpu-gates`: no spill in any loop). The backward's 64 x 64 block on 4 warps spills its dropout draws, so dropout's
# backward goes without it (`BACKWARD_PRUNING`).
# float32, whose IEEE products run on the CUDA cores, has smaller blocks of its own. Under the interpreter one small
# block, so that tests cross block edges.
if INTERPRETING:
    FORWARD_CONFIGS = KEY_VALUE_GRAD_CONFIGS = QUERY_GRAD_CONFIGS = [_config(16, 32)]  # dropout's draws: 32 keys
    FLOAT32_CONFIGS = []
    SPILLING_UNDER_DROPOUT = []
else:
    FLOAT32_CONFIGS = [_config(16, 32, 2, 4), _config(32, 32, 2, 8), _config(32, 16, 2, 4)]
    FORWARD_CONFIGS = [
        _config(64, 64, 3, 4),
        *(_config(DECODING_BLOCK_M, block_n, 2, 4) for block_n in (64, 128)),
        *FLOAT32_CONFIGS[:2],
    ]
    SPILLING_UNDER_DROPOUT = [_config(64, 64, 2, 4)]
    KEY_VALUE_GRAD_CONFIGS = [_config(64, 128, 2, 8), _config(32, 128, 2, 8), _config(64, 64, 2, 4),
                              *FLOAT32_CONFIGS[:2]]
    QUERY_GRAD_CONFIGS = [_config(64, 64, 2, 4), _config(128, 32, 2, 8), _config(128, 64, 2, 8),
                          FLOAT32_CONFIGS[0], FLOAT32_CONFIGS[2]]

# A band by rotation reads the sinusoid's rows `0 .. 2K + ROTATION_ROWS - 1`: the forward's turns its block's queries
# by `i - m0` (`_rotated_band`), the backward's are turned once, by `i mod ROTATION_ROWS`, a multiple of every block
# (`nezha_row_statistics_kernel`). Under the interpreter twice its block, so that the tests cross that reference.
ROTATION_ROWS = 2 * 16 if INTERPRETING else max(config.kwargs["BLOCK_M"] for config in FORWARD_CONFIGS
                                                  + KEY_VALUE_GRAD_CONFIGS + QUERY_GRAD_CONFIGS)
ROTATION = tl.constexpr(ROTATION_ROWS)

# A split of a decoding step's keys is a whole number of this many keys, so that every tuned key block divides it.
SPLIT_GRANULE = max(config.kwargs["BLOCK_N"] for config in FORWARD_CONFIGS)


def length_class(length: int) -> int:
    """What the tuning is keyed on instead of a length: its power of two (at least 16), so that a decoding loop,
    whose key length grows by one per step, tunes once per doubling rather than at every step."""
    return max(16, 1 << (max(length, 1) - 1).bit_length())


def _configs_for(configs, named_args, spilling_under_dropout=(), **kwargs):
    """The blocks a call is tuned over: float32's own (`FLOAT32_CONFIGS`) or the others; none of more queries than
    the call's length class has; a decoding step (fewer queries than the larger blocks) gets the blocks of 16, longer
    calls only the larger blocks. Under dropout, whole multiples of its draws, and none that spills them
    (`spilling_under_dropout`), unless that leaves none (blocks pinned by hand)."""
    named = {**named_args, **kwargs}  # the launches name their arguments
    own = [config for config in configs if (config in FLOAT32_CONFIGS) == bool(named["IEEE"])] or configs
    if named["DROPOUT"]:
        own = [config for config in own if config not in spilling_under_dropout
               and config.kwargs["BLOCK_M"] % DROPOUT_QUERIES == 0
               and config.kwargs["BLOCK_N"] % DROPOUT_KEYS == 0] or own
    fitting = [config for config in own if config.kwargs["BLOCK_M"] <= named["LQ_CLASS"]]
    wide = [config for config in fitting if config.kwargs["BLOCK_M"] > DECODING_BLOCK_M]
    return wide or fitting or own[:1]


TUNING_KEY = ["LQ_CLASS", "LK_CLASS", "K", "BLOCK_D", "HAS_VALID", "CAUSAL", "HAS_SOURCE", "DROPOUT"]
PRUNING = {"early_config_prune": _configs_for}
BACKWARD_PRUNING = {"early_config_prune": functools.partial(_configs_for,
                                                           spilling_under_dropout=SPILLING_UNDER_DROPOUT)}
# Values that change from call to call are not specialised on: those of a decoding step (no recompilation per step),
# and dropout's seed, whose type is fixed too (`seed: tl.int64`): a seed that is a multiple of 16, or 1, or below
# 2^31 would each compile kernels of their own in the middle of training.
CALL_VALUES = ["Lk", "offset", "seed"]


# --- tiles -------------------------------------------------------------------------------------------------------


@triton.jit
def _columns(offs_d, D: tl.constexpr):
    """Which of a block's columns `offs_d` hold the head's `D`: a constant when `D` fills the block (a power of two
    of at least 16), so that no mask is left on the head size."""
    if D == offs_d.shape[0]:
        return tl.full(offs_d.shape, 1, tl.int1)
    return offs_d < D


@triton.jit
def _rows(base, offs, offs_d, stride_row, stride_d, rows, D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows `offs` of a `[rows, D]` matrix at `base` with the given strides, zeros outside it (rows past `rows`
    masked only where `MASK_ROWS`: a block that may end past the last row)."""
    pointers = base + offs[:, None] * stride_row + offs_d[None, :] * stride_d
    if MASK_ROWS:
        return tl.load(pointers, mask=(offs < rows)[:, None] & _columns(offs_d, D)[None, :], other=0.0)
    return tl.load(pointers, mask=_columns(offs_d, D)[None, :], other=0.0)


@triton.jit
def _whole_rows(base, first, offs_d, stride_row, stride_d, D: tl.constexpr, BLOCK: tl.constexpr):
    """Rows `first .. first + BLOCK - 1` of a matrix at `base`, all inside it: pointers made once for the block's
    shape and moved by the scalar `first * stride_row`, so that a loop over blocks hoists them and each load's address
    is one 64-bit multiply-add, as the yardstick's (pointers of `first + i` per row take two instructions each)."""
    pointers = base + tl.arange(0, BLOCK)[:, None] * stride_row + offs_d[None, :] * stride_d
    return tl.load(pointers + first * stride_row, mask=_columns(offs_d, D)[None, :], other=0.0)


@triton.jit
def _product(a, b, WIDEN: tl.constexpr, IEEE: tl.constexpr):
    """`a @ b` accumulated in float32: float32 operands in IEEE float32, others in their type (widened to float32
    under the interpreter)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _product_into(acc, a, b, WIDEN: tl.constexpr, IEEE: tl.constexpr):
    """`acc + a @ b` as `_product`, accumulated in the product itself (no second pass over `acc`)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _table_row(Table, row, D, offs_d):
    """Row `row` of the `[2K + 1, D]` table, float32."""
    return tl.load(Table + row * D + offs_d, mask=_columns(offs_d, D), other=0.0).to(tl.float32)


@triton.jit
def _row_term(x, row):
    """`x_i . row` per row of `x` in float32: a tail tile's key term (`x = q`) or its output gradient's (`x = dO`)."""
    return tl.sum(x.to(tl.float32) * row[None, :], 1)


@triton.jit
def _window(Table, first, K, D, offs_d, BLOCK_N: tl.constexpr):
    """The table rows `clip(first + w, 0, 2K)` for `w < BLOCK_N`: one part of a band tile's window (`_diagonals`)."""
    rows = tl.minimum(tl.maximum(first + tl.arange(0, BLOCK_N), 0), 2 * K)
    return tl.load(Table + rows[:, None] * D + offs_d[None, :], mask=_columns(offs_d, D)[None, :], other=0.0)


@triton.jit
def _diagonals(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The window position of each pair `(m, n)` of a tile, `n - m + BLOCK_M - 1`: pairs on one diagonal share a
    distance, hence a table row. The `BLOCK_M + BLOCK_N - 1` positions are taken in parts of `BLOCK_N` (their
    number: `_PARTS`); the window's first row is that of the tile's last query and first key."""
    return tl.arange(0, BLOCK_N)[None, :] - tl.arange(0, BLOCK_M)[:, None] + (BLOCK_M - 1)


@triton.jit
def _by_pair(x, Table, first, K, D, offs_d, WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """`x_m . T[r(m, n)]` for each pair `(m, n)` of a band tile: `x` times each part of the window on chip (a product
    like `q k^T`), each pair's entry gathered along its diagonal (each gather `[BLOCK_M, BLOCK_N]` from the same
    shape); a part is loaded (from cache) where it is used rather than held."""
    position = _diagonals(BLOCK_M, BLOCK_N)
    term = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for part in tl.static_range((BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1):
        window = _window(Table, first + part * BLOCK_N, K, D, offs_d, BLOCK_N)
        column = position - part * BLOCK_N
        products = _product(x, tl.trans(window), WIDEN, IEEE)
        gathered = tl.gather(products, tl.minimum(tl.maximum(column, 0), BLOCK_N - 1), 1)
        term = tl.where((column >= 0) & (column < BLOCK_N), gathered, term)
    return term


@triton.jit
def _add_times_window(acc, weights, Table, first, K, D, offs_d, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`acc + sum_n weights[m, n] T[r(m, n)]` for a band tile (`weights` in the operands' type): per part of the
    window, the weights placed by position (gathered along the diagonals, 0 where no key of the tile is) times it."""
    key = tl.arange(0, BLOCK_N)[None, :] + tl.arange(0, BLOCK_M)[:, None] - (BLOCK_M - 1)  # the key at position w
    for part in tl.static_range((BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1):
        placed = tl.gather(weights, tl.minimum(tl.maximum(key, 0), BLOCK_N - 1), 1)
        placed = tl.where((key >= 0) & (key < BLOCK_N), placed, tl.zeros_like(placed))
        acc = _product_into(acc, placed, _window(Table, first + part * BLOCK_N, K, D, offs_d, BLOCK_N), WIDEN, IEEE)
        key += BLOCK_N
    return acc


@triton.jit
def _key_block(Kh, Vh, n0, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, Lk, D: tl.constexpr,
               EDGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """`(offs_n, k, v)` of the key block at `n0` (`EDGE`: it may end past the last key)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if EDGE:
        k = _rows(Kh, offs_n, offs_d, stride_kn, stride_kd, Lk, D, True)
        v = _rows(Vh, offs_n, offs_d, stride_vn, stride_vd, Lk, D, True)
    else:
        k = _whole_rows(Kh, n0, offs_d, stride_kn, stride_kd, D, BLOCK_N)
        v = _whole_rows(Vh, n0, offs_d, stride_vn, stride_vd, D, BLOCK_N)
    return offs_n, k, v


@triton.jit
def _window_start(n0, m0, offset, K, BLOCK_M: tl.constexpr):
    """The first table row of the window of the tile at query block `m0`, key block `n0`: that of its last query and
    first key (`_diagonals`)."""
    return n0 - offset - m0 - (BLOCK_M - 1) + K


@triton.jit
def _visible(offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, KIND: tl.constexpr, HAS_VALID: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, EDGE: tl.constexpr):
    """Which pairs of a tile are seen (broadcastable to `[BLOCK_M, BLOCK_N]`): keys inside the call (checked where the
    block may end past the last key, `EDGE`), not padding, and under a causal mask at or before the query or a source
    key (the flags of the sequence at `key_row`). A left tail key precedes every query of its tile."""
    if EDGE:
        visible = (offs_n < Lk)[None, :]
    else:
        visible = tl.full(offs_n.shape, 1, tl.int1)[None, :]
    if HAS_VALID:
        visible = visible & (tl.load(KeyValid + key_row + offs_n, mask=offs_n < Lk, other=0) != 0)[None, :]
    if CAUSAL and KIND != LEFT:
        sees = offs_n[None, :] <= (offset + offs_m)[:, None]
        if HAS_SOURCE:
            sees = sees | (tl.load(KeyIsSource + key_row + offs_n, mask=offs_n < Lk, other=0) != 0)[None, :]
        visible = visible & sees
    return visible


@triton.jit
def _scores(q, k, Table, first, K, D: tl.constexpr, offs_d, offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource,
            key_row, KIND: tl.constexpr, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
            EDGE: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """A tile's scores before the scale: `q . k`, plus `q . T[r]` from a band tile's window (its first row `first`);
    -inf where not seen, masked only in a band tile and a tail's masked tile (`EDGE`: a block past the last key, or
    one that padding, a causal mask or source keys cut; `_tail_blocks`). A tail's key term is the same for a whole row:
    the callers fold it into the row's maximum or log-sum-exp, so that a tail tile costs what a plain FlashAttention-2
    tile does."""
    scores = _product(q, tl.trans(k), WIDEN, IEEE)
    if KIND == BAND:
        scores += _by_pair(q, Table, first, K, D, offs_d, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    if EDGE or KIND == BAND:
        visible = _visible(offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, KIND, HAS_VALID, CAUSAL,
                           HAS_SOURCE, EDGE)
        scores = tl.where(visible, scores, float("-inf"))
    return scores


@triton.jit
def _seen_in_band(scores, offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, HAS_VALID: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, EDGE: tl.constexpr):
    """A band tile's scores by rotation (`_rotated_band_tile`, `_rotated_query_tile`), -inf where not seen: masked per
    pair under padding or a causal mask, else only past the last key (`EDGE`: the block may end there)."""
    if HAS_VALID or CAUSAL:
        visible = _visible(offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, BAND, HAS_VALID, CAUSAL,
                           HAS_SOURCE, EDGE)
        scores = tl.where(visible, scores, float("-inf"))
    elif EDGE:  # keys past the last one: a bias per column, not a mask per pair
        scores += tl.where(offs_n < Lk, 0.0, float("-inf"))[None, :]
    return scores


@triton.jit
def _byte_pairs(word):
    """The four bytes of 32-bit words, `[..., e, k]` for byte `2k + e`."""
    return tl.join(tl.join(word & 0xFF, (word >> 8) & 0xFF), tl.join((word >> 16) & 0xFF, word >> 24))


@triton.jit
def _draw_words(seed, head, pairs, n0, BLOCK_N: tl.constexpr):
    """The four 32-bit Philox outputs of a tile's dropout calls (the module docstring's rule), `[pair, group]`: one
    call per pair of queries (`pairs`, `8u + v` for queries `16u + 8h + v`) and group of 8 keys (`4a + c` from the
    tile's first key `n0`, for keys `32a + 8k + 2c + e`), on the counter `(pair, group, head, 0)`."""
    zeros = tl.zeros([pairs.shape[0], BLOCK_N // 8], tl.int32)
    groups = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    return tl.philox(seed, zeros + pairs[:, None], zeros + groups[None, :], zeros + head, zeros, PHILOX_ROUNDS)


@triton.jit
def _kept(seed, head, offs_m, n0, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which pairs of the tile at queries `offs_m` and keys `n0 ...` dropout keeps (the module docstring's rule): one
    Philox call per pair of queries `(i, i + 8)` and 8 keys `32a + 8k + 2c + e` (`k < 4`, `e < 2`), the pairs a
    thread holds of a Hopper product's tile, so that the draws need no exchange between threads."""
    pair_of = offs_m // 16 * 8 + offs_m % 8  # query 16u + 8h + v: pair 8u + v
    pairs = tl.reshape(tl.max(tl.reshape(pair_of, [BLOCK_M // 16, 2, 8]), 1), [BLOCK_M // 2])
    r0, r1, r2, r3 = _draw_words(seed, head, pairs, n0, BLOCK_N)
    shape: tl.constexpr = [BLOCK_M // 16, 8, BLOCK_N // 32, 4]  # (u, v, a, c)
    draws = tl.join(tl.join(_byte_pairs(tl.reshape(r0, shape)), _byte_pairs(tl.reshape(r1, shape))),
                    tl.join(_byte_pairs(tl.reshape(r2, shape)), _byte_pairs(tl.reshape(r3, shape))))
    draws = tl.permute(draws, (0, 7, 1, 2, 6, 5, 3, 4))  # (u, v, a, c, e, k mod 2, k div 2, h) -> (u, h, v, a, k, e)
    return tl.reshape(draws, [BLOCK_M, BLOCK_N]).to(tl.int32) >= threshold  # output 2h + k div 2, byte 2(k mod 2) + e


@triton.jit
def _bytes_at_least(word, threshold):
    """The four bytes of 32-bit `word` against `threshold` (1 .. 255) at once, as unsigned numbers: each byte's high
    bit set where the byte is at least `threshold`, every other bit clear (four instructions for four draws). A rate
    of 1 (threshold 256) is outside, and needs no draws: the kernels scale every gradient by its `keep_scale`, 0."""
    spread = tl.cast(threshold, tl.uint32) * 0x01010101  # a tensor even where the JIT made a threshold of 1 a constant
    low = (word | 0x80808080) - (spread & 0x7F7F7F7F)  # per byte 128 + (low 7 bits - threshold's): never borrows
    # a byte's high bit against the threshold's, and where they are equal the low bits' difference's sign
    return ((word & ~spread) | (~(word ^ spread) & low)) & 0x80808080


@triton.jit
def _kept_by_keys(seed, head, m0, n0, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`tl.trans(_kept(...))` of the tile at queries `m0 ...` and keys `n0 ...`: the pairs dropout keeps as `[keys,
    queries]`, dK/dV's orientation, where a thread holds two keys of each call's eight, so that the draws must move
    between threads. Each thread draws its calls (`_kept`'s counters) and compares their 16 bytes into one word of
    bits; that word, not the draws, moves to the threads that use it (one exchange per tile, where the joins of
    `_kept` exchanged every 32-bit output), and each pair tests its bit."""
    pairs = m0 // 16 * 8 + tl.arange(0, BLOCK_M // 2)  # query 16u + 8h + v: pair 8u + v
    r0, r1, r2, r3 = _draw_words(seed, head, pairs, n0, BLOCK_N)  # key 32a + 16d + 8m + 2c + e: group 4a + c
    bits = ((_bytes_at_least(r0, threshold) >> 7) | (_bytes_at_least(r1, threshold) >> 6)
            | (_bytes_at_least(r2, threshold) >> 5) | (_bytes_at_least(r3, threshold) >> 4))  # output w, byte y: 8y + w
    # A reduction Triton does not recompute in another layout: without it, every thread that uses a call would
    # draw it again (four times the Philox calls) rather than receive its word.
    bits = tl.max(bits[:, :, None], 2)
    bits = tl.permute(tl.reshape(bits, [BLOCK_M // 16, 8, BLOCK_N // 32, 4]), (2, 3, 0, 1))  # (a, c, u, v)
    bits = tl.reshape(bits, [1, 1, 1, 1, BLOCK_N // 32, 4, BLOCK_M // 16, 8])  # (d, m, e, h, a, c, u, v)
    d = tl.arange(0, 2)[:, None, None, None, None, None, None, None]
    m = tl.arange(0, 2)[None, :, None, None, None, None, None, None]
    e = tl.arange(0, 2)[None, None, :, None, None, None, None, None]
    h = tl.arange(0, 2)[None, None, None, :, None, None, None, None]
    # a pair's bit is 8 (2m + e) + 2h + d (output 2h + k div 2, byte 2 (k mod 2) + e, for k = 2d + m); shifted by
    # its keys' e and d first (a thread holds one of each), by a constant per pair after
    bits = bits >> (8 * e + d).to(tl.uint32)
    kept = tl.permute((bits >> (16 * m + 2 * h).to(tl.uint32)) & 1, (4, 0, 1, 5, 2, 6, 3, 7))  # key, query order
    return tl.reshape(kept, [BLOCK_N, BLOCK_M]) != 0


@triton.jit
def _whole_blocks_end(lo, hi, length, BLOCK: tl.constexpr):
    """Where the blocks of `BLOCK` from `lo` to `hi` stop lying wholly inside `length` rows: a loop runs them unmasked
    up to it, and the one block from it to `hi` (if any) is the masked tile after the loop."""
    return tl.maximum(tl.minimum(hi, length // BLOCK * BLOCK), lo)


@triton.jit
def _class_bounds(lo, hi, before, after, BLOCK: tl.constexpr):
    """Blocks of `BLOCK` from `lo` to `hi` split at `(first, second, hi)`: the blocks before `first` lie wholly before
    position `before`, those from `second` wholly at or after `after`, the rest between (`hi` no less than `lo`)."""
    hi = tl.maximum(hi, lo)
    first = tl.minimum(tl.maximum(tl.maximum(before, 0) // BLOCK * BLOCK, lo), hi)
    second = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(after, 0), BLOCK) * BLOCK, first), hi)
    return first, second, hi


@triton.jit
def _keys_of_block(m0, offset, Lk, KeyBounds, b, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_SOURCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`(lo, hi)`: the keys a query block of sequence `b` covers, from the block of the first valid key to the last
    key any of its queries sees (the last valid key; under a causal mask its last query, or the last source key)."""
    lo = 0
    hi = Lk
    if HAS_VALID or HAS_SOURCE:
        lo = tl.load(KeyBounds + b * 4) // BLOCK_N * BLOCK_N
        hi = tl.load(KeyBounds + b * 4 + 1)
    if CAUSAL:
        last = offset + m0 + BLOCK_M
        if HAS_SOURCE:
            last = tl.maximum(last, tl.load(KeyBounds + b * 4 + 2))
        hi = tl.minimum(hi, last)
    return lo, hi


@triton.jit
def _one_run(KeyBounds, b, KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr):
    """`(first, end, one_run)`: the keys a tail of class `KIND` may see in sequence `b` (`KeyBounds`), from `first` to
    `end` (its valid keys; a right tail's under a causal mask, its valid source keys: no other key right of a causal
    query is seen), and whether they are all of them, one run (no key inside masked: then a tail's blocks wholly
    inside need no mask)."""
    bounds = KeyBounds + b * 4
    end = tl.load(bounds + 1)
    if KIND == RIGHT and CAUSAL and HAS_SOURCE:
        end = tl.minimum(end, tl.load(bounds + 2))
    return tl.load(bounds), end, tl.load(bounds + 3) != 0


@triton.jit
def _tail_blocks(lo, hi, KeyBounds, b, KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """`(start, stop, hi, one_run)` of a tail's key blocks `lo .. hi` under padding or source keys (`_one_run`): the
    blocks from `start` to `stop` lie wholly among the keys seen and, where those are one run, need no mask; at most
    one block before `start` and one from `stop` to `hi` are cut by its ends (a masked tile each). `hi` clipped to the
    keys seen."""
    first, end, one_run = _one_run(KeyBounds, b, KIND, CAUSAL, HAS_SOURCE)
    hi = tl.maximum(tl.minimum(hi, end), lo)
    start = tl.minimum(tl.maximum(tl.cdiv(first, BLOCK) * BLOCK, lo), hi)
    stop = tl.maximum(tl.minimum(end // BLOCK * BLOCK, hi), start)
    return start, stop, hi, one_run


@triton.jit
def _program(blocks, heads, Offset, offset, OFFSET_IN_MEMORY: tl.constexpr):
    """`(block, head, b, h, offset)` of this program. Programs are numbered (head, block), blocks fastest, on the
    grid's first axis alone (CUDA allows 65,535 on the others); `b` and `h` (int64) are the head's sequence and head
    index. A static cache's offset, on the GPU, is read here, never on the host."""
    block, head = tl.program_id(0) % blocks, tl.program_id(0) // blocks
    if OFFSET_IN_MEMORY:
        offset = tl.load(Offset).to(tl.int32)
    return block, head, (head // heads).to(tl.int64), (head % heads).to(tl.int64), offset


@triton.jit
def _seed(Seed, seed, SEED_IN_MEMORY: tl.constexpr):
    """Dropout's seed: `seed`, or (`SEED_IN_MEMORY`) the one at `Seed`, a tensor on the GPU (a traced call's: read on
    the host it would wait for the GPU, and a CUDA graph would keep the value it was captured with)."""
    if SEED_IN_MEMORY:
        seed = tl.load(Seed)
    return seed


# --- forward -----------------------------------------------------------------------------------------------------


@triton.jit
def _softmax_step(scores, row_max, row_sum, key_term, scale_log2):
    """One tile of the online softmax: `(p, rescale, new_max, row_sum, p_sum)` from the tile's scores before the
    scale (`p_sum` the tile's part of the new `row_sum`).
    `key_term` is a tail's key term per row in base 2 (`q_i . T[row] * scale * log2(e)`; 0 for the band), folded into
    the maximum: a pair's exponent is then one multiply-add, `scores * scale_log2 - (max - key_term)`, as in plain
    FlashAttention-2 (`scale_log2` > 0). A row that has seen nothing yet stays at 0."""
    new_max = tl.maximum(row_max, tl.max(scores, 1) * scale_log2 + key_term)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(row_max - shift)
    p = tl.exp2(scores * scale_log2 - (shift - key_term)[:, None])
    p_sum = tl.sum(p, 1)
    return p, rescale, new_max, row_sum * rescale + p_sum, p_sum


@triton.jit
def _forward_tile(acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0, m0,
                  offs_m, offset, Lk, K, D: tl.constexpr, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                  scale_log2, seed, head, threshold, KIND: tl.constexpr, HAS_VALID: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, WIDEN: tl.constexpr,
                  IEEE: tl.constexpr, EDGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile at key block `n0` of one class (`_forward_tiles`): `(acc, row_max, row_sum, mass)` updated, a tail's
    value term gathered in `mass`, a band's (by the table's window) added to `acc`. `EDGE`: the block may end past the
    last key."""
    OPERAND = Vh.dtype.element_ty
    offs_n, k, v = _key_block(Kh, Vh, n0, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, Lk, D, EDGE, BLOCK_N)
    first = _window_start(n0, m0, offset, K, BLOCK_M)
    scores = _scores(q, k, Table, first, K, D, offs_d, offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row,
                     KIND, HAS_VALID, CAUSAL, HAS_SOURCE, EDGE, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    p, rescale, row_max, row_sum, _ = _softmax_step(scores, row_max, row_sum, key_term, scale_log2)
    if DROPOUT:
        p = tl.where(_kept(seed, head, offs_m, n0, threshold, BLOCK_M, BLOCK_N), p, 0.0)  # `keep_scale` at the end
    acc = _product_into(acc * rescale[:, None], p.to(OPERAND), v, WIDEN, IEEE)
    if KIND == BAND:
        acc = _add_times_window(acc, p.to(OPERAND), Table, first, K, D, offs_d, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    else:
        mass = mass * rescale + tl.sum(p, 1)  # the dropped-out probabilities, with dropout
    return acc, row_max, row_sum, mass


@triton.jit
def _forward_tiles(acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, KeyBounds, b,
                   key_row, lo, hi, m0, offs_m, offset, Lk, K, D: tl.constexpr, offs_d, stride_kn, stride_kd,
                   stride_vn, stride_vd, scale_log2, seed, head, threshold, KIND: tl.constexpr,
                   HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
                   WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax over the key blocks `lo .. hi` of one class: `(acc, row_max, row_sum, mass)`. A tail's
    blocks that every query of the block sees whole run in a loop without a mask (the plain FlashAttention-2 tile);
    the one or two blocks that the last key, padding or the source keys cut are masked tiles before and after it
    (`_tail_blocks`), and where padding or the source keys leave the keys seen in more than one run, every block is
    masked. Under a causal mask without source keys no query sees a key right of its band: no right tail."""
    if KIND == BAND:
        for n0 in range(lo, hi, BLOCK_N):
            acc, row_max, row_sum, mass = _forward_tile(
                acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0, m0,
                offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head,
                threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    elif KIND == RIGHT and CAUSAL and not HAS_SOURCE:
        pass
    elif HAS_VALID or HAS_SOURCE:
        start, stop, hi, one_run = _tail_blocks(lo, hi, KeyBounds, b, KIND, CAUSAL, HAS_SOURCE, BLOCK_N)
        if one_run:
            if lo < start:
                acc, row_max, row_sum, mass = _forward_tile(
                    acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, lo, m0,
                    offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
                    head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M,
                    BLOCK_N)
            for n0 in range(start, stop, BLOCK_N):
                acc, row_max, row_sum, mass = _forward_tile(
                    acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0, m0,
                    offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
                    head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, False, BLOCK_M,
                    BLOCK_N)
            if stop < hi:
                acc, row_max, row_sum, mass = _forward_tile(
                    acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, stop,
                    m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                    seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M,
                    BLOCK_N)
        else:
            for n0 in range(lo, hi, BLOCK_N):
                acc, row_max, row_sum, mass = _forward_tile(
                    acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0, m0,
                    offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
                    head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M,
                    BLOCK_N)
    else:
        edge = _whole_blocks_end(lo, hi, Lk, BLOCK_N)
        for n0 in range(lo, edge, BLOCK_N):
            acc, row_max, row_sum, mass = _forward_tile(
                acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0, m0,
                offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head,
                threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, False, BLOCK_M, BLOCK_N)
        if edge < hi:  # the last block, ending past the last key (`hi - edge < BLOCK_N`)
            acc, row_max, row_sum, mass = _forward_tile(
                acc, row_max, row_sum, mass, q, key_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, edge, m0,
                offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head,
                threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    return acc, row_max, row_sum, mass


@triton.jit
def _rotate_pairs(x, angles, BACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each row of `x` (`[BLOCK_M, BLOCK_D]` float32) rotated pairwise by its row's angles `b` (`angles`: the sinusoid
    rows `0 .. BLOCK_M - 1`, `sin b` in even columns, `cos b` in odd ones): `(x0 cos b + x1 sin b, x1 cos b - x0 sin
    b)`, or the inverse rotation (`BACK`). `q_i . T[t - s]` equals `rotate(q_i, s) . E[t]` for the sinusoid `E`, and
    `sum_j p_j T[t_j - s]` equals `rotate_back(sum_j p_j E[t_j], s)` (the angle-difference formulas)."""
    even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_D // 2, 2]))
    sine, cosine = tl.split(tl.reshape(angles, [BLOCK_M, BLOCK_D // 2, 2]))
    if BACK:
        sine = -sine
    return tl.reshape(tl.join(even * cosine + odd * sine, odd * cosine - even * sine), [BLOCK_M, BLOCK_D])


@triton.jit
def _sinusoid_rows(Sinusoid, rows, D, offs_d):
    """Rows `rows` of the `[rows, D]` sinusoid (`triton_attention` makes it: `T` continued past `2K`), in its type."""
    return tl.load(Sinusoid + rows[:, None] * D + offs_d[None, :], mask=_columns(offs_d, D)[None, :], other=0.0)


@triton.jit
def _clip_masks(rows, first, K, COLUMNS: tl.constexpr, ONE_SIDED: tl.constexpr, AGAIN: tl.constexpr):
    """`(clip, right)`: which pairs of a rotated band tile (queries at positions `rows` by the `COLUMNS` keys from
    `first`; `distance = j - i`) are clipped. Where `ONE_SIDED` (`2K >= COLUMNS`: a row's distances span at most `2K`,
    so its clipped pairs lie on one side), `clip` is them, by one compare per pair with a threshold per row, and
    `right` per row whether they are `distance >= K` ones; otherwise `clip` the pairs `distance <= -K` and `right`
    those `distance >= K`. `AGAIN`: the same masks by other compares (`x > t - 1` for `x >= t`), for a tile's use
    after its products: with the one-sided rows' run-time thresholds the compilers cannot prove them equal (the
    subtraction may wrap), so they compare again, one instruction per pair, where a merged compare's predicates would
    be kept packed in registers across the products (three instructions per pair). The two-sided form compares with
    the constant `K`, which the compilers may merge; only a small `K` is two-sided, which no tuned block compiles."""
    columns = tl.arange(0, COLUMNS)[None, :]
    if ONE_SIDED:
        right = first + COLUMNS - 1 - rows >= K  # the row's largest distance is at its last key
        threshold = tl.where(right, rows - first + K, rows - first - K + 1)[:, None]
        if AGAIN:
            clip = (columns > threshold - 1) == right[:, None]
        else:
            clip = (columns >= threshold) == right[:, None]
    else:
        distance = (first - rows)[:, None] + columns
        if AGAIN:
            clip, right = distance < 1 - K, distance > K - 1
        else:
            clip, right = distance <= -K, distance >= K
    return clip, right


@triton.jit
def _clipped(term, left_row, right_row, clip, right, ONE_SIDED: tl.constexpr):
    """A rotated band tile's table term with its clipped pairs' replaced (`_clip_masks`): the row's `left_row`
    (`x_i . T[0]`) where `distance <= -K`, `right_row` where `distance >= K` (both broadcast to the tile)."""
    if ONE_SIDED:
        term = tl.where(clip, tl.where(right[:, None], right_row, left_row), term)
    else:
        term = tl.where(right, right_row, tl.where(clip, left_row, term))
    return term


@triton.jit
def _split_clipped(x, x_sum, clip, right, ONE_SIDED: tl.constexpr):
    """`(inside, left, right)` of a rotated band tile's per-pair `x` (`[BLOCK_M, BLOCK_N]`, `_clip_masks`): `x` with
    its clipped pairs zeroed, and the row sums of `x` over the pairs clipped left (`distance <= -K`) and right
    (`distance >= K`). Given `x`'s row sums (`x_sum`, or None), a one-sided row's clipped sum is `x_sum` less the
    inside's (float32: an error of float32's rounding of `x_sum`), saving a pass over the tile."""
    if ONE_SIDED:
        if x_sum is None:
            clipped = tl.where(clip, x, 0.0)
            inside, total = x - clipped, tl.sum(clipped, 1)
        else:
            inside = tl.where(clip, 0.0, x)
            total = x_sum - tl.sum(inside, 1)
        left_sum, right_sum = tl.where(right, 0.0, total), tl.where(right, total, 0.0)
    else:
        left_part, right_part = tl.where(clip, x, 0.0), tl.where(right, x, 0.0)
        inside, left_sum, right_sum = x - left_part - right_part, tl.sum(left_part, 1), tl.sum(right_part, 1)
    return inside, left_sum, right_sum


@triton.jit
def _rotated_band_tile(acc, spread, left_mass, right_mass, row_max, row_sum, q, rotated, left_raw, right_raw, Kh, Vh,
                       Sinusoid, KeyValid, KeyIsSource, key_row, n0, m0, offs_m, offset, Lk, K, D: tl.constexpr,
                       offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head, threshold,
                       HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
                       DROPOUT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, EDGE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A band tile without gathers (the table the exact sinusoid, `ROTATE`): with `s = i - m0` and `t = j - offset -
    m0 + K`, a pair inside the band (`|j - i| < K`) has `T[t - s]`, so its key term is `rotated_i . E[t_j]` (one
    product with the sinusoid's rows of the tile's keys, `rotated` the block's queries turned by `s`) and its value
    term gathers in `spread = sum_j p_ij E[t_j]`, turned back once after the band. A clipped pair takes its row's
    constant (`left_raw`, `right_raw`: `q_i . T[0]`, `q_i . T[2K]`) and its probability the row's `left_mass` or
    `right_mass`, as a tail's does (`EDGE`: the block may end past the last key)."""
    OPERAND = Vh.dtype.element_ty
    offs_n, k, v = _key_block(Kh, Vh, n0, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, Lk, D, EDGE, BLOCK_N)
    sinusoid = _sinusoid_rows(Sinusoid, tl.minimum(tl.maximum(offs_n - offset - m0 + K, 0), 2 * K + BLOCK_M - 1), D,
                              offs_d)
    ONE_SIDED: tl.constexpr = 2 * K >= BLOCK_N
    clip, right = _clip_masks(offset + offs_m, n0, K, BLOCK_N, ONE_SIDED, False)
    term = _clipped(_product(rotated, tl.trans(sinusoid), WIDEN, IEEE), left_raw[:, None], right_raw[:, None], clip,
                    right, ONE_SIDED)
    scores = _product_into(term, q, tl.trans(k), WIDEN, IEEE)
    scores = _seen_in_band(scores, offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, HAS_VALID, CAUSAL,
                           HAS_SOURCE, EDGE)
    p, rescale, row_max, row_sum, p_sum = _softmax_step(scores, row_max, row_sum, 0.0, scale_log2)
    if DROPOUT:
        p = tl.where(_kept(seed, head, offs_m, n0, threshold, BLOCK_M, BLOCK_N), p, 0.0)  # `keep_scale` at the end
        p_sum = None  # the kept probabilities' sum is not the softmax's
    acc = _product_into(acc * rescale[:, None], p.to(OPERAND), v, WIDEN, IEEE)
    clip, right = _clip_masks(offset + offs_m, n0, K, BLOCK_N, ONE_SIDED, True)
    inside, left, right = _split_clipped(p, p_sum, clip, right, ONE_SIDED)
    spread = _product_into(spread * rescale[:, None], inside.to(OPERAND), sinusoid, WIDEN, IEEE)
    left_mass = left_mass * rescale + left
    right_mass = right_mass * rescale + right
    return acc, spread, left_mass, right_mass, row_max, row_sum


@triton.jit
def _rotated_band(acc, row_max, row_sum, q, first_row, last_row, Kh, Vh, Sinusoid, KeyValid, KeyIsSource, key_row, lo,
                  hi, m0, offs_m, offset, Lk, K, D: tl.constexpr, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                  scale_log2, seed, head, threshold, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The band's key blocks `lo .. hi` by rotation (`_rotated_band_tile`): `(acc, row_max, row_sum)`, the band's
    value term added to `acc` after the loop. Whole blocks run in a loop without a key mask, the one that may end past
    the last key after it (as the tails', `_forward_tiles`)."""
    angles = _sinusoid_rows(Sinusoid, tl.arange(0, BLOCK_M), D, offs_d).to(tl.float32)
    rotated = _rotate_pairs(q.to(tl.float32), angles, False, BLOCK_M, BLOCK_D).to(q.dtype)
    left_raw, right_raw = _row_term(q, first_row), _row_term(q, last_row)
    spread = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    left_mass = tl.zeros([BLOCK_M], tl.float32)
    right_mass = tl.zeros([BLOCK_M], tl.float32)
    edge = _whole_blocks_end(lo, hi, Lk, BLOCK_N)
    for n0 in range(lo, edge, BLOCK_N):
        acc, spread, left_mass, right_mass, row_max, row_sum = _rotated_band_tile(
            acc, spread, left_mass, right_mass, row_max, row_sum, q, rotated, left_raw, right_raw, Kh, Vh, Sinusoid,
            KeyValid, KeyIsSource, key_row, n0, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn,
            stride_vd, scale_log2, seed, head, threshold, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN,
            IEEE, False, BLOCK_M, BLOCK_N)
    if edge < hi:  # the last block, ending past the last key (`hi - edge < BLOCK_N`)
        acc, spread, left_mass, right_mass, row_max, row_sum = _rotated_band_tile(
            acc, spread, left_mass, right_mass, row_max, row_sum, q, rotated, left_raw, right_raw, Kh, Vh, Sinusoid,
            KeyValid, KeyIsSource, key_row, edge, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd,
            stride_vn, stride_vd, scale_log2, seed, head, threshold, HAS_VALID, CAUSAL, HAS_SOURCE,
            DROPOUT, WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    acc += _rotate_pairs(spread, angles, True, BLOCK_M, BLOCK_D)
    acc += left_mass[:, None] * first_row[None, :] + right_mass[:, None] * last_row[None, :]
    return acc, row_max, row_sum


@triton.jit
def _store_output(Out, Lse, acc, row_max, row_sum, b, h, head, offs_m, offs_d, Lq, D, stride_ob, stride_oh,
                  stride_om, stride_od):
    """`acc / row_sum` into `Out` (`[batch, queries, heads, d]` strides) and the rows' natural log-sum-exp into
    `Lse`; a row that saw nothing gets 0 and -inf."""
    nothing = row_sum == 0.0
    out = acc / tl.where(nothing, 1.0, row_sum)[:, None]
    rows_in = offs_m < Lq
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=rows_in[:, None] & _columns(offs_d, D)[None, :])
    lse = tl.where(nothing, float("-inf"), (row_max + tl.log2(tl.where(nothing, 1.0, row_sum))) * LN2)
    tl.store(Lse + head.to(tl.int64) * Lq + offs_m, lse, mask=rows_in)


@triton.autotune(configs=FORWARD_CONFIGS, key=[*TUNING_KEY, "SPLIT", "ROTATE"], prune_configs_by=PRUNING)
@triton.jit(do_not_specialize=[*CALL_VALUES, "key_chunk", "splits"])
def nezha_forward_kernel(
    Q, Kx, V, Table, Sinusoid, Out, Lse, Partial, PartialStats, KeyValid, KeyIsSource, KeyBounds, Offset, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
    heads, Lq, Lk, D: tl.constexpr, K: tl.constexpr, offset, scale_log2, seed: tl.int64, threshold, keep_scale,
    splits, key_chunk, LQ_CLASS, LK_CLASS,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, SPLIT: tl.constexpr, ROTATE: tl.constexpr,
    WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One block of queries of one head against its keys, or (`SPLIT`) against the `key_chunk` keys of one split:
    the output and log-sum-exp, or the split's unnormalised output, maximum and sum (`Partial`, `PartialStats`).
    Programs are numbered (head, split, query block) (`_program`). `ROTATE`: `Table` is the exact sinusoid and
    `Sinusoid` its continuation to `2K + ROTATION_ROWS` rows, so band tiles go by rotation (`_rotated_band`), not by
    the table's window. `LQ_CLASS` and `LK_CLASS` (`length_class`) are what the tuning is keyed on; the kernel does
    not read them."""
    query_blocks = tl.cdiv(Lq, BLOCK_M)
    block, head, b, h, offset = _program(query_blocks * splits, heads, Offset, offset, OFFSET_IN_MEMORY)
    seed = _seed(Seed, seed, SEED_IN_MEMORY)
    block, split = block % query_blocks, block // query_blocks
    m0 = block * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qm, stride_qd, Lq, D, True)
    Kh, Vh = Kx + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh
    key_row = b * Lk  # the sequence's key flags
    first_row, last_row = _table_row(Table, 0, D, offs_d), _table_row(Table, 2 * K, D, offs_d)

    lo, hi = _keys_of_block(m0, offset, Lk, KeyBounds, b, HAS_VALID, CAUSAL, HAS_SOURCE, BLOCK_M, BLOCK_N)
    lo = tl.maximum(lo, split * key_chunk)  # a split's chunk is a whole number of key blocks
    hi = tl.minimum(hi, (split + 1) * key_chunk)
    band_lo, band_hi, hi = _class_bounds(lo, hi, offset + m0 - K + 1, offset + m0 + BLOCK_M - 1 + K, BLOCK_N)

    zeros = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_max = zeros + float("-inf")
    left_term, right_term = _row_term(q, first_row) * scale_log2, _row_term(q, last_row) * scale_log2
    acc, row_max, row_sum, mass = _forward_tiles(
        acc, row_max, zeros, zeros, q, left_term, Kh, Vh, Table, KeyValid, KeyIsSource, KeyBounds, b, key_row, lo,
        band_lo, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
        head, threshold, LEFT, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    acc += mass[:, None] * first_row[None, :]
    if ROTATE:
        acc, row_max, row_sum = _rotated_band(
            acc, row_max, row_sum, q, first_row, last_row, Kh, Vh, Sinusoid, KeyValid, KeyIsSource, key_row, band_lo,
            band_hi, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
            seed, head, threshold, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M, BLOCK_N,
            BLOCK_D)
    else:
        acc, row_max, row_sum, _ = _forward_tiles(
            acc, row_max, row_sum, zeros, q, zeros, Kh, Vh, Table, KeyValid, KeyIsSource, KeyBounds, b, key_row,
            band_lo, band_hi, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
            scale_log2, seed, head, threshold, BAND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M,
            BLOCK_N)
    acc, row_max, row_sum, mass = _forward_tiles(
        acc, row_max, row_sum, zeros, q, right_term, Kh, Vh, Table, KeyValid, KeyIsSource, KeyBounds, b, key_row,
        band_hi, hi, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
        head, threshold, RIGHT, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    acc += mass[:, None] * last_row[None, :]
    if DROPOUT:
        acc *= keep_scale  # dropout's `1 / (1 - p)`, once per output rather than per pair

    if SPLIT:
        slot = (head * splits + split).to(tl.int64) * Lq + offs_m
        rows_in = offs_m < Lq
        tl.store(Partial + slot[:, None] * BLOCK_D + offs_d[None, :], acc, mask=rows_in[:, None])
        tl.store(PartialStats + slot * 2, row_max, mask=rows_in)
        tl.store(PartialStats + slot * 2 + 1, row_sum, mask=rows_in)
    else:
        _store_output(Out, Lse, acc, row_max, row_sum, b, h, head, offs_m, offs_d, Lq, D, stride_ob, stride_oh,
                      stride_om, stride_od)


@triton.jit(do_not_specialize=["splits"])
def nezha_merge_kernel(Partial, PartialStats, Out, Lse, stride_ob, stride_oh, stride_om, stride_od, heads, Lq,
                       D: tl.constexpr, splits, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """A decoding step's splits merged by their log-sum-exps, for one block of queries of one head: the output and
    log-sum-exp."""
    block, head, b, h, _ = _program(tl.cdiv(Lq, BLOCK_M), heads, None, 0, False)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_in = offs_m < Lq
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(0, splits):
        slot = (head * splits + split).to(tl.int64) * Lq + offs_m
        split_max = tl.load(PartialStats + slot * 2, mask=rows_in, other=float("-inf"))
        split_sum = tl.load(PartialStats + slot * 2 + 1, mask=rows_in, other=0.0)
        new_max = tl.maximum(row_max, split_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        mine, theirs = tl.exp2(row_max - shift), tl.exp2(split_max - shift)
        part = tl.load(Partial + slot[:, None] * BLOCK_D + offs_d[None, :], mask=rows_in[:, None], other=0.0)
        acc = acc * mine[:, None] + part * theirs[:, None]
        row_sum = row_sum * mine + split_sum * theirs
        row_max = new_max
    _store_output(Out, Lse, acc, row_max, row_sum, b, h, head, offs_m, offs_d, Lq, D,
                  stride_ob, stride_oh, stride_om, stride_od)


# --- backward ----------------------------------------------------------------------------------------------------


@triton.jit
def nezha_row_statistics_kernel(Q, DO, O, Table, Sinusoid, Lse, RowLse, RowDot, RowTerms, RotQ, RotDO, stride_qb,
                                stride_qh, stride_qm, stride_qd, stride_ob, stride_oh, stride_om, stride_od, stride_yb,
                                stride_yh, stride_ym, stride_yd, heads, Lq, D: tl.constexpr, K: tl.constexpr,
                                scale_log2, keep_rate, DROPOUT: tl.constexpr, ROTATE: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The backward's statistics of one block of queries of one head, one row per tile class (`[heads, 3, Lq]`
    float32, the class's index): `RowLse`, the forward's log-sum-exp in base 2 (+inf for a row that saw nothing, so
    that its probabilities are 0) less a tail's key term `q_i . T[row] * scale * log2(e)`; `RowDot`, `D_i = dO_i . O_i`
    (`O`: `stride_y*`) less a tail's output term `dO_i . T[row]`, or with dropout, which multiplies that term pair by
    pair, the term itself (the band's row keeps `D_i`, times dropout's `keep_rate = 1 - p`, 0 where `p = 1`:
    `_gradient_of_scores` leaves the factor `1 / (1 - p)` to the end). A tail tile then costs a plain
    FlashAttention-2 tile: its exponent one multiply-add, nothing per row recomputed in the key/value gradients'
    loop. `ROTATE` (the backward's
    band by rotation): also `RowTerms` (`[heads, 4, Lq]` float32: `q_i . T[0]`, `q_i . T[2K]`, `dO_i . T[0]`,
    `dO_i . T[2K]`, the terms of a band tile's clipped pairs) and the queries and output gradients turned pairwise
    by `i mod ROTATION_ROWS` (`RotQ`, `RotDO`, `[heads, Lq, D]` in their type)."""
    block, head, b, h, _ = _program(tl.cdiv(Lq, BLOCK_M), heads, None, 0, False)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < Lq
    q = _rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qm, stride_qd, Lq, D, True)
    do = _rows(DO + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_om, stride_od, Lq, D, True)
    out = _rows(O + b * stride_yb + h * stride_yh, offs_m, offs_d, stride_ym, stride_yd, Lq, D, True)
    lse = tl.load(Lse + head.to(tl.int64) * Lq + offs_m, mask=rows, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    row_dot = tl.sum(do.to(tl.float32) * out.to(tl.float32), 1)
    first_row, last_row = _table_row(Table, 0, D, offs_d), _table_row(Table, 2 * K, D, offs_d)
    left, right = _row_term(do, first_row), _row_term(do, last_row)
    if ROTATE:
        terms = head.to(tl.int64) * 4 * Lq + offs_m
        tl.store(RowTerms + terms, _row_term(q, first_row), mask=rows)
        tl.store(RowTerms + terms + Lq, _row_term(q, last_row), mask=rows)
        tl.store(RowTerms + terms + 2 * Lq, left, mask=rows)
        tl.store(RowTerms + terms + 3 * Lq, right, mask=rows)
        angles = _sinusoid_rows(Sinusoid, offs_m % ROTATION, D, offs_d).to(tl.float32)
        turned = head.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :]
        inside = rows[:, None] & _columns(offs_d, D)[None, :]
        tl.store(RotQ + turned, _rotate_pairs(q.to(tl.float32), angles, False, BLOCK_M, BLOCK_D).to(q.dtype),
                 mask=inside)
        tl.store(RotDO + turned, _rotate_pairs(do.to(tl.float32), angles, False, BLOCK_M, BLOCK_D).to(do.dtype),
                 mask=inside)
    if DROPOUT:
        row_dot = row_dot * keep_rate
    else:
        left, right = row_dot - left, row_dot - right
    base = head.to(tl.int64) * 3 * Lq + offs_m
    tl.store(RowLse + base + LEFT * Lq, lse - _row_term(q, first_row) * scale_log2, mask=rows)
    tl.store(RowLse + base + BAND * Lq, lse, mask=rows)
    tl.store(RowLse + base + RIGHT * Lq, lse - _row_term(q, last_row) * scale_log2, mask=rows)
    tl.store(RowDot + base + LEFT * Lq, left, mask=rows)
    tl.store(RowDot + base + BAND * Lq, row_dot, mask=rows)
    tl.store(RowDot + base + RIGHT * Lq, right, mask=rows)


@triton.jit
def _class_statistics(RowLse, RowDot, head, m0, Lq, KIND: tl.constexpr, DROPOUT: tl.constexpr,
                      MASK_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """`(lse, row_dot, output_term)` of the block of queries at `m0` for a tile class
    (`nezha_row_statistics_kernel`): +inf and 0 past the queries (masked only where `MASK_ROWS`: a block that may end
    past the last query); `output_term` is 0 but for a tail's with dropout, and with dropout `row_dot` is `D_i (1 -
    p)` (the band's row). The block's first query moves the (64-bit) base, so that each load's pointers are
    one base and constant offsets."""
    block = tl.arange(0, BLOCK_M)
    rows = m0 + block < Lq
    head_rows = head.to(tl.int64) * 3 * Lq  # a scalar: the loop adds only the queries' offsets
    lse_of, dot_of = RowLse + head_rows + (KIND * Lq + m0), RowDot + head_rows + (KIND * Lq + m0)
    if MASK_ROWS:
        lse = tl.load(lse_of + block, mask=rows, other=float("inf"))
        row_dot = tl.load(dot_of + block, mask=rows, other=0.0)
    else:
        lse = tl.load(lse_of + block)
        row_dot = tl.load(dot_of + block)
    output_term = tl.zeros_like(row_dot)
    if DROPOUT and KIND != BAND:
        output_term = row_dot
        band_dot_of = RowDot + head_rows + (BAND * Lq + m0)
        if MASK_ROWS:
            row_dot = tl.load(band_dot_of + block, mask=rows, other=0.0)
        else:
            row_dot = tl.load(band_dot_of + block)
    return lse, row_dot, output_term


@triton.jit
def _gradient_of_scores(p, grad_p, keep, row_dot, output_term, DROPOUT: tl.constexpr):
    """`(kept, dS)` of a tile from its probabilities `p` and `dP` before dropout (both per pair, any orientation;
    `row_dot` and `output_term` broadcast to them): `dS = P (z (dP + output_term) - D)` for dropout's factor `z`
    (kept: `keep_scale = 1 / (1 - p)`, else 0), `P (dP - D)` without (the output term already in `D`), and `kept`
    the probabilities dropout keeps (0 where it drops). With dropout both come without `keep_scale`, which the kernels
    apply once to the gradients they sum (a multiply per output, not per pair), and `row_dot` is `D (1 - p)`
    (`nezha_row_statistics_kernel`)."""
    if DROPOUT:
        kept = tl.where(keep, p, 0.0)
        grad_s = kept * (grad_p + output_term) - p * row_dot  # `kept` used twice: selected in float32, not bfloat16
    else:
        kept = p
        grad_s = p * (grad_p - row_dot)
    return kept, grad_s


@triton.jit
def _key_value_products(grad_k, grad_v, scores, grad_p, q, do, lse, row_dot, output_term, offs_m, m0, offs_n, n0,
                        offset, Lk, KeyValid, KeyIsSource, key_row, scale_log2, seed, head, threshold,
                        KIND: tl.constexpr, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
                        DROPOUT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`(grad_k, grad_v)` updated by a tile whose `S^T` and `dP^T` (before the scale and the masks) are `scores` and
    `grad_p`: the masks (`MASKED`: a pair may be unseen), the probabilities, dropout's draws, `dS` and the two
    products."""
    OPERAND = q.dtype
    if MASKED:
        visible = _visible(offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, KIND, HAS_VALID, CAUSAL,
                           HAS_SOURCE, False)
        scores = tl.where(tl.trans(tl.broadcast_to(visible, [BLOCK_M, BLOCK_N])), scores, float("-inf"))
    p = tl.exp2(scores * scale_log2 - lse[None, :])
    keep = None
    if DROPOUT:
        keep = _kept_by_keys(seed, head, m0, n0, threshold, BLOCK_M, BLOCK_N)
    kept, grad_s = _gradient_of_scores(p, grad_p, keep, row_dot[None, :], output_term[None, :], DROPOUT)
    grad_v = _product_into(grad_v, kept.to(OPERAND), do, WIDEN, IEEE)
    return _product_into(grad_k, grad_s.to(OPERAND), q, WIDEN, IEEE), grad_v


@triton.jit
def _key_value_tile(grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
                    KeyIsSource, key_row, m0, n0, offs_n, offset, Lq, Lk, K, D: tl.constexpr, offs_d, stride_qm,
                    stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold, KIND: tl.constexpr,
                    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
                    ROTATE: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, MASK_ROWS: tl.constexpr,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile of `_key_value_tiles` at query block `m0`: `(grad_k, grad_v)` updated (`MASK_ROWS`: the block may end
    past the last query; `MASKED`: a pair may be unseen); a band tile by rotation (`ROTATE`,
    `_rotated_key_value_tile`) or by the table's window."""
    if ROTATE and KIND == BAND:
        grad_k, grad_v = _rotated_key_value_tile(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, RowTerms, RotQ, RotDO, Sinusoid, KeyValid, KeyIsSource,
            key_row, m0, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm, stride_qd, stride_om, stride_od,
            scale_log2, seed, head, threshold, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE,
            MASK_ROWS, BLOCK_M, BLOCK_N)
    else:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _rows(Qh, offs_m, offs_d, stride_qm, stride_qd, Lq, D, MASK_ROWS)
        do = _rows(DOh, offs_m, offs_d, stride_om, stride_od, Lq, D, MASK_ROWS)
        lse, row_dot, output_term = _class_statistics(RowLse, RowDot, head, m0, Lq, KIND, DROPOUT, MASK_ROWS, BLOCK_M)
        scores = _product(k, tl.trans(q), WIDEN, IEEE)
        grad_p = _product(v, tl.trans(do), WIDEN, IEEE)
        if KIND == BAND:
            first = _window_start(n0, m0, offset, K, BLOCK_M)
            scores += tl.trans(_by_pair(q, Table, first, K, D, offs_d, WIDEN, IEEE, BLOCK_M, BLOCK_N))
            grad_p += tl.trans(_by_pair(do, Table, first, K, D, offs_d, WIDEN, IEEE, BLOCK_M, BLOCK_N))
        grad_k, grad_v = _key_value_products(
            grad_k, grad_v, scores, grad_p, q, do, lse, row_dot, output_term, offs_m, m0, offs_n, n0, offset, Lk,
            KeyValid, KeyIsSource, key_row, scale_log2, seed, head, threshold, KIND, HAS_VALID, CAUSAL,
            HAS_SOURCE, DROPOUT, WIDEN, IEEE, MASKED, BLOCK_M, BLOCK_N)
    return grad_k, grad_v


@triton.jit
def _key_value_blocks(grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
                      KeyIsSource, key_row, lo, hi, n0, offs_n, offset, Lq, Lk, K, D: tl.constexpr, offs_d, stride_qm,
                      stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold, KIND: tl.constexpr,
                      HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
                      DROPOUT: tl.constexpr, ROTATE: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                      MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_key_value_tiles`' query blocks `lo .. hi`, masked where `MASKED`: whole query blocks in a loop without a
    query mask, the one that may end past the last query after it (as the forward's tails)."""
    edge = _whole_blocks_end(lo, hi, Lq, BLOCK_M)
    for m0 in range(lo, edge, BLOCK_M):
        grad_k, grad_v = _key_value_tile(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, key_row, m0, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm, stride_qd, stride_om,
            stride_od, scale_log2, seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT,
            ROTATE, WIDEN, IEEE, False, MASKED, BLOCK_M, BLOCK_N)
    if edge < hi:  # the last block, ending past the last query (`hi - edge < BLOCK_M`)
        grad_k, grad_v = _key_value_tile(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, key_row, edge, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm, stride_qd, stride_om,
            stride_od, scale_log2, seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT,
            ROTATE, WIDEN, IEEE, True, MASKED, BLOCK_M, BLOCK_N)
    return grad_k, grad_v


@triton.jit
def _key_value_tiles(grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
                     KeyIsSource, KeyBounds, b, key_row, lo, hi, n0, offs_n, offset, Lq, Lk, K, D: tl.constexpr,
                     offs_d, stride_qm, stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold,
                     KIND: tl.constexpr, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
                     DROPOUT: tl.constexpr, ROTATE: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`dK` (unscaled) and `dV` of a key block over the query blocks `lo .. hi` of one class, as FlashAttention-2's
    Triton kernels compute them: transposed, `S^T = K Q^T`, so that the key block's rows are every product's rows
    (wgmma on Hopper) and nothing is transposed between products. Keys past the last one need no mask: their rows
    are never stored. A tail's tiles are masked only where padding or source keys cut the key block (`_one_run`: a
    block wholly among one run of keys seen needs none); under a causal mask without source keys no query left of a
    key's band sees it: no right tail."""
    whole = True  # the key block wholly among the keys this class sees, one run: no mask
    if KIND != BAND and (HAS_VALID or HAS_SOURCE):
        first, end, one_run = _one_run(KeyBounds, b, KIND, CAUSAL, HAS_SOURCE)
        whole = one_run & (first <= n0) & (n0 + BLOCK_N <= end)
    if KIND == RIGHT and CAUSAL and not HAS_SOURCE:
        pass
    elif whole == 0:
        grad_k, grad_v = _key_value_blocks(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, key_row, lo, hi, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm, stride_qd, stride_om,
            stride_od, scale_log2, seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, ROTATE,
            WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    else:
        grad_k, grad_v = _key_value_blocks(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, key_row, lo, hi, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm, stride_qd, stride_om,
            stride_od, scale_log2, seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, ROTATE,
            WIDEN, IEEE, KIND == BAND and (HAS_VALID or CAUSAL), BLOCK_M, BLOCK_N)
    return grad_k, grad_v


@triton.jit
def _band_terms(RowTerms, head, offs_m, Lq, MASK_ROWS: tl.constexpr):
    """`(left_key, right_key, left_out, right_out)` of the queries `offs_m`: the terms a rotated band tile's clipped
    pairs take (`q_i . T[0]`, `q_i . T[2K]`, `dO_i . T[0]`, `dO_i . T[2K]`; `nezha_row_statistics_kernel`), 0 past
    the queries (masked only where `MASK_ROWS`)."""
    base = RowTerms + head.to(tl.int64) * 4 * Lq + offs_m
    if MASK_ROWS:
        rows = offs_m < Lq
        return (tl.load(base, mask=rows, other=0.0), tl.load(base + Lq, mask=rows, other=0.0),
                tl.load(base + 2 * Lq, mask=rows, other=0.0), tl.load(base + 3 * Lq, mask=rows, other=0.0))
    return tl.load(base), tl.load(base + Lq), tl.load(base + 2 * Lq), tl.load(base + 3 * Lq)


@triton.jit
def _turned(Turned, head, offs_m, offs_d, Lq, D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows `offs_m` of the queries or output gradients turned by `i mod ROTATION_ROWS` (`RotQ`, `RotDO`)."""
    return _rows(Turned + head.to(tl.int64) * Lq * D, offs_m, offs_d, D, 1, Lq, D, MASK_ROWS)


@triton.jit
def _rotated_key_value_tile(grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
                            KeyIsSource, key_row, m0, n0, offs_n, offset, Lq, Lk, K, D: tl.constexpr, offs_d,
                            stride_qm, stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold,
                            HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr,
                            DROPOUT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, MASK_ROWS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A band tile of `_key_value_tiles` by rotation (`ROTATE`, as the forward's `_rotated_band_tile`), with the
    queries and output gradients turned pairwise by `s = i - m0'`, `m0'` the multiple of `ROTATION_ROWS` at or before
    the tile's first query (`RotQ`, `RotDO`): a pair inside the band has its key term `q~_i . E[t_j]` and its output
    term `dO~_i . E[t_j]` (`t = j - offset - m0' + K`), one product each with the sinusoid's rows of the block's keys;
    a clipped pair takes its tail's terms instead (`_band_terms`, `_clipped`). `dK`, `dV` take no table term."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = _rows(Qh, offs_m, offs_d, stride_qm, stride_qd, Lq, D, MASK_ROWS)
    do = _rows(DOh, offs_m, offs_d, stride_om, stride_od, Lq, D, MASK_ROWS)
    rotated_q = _turned(RotQ, head, offs_m, offs_d, Lq, D, MASK_ROWS)
    rotated_do = _turned(RotDO, head, offs_m, offs_d, Lq, D, MASK_ROWS)
    lse, row_dot, output_term = _class_statistics(RowLse, RowDot, head, m0, Lq, BAND, DROPOUT, MASK_ROWS, BLOCK_M)
    left_key, right_key, left_out, right_out = _band_terms(RowTerms, head, offs_m, Lq, MASK_ROWS)
    reference = m0 // ROTATION * ROTATION
    sinusoid = _sinusoid_rows(Sinusoid, tl.minimum(tl.maximum(offs_n - offset - reference + K, 0),
                                                   2 * K + ROTATION - 1), D, offs_d)
    distance = (offs_n - offset)[:, None] - offs_m[None, :]
    # Both sides per pair: with one side per row (`_clip_masks`) this transposed tile compiled larger
    # (docs/performance.md).
    clip, right = distance <= -K, distance >= K
    scores = _product_into(_clipped(_product(sinusoid, tl.trans(rotated_q), WIDEN, IEEE), left_key[None, :],
                                    right_key[None, :], clip, right, False), k, tl.trans(q), WIDEN, IEEE)
    grad_p = _product_into(_clipped(_product(sinusoid, tl.trans(rotated_do), WIDEN, IEEE), left_out[None, :],
                                    right_out[None, :], clip, right, False), v, tl.trans(do), WIDEN, IEEE)
    return _key_value_products(grad_k, grad_v, scores, grad_p, q, do, lse, row_dot, output_term, offs_m, m0, offs_n,
                               n0, offset, Lk, KeyValid, KeyIsSource, key_row, scale_log2, seed, head, threshold, BAND,
                               HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, HAS_VALID or CAUSAL, BLOCK_M,
                               BLOCK_N)


@triton.jit
def _add_row_sums(sums, x, WIDEN: tl.constexpr, IEEE: tl.constexpr):
    """`sums` (`[rows, MASS_COLUMNS]` float32) plus the row sums of `x` (`[rows, n]`, in the products' operand type)
    in its column 0, the others staying 0. bfloat16 and float16 sum as a product with a column of ones: a small wgmma
    per tile instead of a sum across each row's threads (a multiply-add per pair and the shuffles), `x` rounded as
    the product with the keys takes it. float32, whose IEEE products run on the CUDA cores, by the sum itself."""
    first = tl.arange(0, MASS_COLUMNS)[None, :] == 0
    if IEEE:
        return sums + tl.where(first, tl.sum(x, 1)[:, None], 0.0)
    ones = tl.where(first, 1.0, 0.0) + tl.zeros([x.shape[1], MASS_COLUMNS], tl.float32)
    return _product_into(sums, x, ones.to(x.dtype), WIDEN, IEEE)


@triton.jit
def _query_tile(grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0, m0,
                offs_m, offset, Lk, K, D: tl.constexpr, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                scale_log2, seed, head, threshold, KIND: tl.constexpr, HAS_VALID: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, WIDEN: tl.constexpr,
                IEEE: tl.constexpr, EDGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile of `_query_tiles` at key block `n0`: `(grad_q, mass)` updated (`EDGE`: the block may end past the
    last key)."""
    OPERAND = Vh.dtype.element_ty
    offs_n, k, v = _key_block(Kh, Vh, n0, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, Lk, D, EDGE, BLOCK_N)
    first = _window_start(n0, m0, offset, K, BLOCK_M)
    scores = _scores(q, k, Table, first, K, D, offs_d, offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row,
                     KIND, HAS_VALID, CAUSAL, HAS_SOURCE, EDGE, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    p = tl.exp2(scores * scale_log2 - lse[:, None])
    grad_p = _product(do, tl.trans(v), WIDEN, IEEE)
    if KIND == BAND:
        grad_p += _by_pair(do, Table, first, K, D, offs_d, WIDEN, IEEE, BLOCK_M, BLOCK_N)
    keep = None
    if DROPOUT:
        keep = _kept(seed, head, offs_m, n0, threshold, BLOCK_M, BLOCK_N)
    _, grad_s = _gradient_of_scores(p, grad_p, keep, row_dot[:, None], output_term[:, None], DROPOUT)
    if KIND == BAND:
        grad_q = _add_times_window(grad_q, grad_s.to(OPERAND), Table, first, K, D, offs_d, WIDEN, IEEE, BLOCK_M,
                                   BLOCK_N)
    else:
        mass = _add_row_sums(mass, grad_s.to(OPERAND), WIDEN, IEEE)
    return _product_into(grad_q, grad_s.to(OPERAND), k, WIDEN, IEEE), mass


@triton.jit
def _query_tiles(grad_q, q, do, Kh, Vh, Table, RowLse, RowDot, KeyValid, KeyIsSource, KeyBounds, b, key_row, lo, hi,
                 m0, offs_m, offset, Lq, Lk, K, D: tl.constexpr, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                 scale_log2, seed, head, threshold, KIND: tl.constexpr, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`(grad_q, mass)`: `sum_j dS_ij (k_j + T[r])` (unscaled) of a query block over the key blocks `lo .. hi` of one
    class, the band's table part added tile by tile, a tail's gathered in `mass` (for its row) as the forward's value
    term is. A tail's blocks that every query sees whole run in a loop without a mask, those the last key, padding or
    source keys cut are masked tiles before and after it, as the forward's (`_forward_tiles`)."""
    lse, row_dot, output_term = _class_statistics(RowLse, RowDot, head, m0, Lq, KIND, DROPOUT, True, BLOCK_M)
    mass = tl.zeros([BLOCK_M, MASS_COLUMNS], tl.float32)
    if KIND == BAND:
        for n0 in range(lo, hi, BLOCK_N):
            grad_q, mass = _query_tile(
                grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0,
                m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
                head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    elif KIND == RIGHT and CAUSAL and not HAS_SOURCE:
        pass
    elif HAS_VALID or HAS_SOURCE:
        start, stop, hi, one_run = _tail_blocks(lo, hi, KeyBounds, b, KIND, CAUSAL, HAS_SOURCE, BLOCK_N)
        if one_run:
            if lo < start:
                grad_q, mass = _query_tile(
                    grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row,
                    lo, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                    seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M,
                    BLOCK_N)
            for n0 in range(start, stop, BLOCK_N):
                grad_q, mass = _query_tile(
                    grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row,
                    n0, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                    seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, False, BLOCK_M,
                    BLOCK_N)
            if stop < hi:
                grad_q, mass = _query_tile(
                    grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row,
                    stop, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                    scale_log2, seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True,
                    BLOCK_M, BLOCK_N)
        else:
            for n0 in range(lo, hi, BLOCK_N):
                grad_q, mass = _query_tile(
                    grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row,
                    n0, m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                    seed, head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M,
                    BLOCK_N)
    else:
        edge = _whole_blocks_end(lo, hi, Lk, BLOCK_N)
        for n0 in range(lo, edge, BLOCK_N):
            grad_q, mass = _query_tile(
                grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, n0,
                m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
                head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, False, BLOCK_M, BLOCK_N)
        if edge < hi:  # the last block, ending past the last key (`hi - edge < BLOCK_N`)
            grad_q, mass = _query_tile(
                grad_q, mass, q, do, lse, row_dot, output_term, Kh, Vh, Table, KeyValid, KeyIsSource, key_row, edge,
                m0, offs_m, offset, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
                head, threshold, KIND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    return grad_q, tl.sum(mass, 1)


@triton.jit
def _rotated_query_tile(grad_q, spread, left_mass, right_mass, q, do, rotated_q, rotated_do, lse, row_dot, left_key,
                        right_key, left_out, right_out, reference, Kh, Vh, Sinusoid, KeyValid, KeyIsSource, key_row, n0,
                        m0, offs_m, offset, Lk, K, D: tl.constexpr, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                        scale_log2, seed, head, threshold, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr,
                        HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                        EDGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One band tile of `_rotated_query_band` at key block `n0`: `(grad_q, spread, left_mass, right_mass)` updated
    (`EDGE`: the block may end past the last key)."""
    OPERAND = Vh.dtype.element_ty
    offs_n, k, v = _key_block(Kh, Vh, n0, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, Lk, D, EDGE, BLOCK_N)
    sinusoid = _sinusoid_rows(Sinusoid, tl.minimum(tl.maximum(offs_n - offset - reference + K, 0),
                                                   2 * K + ROTATION - 1), D, offs_d)
    ONE_SIDED: tl.constexpr = 2 * K >= BLOCK_N
    key_term = _product(rotated_q, tl.trans(sinusoid), WIDEN, IEEE)
    output_term = _product(rotated_do, tl.trans(sinusoid), WIDEN, IEEE)
    clip, right = _clip_masks(offset + offs_m, n0, K, BLOCK_N, ONE_SIDED, False)
    key_term = _clipped(key_term, left_key[:, None], right_key[:, None], clip, right, ONE_SIDED)
    output_term = _clipped(output_term, left_out[:, None], right_out[:, None], clip, right, ONE_SIDED)
    scores = _product_into(key_term, q, tl.trans(k), WIDEN, IEEE)
    scores = _seen_in_band(scores, offs_m, offs_n, offset, Lk, KeyValid, KeyIsSource, key_row, HAS_VALID, CAUSAL,
                           HAS_SOURCE, EDGE)
    p = tl.exp2(scores * scale_log2 - lse[:, None])
    grad_p = _product_into(output_term, do, tl.trans(v), WIDEN, IEEE)
    keep = None
    if DROPOUT:
        keep = _kept(seed, head, offs_m, n0, threshold, BLOCK_M, BLOCK_N)
    grad_s = _gradient_of_scores(p, grad_p, keep, row_dot[:, None], 0.0, DROPOUT)[1]
    clip, right = _clip_masks(offset + offs_m, n0, K, BLOCK_N, ONE_SIDED, True)
    inside, left, right = _split_clipped(grad_s, None, clip, right, ONE_SIDED)
    spread = _product_into(spread, inside.to(OPERAND), sinusoid, WIDEN, IEEE)
    grad_q = _product_into(grad_q, grad_s.to(OPERAND), k, WIDEN, IEEE)
    return grad_q, spread, left_mass + left, right_mass + right


@triton.jit
def _rotated_query_band(grad_q, q, do, Kh, Vh, Table, Sinusoid, RowLse, RowDot, RowTerms, RotQ, RotDO, KeyValid,
                        KeyIsSource, key_row, lo, hi, m0, offs_m, offset, Lq, Lk, K, D: tl.constexpr, offs_d,
                        stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head, threshold,
                        HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
                        WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """The band's key blocks `lo .. hi` of the query gradient by rotation (`ROTATE`, as the forward's
    `_rotated_band`): the block's queries and output gradients turned by `s = i - m0'` (`RotQ`, `RotDO`; `m0'` the
    multiple of `ROTATION_ROWS` at or before `m0`), so that a pair inside the band has its key and output terms by
    one product each with the sinusoid's rows of the tile's keys; its table term of `dQ` gathers in `spread = sum_j
    dS_ij E[t_j]`, turned back once after the band. A clipped pair takes its tail's terms (`_band_terms`,
    `_clipped`) and its `dS` the tail's mass (the row's `T[0]` or `T[2K]`). Whole blocks run in a loop without a key
    mask, the one that may end past the last key after it (as the tails', `_forward_tiles`)."""
    rotated_q = _turned(RotQ, head, offs_m, offs_d, Lq, D, True)
    rotated_do = _turned(RotDO, head, offs_m, offs_d, Lq, D, True)
    lse, row_dot, _ = _class_statistics(RowLse, RowDot, head, m0, Lq, BAND, DROPOUT, True, BLOCK_M)
    left_key, right_key, left_out, right_out = _band_terms(RowTerms, head, offs_m, Lq, True)
    reference = m0 // ROTATION * ROTATION
    spread = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    left_mass = tl.zeros([BLOCK_M], tl.float32)
    right_mass = tl.zeros([BLOCK_M], tl.float32)
    edge = _whole_blocks_end(lo, hi, Lk, BLOCK_N)
    for n0 in range(lo, edge, BLOCK_N):
        grad_q, spread, left_mass, right_mass = _rotated_query_tile(
            grad_q, spread, left_mass, right_mass, q, do, rotated_q, rotated_do, lse, row_dot, left_key, right_key,
            left_out, right_out, reference, Kh, Vh, Sinusoid, KeyValid, KeyIsSource, key_row, n0, m0, offs_m, offset,
            Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head, threshold, HAS_VALID,
            CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, False, BLOCK_M, BLOCK_N)
    if edge < hi:  # the last block, ending past the last key (`hi - edge < BLOCK_N`)
        grad_q, spread, left_mass, right_mass = _rotated_query_tile(
            grad_q, spread, left_mass, right_mass, q, do, rotated_q, rotated_do, lse, row_dot, left_key, right_key,
            left_out, right_out, reference, Kh, Vh, Sinusoid, KeyValid, KeyIsSource, key_row, edge, m0, offs_m, offset,
            Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed, head, threshold, HAS_VALID,
            CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, True, BLOCK_M, BLOCK_N)
    angles = _sinusoid_rows(Sinusoid, offs_m % ROTATION, D, offs_d).to(tl.float32)
    grad_q += _rotate_pairs(spread, angles, True, BLOCK_M, BLOCK_D)
    return (grad_q + left_mass[:, None] * _table_row(Table, 0, D, offs_d)[None, :]
            + right_mass[:, None] * _table_row(Table, 2 * K, D, offs_d)[None, :])


def _grad_kernel(
    Q, Kx, V, DO, Table, Sinusoid, RowLse, RowDot, RowTerms, RotQ, RotDO, DQ, DK, DV, KeyValid, KeyIsSource, KeyBounds,
    Offset, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
    heads, Lq, Lk, D: tl.constexpr, K: tl.constexpr, offset, scale, scale_log2, seed: tl.int64, threshold, keep_scale,
    LQ_CLASS, LK_CLASS,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, ROTATE: tl.constexpr, WIDEN: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The body of both backward kernels (`nezha_key_value_grad_kernel`, `nezha_query_grad_kernel`): the gradients
    whose outputs it is given, the others None (`[batch, heads, length, d]` contiguous), recomputing the
    probabilities over the tiles the forward visits (`_program` numbers the programs). `ROTATE`: the band by
    rotation, as the forward's.

    - `DK`, `DV` (`DQ` None): one block of keys of one head, `dK = scale sum_i dS_ij q_i` and `dV = sum_i P~_ij dO_i`
      over the query blocks that see any of its keys: left tail, band, then right tail tiles (`_key_value_tiles`).
    - `DQ` (`DK`, `DV` None): one block of queries of one head, `dQ = scale sum_j dS_ij (k_j + T[r])` over the key
      blocks the forward visits (`_query_tiles`, `_rotated_query_band`)."""
    KEY_VALUE: tl.constexpr = DQ is None
    BLOCK: tl.constexpr = BLOCK_N if KEY_VALUE else BLOCK_M  # the program's rows: keys for dK, dV, queries for dQ
    block, head, b, h, offset = _program(tl.cdiv(Lk if KEY_VALUE else Lq, BLOCK), heads, Offset, offset,
                                         OFFSET_IN_MEMORY)
    seed = _seed(Seed, seed, SEED_IN_MEMORY)
    first = block * BLOCK
    offs = first + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    # The program's own rows load first, the other side's heads are addressed after: ptxas's register choices follow
    # the order (`make gpu-gates` counts the spills of each).
    if KEY_VALUE:
        n0, offs_n = first, offs
        k = _rows(Kx + b * stride_kb + h * stride_kh, offs_n, offs_d, stride_kn, stride_kd, Lk, D, True)
        v = _rows(V + b * stride_vb + h * stride_vh, offs_n, offs_d, stride_vn, stride_vd, Lk, D, True)
        Qh, DOh = Q + b * stride_qb + h * stride_qh, DO + b * stride_ob + h * stride_oh
        key_row = b * Lk  # the sequence's key flags

        lo = 0
        hi = Lq
        if HAS_VALID or HAS_SOURCE:  # a block of padding only is seen by no query
            hi = tl.where((n0 + BLOCK_N <= tl.load(KeyBounds + b * 4)) | (n0 >= tl.load(KeyBounds + b * 4 + 1)), 0,
                          hi)
        if CAUSAL:  # no query before the block's first key sees it, unless it holds a source key
            lo = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
            if HAS_SOURCE:
                lo = tl.where(n0 < tl.load(KeyBounds + b * 4 + 2), 0, lo)
        right_hi, left_lo, hi = _class_bounds(lo, hi, n0 - K - offset + 1, n0 + BLOCK_N - 1 + K - offset, BLOCK_M)

        grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        grad_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # The classes' order is only the sums' order; left tail first compiles to fewer instructions in 5 of the 6
        # tuned (configuration, dropout) kernels, ptxas's register choices (docs/performance.md).
        grad_k, grad_v = _key_value_tiles(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, KeyBounds, b, key_row, left_lo, hi, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm,
            stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold, LEFT, HAS_VALID, CAUSAL, HAS_SOURCE,
            DROPOUT, ROTATE, WIDEN, IEEE, BLOCK_M, BLOCK_N)
        grad_k, grad_v = _key_value_tiles(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, KeyBounds, b, key_row, right_hi, left_lo, n0, offs_n, offset, Lq, Lk, K, D, offs_d,
            stride_qm, stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold, BAND, HAS_VALID, CAUSAL,
            HAS_SOURCE, DROPOUT, ROTATE, WIDEN, IEEE, BLOCK_M, BLOCK_N)
        grad_k, grad_v = _key_value_tiles(
            grad_k, grad_v, k, v, Qh, DOh, RowLse, RowDot, Table, RowTerms, RotQ, RotDO, Sinusoid, KeyValid,
            KeyIsSource, KeyBounds, b, key_row, lo, right_hi, n0, offs_n, offset, Lq, Lk, K, D, offs_d, stride_qm,
            stride_qd, stride_om, stride_od, scale_log2, seed, head, threshold, RIGHT, HAS_VALID, CAUSAL, HAS_SOURCE,
            DROPOUT, ROTATE, WIDEN, IEEE, BLOCK_M, BLOCK_N)
        out = head.to(tl.int64) * Lk * D + offs_n[:, None] * D + offs_d[None, :]
        key_mask = (offs_n < Lk)[:, None] & _columns(offs_d, D)[None, :]
        if DROPOUT:  # `_gradient_of_scores`: dS and the kept probabilities without dropout's `keep_scale`
            grad_k, grad_v = grad_k * keep_scale, grad_v * keep_scale
        tl.store(DK + out, (grad_k * scale).to(DK.dtype.element_ty), mask=key_mask)
        tl.store(DV + out, grad_v.to(DV.dtype.element_ty), mask=key_mask)
    else:
        m0, offs_m = first, offs
        q = _rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qm, stride_qd, Lq, D, True)
        do = _rows(DO + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_om, stride_od, Lq, D, True)
        Kh, Vh = Kx + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh
        key_row = b * Lk

        lo, hi = _keys_of_block(m0, offset, Lk, KeyBounds, b, HAS_VALID, CAUSAL, HAS_SOURCE, BLOCK_M, BLOCK_N)
        band_lo, band_hi, hi = _class_bounds(lo, hi, offset + m0 - K + 1, offset + m0 + BLOCK_M - 1 + K, BLOCK_N)

        grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        grad_q, mass = _query_tiles(
            grad_q, q, do, Kh, Vh, Table, RowLse, RowDot, KeyValid, KeyIsSource, KeyBounds, b, key_row, lo, band_lo,
            m0, offs_m, offset, Lq, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
            head, threshold, LEFT, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M, BLOCK_N)
        grad_q += mass[:, None] * _table_row(Table, 0, D, offs_d)[None, :]
        if ROTATE:
            grad_q = _rotated_query_band(
                grad_q, q, do, Kh, Vh, Table, Sinusoid, RowLse, RowDot, RowTerms, RotQ, RotDO, KeyValid, KeyIsSource,
                key_row, band_lo, band_hi, m0, offs_m, offset, Lq, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn,
                stride_vd, scale_log2, seed, head, threshold, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE,
                BLOCK_M, BLOCK_N, BLOCK_D)
        else:
            grad_q, _ = _query_tiles(
                grad_q, q, do, Kh, Vh, Table, RowLse, RowDot, KeyValid, KeyIsSource, KeyBounds, b, key_row, band_lo,
                band_hi, m0, offs_m, offset, Lq, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                scale_log2, seed, head, threshold, BAND, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M,
                BLOCK_N)
        grad_q, mass = _query_tiles(
            grad_q, q, do, Kh, Vh, Table, RowLse, RowDot, KeyValid, KeyIsSource, KeyBounds, b, key_row, band_hi, hi,
            m0, offs_m, offset, Lq, Lk, K, D, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, seed,
            head, threshold, RIGHT, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE, BLOCK_M, BLOCK_N)
        grad_q += mass[:, None] * _table_row(Table, 2 * K, D, offs_d)[None, :]
        if DROPOUT:
            grad_q *= keep_scale  # `_gradient_of_scores`: dS without dropout's `keep_scale`
        tl.store(DQ + head.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :],
                 (grad_q * scale).to(DQ.dtype.element_ty), mask=(offs_m < Lq)[:, None] & _columns(offs_d, D)[None, :])


def _autotuned_grad_kernel(name: str, configs: list):
    """`_grad_kernel` as a kernel of its own, tuned over `configs` and compiled under `name` (what the SASS, the
    gates and a profiler call it): each has its own autotuner and JIT cache."""
    return triton.autotune(configs=configs, key=[*TUNING_KEY, "ROTATE"], prune_configs_by=BACKWARD_PRUNING)(
        triton.jit(_grad_kernel, do_not_specialize=CALL_VALUES, repr=lambda _: name))


# The launchers give each the outputs of its own gradients and None for the others (`triton_attention`).
nezha_key_value_grad_kernel = _autotuned_grad_kernel("nezha_key_value_grad_kernel", KEY_VALUE_GRAD_CONFIGS)
nezha_query_grad_kernel = _autotuned_grad_kernel("nezha_query_grad_kernel", QUERY_GRAD_CONFIGS)
