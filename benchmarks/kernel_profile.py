"""Where one attention call's time goes, by the code that runs: the block products, the engine's own passes, the rest.

    python benchmarks/kernel_profile.py --dtype bfloat16 --lengths 2048 8192

NEZHA's fused kernel and PyTorch's CPU flash attention (what BERT-SDPA runs) both multiply blocks in a library's
matrix code (oneDNN's generated brgemm, or MKL / OpenBLAS) and pass over the scores in their own code (scaling, the
softmax's exponentials, NEZHA's relative terms). Which of the two makes one engine slower than the other differs by
CPU: with AMX the products run about five times as fast as with AVX512-BF16 alone, so the passes weigh more there
(docs/performance.md). This splits each engine's time on this machine so the two can be compared part by part.

One attention layer of a base model (batch 1, 12 heads, head size 64, K = 64, no mask, no gradients), `[batch, heads,
length, head size]` views of `[batch, length, heads, head size]` as the models pass them. Each engine and length runs
in a child process under Linux `perf record` with its software clock (no hardware counters needed), sampling only
the timed calls (perf's control FIFO switches sampling on and off around them). A sample counts as:
- products: in code generated at run time (oneDNN's brgemm) or in a symbol of a BLAS (MKL, OpenBLAS, oneDNN);
- own passes: elsewhere in the engine's own library (the kernel's shared object; libtorch_cpu for SDPA);
- rest: anything else (the OpenMP runtime waiting, memory allocation, the operating system).
Seconds per call = the median call time x the share of samples (both threads are sampled; a waiting thread counts as
rest). On a busy machine the call times swing with the load; the samples do not, as `cpu-clock` samples a thread only
while it runs: the CPU milliseconds each part took per call (samples / sampling rate / calls, both threads together)
are the figures to compare there. The products' throughput counts 4 x L^2 x hidden multiply-adds per call, NEZHA's relative-term products
(4 x L x (2K + 1) x hidden, 3% at K = 64) left out. Needs `perf` (Debian's linux-perf) on Linux.

Writes `benchmarks/results/<kind>/kernel-profile-<dtype>.md` and `.json` (`machine.results_directory`).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import describe, results_directory, summary  # noqa: E402

HEADS, HEAD_SIZE, K = 12, 64, 64
ENGINES = ("NEZHA fused kernel", "SDPA")
PARTS = ("products", "own passes", "rest")
MINIMUM_SECONDS = 2.0  # of timed calls per engine and length, so that short calls still give a thousand samples or more
# Where a sampled instruction lies, as `perf script -F ip,sym,dso` prints it: "address symbol (shared object)".
SAMPLES_PER_SECOND = 997  # perf's sampling rate, per running thread
SAMPLE = re.compile(r"^\s*[0-9a-f]+ (.*) \((.*)\)$")
PRODUCT_CODE = re.compile(r"mkl_|openblas|dnnl|brgemm|gemm", re.IGNORECASE)
# Code generated at run time: perf names it by the map file it would read its symbols from (perf-<pid>.map).
GENERATED_CODE = re.compile(r"^\[JIT\]|perf-\d+\.map$")


def engine_library(engine: str) -> re.Pattern:
    """The shared object whose own code is the engine's passes."""
    return re.compile(r"nezha_hf_fused_attention" if engine == ENGINES[0] else r"libtorch_cpu")


def part_of(symbol: str, library: str, own: re.Pattern) -> str:
    """Which part of `PARTS` a sample in `symbol` of `library` belongs to."""
    if GENERATED_CODE.search(library) or PRODUCT_CODE.search(symbol) or PRODUCT_CODE.search(Path(library).name):
        return "products"
    return "own passes" if own.search(Path(library).name) else "rest"


def child(engine: str, length: int, dtype: torch.dtype, repeats: int, times_file: str) -> None:
    """Runs at least `repeats` timed calls and `MINIMUM_SECONDS` of them, sampling switched on around them through
    perf's control FIFO."""
    from nezha_hf import fused_attention
    from nezha_hf import relative_attention as ra
    from nezha_hf.attention_ops import AttentionProblem

    torch.manual_seed(0)
    query, key, value = (torch.randn(1, length, HEADS, HEAD_SIZE).to(dtype).transpose(1, 2) for _ in range(3))
    table = ra.sinusoid_relative_table(K, HEAD_SIZE)
    problem = AttentionProblem(ra.RelativeAttentionMask(), HEAD_SIZE**-0.5)
    if engine == ENGINES[0]:
        if fused_attention.fused_kernel() is None:
            raise SystemExit("the fused kernel is unavailable here (see the logged error)")

        def call():
            return fused_attention.fused_attention(query, key, value, table, problem)
    else:

        def call():
            return torch.nn.functional.scaled_dot_product_attention(query, key, value)

    control = os.open(os.environ["PERF_CTL"], os.O_WRONLY)
    acknowledged = os.open(os.environ["PERF_ACK"], os.O_RDONLY)

    def sampling(command: bytes) -> None:
        os.write(control, command + b"\n")
        os.read(acknowledged, 5)

    times = []
    with torch.no_grad():
        call()  # warm-up: builds the kernel's routines
        sampling(b"enable")
        while len(times) < repeats or sum(times) < MINIMUM_SECONDS:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        sampling(b"disable")
    Path(times_file).write_text(json.dumps(times))


def profile(engine: str, length: int, dtype_name: str, repeats: int, work: Path) -> dict:
    """One engine at one length: the median call time and the seconds of each part."""
    control, acknowledged, data, times_file = (work / name for name in ("ctl", "ack", "perf.data", "times.json"))
    for fifo in (control, acknowledged):
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
    command = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(SAMPLES_PER_SECOND), "-D", "-1", f"--control=fifo:{control},{acknowledged}",
               "-o", str(data), sys.executable, __file__, "--child", engine, "--lengths", str(length), "--dtype", dtype_name,
               "--repeats", str(repeats), "--times-file", str(times_file)]
    subprocess.run(command, check=True, env={**os.environ, "PERF_CTL": str(control), "PERF_ACK": str(acknowledged)})
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym,dso"], check=True, capture_output=True,
                            text=True).stdout
    own = engine_library(engine)
    counts = Counter(part_of(*match.groups(), own) for line in script.splitlines() if (match := SAMPLE.match(line)))
    samples = sum(counts.values())
    if samples == 0:
        raise SystemExit(f"perf recorded no samples of {engine} at {length} tokens")
    times = json.loads(times_file.read_text())
    seconds = statistics.median(times)
    flops = 4 * length**2 * HEADS * HEAD_SIZE
    parts = {part: seconds * counts[part] / samples for part in PARTS}
    cpu = {part: counts[part] / SAMPLES_PER_SECOND / len(times) for part in PARTS}
    return {"engine": engine, "tokens": length, "seconds": seconds, "samples": samples, "parts": parts, "cpu": cpu,
            "products_tflops": flops / parts["products"] / 1e12 if parts["products"] else None}


def write_results(rows: list[dict], machine: dict, args) -> Path:
    results = results_directory(machine)
    name = f"kernel-profile-{args.dtype}"
    command = "python benchmarks/kernel_profile.py " + " ".join(sys.argv[1:])
    lines = [f"Command: `{command.strip()}` (one base-width attention layer, batch 1, no mask, forward; medians of "
             f"at least {args.repeats} calls and {MINIMUM_SECONDS:.0f} s, sampled by `perf record -e cpu-clock`)", "",
             summary(machine), "",
             "| tokens | engine | call (ms) | products (ms) | own passes (ms) | rest (ms) | products' TFLOP/s | samples | "
             "CPU ms per call: products / own passes / rest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        parts, tflops = row["parts"], row["products_tflops"]
        lines.append(f"| {row['tokens']} | {row['engine']} | {1e3 * row['seconds']:.1f} | {1e3 * parts['products']:.1f} | "
                     f"{1e3 * parts['own passes']:.1f} | {1e3 * parts['rest']:.1f} | "
                     f"{f'{tflops:.2f}' if tflops else '-'} | {row['samples']} | "
                     + " / ".join(f"{1e3 * row['cpu'][part]:.1f}" for part in PARTS) + " |")
    lines += ["", "Products: oneDNN's generated code and BLAS symbols; own passes: the rest of the engine's library (the "
              "kernel's shared object, libtorch_cpu for SDPA); rest: the OpenMP runtime waiting, allocation, the "
              "operating system. Seconds = the median call x the share of samples; CPU ms per call = the part's samples / "
              f"{SAMPLES_PER_SECOND} Hz / calls, both threads together, what to compare on a busy machine."]
    (results / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (results / f"{name}.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=1))
    return results / f"{name}.md"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--times-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.child:
        return child(args.child, args.lengths[0], dtype, args.repeats, args.times_file)
    if not sys.platform.startswith("linux") or shutil.which("perf") is None:
        raise SystemExit("kernel_profile.py needs Linux `perf` (Debian: apt-get install linux-perf)")
    machine = describe(dtype)
    print(summary(machine), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for length in args.lengths:
            for engine in ENGINES:
                row = profile(engine, length, args.dtype, args.repeats, Path(work))
                rows.append(row)
                print(f"{length:6d} {engine:20s} {1e3 * row['seconds']:.1f} ms: " + ", ".join(
                    f"{part} {1e3 * seconds:.1f} ms" for part, seconds in row["parts"].items()) + "; CPU ms per call " +
                    " / ".join(f"{1e3 * row['cpu'][part]:.1f}" for part in PARTS), flush=True)
    print(f"wrote {write_results(rows, machine, args)}")


if __name__ == "__main__":
    main()
