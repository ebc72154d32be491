"""Benchmark results say where they come from: the command that made them and the machine it ran on."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.md"))


@pytest.mark.parametrize("result", RESULTS, ids=lambda path: path.name)
def test_every_result_names_its_command_and_its_cpu(result):
    """A ratio holds for the kind of CPU it was taken on (AMX or not): each file names it and the matrix-multiply
    throughput measured in the same run."""
    text = result.read_text(encoding="utf-8")
    assert text.startswith("Command: `python benchmarks/") or text.startswith("Command: `MALLOC_"), text[:100]
    machine = (re.search(r"^CPU: (.+) \(has (.+); lacks (.+)\), \d+ threads, torch (\S+); \w+ matmul ([\d.]+) TFLOP/s",
                         text, flags=re.M)
               or re.search(r"^GPU: (.+), torch (\S+); \w+ matmul ([\d.]+) TFLOP/s", text, flags=re.M))
    assert machine, f"{result.name} does not name its CPU or GPU"
    assert float(machine.group(machine.lastindex)) > 0


def test_the_machine_description_is_measured():
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.machine import REDUCED_PRECISION_FLAGS, describe, summary

    machine = describe(torch.float32)
    assert set(machine["flags"]) | set(machine["missing_flags"]) == set(REDUCED_PRECISION_FLAGS)
    assert machine["matmul_tflops"] > 0 and machine["kernel_products"]
    assert summary(machine).startswith("CPU: ")
    on_a_gpu = summary({**machine, "gpu": "NVIDIA H100 80GB HBM3 (compute capability 9.0)", "kernel_products": None})
    assert on_a_gpu.startswith("GPU: NVIDIA H100") and "TFLOP/s" in on_a_gpu
