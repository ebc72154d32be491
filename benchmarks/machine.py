"""The machine a benchmark ran on, as every results file names it.

A speed ratio holds for the kind of CPU it was measured on: with Intel AMX, PyTorch's bfloat16 matrix products run
about six times its float32 ones; with AVX512-BF16 alone, about twice (docs/performance.md names the two machines).
So each results file says which CPU it came from (model name, and which of `amx_bf16`, `amx_fp16`, `avx512_bf16`,
`avx512_fp16` it has), the machine's matrix-multiply throughput in the benchmark's dtype, measured in the same run,
and how the fused kernel multiplies that dtype there (`nezha_hf.fused_attention.product_routine`); the speed
benchmarks write into a folder per kind of machine (`results_directory`), so an AMX machine's figures and an
AVX512-BF16 machine's stand side by side.

    python benchmarks/machine.py --dtype bfloat16      # prints the description
"""

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch

# The instruction sets that decide how fast reduced precision runs, as Linux names them in /proc/cpuinfo.
REDUCED_PRECISION_FLAGS = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16")
MATMUL_SIZE = 4096


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, macOS sysctl, else what `platform` knows)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if platform.system() == "Darwin":
        done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> list[str]:
    """Which of `REDUCED_PRECISION_FLAGS` the CPU has: from /proc/cpuinfo, else from PyTorch's own CPU detection."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in REDUCED_PRECISION_FLAGS if flag in present]
    detected = {"amx_bf16": torch.cpu._is_amx_tile_supported(), "amx_fp16": torch.cpu._is_amx_fp16_supported(),
                "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}
    return [flag for flag, present in detected.items() if present]


def matmul_throughput(dtype: torch.dtype, device: str = "cpu", size: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """TFLOP/s of `a @ b` for two `size`-square matrices of `dtype`, best of `repeats` (after a warm-up)."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        if device != "cpu":
            getattr(torch, torch.device(device).type).synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def describe(dtype: torch.dtype, device: str = "cpu") -> dict:
    """The machine as a results file records it; `throughput` is measured now, on `device`."""
    from nezha_hf.fused_attention import product_routine

    flags = cpu_flags()
    gpu = None
    if device.startswith("cuda"):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        gpu = f"{torch.cuda.get_device_name(device)} (compute capability {capability})"
    return {
        "cpu": cpu_model(),
        "gpu": gpu,
        "device": device,
        "flags": flags,
        "missing_flags": [flag for flag in REDUCED_PRECISION_FLAGS if flag not in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_tflops": matmul_throughput(dtype, device),
        "kernel_products": product_routine(dtype) if device == "cpu" else None,
    }


RESULTS = Path(__file__).parent / "results"
# Kinds of machine whose speed ratios differ, the results folder of each; a CPU is the first kind whose flag it has.
KINDS = {"amx": "amx_bf16", "avx512-bf16": "avx512_bf16"}


def machine_kind(machine: dict) -> str:
    """`"gpu"`; `"amx"` for a CPU with AMX (bfloat16 products about 6x float32's); `"avx512-bf16"` for AVX512-BF16
    without AMX (about 2x); `"cpu"` for any other CPU."""
    if machine.get("gpu"):
        return "gpu"
    return next((kind for kind, flag in KINDS.items() if flag in machine["flags"]), "cpu")


def results_directory(machine: dict) -> Path:
    """Where a speed benchmark run on `machine` writes: `benchmarks/results/<machine_kind>/`, so that one kind's
    figures never replace another's."""
    directory = RESULTS / machine_kind(machine)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def summary(machine: dict) -> str:
    """One line naming the machine, for the top of a results file: the CPU, or the GPU the run used."""
    throughput = (f"{machine['dtype']} matmul {machine['matmul_tflops']:.2f} TFLOP/s ({MATMUL_SIZE:,} square, best of 5, "
                  f"measured in this run)")
    if machine.get("gpu"):
        return f"GPU: {machine['gpu']}, torch {machine['torch']}; {throughput}; CPU: {machine['cpu']}"
    has = ", ".join(machine["flags"]) or "none"
    lacks = ", ".join(machine["missing_flags"]) or "none"
    kernel = f"; the fused kernel multiplies {machine['dtype']} blocks as {machine['kernel_products']}" if machine[
        "kernel_products"] else ""
    return (f"CPU: {machine['cpu']} (has {has}; lacks {lacks}), {machine['threads']} threads, torch {machine['torch']}; "
            f"{throughput}{kernel}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args()
    print(summary(describe(getattr(torch, args.dtype))))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
