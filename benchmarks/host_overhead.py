"""Host time of one attention call: what Python and PyTorch's dispatch cost before any kernel runs.

    python benchmarks/host_overhead.py         # writes benchmarks/results/<machine kind>/host-overhead.md

On a GPU, a 2,048-token call's kernels take well under a millisecond, so the host's work per call (building the
kernels' arguments, the op's dispatch and autograd, Triton's launcher) decides the time unless it stays below that:
an H100's 2,048-token forward+backward took 1.79 ms, of which its kernels ran 0.80 ms
(benchmarks/gpu/results/gpu-attention-2048-pinned.md). This measures that host work on the CPU, with no GPU: the
Triton engine's four kernels are replaced by launches that do nothing (after one real call under Triton's
interpreter, which compiles the backward's check), on a problem small enough (batch 1 x 2 heads x 64 tokens x head
size 64, bfloat16) that the remaining tensor work (allocations, the table's conversion) is negligible. Triton's own
launcher (argument specialisation, the autotuner's key) is not included: it needs a GPU.

Each row: microseconds of CPU time per call, the fastest of `--repeats` runs of `--calls` calls (all rows' runs
interleaved), for the forward (no autograd) and a training step (forward and backward, gradients cleared first), by
three routes: `direct` (what the model calls: `attention_ops.engine_op`'s path past the dispatcher), `registered ops`
(every call through the `torch.library` ops, forward and backward, as under tracing and modes, and as every call went
before the direct route), and SDPA on the same tensors (one C++ op; its backward computes for real). The compiled CPU
kernel's rows (`fused`, its real kernel at this size) show the same routes.
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # the one real call runs on the CPU
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu import gpu_ops  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402
from nezha_hf import attention_ops, fused_attention, triton_attention  # noqa: E402
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask, sinusoid_relative_table  # noqa: E402

TRITON_KERNELS = ("nezha_forward_kernel", "nezha_row_statistics_kernel", "nezha_key_value_grad_kernel",
                  "nezha_query_grad_kernel")


class NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](...)` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def microseconds(routes: dict, calls: int, repeats: int) -> dict:
    """For each `(route, step)` of `routes` (`name -> (step, through_ops)`), the fastest of `repeats` runs of `calls`
    calls, in microseconds of this thread's CPU time per call (CPU time, not wall time, and the routes' runs
    interleaved: a shared machine's other work and its drifts then barely show). `through_ops`: every call of the
    step goes through the engines' registered ops, as every call did before the direct route."""
    best = dict.fromkeys(routes, float("inf"))
    for repeat in range(repeats + 1):  # the first round warms up
        for name, (step, through_ops) in routes.items():
            with mock.patch.object(attention_ops, "_needs_dispatcher", lambda *arguments: True) if through_ops \
                    else contextlib.nullcontext():
                start = time.thread_time()
                for _ in range(calls):
                    step()
                if repeat:
                    best[name] = min(best[name], (time.thread_time() - start) / calls * 1e6)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    batch, heads, length, size, K = 1, 2, 64, 64, 64
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(batch, heads, length, size, generator=generator, dtype=torch.bfloat16)
                         .requires_grad_() for _ in range(3))
    grad_output = torch.randn(batch, length, heads, size, generator=generator, dtype=torch.bfloat16)
    table = sinusoid_relative_table(K, size).to(torch.bfloat16)
    problem = AttentionProblem(RelativeAttentionMask(), size**-0.5, 0.0, None)
    inputs = [query, key, value]

    engines, stubs = {}, contextlib.ExitStack()
    if triton_attention.triton_installed():
        engines["triton"] = lambda q, k, v: triton_attention.triton_attention(q, k, v, table, problem)
        gpu_ops.training_step(engines["triton"], inputs, grad_output)()  # one real call: the backward's check compiles
        for name in TRITON_KERNELS:  # put back when measured (a test runs this in its own process)
            stubs.enter_context(mock.patch.object(triton_attention._kernels(), name, NoLaunch()))
    if fused_attention.fused_kernel() is not None:
        engines["fused"] = lambda q, k, v: fused_attention.fused_attention(q, k, v, table, problem)
    engines["SDPA"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    routes = {}
    for engine, attend in engines.items():
        forward, train = gpu_ops.forward_step(attend, inputs), gpu_ops.training_step(attend, inputs, grad_output)
        for through_ops in ((False, True) if engine != "SDPA" else (False,)):
            route = engine if engine == "SDPA" else f"{engine}, {'registered ops' if through_ops else 'direct'}"
            routes[(route, "forward")] = (forward, through_ops)
            routes[(route, "forward+backward")] = (train, through_ops)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread's; a second only adds its scheduling noise
    with stubs:
        try:
            times = microseconds(routes, args.calls, args.repeats)
        finally:
            torch.set_num_threads(threads)

    machine = describe(torch.bfloat16)
    command = " ".join(["python benchmarks/host_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [f"Command: `{command}`",
             "", summary(machine), "",
             f"Host CPU time per call, microseconds (fastest of {args.repeats} interleaved runs of {args.calls} calls; "
             f"batch {batch} x {heads} heads x {length} tokens x {size}, bfloat16; Triton's launches stubbed):", "",
             "| route | forward | forward+backward |", "|---|---|---|"]
    lines += [f"| {route} | {times[(route, 'forward')]:.0f} | {times[(route, 'forward+backward')]:.0f} |"
              for route in dict.fromkeys(route for route, _ in routes)]
    output = results_directory(machine) / "host-overhead.md"
    output.write_text("\n".join(lines) + "\n")
    rows = [{"route": route, "case": case, "microseconds": value} for (route, case), value in times.items()]
    record = {"command": lines[0], "machine": machine, "rows": rows}
    output.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print("\n".join(lines), f"\n\nwritten to {output} and its .json", sep="")


if __name__ == "__main__":
    main()
