"""Where the time of one attention call goes, against one SDPA call of the same size.

    python benchmarks/attention_parts.py --length 2048

One attention layer's worth of heads (batch 1, 12 heads, head size 64, K = 64, `--dtype` (float32), no mask).
Each line is the median of `--repeats` runs of: PyTorch's SDPA (what BERT uses), the compiled
kernel (the default), and for the PyTorch-only three-region path its two tails' fused-kernel
calls, the band (all its chunks) and the whole function, forward and backward separately. The backward lines reuse the
forward's saved state, as autograd does. The decode lines are one decoding step (one query against `--length` cached
keys), from a cache laid out as transformers keeps it and from per-head views of `[batch, length, heads, head size]`.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nezha_hf import fused_attention, three_regions  # noqa: E402
from nezha_hf import relative_attention as ra  # noqa: E402
from nezha_hf.attention_ops import AttentionProblem  # noqa: E402
from benchmarks.machine import describe, summary  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    length, heads, size, K, scale = args.length, 12, 64, 64, 64**-0.5
    torch.manual_seed(0)
    # [batch, heads, L, d] views of [batch, L, heads, d], as the model passes them.
    query, key, value = (torch.randn(1, length, heads, size, dtype=dtype).transpose(1, 2) for _ in range(3))
    grad = torch.randn(1, heads, length, size, dtype=dtype)
    table = ra.sinusoid_relative_table(K, size).to(dtype)  # in the inputs' type, as the model passes it
    problem = AttentionProblem(ra.RelativeAttentionMask(), scale)
    band, tails = three_regions._regions(query, table, problem)
    lse = torch.zeros(1, heads, length)

    def tails_forward():
        return [tail.forward(query, key, value, scale) for tail in tails]

    def tails_backward():
        for tail in tails:
            tail.backward(grad, query, key, value, grad, lse, scale)

    def band_forward():
        return [band.forward(query, key, value, scale, part) for part in band.chunks()]

    def band_backward():
        return [band.backward(grad, query, key, value, grad, lse, scale, part) for part in band.chunks()]

    def three_regions_forward():
        return three_regions.three_regions_attention(query, key, value, table, problem)

    leaves = [t.detach().requires_grad_() for t in (query, key, value)]

    def three_regions_forward_backward():
        three_regions.three_regions_attention(*leaves, table, problem).transpose(1, 2).backward(grad)

    if fused_attention.fused_kernel() is None:
        raise SystemExit("the compiled kernel is unavailable here (see the logged error)")

    def kernel_forward():
        return fused_attention.fused_attention(query, key, value, table, problem)

    def kernel_forward_backward():
        fused_attention.fused_attention(*leaves, table, problem).transpose(1, 2).backward(grad)

    def sdpa_forward():
        return torch.nn.functional.scaled_dot_product_attention(query, key, value)

    def sdpa_forward_backward():
        torch.nn.functional.scaled_dot_product_attention(*leaves).backward(grad)

    # A decoding step: one query at position L against L + 1 cached keys, from the cache transformers keeps
    # ([batch, heads, length, head size]) and from per-head views of [batch, length, heads, head size] (rows of a
    # head 3 KB apart).
    step = AttentionProblem(ra.RelativeAttentionMask(causal=True, query_offset=length), scale)
    step_query = torch.randn(1, heads, 1, size, dtype=dtype)
    layouts = {"[B,H,L,d]": [torch.randn(1, heads, length + 1, size, dtype=dtype) for _ in range(2)],
               "[B,L,H,d]": [torch.randn(1, length + 1, heads, size, dtype=dtype).transpose(1, 2) for _ in range(2)]}

    def decoding_step(cache, engine):
        if engine == "SDPA":
            return lambda: torch.nn.functional.scaled_dot_product_attention(step_query, *cache)
        return lambda: fused_attention.fused_attention(step_query, *cache, table, step)

    no_grad = torch.no_grad()
    cases = {
        ("forward", "SDPA"): no_grad(sdpa_forward),
        ("forward", "compiled kernel (default)"): no_grad(kernel_forward),
        ("forward", "tails (two causal kernel calls)"): no_grad(tails_forward),
        ("forward", "band (kernel on windows)"): no_grad(band_forward),
        ("forward", "three regions (all, with merging)"): no_grad(three_regions_forward),
        ("backward", "tails"): no_grad(tails_backward),
        ("backward", "band"): no_grad(band_backward),
        ("forward+backward", "SDPA"): sdpa_forward_backward,
        ("forward+backward", "compiled kernel (default)"): kernel_forward_backward,
        ("forward+backward", "three regions"): three_regions_forward_backward,
        **{(f"decode {layout}", name): no_grad(decoding_step(cache, name))
           for layout, cache in layouts.items() for name in ("SDPA", "compiled kernel (default)")},
    }
    samples = {case: [] for case in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.repeats):  # round robin, so a slow spell of the machine hits every case alike
        for case, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[case].append(time.perf_counter() - start)
    ms = {case: 1e3 * statistics.median(values) for case, values in samples.items()}
    ms[("backward", "SDPA (forward+backward - forward)")] = ms[("forward+backward", "SDPA")] - ms[("forward", "SDPA")]

    print(summary(describe(dtype)))
    print(f"L = {length}, {heads} heads, head size {size}, K = {K}, {args.dtype}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} (ms)")
    for section in ("forward", "backward", "forward+backward", *(f"decode {layout}" for layout in layouts)):
        reference = next(value for (part, name), value in ms.items() if part == section and name.startswith("SDPA"))
        for (part, name), value in sorted(ms.items(), key=lambda item: not item[0][1].startswith("SDPA")):
            if part == section:
                print(f"{section:17s} {name:36s} {value:8.1f}   {value / reference:5.2f}x SDPA")


if __name__ == "__main__":
    main()
