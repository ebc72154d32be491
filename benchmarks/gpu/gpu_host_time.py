"""Whether NEZHA's Triton op is host-bound on a GPU: host time per call against wall time, and where the host's time
goes (cProfile).

    python benchmarks/gpu/gpu_host_time.py    # on the GPU machine, after the GPU check (docs/performance.md)

Batch 4 x 12 heads x 2,048 tokens x head size 64, K = 64, bfloat16, no mask (the attention op's 2,048-token case).
After 5 warm-up calls: 20 training steps (forward and backward), timed on the host without waiting for the GPU
(`host`) and with a synchronisation at the end (`wall`); then 20 forwards the same way; then the training steps again
under cProfile, sorted by cumulative time. `host` close to `wall` means the GPU waits for the host: the kernels'
own times (the op step's `--profile`) are then not what a caller sees. The kernels are autotuned in the warm-up.
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu import gpu_ops  # noqa: E402
from nezha_hf.attention_ops import RelativeAttentionMask  # noqa: E402

BATCH, HEADS, LENGTH, HEAD_SIZE, K = 4, 12, 2048, 64, 64


def per_call_ms(step, calls: int = 20) -> tuple[float, float]:
    """`(host, wall)` milliseconds per call of `calls` calls of `step`."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (host - start) / calls, 1e3 * (time.perf_counter() - start) / calls


def main():
    inputs = gpu_ops.random_inputs(BATCH, HEADS, LENGTH, LENGTH, HEAD_SIZE, torch.bfloat16, "cuda")
    for tensor in inputs:
        tensor.requires_grad_(True)
    table = gpu_ops.relative_table(K, HEAD_SIZE, torch.bfloat16, "cuda")
    attend = gpu_ops.nezha(table, gpu_ops.problem_for(RelativeAttentionMask(), HEAD_SIZE))
    grad_output = torch.randn(BATCH, LENGTH, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    train = gpu_ops.training_step(attend, inputs, grad_output)
    forward = gpu_ops.forward_step(attend, inputs)
    for _ in range(5):
        train()
    for name, step in (("forward+backward", train), ("forward", forward)):
        host, wall = per_call_ms(step)
        print(f"{name}: host {host:.3f} ms per call, wall {wall:.3f} ms per call")
    profiler = cProfile.Profile()
    profiler.enable()
    per_call_ms(train)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
