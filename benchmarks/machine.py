"""The machine a benchmark ran on, as every results file names it.

A speed ratio holds for the kind of CPU it was measured on: with Intel AMX, PyTorch's bfloat16 matrix products run
about six times its float32 ones; with AVX512-BF16 alone, about twice (docs/performance.md names the two machines).
So each results file says which CPU it came from (model name, and which of `amx_bf16`, `amx_fp16`, `avx512_bf16`,
`avx512_fp16` it has), the machine's matrix-multiply throughput in the benchmark's dtype, measured in the same run,
and how the fused kernel multiplies that dtype there (`nezha_hf.fused_attention.product_routine`); the speed
benchmarks write into a folder per kind of machine (`results_directory`), so an AMX machine's figures and an
AVX512-BF16 machine's stand side by side. On a GPU it names the GPU, its matrix-multiply throughput (an 8,192-square
product, timed with CUDA events) and the software versions (Python, PyTorch, CUDA, the driver, Triton, transformers),
and the figures go to `benchmarks/gpu/results/`, beside the GPU check that makes them.

    python benchmarks/machine.py --dtype bfloat16      # prints the description
"""

import argparse
import importlib
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

# The instruction sets that decide how fast reduced precision runs, as Linux names them in /proc/cpuinfo.
REDUCED_PRECISION_FLAGS = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16")
MATMUL_SIZE = 4096
GPU_MATMUL_SIZE = 8192  # large enough to reach a GPU's peak (an H100's bfloat16 products run near 800 TFLOP/s)
GPU_MATMUL_REPEATS = 20


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


def cpu_flags(names: tuple[str, ...] = REDUCED_PRECISION_FLAGS) -> list[str]:
    """Which of `names` (flags as Linux names them; `REDUCED_PRECISION_FLAGS` unless said) the CPU has: from
    /proc/cpuinfo, else from PyTorch's own CPU detection (which knows AMX, AVX512-BF16 and AVX512-VNNI)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in names if flag in present]
    detected = {"amx_bf16": torch.cpu._is_amx_tile_supported(), "amx_fp16": torch.cpu._is_amx_fp16_supported(),
                "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_int8": torch.cpu._is_amx_tile_supported(),
                "avx512_vnni": torch.cpu._is_vnni_supported()}
    return [flag for flag in names if detected.get(flag)]


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


def gpu_matmul_throughput(dtype: torch.dtype, device: str = "cuda", size: int = GPU_MATMUL_SIZE,
                          repeats: int = GPU_MATMUL_REPEATS) -> float:
    """TFLOP/s of `a @ b` for two random `size`-square matrices of `dtype` on a GPU (random, not zeros, which run
    faster): the median of `repeats` products each timed with CUDA events, after 3 warm-ups."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times) / 1e12


def software_versions() -> dict:
    """What a GPU figure depends on besides the GPU: Python, PyTorch and its CUDA, the driver (None without
    `nvidia-smi`), Triton and transformers (None where not installed)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
        versions["driver"] = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        versions["driver"] = None
    return versions


def describe(dtype: torch.dtype, device: str = "cpu") -> dict:
    """The machine as a results file records it; `throughput` is measured now, on `device`."""
    from nezha_hf.fused_attention import product_routine

    flags = cpu_flags()
    machine = {
        "cpu": cpu_model(),
        "gpu": None,
        "device": device,
        "flags": flags,
        "missing_flags": [flag for flag in REDUCED_PRECISION_FLAGS if flag not in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if device.startswith("cuda"):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        machine.update(gpu=f"{torch.cuda.get_device_name(device)} (compute capability {capability})",
                       software=software_versions(), matmul_tflops=gpu_matmul_throughput(dtype, device),
                       kernel_products=None)
    else:
        machine.update(matmul_tflops=matmul_throughput(dtype, device),
                       kernel_products=product_routine(dtype) if device == "cpu" else None)
    return machine


RESULTS = Path(__file__).parent / "results"
GPU_RESULTS = Path(__file__).parent / "gpu" / "results"  # beside the GPU check (benchmarks/gpu/)
# Kinds of CPU whose speed ratios differ, the results folder of each; a CPU is the first kind whose flag it has.
KINDS = {"amx": "amx_bf16", "avx512-bf16": "avx512_bf16"}


def machine_kind(machine: dict) -> str:
    """`"gpu"`; `"amx"` for a CPU with AMX (bfloat16 products about 6x float32's); `"avx512-bf16"` for AVX512-BF16
    without AMX (about 2x); `"cpu"` for any other CPU."""
    if machine.get("gpu"):
        return "gpu"
    return next((kind for kind, flag in KINDS.items() if flag in machine["flags"]), "cpu")


def results_folder(kind: str) -> Path:
    """The results folder of a kind of machine (`machine_kind`): `benchmarks/results/<kind>/` for a CPU,
    `benchmarks/gpu/results/` for a GPU."""
    return GPU_RESULTS if kind == "gpu" else RESULTS / kind


def results_directory(machine: dict) -> Path:
    """Where a speed benchmark run on `machine` writes (`results_folder` of its kind, made if absent), so that one
    kind's figures never replace another's."""
    directory = results_folder(machine_kind(machine))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def summary(machine: dict) -> str:
    """One line naming the machine, for the top of a results file: the CPU, or the GPU the run used."""
    if machine.get("gpu"):
        software = machine.get("software", {})
        versions = ", ".join(f"{name} {software[name]}" for name in ("cuda", "driver", "triton", "transformers", "python")
                             if software.get(name))
        return (f"GPU: {machine['gpu']}, torch {machine['torch']}; {machine['dtype']} matmul "
                f"{machine['matmul_tflops']:.1f} TFLOP/s ({GPU_MATMUL_SIZE:,} square, median of {GPU_MATMUL_REPEATS} "
                f"timed with CUDA events, measured in this run); {versions}; CPU: {machine['cpu']}")
    throughput = (f"{machine['dtype']} matmul {machine['matmul_tflops']:.2f} TFLOP/s ({MATMUL_SIZE:,} square, best of 5, "
                  f"measured in this run)")
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
