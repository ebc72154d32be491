"""The yardstick: plain FlashAttention-2 in Triton, forward and backward, no relative terms and no mask.

What NEZHA's Triton kernels (`nezha_hf/triton_kernels.py`) are measured against: `benchmarks/gpu/gpu_gates.py` compiles
these kernels with the same blocks, warps and stages as each of NEZHA's tuned configurations and compares the
instructions of their loops. Written the way Triton's fused-attention tutorial structures FlashAttention-2: scores
in base 2 with the scale folded into the exponent's argument, the online softmax per key block, `dK` and `dV` per key
block computing `S^T = K Q^T` (so that the key block's rows are the products' rows), `dQ` per query block; the
backward recomputes the probabilities from the forward's log-sum-exp. Lengths are whole numbers of blocks, so no
tile has a mask: the loops are the bare FlashAttention-2 tile.

It lives with the benchmarks, not in the package: nothing a user runs calls it. The kernels import only Triton (the
gates compile them in an environment without PyTorch); the launchers import torch when called.
"""

import triton
import triton.language as tl


@triton.jit
def yardstick_forward_kernel(Q, K, V, Out, Lse, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh,
                             stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, heads, L, scale_log2,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One block of queries of one head: the output (`[batch, heads, L, d]` contiguous) and the base-2 log-sum-exp."""
    block, head = tl.program_id(0), tl.program_id(1)
    b, h = (head // heads).to(tl.int64), (head % heads).to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        k = tl.load(k_ptrs + n0 * stride_kn)
        scores = tl.dot(q, tl.trans(k))
        new_max = tl.maximum(row_max, tl.max(scores, 1) * scale_log2)
        p = tl.exp2(scores * scale_log2 - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_ptrs + n0 * stride_vn)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None])
        row_max = new_max
    out = Out + head.to(tl.int64) * L * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(out, (acc / row_sum[:, None]).to(Out.dtype.element_ty))
    tl.store(Lse + head.to(tl.int64) * L + offs_m, row_max + tl.log2(row_sum))


@triton.jit
def yardstick_key_value_grad_kernel(Q, K, V, DO, Lse, RowDot, DK, DV, stride_b, stride_h, stride_m, stride_d, heads,
                                    L, scale, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr):
    """One block of keys of one head: `dK` and `dV` (`[batch, heads, L, d]` contiguous, like every input here)."""
    block, head = tl.program_id(0), tl.program_id(1)
    base = (head // heads).to(tl.int64) * stride_b + (head % heads).to(tl.int64) * stride_h
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_n[:, None] * stride_m + offs_d[None, :] * stride_d
    k, v = tl.load(K + base + rows), tl.load(V + base + rows)
    q_t_ptrs = Q + base + offs_m[None, :] * stride_m + offs_d[:, None] * stride_d  # `Q^T`, `[HEAD_DIM, BLOCK_M]`
    do_ptrs = DO + base + offs_m[:, None] * stride_m + offs_d[None, :] * stride_d
    statistics = head.to(tl.int64) * L + offs_m
    grad_k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    grad_v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for m0 in range(0, L, BLOCK_M):
        q_t = tl.load(q_t_ptrs + m0 * stride_m)
        lse = tl.load(Lse + statistics + m0)
        p_t = tl.exp2(tl.dot(k, q_t) * scale_log2 - lse[None, :])
        do = tl.load(do_ptrs + m0 * stride_m)
        grad_v = tl.dot(p_t.to(do.dtype), do, grad_v)
        grad_p_t = tl.dot(v, tl.trans(do))
        grad_s_t = p_t * (grad_p_t - tl.load(RowDot + statistics + m0)[None, :])
        grad_k = tl.dot(grad_s_t.to(do.dtype), tl.trans(q_t), grad_k)
    out = head.to(tl.int64) * L * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (grad_k * scale).to(DK.dtype.element_ty))
    tl.store(DV + out, grad_v.to(DV.dtype.element_ty))


@triton.jit
def yardstick_query_grad_kernel(Q, K, V, DO, Lse, RowDot, DQ, stride_b, stride_h, stride_m, stride_d, heads, L, scale,
                                scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One block of queries of one head: `dQ` (`[batch, heads, L, d]` contiguous)."""
    block, head = tl.program_id(0), tl.program_id(1)
    base = (head // heads).to(tl.int64) * stride_b + (head % heads).to(tl.int64) * stride_h
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] * stride_m + offs_d[None, :] * stride_d
    q, do = tl.load(Q + base + rows), tl.load(DO + base + rows)
    lse = tl.load(Lse + head.to(tl.int64) * L + offs_m)
    row_dot = tl.load(RowDot + head.to(tl.int64) * L + offs_m)
    columns = offs_n[None, :] * stride_m + offs_d[:, None] * stride_d  # `K^T`, `V^T`: `[HEAD_DIM, BLOCK_N]`
    grad_q = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        k_t = tl.load(K + base + columns + n0 * stride_m)
        p = tl.exp2(tl.dot(q, k_t) * scale_log2 - lse[:, None])
        v_t = tl.load(V + base + columns + n0 * stride_m)
        grad_s = p * (tl.dot(do, v_t) - row_dot[:, None])
        grad_q = tl.dot(grad_s.to(q.dtype), tl.trans(k_t), grad_q)
    out = head.to(tl.int64) * L * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out, (grad_q * scale).to(DQ.dtype.element_ty))


def yardstick_forward(query, key, value, scale: float, block_m: int = 128, block_n: int = 64, warps: int = 8,
                      stages: int = 3, registers: int | None = None):
    """Plain attention of `[batch, heads, L, d]` tensors (L a whole number of both blocks, d a power of two of at
    least 16): `(output [batch, heads, L, d], base-2 log-sum-exp [batch, heads, L] float32)`. `registers` caps a
    thread's (Triton's `maxnreg`), as a capped NEZHA configuration is."""
    import torch

    batch, heads, length, size = query.shape
    assert length % block_m == 0 and length % block_n == 0, "the yardstick takes whole blocks only"
    output = torch.empty(batch, heads, length, size, dtype=query.dtype, device=query.device)
    lse = torch.empty(batch, heads, length, dtype=torch.float32, device=query.device)
    yardstick_forward_kernel[(length // block_m, batch * heads)](
        query, key, value, output, lse, *query.stride(), *key.stride(), *value.stride(), heads, length,
        scale * 1.4426950408889634, HEAD_DIM=size, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        num_stages=stages, **({"maxnreg": registers} if registers else {}))
    return output, lse


def yardstick_backward(grad_output, query, key, value, output, lse, scale: float, key_blocks=(32, 64, 8, 2),
                       query_blocks=(64, 32, 8, 2)):
    """`(dQ, dK, dV)` of `yardstick_forward` (every tensor `[batch, heads, L, d]` contiguous); `key_blocks` and
    `query_blocks` are `(BLOCK_M, BLOCK_N, warps, stages)` of the dK/dV and dQ kernels."""
    import torch

    batch, heads, length, size = query.shape
    tensors = [t.contiguous() for t in (query, key, value, grad_output)]
    row_dot = (grad_output.float() * output.float()).sum(-1).contiguous()  # D_i = dO_i . O_i
    grad_query, grad_key, grad_value = (torch.empty_like(t) for t in tensors[:3])
    strides = tensors[0].stride()
    shared = dict(heads=heads, L=length, scale=scale, scale_log2=scale * 1.4426950408889634, HEAD_DIM=size)
    block_m, block_n, warps, stages = key_blocks
    yardstick_key_value_grad_kernel[(length // block_n, batch * heads)](
        *tensors, lse, row_dot, grad_key, grad_value, *strides, **shared, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    block_m, block_n, warps, stages = query_blocks
    yardstick_query_grad_kernel[(length // block_m, batch * heads)](
        *tensors, lse, row_dot, grad_query, *strides, **shared, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        num_stages=stages)
    return grad_query, grad_key, grad_value
