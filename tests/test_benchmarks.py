"""Benchmark results say where they come from: the command that made them and the machine it ran on."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks are scripts of the repository, not part of the package
RESULTS = sorted((ROOT / "benchmarks" / "results").rglob("*.md"))


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


@pytest.mark.parametrize("result", [path for path in RESULTS if path.parent.name != "results"],
                         ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_result_lies_in_the_folder_of_its_kind_of_machine(result):
    """Speed figures of an AMX machine and of an AVX512-BF16 machine differ: each lies in its kind's folder, which the
    benchmarks choose from the machine they describe (`machine.results_directory`)."""
    from benchmarks.machine import machine_kind

    recorded = json.loads(result.with_suffix(".json").read_text())["machine"]
    assert machine_kind(recorded) == result.parent.name


def test_the_kind_of_machine_is_the_first_whose_flag_it_has(tmp_path, monkeypatch):
    from benchmarks import machine

    assert machine.machine_kind({"flags": ["amx_bf16", "avx512_bf16"]}) == "amx"
    assert machine.machine_kind({"flags": ["avx512_bf16", "avx512_fp16"]}) == "avx512-bf16"
    assert machine.machine_kind({"flags": []}) == "cpu"
    assert machine.machine_kind({"flags": ["amx_bf16"], "gpu": "NVIDIA H100"}) == "gpu"
    monkeypatch.setattr(machine, "RESULTS", tmp_path)
    assert machine.results_directory({"flags": ["avx512_bf16"]}) == tmp_path / "avx512-bf16"
    assert (tmp_path / "avx512-bf16").is_dir()


def test_the_machine_description_is_measured():
    from benchmarks.machine import REDUCED_PRECISION_FLAGS, describe, summary

    machine = describe(torch.float32)
    assert set(machine["flags"]) | set(machine["missing_flags"]) == set(REDUCED_PRECISION_FLAGS)
    assert machine["matmul_tflops"] > 0 and machine["kernel_products"]
    assert summary(machine).startswith("CPU: ")
    on_a_gpu = summary({**machine, "gpu": "NVIDIA H100 80GB HBM3 (compute capability 9.0)", "kernel_products": None})
    assert on_a_gpu.startswith("GPU: NVIDIA H100") and "TFLOP/s" in on_a_gpu


def test_the_kernel_profile_tells_products_from_an_engines_own_passes():
    """`kernel_profile.py` splits perf samples by the code they fall in: a sample in the wrong part would move time
    between the products and the passes, the comparison an AMX machine is to be profiled for."""
    from benchmarks.kernel_profile import ENGINES, SAMPLE, engine_library, part_of

    nezha, sdpa = (engine_library(engine) for engine in ENGINES)
    kernel = "/root/.cache/torch_extensions/nezha_hf_fused_attention_0123/nezha_hf_fused_attention_0123.so"
    torch_cpu = "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"
    line = "     7fab713006b9 [unknown] (/tmp/perf-31645.map)"
    assert part_of(*SAMPLE.match(line).groups(), nezha) == "products"  # oneDNN's generated brgemm
    assert part_of("[unknown]", "[JIT] tid 31645", nezha) == "products"
    assert part_of("mkl_blas_def_sgemm_kernel_0_zen", torch_cpu, sdpa) == "products"
    assert part_of("(anonymous namespace)::forward_impl<float>", kernel, nezha) == "own passes"
    assert part_of("at::native::(anonymous namespace)::_exp_reduce_sum_fusion_kernel<float>", torch_cpu, sdpa) == \
        "own passes"
    assert part_of("at::native::(anonymous namespace)::_exp_reduce_sum_fusion_kernel<float>", torch_cpu, nezha) == "rest"
    assert part_of("[unknown]", "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1", sdpa) == "rest"
    assert part_of("malloc", "/usr/lib/x86_64-linux-gnu/libc.so.6", nezha) == "rest"
