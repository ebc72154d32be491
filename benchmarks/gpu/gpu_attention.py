"""NEZHA's attention op on a GPU against SDPA's FlashAttention on the same tensors: milliseconds, ratio and TFLOP/s.

    python benchmarks/gpu/gpu_attention.py             # on a CUDA GPU (part of benchmarks/gpu/gpu_check.py)
    python benchmarks/gpu/gpu_attention.py --lengths 2048 --dtypes bfloat16
    python benchmarks/gpu/gpu_attention.py --rehearse  # on the CPU: Triton's interpreter, tiny sizes, perf_counter

Batch 4 x 12 heads x head size 64, K = 64 (the base model's attention), for each dtype and length: the forward, the
forward and backward, and the forward and backward with attention dropout 0.1 (SDPA with `dropout_p=0.1`); then a
decoding step, 1 query against `--cache` keys (8,192). NEZHA is the op `nezha_hf.triton_attention.triton_attention`;
SDPA is `scaled_dot_product_attention` under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`, except the decoding step,
which takes the first backend SDPA runs it with (the table names it).

Each row records the block configuration Triton's autotuner chose for every NEZHA kernel it ran (`configs`, named as
`benchmarks/gpu/gpu_gates.py` names them), so that the GPU check can print the CPU gate counts of what it timed. With
`--yardstick`, the forward and forward+backward rows also time the plain FlashAttention-2 Triton kernel
(`benchmarks/gpu/triton_yardstick.py`, no relative terms) with NEZHA's chosen blocks on the same tensors, which tells
"Triton against CUDA FlashAttention" (yardstick / SDPA) apart from "NEZHA against Triton FlashAttention" (NEZHA /
yardstick). With `--compile`, the decoding step is also timed under `torch.compile` (NEZHA and SDPA each compiled);
a step that fails to compile is recorded in one line (`nezha_error`, `sdpa_error`) and the run goes on. `--cases`
keeps some cases only. The environment variable `NEZHA_CHECK_BLOCKS` (`forward=128x64x8x3,dK/dV=64x128x8x2,dQ=128x32x8x2`:
BLOCK_M x BLOCK_N x warps x stages) pins a kernel's autotuner to one configuration, so that the GPU check can time
block sizes as variants, each in a fresh process (`gpu_check.py --variant`).

Before a case is timed, the same problem is asked of `nezha_triton` through `relative_attention`, as a model asks,
and the engine's own record (`recorded_attention_calls`) must say the Triton engine ran it: otherwise the script ends
with that one line and exit status 1, before the case prints anything. Times are medians of
`triton.testing.do_bench` (CUDA events, the L2 cache flushed before each call) after a warm-up call, so compilation
and autotuning are outside them; peak memory (forward+backward cases) is the allocator's peak of one call beyond what
was allocated before it, after the warm-up. FLOPs: forward `4 * batch * heads * queries * keys * head_size`,
forward+backward 3.5 times that. Writes `gpu-attention.md` and `.json` to `--results` (default: the machine's folder,
benchmarks/gpu/results/), each naming the GPU, its bfloat16 matmul throughput measured in this run and the software
versions.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.gpu_script import attention_cells, number, rehearsing, write_staged  # noqa: E402

rehearsing(sys.argv)  # before anything imports Triton

import torch  # noqa: E402

from benchmarks.gpu import gpu_gates, gpu_ops  # noqa: E402
from benchmarks.gpu.gpu_ops import DTYPES, CheckFailed  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402

GPU = dict(batch=4, heads=12, head_size=64, K=64, lengths=[2048, 8192], cache=8192)
REHEARSAL = dict(batch=1, heads=2, head_size=16, K=4, lengths=[40], cache=40)
# The targets, NEZHA / SDPA (bfloat16 on an H100 or H200): forward and forward+backward at most 1.3x at 2,048
# tokens and 1.15x at 8,192, with dropout at most 1.3x, a decoding step at most 1.5x.
# A compiled decoding step at most 1.1x SDPA compiled.
TARGETS = {("forward", 2048): 1.3, ("forward", 8192): 1.15, ("forward+backward", 2048): 1.3,
           ("forward+backward", 8192): 1.15, ("forward+backward, dropout", None): 1.3, ("decoding step", None): 1.5,
           ("decoding step, compiled", None): 1.1}
CASES = ["forward", "forward+backward", "forward+backward, dropout", "decoding step", "decoding step, compiled"]
# NEZHA's autotuned kernels, by the short names the gates give them (benchmarks/gpu/gpu_gates.py).
KERNELS = {"forward": "nezha_forward_kernel", "dK/dV": "nezha_key_value_grad_kernel", "dQ": "nezha_query_grad_kernel"}
PINNING = "NEZHA_CHECK_BLOCKS"  # the environment switch of `pin_blocks`


def pin_blocks(text: str | None) -> dict[str, str]:
    """Pin NEZHA's autotuned kernels to the configurations `text` names (`NEZHA_CHECK_BLOCKS`, e.g.
    `forward=128x64x8x3x128,dQ=128x32x8x2`: BLOCK_M x BLOCK_N x warps x stages, and registers a thread where
    capped), for this process, every case included (a capped forward runs under dropout too, which tuning never
    does); returns them by
    kernel. A malformed entry, blocks that are not whole multiples of dropout's
    (`triton_kernels.DROPOUT_QUERIES` x `DROPOUT_KEYS`), or a forward
    key block that does not divide the decoding split's granule, raises `CheckFailed` in one line."""
    import triton

    from nezha_hf import triton_kernels

    pinned = {}
    for entry in filter(None, (text or "").replace(" ", "").split(",")):
        name, _, numbers = entry.partition("=")
        try:
            block_m, block_n, warps, stages, *registers = (int(number) for number in numbers.split("x"))
            if len(registers) > 1 or min(registers, default=1) < 1:
                raise ValueError
        except ValueError:
            raise CheckFailed(f"{PINNING}: {entry!r} is not KERNEL=MxNxWARPSxSTAGES[xREGISTERS]") from None
        if name not in KERNELS:
            raise CheckFailed(f"{PINNING}: {name!r} is none of {', '.join(KERNELS)}")
        queries, keys = triton_kernels.DROPOUT_QUERIES, triton_kernels.DROPOUT_KEYS
        if block_m % queries or block_n % keys:
            raise CheckFailed(f"{PINNING}: {entry!r}: dropout draws for {queries} queries and {keys} keys at a time, "
                              f"so blocks are whole multiples of {queries} x {keys}")
        if name == "forward" and triton_kernels.SPLIT_GRANULE % block_n:
            raise CheckFailed(f"{PINNING}: the forward's key block {block_n} does not divide the decoding split's "
                              f"{triton_kernels.SPLIT_GRANULE} keys")
        kernel = getattr(triton_kernels, KERNELS[name])
        # One configuration: the autotuner launches it without pruning or benchmarking.
        kernel.configs = [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                                        num_stages=stages, maxnreg=registers[0] if registers else None)]
        pinned[name] = config_name(kernel.configs[0])
    return pinned


def config_name(config) -> str:
    """A Triton configuration as `benchmarks/gpu/gpu_gates.py` names it (`128x64, 8 warps, 3 stages, 128 registers`)."""
    return gpu_gates.config_name(gpu_gates.config_dict(config))


def chosen_configs(train: bool) -> dict:
    """The configuration (`triton.Config`) the autotuner last launched of each NEZHA kernel a case runs (the
    forward; with `train`, dK/dV and dQ too)."""
    from nezha_hf import triton_kernels

    names = ["forward", "dK/dV", "dQ"] if train else ["forward"]
    chosen = {name: getattr(getattr(triton_kernels, KERNELS[name]), "best_config", None) for name in names}
    return {name: config for name, config in chosen.items() if config is not None}


def target(case: str, dtype: str, length: int, device: str) -> float | None:
    """The issue's target ratio for a row, None where it sets none (float16, other lengths, a CPU rehearsal)."""
    if dtype != "bfloat16" or device != "cuda":
        return None
    return TARGETS.get((case, length), TARGETS.get((case, None)))


def prepared(case, dtype_name, queries, keys, sizes, device, dropout=0.0, train=False,
             compile_backend: str | None = None) -> tuple[list, dict, str]:
    """One case's inputs and its NEZHA and SDPA steps (`{"nezha": step, "sdpa": step}`, forward or forward and
    backward; each attention under `torch.compile(backend=compile_backend)` if given) on the same tensors, with the
    Triton engine checked to run NEZHA's (eagerly); and the case in words."""
    dtype = DTYPES[dtype_name]
    batch, heads, head_size = sizes["batch"], sizes["heads"], sizes["head_size"]
    inputs = [tensor.requires_grad_(train) for tensor in
              gpu_ops.random_inputs(batch, heads, queries, keys, head_size, dtype, device)]
    table = gpu_ops.relative_table(sizes["K"], head_size, dtype, device)
    # A decoding step: the query at the last position of a cache (a causal mask, which then hides no key).
    mask = gpu_ops.RelativeAttentionMask(causal=queries < keys, query_offset=keys - queries)
    problem = gpu_ops.problem_for(mask, head_size, dropout, seed=1)
    what = f"the {dtype_name} {case} at {keys:,} keys"
    gpu_ops.require_triton(*inputs, table, problem, what)
    steps = {}
    for name, attend in (("nezha", gpu_ops.nezha(table, problem)), ("sdpa", gpu_ops.sdpa(dropout))):
        attend = attend if compile_backend is None else torch.compile(attend, backend=compile_backend)
        if train:
            shape = (batch, queries, heads, head_size) if name == "nezha" else (batch, heads, queries, head_size)
            grad_output = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
            steps[name] = gpu_ops.training_step(attend, inputs, grad_output)
        else:
            steps[name] = gpu_ops.forward_step(attend, inputs)
    return inputs, steps, what


def yardstick_step(inputs, configs: dict, train: bool):
    """The plain FlashAttention-2 Triton kernel's forward (and backward) on `inputs`, with the blocks NEZHA's
    autotuner chose (`configs`, from `chosen_configs`); None where the length is not a whole number of those blocks
    (it takes no mask)."""
    from benchmarks.gpu.triton_yardstick import yardstick_backward, yardstick_forward

    blocks = {name: (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
              for name, config in configs.items()}
    query, key, value = (tensor.detach() for tensor in inputs)
    length, scale = query.shape[2], query.shape[-1] ** -0.5
    if any(length % size for block in blocks.values() for size in block[:2]) or len(blocks) < (3 if train else 1):
        return None
    grad_output = torch.randn(query.shape, generator=torch.Generator().manual_seed(2)).to(query.device, query.dtype)

    def step():
        output, lse = yardstick_forward(query, key, value, scale, *blocks["forward"])
        if train:
            yardstick_backward(grad_output, query, key, value, output, lse, scale, key_blocks=blocks["dK/dV"],
                               query_blocks=blocks["dQ"])
        return output

    return step


def measure(case, dtype_name, queries, keys, sizes, device, backends, dropout=0.0, train=False,
            yardstick=False) -> dict:
    """One row: the Triton engine checked to run the problem, then NEZHA and SDPA timed on the same tensors (and
    with `yardstick`, the plain FlashAttention-2 kernel, for the cases without dropout)."""
    batch, heads, head_size = sizes["batch"], sizes["heads"], sizes["head_size"]
    inputs, steps, what = prepared(case, dtype_name, queries, keys, sizes, device, dropout, train)
    row = {"case": case, "dtype": dtype_name, "queries": queries, "keys": keys, "dropout": dropout,
           "target": target(case, dtype_name, keys, device)}
    row["sdpa_backend"], steps["sdpa"] = gpu_ops.under_backend(steps["sdpa"], backends, what)
    flops = gpu_ops.attention_flops(batch, heads, queries, keys, head_size, backward=train)
    # The fewest bytes a forward moves: each input read once, the output (the query's size) written once.
    moved = (sum(tensor.numel() for tensor in inputs) + inputs[0].numel()) * inputs[0].element_size()
    for name, step in steps.items():
        row[f"{name}_ms"] = gpu_ops.median_ms(step, device)
        row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
        if train:
            row[f"{name}_peak_mb"] = gpu_ops.peak_memory_mb(step, device)
        else:
            row[f"{name}_gb_per_s"] = moved / (row[f"{name}_ms"] * 1e-3) / 1e9
        if name == "nezha":
            configs = chosen_configs(train)
            row["configs"] = {kernel: config_name(config) for kernel, config in configs.items()}
    row["ratio"] = row["nezha_ms"] / row["sdpa_ms"]
    row["met"] = None if row["target"] is None else row["ratio"] <= row["target"]
    plain = yardstick_step(inputs, configs, train) if yardstick and not dropout and queries == keys else None
    if plain is not None:
        row["yardstick_ms"] = gpu_ops.median_ms(plain, device)
        row["nezha_over_yardstick"] = row["nezha_ms"] / row["yardstick_ms"]
        row["yardstick_over_sdpa"] = row["yardstick_ms"] / row["sdpa_ms"]
    return row


def measure_compiled(dtype_name, keys, sizes, device, backend: str) -> dict:
    """The decoding step (1 query, `keys` cached) with NEZHA's op and SDPA each under `torch.compile(backend=...)`:
    a row like `measure`'s; where a compiled step fails, `nezha_error` or `sdpa_error` holds the error in one line,
    and there is no ratio."""
    case = "decoding step, compiled"
    _, steps, what = prepared(case, dtype_name, 1, keys, sizes, device, compile_backend=backend)
    row = {"case": case, "dtype": dtype_name, "queries": 1, "keys": keys, "dropout": 0.0,
           "target": target(case, dtype_name, keys, device), "compile_backend": backend, "sdpa_backend": "-"}
    for name in ("sdpa", "nezha"):
        try:
            if name == "sdpa":
                row["sdpa_backend"], steps["sdpa"] = gpu_ops.under_backend(steps["sdpa"], gpu_ops.ANY_BACKEND, what)
            row[f"{name}_ms"] = gpu_ops.median_ms(steps[name], device)
        except Exception as error:  # noqa: BLE001 - a failure to compile is the finding, recorded in one line
            first = (str(error).strip().splitlines() or [""])[0]
            row.update({f"{name}_ms": None, f"{name}_error": f"{type(error).__name__}: {first}"[:300]})
    timed = row["nezha_ms"] is not None and row["sdpa_ms"] is not None
    row["ratio"] = row["nezha_ms"] / row["sdpa_ms"] if timed else None
    row["met"] = None if row["target"] is None else timed and row["ratio"] <= row["target"]
    return row


def table(rows: list[dict]) -> list[str]:
    """The results as a Markdown table (a row whose NEZHA step failed shows its error instead of a time)."""
    lines = ["| case | dtype | queries x keys | NEZHA (ms) | SDPA (ms) | ratio | target | yardstick (ms) | NEZHA / "
             "yardstick | yardstick / SDPA | NEZHA / SDPA TFLOP/s | GB/s NEZHA / SDPA | SDPA backend | peak MB NEZHA / "
             "SDPA | NEZHA's blocks |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for row in rows:
        goal = "-" if row["target"] is None else f"<= {row['target']} ({'met' if row['met'] else 'NOT met'})"
        memory = (f"{row['nezha_peak_mb']:.0f} / {row['sdpa_peak_mb']:.0f}" if row.get("nezha_peak_mb") is not None
                  else "-")
        bandwidth = f"{row['nezha_gb_per_s']:.0f} / {row['sdpa_gb_per_s']:.0f}" if "nezha_gb_per_s" in row else "-"
        speed = f"{number(row.get('nezha_tflops'), 1)} / {number(row.get('sdpa_tflops'), 1)}"
        cells = attention_cells(row)
        lines.append(f"| {row['case']} | {row['dtype']} | {row['queries']:,} x {row['keys']:,} | {cells['nezha']} | "
                     f"{cells['sdpa']} | {cells['ratio']} | {goal} | {cells['yardstick']} | {speed} | {bandwidth} | "
                     f"{row['sdpa_backend']} | {memory} | {cells['blocks']} |")
    return lines


def kernel_profile(rows_case: tuple, sizes: dict, device: str) -> list[dict]:
    """Where one NEZHA call's time goes: each kernel's share of the device time of `rows_case` (case, dtype,
    queries, keys, dropout, train), from `torch.profiler` over 3 calls after a warm-up. On the CPU (rehearsing) the
    operators' CPU time stands in."""
    from torch.profiler import ProfilerActivity, profile

    case, dtype_name, queries, keys, dropout, train = rows_case
    step = prepared(case, dtype_name, queries, keys, sizes, device, dropout, train)[1]["nezha"]
    step()
    gpu_ops.synchronize(device)
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        for _ in range(3):
            step()
        gpu_ops.synchronize(device)
    timed = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [event for event in profiler.key_averages() if getattr(event, timed) > 0]
    total = sum(getattr(event, timed) for event in events) or 1.0
    events.sort(key=lambda event: getattr(event, timed), reverse=True)
    return [{"case": f"{dtype_name} {case}, {keys:,} keys", "kernel": event.key[:80], "calls": event.count // 3,
             "ms_per_call": getattr(event, timed) / 3 / 1e3, "share": getattr(event, timed) / total}
            for event in events[:8]]


def report(rows: list[dict], profiles: list[dict], sizes: dict, machine: dict, device: str, argv, output: Path):
    """Write what is measured so far to `output`.md and .json (after every row: a step stopped at its budget keeps
    its rows)."""
    command = "python benchmarks/gpu/gpu_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    timer = "triton.testing.do_bench (CUDA events)" if device == "cuda" else "perf_counter (a CPU rehearsal)"
    lines = [f"Command: `{command.strip()}`", "", summary(machine), "",
             f"Batch {sizes['batch']} x {sizes['heads']} heads x head size {sizes['head_size']}, K = {sizes['K']}; "
             f"NEZHA's Triton engine (checked to run each case) against SDPA on the same tensors; medians of {timer} "
             "after a warm-up; ratio = NEZHA / SDPA; GB/s: the fewest bytes a forward moves (inputs read and output "
             "written once) over its time.", "", *table(rows)]
    if profiles:
        lines += ["", "Where NEZHA's time goes (torch.profiler, 3 calls after a warm-up; the 8 largest kernels):", "",
                  "| case | kernel | calls per call | ms per call | share |", "|---|---|---|---|---|"]
        lines += [f"| {p['case']} | `{p['kernel']}` | {p['calls']} | {p['ms_per_call']:.3f} | {p['share']:.0%} |"
                  for p in profiles]
    write_staged(output.with_suffix(".md"), "\n".join(lines) + "\n")
    write_staged(output.with_suffix(".json"), json.dumps(
        {"command": command.strip(), "machine": machine, "sizes": sizes, "rows": rows, "profiles": profiles},
        indent=1))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU under Triton's interpreter, tiny sizes")
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16"], default=["bfloat16", "float16"])
    parser.add_argument("--lengths", type=int, nargs="*", help="tokens of the full-attention cases (default 2048 8192)")
    parser.add_argument("--cache", type=int, help="cached keys of the decoding step (default 8192; 0: none)")
    parser.add_argument("--dropout", type=float, default=0.1, help="attention dropout of the dropout case")
    parser.add_argument("--profile", action="store_true",
                        help="then each kernel's share of the first dtype's training cases at the longest length "
                             "and of the decoding step (torch.profiler)")
    parser.add_argument("--yardstick", action="store_true",
                        help="also time the plain FlashAttention-2 Triton kernel (forward and forward+backward rows)")
    parser.add_argument("--compile", action="store_true", help="also time the decoding step under torch.compile")
    parser.add_argument("--compile-backend", help="torch.compile's backend (default inductor; rehearsing, aot_eager)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES, help="the cases to time (default all)")
    parser.add_argument("--results", type=Path, help="folder to write to (default: the machine's results folder)")
    parser.add_argument("--output", default="gpu-attention", help="file name stem")
    args = parser.parse_args(argv)
    sizes = dict(REHEARSAL if args.rehearse else GPU)
    sizes["lengths"] = sizes["lengths"] if args.lengths is None else args.lengths
    sizes["cache"] = sizes["cache"] if args.cache is None else args.cache
    # Rehearsing, the CPU's SDPA has no FlashAttention dropout kernel: every case takes any backend (and names it).
    pinned = gpu_ops.ANY_BACKEND if args.rehearse else gpu_ops.FLASH
    try:
        device = gpu_ops.device_for(args.rehearse)
        pinned_blocks = pin_blocks(os.environ.get(PINNING))
        machine = describe(torch.bfloat16, device)
        print(summary(machine), flush=True)
        if pinned_blocks:
            print(f"{PINNING}: " + "; ".join(f"{name} pinned to {config}" for name, config in pinned_blocks.items()),
                  flush=True)
        output = (args.results or results_directory(machine)) / args.output
        output.parent.mkdir(parents=True, exist_ok=True)
        rows, profiles = [], []
        for dtype in args.dtypes:
            cases = [(case, length, length, dropout, train) for length in sizes["lengths"]
                     for case, dropout, train in (("forward", 0.0, False), ("forward+backward", 0.0, True),
                                                  ("forward+backward, dropout", args.dropout, True))]
            cases += [("decoding step", 1, sizes["cache"], 0.0, False)] if sizes["cache"] else []
            if sizes["cache"] and args.compile:
                cases.append(("decoding step, compiled", 1, sizes["cache"], 0.0, False))
            for case, queries, keys, dropout, train in cases:
                if case not in args.cases:
                    continue
                if case == "decoding step, compiled":
                    compiler = args.compile_backend or ("aot_eager" if args.rehearse else "inductor")
                    rows.append(measure_compiled(dtype, keys, sizes, device, compiler))
                else:
                    backends = gpu_ops.ANY_BACKEND if case == "decoding step" else pinned
                    rows.append(measure(case, dtype, queries, keys, sizes, device, backends, dropout, train,
                                        args.yardstick))
                row = rows[-1]
                nezha = row.get("nezha_error") or f"{row['nezha_ms']:.3f} ms"
                sdpa = row.get("sdpa_error") or f"{row['sdpa_ms']:.3f} ms"
                plain = f", yardstick {row['yardstick_ms']:.3f} ms" if "yardstick_ms" in row else ""
                ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
                print(f"{dtype:9s} {case:26s} {keys:6d} keys: NEZHA {nezha}, SDPA ({row['sdpa_backend']}) {sdpa}"
                      f"{plain}, ratio {ratio}", flush=True)
                report(rows, profiles, sizes, machine, device, argv, output)
        if args.profile:
            longest = max(sizes["lengths"])
            profiled = [(case, args.dtypes[0], longest, longest, dropout, True)
                        for case, dropout in (("forward+backward", 0.0), ("forward+backward, dropout", args.dropout))]
            profiled += [("decoding step", args.dtypes[0], 1, sizes["cache"], 0.0, False)] if sizes["cache"] else []
            for profiled_case in profiled:
                profiles += kernel_profile(profiled_case, sizes, device)
                report(rows, profiles, sizes, machine, device, argv, output)
    except CheckFailed as error:
        print(f"gpu_attention.py: {error}", file=sys.stderr)
        return 1
    print("\n".join(report(rows, profiles, sizes, machine, device, argv, output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
