"""Host time against kernel time per layer: NEZHA (Triton engine) and BERT-SDPA of the same size, by torch.profiler.

    python benchmarks/gpu/gpu_profile.py             # on a CUDA GPU (part of benchmarks/gpu/gpu_check.py)
    python benchmarks/gpu/gpu_profile.py --rehearse  # on the CPU: Triton's interpreter, tiny sizes

A model step at batch 1 x 2,048 tokens runs BERT far below the matmul peak: it is launch-bound, so what each layer
costs the host (Python, dispatch, argument building, launches) matters as much as what its kernels cost the GPU.
For each model (12 base-width layers, bfloat16) and batch (1 and 8) at `--tokens` (2,048), one forward pass
(`torch.no_grad`) is run as a warm-up (compilation and autotuning), then `--passes` (3) under
`torch.profiler` (CPU and CUDA activities), each encoder layer inside a `record_function` range of its own. Per layer:
the host time is the range's CPU duration (the host's time issuing the layer's work, launches included, not waiting
for it), the kernel time the device time of the kernels launched inside it; both are averaged over layers and passes.
A layer whose host time exceeds its kernel time keeps the GPU waiting for the host. The whole pass is also timed by
CUDA events. NEZHA must run the Triton engine (`recorded_attention_calls`), or the script ends in one line.

Rehearsing, the model is 1 layer at 32 tokens on the CPU (batches 1 and 2) and there are no kernels: the kernel
column is 0 and means nothing. Writes `gpu-profile.md` and `.json` to `--results` (default benchmarks/gpu/results/),
after each (model, batch).

    python benchmarks/gpu/gpu_profile.py --fake-gpu      # on the CPU: the host time per layer, Triton's launches included

With `--fake-gpu`, the host split is measured on the CPU: NEZHA's Triton engine launches through Triton's whole
launch path against a fake H100 (`gpu_fake_driver.fake_hopper`: Triton compiles, only the launch is stubbed), on CPU
tensors, and BERT-SDPA runs on the CPU. The rest of each layer (projections, normalisation, feed-forward) computes on
the CPU, so the host time is separated from the compute by size, as `host_overhead.py` does: 12 layers of 12 heads
of 16 (hidden 192, feed-forward 768: the layers' operations all there, their products small), batch 1 at 8, 16 and
32 tokens, and each model's host time per layer is the least-squares line's value at no tokens through its
per-layer times (the profiler's layer ranges, as on a GPU). Writes `gpu-profile-fake-gpu.md` and `.json` to the
machine's results folder (or `--results`).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.gpu_script import rehearsing, write_staged  # noqa: E402

rehearsing(sys.argv)  # before anything imports Triton

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.gpu import gpu_fake_driver  # noqa: E402
from benchmarks.attention import build, sdpa_backend, synchronize  # noqa: E402
from benchmarks.host_overhead import at_no_work  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402
from nezha_hf import triton_attention  # noqa: E402
from nezha_hf.relative_attention import Engine, recorded_attention_calls  # noqa: E402

GPU = dict(layers=12, tokens=2048, batches=[1, 8], passes=3)
REHEARSAL = dict(layers=1, tokens=32, batches=[1, 2], passes=1)
FAKE_GPU = dict(layers=12, tokens=[8, 16, 32], batches=[1], passes=9, hidden_size=192, intermediate_size=768)
HOST_TARGET = 1.2  # issue 70: NEZHA's host time per layer at most 1.2x BERT-SDPA's
LAYER = "layer "  # the prefix of each encoder layer's profiler range


class EngineDidNotRun(RuntimeError):
    """NEZHA's passes ran an engine other than Triton's: the message is the one line the script ends with."""


def ranged_layers(model) -> list:
    """Put each encoder layer of `model` inside a profiler range `layer <i>` (forward hooks); returns the hooks'
    handles."""
    handles = []
    for index, layer in enumerate(model.encoder.layer):
        ranges = []

        def enter(module, args, index=index, ranges=ranges):
            ranges.append(record_function(f"{LAYER}{index}"))
            ranges[-1].__enter__()

        def leave(module, args, output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    return handles


def pass_ms(model, input_ids, device: str) -> float:
    """Milliseconds of one forward pass: CUDA events on a GPU, `perf_counter` elsewhere."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(input_ids)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    model(input_ids)
    return (time.perf_counter() - started) * 1e3


def pass_cpu_ms(model, input_ids) -> float:
    """Milliseconds of this thread's CPU time for one forward pass."""
    started = time.thread_time()
    model(input_ids)
    return (time.thread_time() - started) * 1e3


def layer_times(model, input_ids, device: str, passes: int) -> dict:
    """Per layer, averaged over layers and `passes`: host ms (the range's CPU duration) and kernel ms (the device
    time of the kernels launched inside it)."""
    handles = ranged_layers(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=activities) as profiler:
            for _ in range(passes):
                model(input_ids)
            synchronize(device)
    finally:
        for handle in handles:
            handle.remove()
    ranges = [event for event in profiler.events()
              if event.name.startswith(LAYER) and event.device_type == torch.autograd.DeviceType.CPU]
    if not ranges:
        raise RuntimeError("the profiler recorded no layer range")
    return {"host_ms": statistics.mean(event.cpu_time_total for event in ranges) / 1e3,
            "host_median_ms": statistics.median(event.cpu_time_total for event in ranges) / 1e3,
            "kernel_ms": statistics.mean(event.device_time_total for event in ranges) / 1e3,
            "ranges": len(ranges)}


def measure(kind: str, batch: int, sizes: dict, device: str, dtype: str) -> dict:
    """One row: `kind` ("nezha" on the Triton engine, or "bert" on SDPA) at `batch` x `sizes["tokens"]` (and the
    widths `sizes` names, if any)."""
    widths = {name: sizes[name] for name in ("hidden_size", "intermediate_size") if name in sizes}
    model = build(kind, 0.0, sizes["layers"], "nezha_triton" if kind == "nezha" else None, device, dtype,
                  **widths).eval()
    input_ids = torch.randint(1, 21128, (batch, sizes["tokens"]), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), sdpa_backend(kind, device, dtype), recorded_attention_calls() as calls:
        model(input_ids)  # the warm-up: compilation and autotuning
        synchronize(device)
        if kind == "nezha" and {call.ran for call in calls} != {Engine.TRITON}:
            ran = " and ".join(sorted(call.ran.label for call in calls)) or "no"
            why = "; ".join(sorted({call.why for call in calls if call.why})) or "no reason recorded"
            raise EngineDidNotRun(f"NEZHA did not run the Triton engine on {device}: the {ran} engine ran ({why})")
        row = {"model": "NEZHA (nezha_triton)" if kind == "nezha" else "BERT-SDPA", "batch": batch,
               "tokens": sizes["tokens"], "layers": sizes["layers"]}
        row.update(layer_times(model, input_ids, device, sizes["passes"]))
        row["pass_ms"] = statistics.median(pass_ms(model, input_ids, device) for _ in range(sizes["passes"]))
        if device == "cpu":  # this thread's CPU time of a pass without the profiler (the fake GPU's host time)
            row["pass_cpu_ms"] = statistics.median(pass_cpu_ms(model, input_ids) for _ in range(sizes["passes"]))
    row["host_over_kernel"] = row["host_ms"] / row["kernel_ms"] if row["kernel_ms"] else None
    return row


def report(rows: list[dict], machine: dict, sizes: dict, argv, output: Path) -> list[str]:
    """Write the rows so far to `output`.md and .json; returns the Markdown lines."""
    command = "python benchmarks/gpu/gpu_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Command: `{command.strip()}`", "", summary(machine), "",
             f"{sizes['layers']} base-width layers, {machine['dtype']}, forward (no_grad), {sizes['passes']} profiled "
             "passes after a warm-up; per layer: host ms = the layer's CPU range, kernel ms = its kernels' device "
             "time; pass ms: CUDA events (median).", "",
             "| model | batch x tokens | host ms per layer | kernel ms per layer | host / kernel | pass ms |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = "-" if row["host_over_kernel"] is None else f"{row['host_over_kernel']:.2f}"
        lines.append(f"| {row['model']} | {row['batch']} x {row['tokens']:,} | {row['host_ms']:.3f} | "
                     f"{row['kernel_ms']:.3f} | {ratio} | {row['pass_ms']:.2f} |")
    by = {(row["model"].split()[0], row["batch"]): row for row in rows}
    for batch in sorted({row["batch"] for row in rows}):
        if ("NEZHA", batch) in by and ("BERT-SDPA", batch) in by:
            nezha, bert = by[("NEZHA", batch)], by[("BERT-SDPA", batch)]
            lines.append(f"\nBatch {batch}: NEZHA's host time per layer {nezha['host_ms'] - bert['host_ms']:+.3f} ms "
                         f"against BERT-SDPA's, kernel time {nezha['kernel_ms'] - bert['kernel_ms']:+.3f} ms.")
    write_staged(output.with_suffix(".md"), "\n".join(lines) + "\n")
    write_staged(output.with_suffix(".json"), json.dumps(
        {"command": command.strip(), "machine": machine, "sizes": sizes, "rows": rows}, indent=1))
    return lines


def fake_gpu(dtype: str, results: Path | None, argv) -> list[str]:
    """The host time per layer on the CPU against a fake H100 (module docstring), NEZHA against BERT-SDPA; writes
    `gpu-profile-fake-gpu.md` and `.json`; returns the Markdown lines."""
    import tempfile
    from unittest import mock

    import triton

    sizes = dict(FAKE_GPU)
    rows = []
    cache = Path(tempfile.gettempdir()) / f"nezha-host-overhead-triton-{triton.__version__}"
    # the Triton engine on CPU tensors (its kernels compiled for the fake H100, not interpreted)
    with mock.patch.dict("os.environ", TRITON_CACHE_DIR=str(cache)), gpu_fake_driver.fake_hopper(), \
            mock.patch.object(triton_attention, "interpreting", lambda: True):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # host work is one thread's
        try:
            for tokens in sizes["tokens"]:
                for kind in ("nezha", "bert"):
                    rows.append(measure(kind, 1, dict(sizes, tokens=tokens), "cpu", dtype))
                    print(f"{rows[-1]['model']:20s} {tokens} tokens: {rows[-1]['host_ms'] * 1e3:.0f} us per layer",
                          flush=True)
        finally:
            torch.set_num_threads(threads)
    models = list(dict.fromkeys(row["model"] for row in rows))
    fitted = {model: at_no_work([(row["tokens"], row["host_median_ms"] * 1e3) for row in rows
                                 if row["model"] == model]) for model in models}
    unprofiled = {model: at_no_work([(row["tokens"], row["pass_cpu_ms"] * 1e3 / row["layers"]) for row in rows
                                     if row["model"] == model]) for model in models}
    nezha, bert = fitted.values()
    machine = describe(getattr(torch, dtype))
    command = "python benchmarks/gpu/gpu_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Command: `{command.strip()}`", "", summary(machine) + f"; Triton {triton.__version__} against a fake H100 "
             "(benchmarks/gpu/gpu_fake_driver.py)", "",
             f"{sizes['layers']} layers of 12 heads (hidden {sizes['hidden_size']}, feed-forward "
             f"{sizes['intermediate_size']}), {dtype}, forward (no_grad), batch 1, {sizes['passes']} profiled passes "
             "after a warm-up; host microseconds per layer (the median of the profiler's layer ranges, one thread) at "
             "each length, "
             "and the least-squares line's value at no tokens; beside it the same from whole passes without the "
             "profiler (this thread's CPU time over the layers; the profiler's own cost per operation, in both "
             "models' ranges, left out):", "",
             "| model | " + " | ".join(f"{tokens} tokens" for tokens in sizes["tokens"]) + " | host per layer | "
             "without the profiler |", "|---|" + "---|" * (len(sizes["tokens"]) + 2)]
    for model, value in fitted.items():
        times = [f"{row['host_median_ms'] * 1e3:.0f}" for row in rows if row["model"] == model]
        lines.append(f"| {model} | " + " | ".join(times) + f" | {value:.0f} | {unprofiled[model]:.0f} |")
    plain = unprofiled[models[0]] / unprofiled[models[1]]
    lines.append(f"\nNEZHA / BERT-SDPA host time per layer: {nezha / bert:.2f} (target {HOST_TARGET}: "
                 f"{'met' if nezha / bert <= HOST_TARGET else 'NOT met'}); without the profiler {plain:.2f}.")
    output = (results or results_directory(machine)) / "gpu-profile-fake-gpu"
    output.parent.mkdir(parents=True, exist_ok=True)
    write_staged(output.with_suffix(".md"), "\n".join(lines) + "\n")
    write_staged(output.with_suffix(".json"), json.dumps(
        {"command": command.strip(), "machine": machine, "triton": triton.__version__, "sizes": sizes, "rows": rows,
         "host_us_per_layer": fitted, "ratio": nezha / bert, "unprofiled_us_per_layer": unprofiled,
         "unprofiled_ratio": plain}, indent=1))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU under Triton's interpreter, tiny sizes")
    parser.add_argument("--fake-gpu", action="store_true",
                        help="on the CPU against a fake H100: the host time per layer, Triton's launches included")
    parser.add_argument("--tokens", type=int, help="tokens per sequence (default 2048)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--results", type=Path, help="folder to write to (default: the machine's results folder)")
    parser.add_argument("--output", default="gpu-profile", help="file name stem")
    args = parser.parse_args(argv)
    if args.fake_gpu:
        print("\n".join(fake_gpu(args.dtype, args.results, argv)))
        return 0
    sizes = dict(REHEARSAL if args.rehearse else GPU)
    sizes["tokens"] = args.tokens or sizes["tokens"]
    sizes["batches"] = args.batches or sizes["batches"]
    if not args.rehearse and not torch.cuda.is_available():
        print("gpu_profile.py: no CUDA GPU is visible to PyTorch (run with --rehearse to rehearse on the CPU)",
              file=sys.stderr)
        return 1
    device = "cpu" if args.rehearse else "cuda"
    machine = describe(getattr(torch, args.dtype), device)
    print(summary(machine), flush=True)
    output = (args.results or results_directory(machine)) / args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for batch in sizes["batches"]:
            for kind in ("nezha", "bert"):
                rows.append(measure(kind, batch, sizes, device, args.dtype))
                row = rows[-1]
                print(f"{row['model']:20s} batch {batch}: host {row['host_ms']:.3f} ms, kernels "
                      f"{row['kernel_ms']:.3f} ms per layer; pass {row['pass_ms']:.2f} ms", flush=True)
                report(rows, machine, sizes, argv, output)
    except EngineDidNotRun as error:
        print(f"gpu_profile.py: {error}", file=sys.stderr)
        return 1
    print("\n".join(report(rows, machine, sizes, argv, output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
