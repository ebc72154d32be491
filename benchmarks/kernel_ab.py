"""Two versions of the fused kernel against each other and against SDPA, in one process: is a change faster?

    python benchmarks/kernel_ab.py --against HEAD~1 --dtype bfloat16 --lengths 512 2048 8192

Builds the kernel source as it is at the git revision `--against` beside the working tree's (the package's own build),
checks whether the two compute the same bits (forward and backward, a few shapes, masks and block sizes), then times
one attention layer (batch 1, 12 heads, head size 64, K = 64, `[batch, heads, length, head size]` views of `[batch,
length, heads, head size]` as the models pass them) round robin: SDPA, the revision's kernel, the working tree's, for
`--seconds` per length. `--pass forward` (the default) times the forward; `--pass training` a forward and its
backward (SDPA through autograd, the kernels' two calls as the op makes them). On a shared machine the times of separate processes swing by more than most
changes (docs/performance.md); within one process, round robin, a slow spell hits all three alike. Prints the
machine, the medians and the ratios to SDPA; writes nothing.
"""

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.machine import describe, summary  # noqa: E402
from nezha_hf import fused_attention  # noqa: E402
from nezha_hf import relative_attention as ra  # noqa: E402
from nezha_hf.attention_ops import AttentionProblem  # noqa: E402

HEADS, HEAD_SIZE, K = 12, 64, 64
# (length, head size, K, causal, (query block, key block)): odd lengths, a last block of fewer than 16 keys, other head
# sizes, explicit blocks.
SAME_BITS_CASES = [(601, 64, 64, False, (0, 0)), (37, 64, 8, True, (0, 0)), (130, 128, 64, False, (32, 64)),
                   (17, 96, 5, True, (0, 0)), (1000, 80, 40, False, (64, 128))]


def build_revision(revision: str):
    """The kernel as its source is at `revision`, built under its own name (the hash of that source)."""
    relative = fused_attention.KERNEL_SOURCE.relative_to(REPO).as_posix()
    try:
        source = subprocess.run(["git", "show", f"{revision}:{relative}"], cwd=REPO, capture_output=True, check=True).stdout
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"kernel_ab.py: no {relative} at {revision!r}: {error.stderr.decode().strip()}") from None
    name = f"nezha_hf_kernel_ab_{hashlib.sha1(source).hexdigest()[:12]}"
    directory = fused_attention.build_directory().with_name(name)
    directory.mkdir(parents=True, exist_ok=True)
    family = fused_attention.compiler_family(fused_attention.compiler()) or "gcc"
    return fused_attention.compile_kernel(directory, source, family)


def same_bits(old, new, dtype: torch.dtype) -> list[str]:
    """The cases of `SAME_BITS_CASES` where the two kernels' outputs, log-sum-exps or gradients differ in any bit."""
    differing = []
    for length, size, k, causal, blocks in SAME_BITS_CASES:
        torch.manual_seed(length)
        query, key, value = (torch.randn(2, length, 3, size).to(dtype).transpose(1, 2) for _ in range(3))
        table = ra.sinusoid_relative_table(k, size).to(dtype).float()
        problem = AttentionProblem(ra.RelativeAttentionMask(causal=causal), size**-0.5)
        grad = torch.randn(2, length, 3, size).to(dtype).transpose(1, 2)
        results = []
        for kernel in (old, new):
            output, lse = kernel.forward(query, key, value, table, problem, *blocks)
            grads = kernel.backward(grad, query, key, value, output.transpose(1, 2), lse, table, problem, *blocks)
            results.append((output, lse, *grads))
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            differing.append(f"length {length}, head size {size}, K {k}, {'causal' if causal else 'bidirectional'}, "
                             f"blocks {blocks}")
    return differing


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision whose kernel source to compare with")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--seconds", type=float, default=20.0, help="of round robin per length (default 20)")
    parser.add_argument("--pass", dest="timed_pass", choices=["forward", "training"], default="forward")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    new = fused_attention.fused_kernel()
    if new is None:
        raise SystemExit("kernel_ab.py: the working tree's kernel is unavailable here (see the logged warning)")
    old = build_revision(args.against)
    print(summary(describe(dtype)))
    differing = same_bits(old, new, dtype)
    print(f"{args.against} against the working tree, {args.dtype}: "
          + ("the same bits in every case checked" if not differing else "different bits in " + "; ".join(differing)))
    table = ra.sinusoid_relative_table(K, HEAD_SIZE).to(dtype).float()
    problem = AttentionProblem(ra.RelativeAttentionMask(), HEAD_SIZE**-0.5)
    for length in args.lengths:
        torch.manual_seed(0)
        query, key, value = (torch.randn(1, length, HEADS, HEAD_SIZE).to(dtype).transpose(1, 2) for _ in range(3))
        grad = torch.randn(1, length, HEADS, HEAD_SIZE).to(dtype).transpose(1, 2)
        leaves = [x.detach().requires_grad_() for x in (query, key, value)]

        def sdpa():
            if args.timed_pass == "forward":
                return torch.nn.functional.scaled_dot_product_attention(query, key, value)
            torch.nn.functional.scaled_dot_product_attention(*leaves).backward(grad)

        def kernel_pass(kernel):
            output, lse = kernel.forward(query, key, value, table, problem, 0, 0)
            if args.timed_pass == "training":
                kernel.backward(grad, query, key, value, output.transpose(1, 2), lse, table, problem, 0, 0)

        calls = {"SDPA": sdpa, args.against: lambda: kernel_pass(old), "working tree": lambda: kernel_pass(new)}
        times = {name: [] for name in calls}
        with torch.inference_mode(args.timed_pass == "forward"):
            for call in calls.values():  # warm-up
                call()
            started = time.perf_counter()
            while time.perf_counter() - started < args.seconds or len(times["SDPA"]) < 5:
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
        sdpa = statistics.median(times["SDPA"])
        print(f"{length} tokens, {args.timed_pass}, {len(times['SDPA'])} rounds: " + ", ".join(
            f"{name} {1e3 * statistics.median(values):.2f} ms ({statistics.median(values) / sdpa:.3f}x SDPA)"
            for name, values in times.items()))


if __name__ == "__main__":
    main()
