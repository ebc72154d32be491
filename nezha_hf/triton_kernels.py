"""NEZHA attention as Triton kernels (flash attention's scheme), for `triton_attention.py`, which launches them.

For a block of queries against a block of keys, with `r = clip(j - i, -K, K) + K`:

- the key term `q_i . T[r]` is looked up per pair in `query_table = q @ T^T` (`[rows, 2K + 1]` per head, made before
  the kernel), so a score costs one load more than plain attention;
- the value term `sum_j p_ij T[r]` is split by distance: in the band `|j - i| < K` each table row meets exactly one key
  per query, so the band's scores are stored per (query, row) and turned into probabilities once the row's maximum and
  sum are known (`p_band @ T`, in blocks of table rows); the two tails (`r = 0` and `r = 2K`) are masked row sums that
  ride along with the online softmax like its normaliser.

The backward is FlashAttention-2's: one kernel over key blocks for the key and value gradients and one over query
blocks for the query gradients, both recomputing the probabilities from the forward's log-sum-exp; the query kernel
splits `dS @ (k + T[r])` the same way. Attention dropout is regenerated from (seed, head, query, key) by Triton's
Philox counter, so the backward redraws the forward's mask without storing it.

Every block product accumulates in float32. float32 inputs multiply in IEEE float32 (not TF32), as PyTorch's own
attention does by default; bfloat16 and float16 inputs multiply in their type, probabilities rounded to it first.

Imported only where Triton is installed and a kernel can run (`triton_attention.py` checks).
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # transformers' remote-code check skips imports inside `try`: Triton stays optional
    raise ImportError("nezha_hf's Triton kernels need Triton: pip install triton") from error


# Triton 3.9's interpreter multiplies bfloat16 `tl.dot` operands as their raw 16-bit integers (it keeps bfloat16 as
# uint16 for numpy), so under TRITON_INTERPRET=1 the kernels widen them to float32 first: exact (every bfloat16 is a
# float32), and the float32 sums are what the GPU's bfloat16 products accumulate into.
INTERPRETING = triton.knobs.runtime.interpret  # what Triton decided when it was imported (TRITON_INTERPRET)

# FlashAttention-2's Triton forward tunes these (and 16 queries, for decoding steps); under the interpreter one small
# block, so tests cross block edges.
if INTERPRETING:
    FORWARD_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})]
else:
    FORWARD_CONFIGS = [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_stages=stages, num_warps=warps)
                       for block_m in (16, 64, 128) for block_n in (32, 64) for stages in (2, 3) for warps in (4, 8)]


def length_class(length: int) -> int:
    """What the forward's tuning is keyed on instead of a length: its power of two (at least 16), so that a decoding
    loop, whose key length grows by one per step, tunes once per doubling rather than at every step."""
    return max(16, 1 << (max(length, 1) - 1).bit_length())


def _configs_for(configs, named_args, **kwargs):
    """No block of more queries than the call's length class has (a decoding step gets blocks of 16)."""
    queries = named_args["LQ_CLASS"]
    return [config for config in configs if config.kwargs["BLOCK_M"] <= queries] or configs[:1]


@triton.jit
def _tile(base, stride_b, stride_h, stride_l, stride_d, b, h, offs_l, offs_d, L, D):
    """Rows `offs_l` of head `(b, h)` of a `[batch, heads, length, d]`-strided tensor, zeros outside `L` x `D`."""
    return tl.load(base + b * stride_b + h * stride_h + offs_l[:, None] * stride_l + offs_d[None, :] * stride_d,
                   mask=(offs_l < L)[:, None] & (offs_d < D)[None, :], other=0.0)


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
def _distance_and_scores(raw, query_table_rows, offs_m, offs_n, Lq, Lk, K, R, offset, scale, key_valid_ptr,
                         key_is_source_ptr, HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr):
    """`(j - i, r, inside the call, scores)` of a block: `(q . k + q . T[r]) * scale`, -inf where the query does not see
    the key (padding, the causal or UniLM prefix rule, outside the call). `raw` is `q @ k^T`; `query_table_rows` points
    at the block's rows of `q @ T^T`."""
    distance = offs_n[None, :] - (offs_m + offset)[:, None]
    index = tl.minimum(tl.maximum(distance, -K), K) + K
    inside = (offs_m < Lq)[:, None] & (offs_n < Lk)[None, :]
    key_term = tl.load(query_table_rows + offs_m[:, None] * R + index, mask=inside, other=0.0)
    scores = (raw + key_term) * scale
    visible = inside
    if CAUSAL:
        sees = distance <= 0
        if HAS_SOURCE:
            source = tl.load(key_is_source_ptr + offs_n, mask=offs_n < Lk, other=0)
            sees = sees | (source != 0)[None, :]
        visible = visible & sees
    if HAS_VALID:
        valid = tl.load(key_valid_ptr + offs_n, mask=offs_n < Lk, other=0)
        visible = visible & (valid != 0)[None, :]
    return distance, index, inside, tl.where(visible, scores, float("-inf"))


@triton.jit
def _keep_factor(seed, head, offs_m, offs_n, Lq, Lk, dropout):
    """Dropout's factor for each pair of a block: `1 / (1 - p)` where kept, 0 where dropped; one Philox draw per
    (head, query, key), the same in the forward and the backward."""
    counter = (head.to(tl.int64) * Lq + offs_m)[:, None] * Lk + offs_n[None, :]
    kept = tl.rand(seed, counter) >= dropout
    return tl.where(kept, 1.0 / (1.0 - dropout), 0.0)


@triton.jit
def _add_table_rows(acc, band_rows, shift, table_ptr, offs_m, offs_d, Lq, R, D, BLOCK_R: tl.constexpr,
                    SCORES: tl.constexpr, OPERAND: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr):
    """`acc + w @ T` for the block's rows of a `[queries, 2K + 1]` band buffer (`band_rows`), in blocks of `BLOCK_R`
    table rows: `w = exp(band - shift)` when it holds scores (`SCORES`, the forward), else `w = band` (the
    backward's dS)."""
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        band_mask = (offs_m < Lq)[:, None] & (offs_r < R)[None, :]
        if SCORES:
            band = tl.load(band_rows + offs_m[:, None] * R + offs_r[None, :], mask=band_mask, other=float("-inf"))
            band = tl.exp(band - shift[:, None])
        else:
            band = tl.load(band_rows + offs_m[:, None] * R + offs_r[None, :], mask=band_mask, other=0.0)
        table = tl.load(table_ptr + offs_r[:, None] * D + offs_d[None, :],
                        mask=(offs_r < R)[:, None] & (offs_d < D)[None, :], other=0.0)
        acc += _product(band.to(OPERAND), table.to(OPERAND), WIDEN, IEEE)
    return acc


@triton.jit
def _split_by_distance(weights, band_values, distance, band_rows, offs_m, offs_n, Lq, Lk, K, R):
    """The tails' sums of a block's `weights`, `(left, right)` (`j - i <= -K`, `>= K`); stores `band_values` of the band
    `|j - i| < K` into the `[queries, 2K + 1]` buffer `band_rows` at row `r` (one key per query and row)."""
    in_band = (distance > -K) & (distance < K) & (offs_m < Lq)[:, None] & (offs_n < Lk)[None, :]
    tl.store(band_rows + offs_m[:, None] * R + distance + K, band_values, mask=in_band)
    return tl.sum(tl.where(distance <= -K, weights, 0.0), 1), tl.sum(tl.where(distance >= K, weights, 0.0), 1)


@triton.jit
def _keys_seen(Lk, offset, block, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr):
    """The keys a query block's loop covers: all, or under a causal mask without source keys those up to its last
    query."""
    if CAUSAL and not HAS_SOURCE:
        return tl.minimum(Lk, offset + (block + 1) * BLOCK_M)
    return Lk


@triton.jit
def _tails(acc, left, right, table_ptr, offs_d, K, D):
    """`acc + left * T[0] + right * T[2K]`: the tails' masses times their one table row."""
    first = tl.load(table_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    last = tl.load(table_ptr + 2 * K * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    return acc + left[:, None] * first[None, :] + right[:, None] * last[None, :]


@triton.autotune(configs=FORWARD_CONFIGS, key=["LQ_CLASS", "LK_CLASS", "BLOCK_D", "R", "CAUSAL", "DROPOUT"],
                 prune_configs_by={"early_config_prune": _configs_for})
@triton.jit
def nezha_forward_kernel(
    Q, Kx, V, QT, Table, Band, Out, Lse, KeyValid, KeyIsSource,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
    H, Lq, Lk, D, R, offset, scale, dropout, seed, LQ_CLASS, LK_CLASS,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
    WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One block of queries of one head: the output and the rows' log-sum-exp (-inf where a query sees nothing).
    `LQ_CLASS` and `LK_CLASS` (`length_class`) are what the tuning is keyed on; the kernel does not read them."""
    block, head = tl.program_id(0), tl.program_id(1)
    b, h = head // H, head % H
    K = (R - 1) // 2
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_in = offs_m < Lq
    q = _tile(Q, stride_qb, stride_qh, stride_qm, stride_qd, b, h, offs_m, offs_d, Lq, D)
    query_table = QT + head.to(tl.int64) * Lq * R
    band_rows = Band + head.to(tl.int64) * Lq * R
    key_valid, key_is_source = KeyValid + b * Lk, KeyIsSource + b * Lk
    OPERAND = V.dtype.element_ty

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    left_mass = tl.zeros([BLOCK_M], tl.float32)
    right_mass = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, _keys_seen(Lk, offset, block, BLOCK_M, CAUSAL, HAS_SOURCE), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _tile(Kx, stride_kb, stride_kh, stride_kn, stride_kd, b, h, offs_n, offs_d, Lk, D)
        v = _tile(V, stride_vb, stride_vh, stride_vn, stride_vd, b, h, offs_n, offs_d, Lk, D)
        distance, _, _, scores = _distance_and_scores(_product(q, tl.trans(k), WIDEN, IEEE), query_table, offs_m,
                                                      offs_n, Lq, Lk, K, R, offset, scale, key_valid, key_is_source,
                                                      HAS_VALID, CAUSAL, HAS_SOURCE)
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen nothing yet stays at 0
        rescale = tl.exp(row_max - shift)
        p = tl.exp(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        stored = scores
        if DROPOUT:
            factor = _keep_factor(seed, head, offs_m, offs_n, Lq, Lk, dropout)
            p = p * factor
            stored = tl.where(factor > 0, scores - tl.log(1.0 - dropout), float("-inf"))
        acc = acc * rescale[:, None] + _product(p.to(OPERAND), v, WIDEN, IEEE)
        left, right = _split_by_distance(p, stored, distance, band_rows, offs_m, offs_n, Lq, Lk, K, R)
        left_mass = left_mass * rescale + left
        right_mass = right_mass * rescale + right
        row_max = new_max

    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    tl.debug_barrier()  # the band's scores, stored by every thread, are read back by others
    # The band's probabilities, now that the row's maximum is final.
    acc = _add_table_rows(acc, band_rows, shift, Table, offs_m, offs_d, Lq, R, D, BLOCK_R, True, OPERAND, WIDEN, IEEE)
    acc = _tails(acc, left_mass, right_mass, Table, offs_d, K, D)
    nothing = row_sum == 0.0
    out = acc / tl.where(nothing, 1.0, row_sum)[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=rows_in[:, None] & (offs_d < D)[None, :])
    lse = tl.where(nothing, float("-inf"), shift + tl.log(tl.where(nothing, 1.0, row_sum)))
    tl.store(Lse + head.to(tl.int64) * Lq + offs_m, lse, mask=rows_in)


@triton.jit
def _block_gradients(q, do, k, v, lse, row_dot, query_table, output_table, offs_m, offs_n, head, Lq, Lk, K, R,
                     offset, scale, dropout, seed, key_valid, key_is_source, HAS_VALID: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, WIDEN: tl.constexpr,
                     IEEE: tl.constexpr):
    """For a block: `(j - i, dropped-out probabilities, dS)`, recomputing the probabilities from the forward's lse.
    `dP_ij = dO_i . (v_j + T[r])` (the table part looked up in `dO @ T^T`), `dS = P (dP z - D)` for dropout's factor
    `z` and `D_i = dO_i . O_i`."""
    distance, index, inside, scores = _distance_and_scores(_product(q, tl.trans(k), WIDEN, IEEE), query_table, offs_m,
                                                           offs_n, Lq, Lk, K, R, offset, scale, key_valid,
                                                           key_is_source, HAS_VALID, CAUSAL, HAS_SOURCE)
    p = tl.exp(scores - tl.where(lse == float("-inf"), 0.0, lse)[:, None])
    grad_p = _product(do, tl.trans(v), WIDEN, IEEE)
    grad_p += tl.load(output_table + offs_m[:, None] * R + index, mask=inside, other=0.0)
    kept = p
    if DROPOUT:
        factor = _keep_factor(seed, head, offs_m, offs_n, Lq, Lk, dropout)
        kept = p * factor
        grad_p = grad_p * factor
    return distance, kept, p * (grad_p - row_dot[:, None])


BACKWARD_BLOCKS = (16, 16) if INTERPRETING else (64, 64)  # FlashAttention-2's Triton backward: fixed blocks


@triton.jit
def nezha_key_value_grad_kernel(
    Q, Kx, V, DO, QT, OT, Lse, RowDot, DK, DV, KeyValid, KeyIsSource,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
    H, Lq, Lk, D, R, offset, scale, dropout, seed,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
    WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One block of keys of one head: `dK = scale sum_i dS_ij q_i`, `dV = sum_i P~_ij dO_i` (float32, `[batch, heads,
    keys, head_size]` contiguous)."""
    block, head = tl.program_id(0), tl.program_id(1)
    b, h = head // H, head % H
    K = (R - 1) // 2
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_mask = (offs_n < Lk)[:, None] & (offs_d < D)[None, :]
    k = _tile(Kx, stride_kb, stride_kh, stride_kn, stride_kd, b, h, offs_n, offs_d, Lk, D)
    v = _tile(V, stride_vb, stride_vh, stride_vn, stride_vd, b, h, offs_n, offs_d, Lk, D)
    query_table, output_table = QT + head.to(tl.int64) * Lq * R, OT + head.to(tl.int64) * Lq * R
    OPERAND = V.dtype.element_ty
    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start = 0
    if CAUSAL and not HAS_SOURCE:  # no query before the block's first key sees it
        start = tl.maximum(block * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for m0 in range(start, Lq, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _tile(Q, stride_qb, stride_qh, stride_qm, stride_qd, b, h, offs_m, offs_d, Lq, D)
        do = _tile(DO, stride_ob, stride_oh, stride_om, stride_od, b, h, offs_m, offs_d, Lq, D)
        lse = tl.load(Lse + head.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
        row_dot = tl.load(RowDot + head.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
        _, kept, grad_s = _block_gradients(q, do, k, v, lse, row_dot, query_table, output_table, offs_m, offs_n,
                                           head, Lq, Lk, K, R, offset, scale, dropout, seed, KeyValid + b * Lk,
                                           KeyIsSource + b * Lk, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN, IEEE)
        grad_v += _product(tl.trans(kept.to(OPERAND)), do, WIDEN, IEEE)
        grad_k += _product(tl.trans(grad_s.to(OPERAND)), q, WIDEN, IEEE)
    out = head.to(tl.int64) * Lk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, grad_k * scale, mask=key_mask)
    tl.store(DV + out, grad_v, mask=key_mask)


@triton.jit
def nezha_query_grad_kernel(
    Q, Kx, V, DO, QT, OT, Lse, RowDot, Table, Band, DQ, KeyValid, KeyIsSource,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
    H, Lq, Lk, D, R, offset, scale, dropout, seed,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOURCE: tl.constexpr, DROPOUT: tl.constexpr,
    WIDEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One block of queries of one head: `dQ = scale sum_j dS_ij (k_j + T[r])` (float32, `[batch, heads, queries,
    head_size]` contiguous); the band's `dS` go through `Band` (zeros) as the forward's probabilities do."""
    block, head = tl.program_id(0), tl.program_id(1)
    b, h = head // H, head % H
    K = (R - 1) // 2
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_in = offs_m < Lq
    row_mask = rows_in[:, None] & (offs_d < D)[None, :]
    q = _tile(Q, stride_qb, stride_qh, stride_qm, stride_qd, b, h, offs_m, offs_d, Lq, D)
    do = _tile(DO, stride_ob, stride_oh, stride_om, stride_od, b, h, offs_m, offs_d, Lq, D)
    lse = tl.load(Lse + head.to(tl.int64) * Lq + offs_m, mask=rows_in, other=0.0)
    row_dot = tl.load(RowDot + head.to(tl.int64) * Lq + offs_m, mask=rows_in, other=0.0)
    query_table, output_table = QT + head.to(tl.int64) * Lq * R, OT + head.to(tl.int64) * Lq * R
    band_rows = Band + head.to(tl.int64) * Lq * R
    OPERAND = V.dtype.element_ty
    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    left_sum = tl.zeros([BLOCK_M], tl.float32)
    right_sum = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, _keys_seen(Lk, offset, block, BLOCK_M, CAUSAL, HAS_SOURCE), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _tile(Kx, stride_kb, stride_kh, stride_kn, stride_kd, b, h, offs_n, offs_d, Lk, D)
        v = _tile(V, stride_vb, stride_vh, stride_vn, stride_vd, b, h, offs_n, offs_d, Lk, D)
        distance, _, grad_s = _block_gradients(q, do, k, v, lse, row_dot, query_table, output_table, offs_m, offs_n,
                                               head, Lq, Lk, K, R, offset, scale, dropout, seed, KeyValid + b * Lk,
                                               KeyIsSource + b * Lk, HAS_VALID, CAUSAL, HAS_SOURCE, DROPOUT, WIDEN,
                                               IEEE)
        grad_q += _product(grad_s.to(OPERAND), k, WIDEN, IEEE)
        left, right = _split_by_distance(grad_s, grad_s, distance, band_rows, offs_m, offs_n, Lq, Lk, K, R)
        left_sum += left
        right_sum += right
    tl.debug_barrier()  # the band's dS, stored by every thread, are read back by others
    grad_q = _add_table_rows(grad_q, band_rows, lse, Table, offs_m, offs_d, Lq, R, D, BLOCK_R, False, OPERAND, WIDEN,
                             IEEE)
    grad_q = _tails(grad_q, left_sum, right_sum, Table, offs_d, K, D)
    tl.store(DQ + head.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :], grad_q * scale, mask=row_mask)
