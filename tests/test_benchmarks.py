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


# --- the GPU check's setup: a checkout on PYTHONPATH, never pip-installed -------------------------------------------


def uninstalled_environment(folder: Path) -> dict:
    """Environment variables under which `python -S` sees this Python's packages but no installed nezha_hf, and the
    checkout on PYTHONPATH: the GPU machine's situation (its packages cannot be changed; nezha_hf comes as a folder).
    Every entry of site-packages is linked into `folder` except nezha_hf's own (metadata, editable-install finder)."""
    import os
    import sysconfig

    folder.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not re.match(r"(__editable__.*)?nezha_hf", entry.name, flags=re.I) and entry.suffix != ".pth":
            (folder / entry.name).symlink_to(entry)
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{folder}"}


def test_a_checkout_that_was_never_installed_imports_and_names_its_version(tmp_path):
    """`import nezha_hf` from a checkout on PYTHONPATH, with no nezha_hf metadata anywhere, reads pyproject.toml's
    version (it raised PackageNotFoundError), and so does `nezha_hf_cli.py --version`."""
    import subprocess
    import tomllib

    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    environment = uninstalled_environment(tmp_path / "site")
    probe = ("import importlib.metadata as m, sys\n"
             "try:\n    m.version('nezha_hf'); print('installed')\nexcept m.PackageNotFoundError:\n    print('none')\n"
             "import nezha_hf\nprint(nezha_hf.__version__)\nprint(nezha_hf.__file__)\n")
    done = subprocess.run([sys.executable, "-S", "-c", probe], env=environment, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["none", expected, str(ROOT / "nezha_hf" / "__init__.py")]
    cli = subprocess.run([sys.executable, "-S", str(ROOT / "nezha_hf_cli.py"), "--version"], env=environment,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (cli.returncode, cli.stdout.strip()) == (0, f"nezha-hf {expected}"), cli.stderr[-2000:]


def test_a_copy_with_neither_pyproject_nor_metadata_says_its_version_is_unknown(tmp_path):
    """The last resort is a version that says so, not an exception; a pyproject.toml of another project is not read."""
    import subprocess

    environment = uninstalled_environment(tmp_path / "site")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    probe = ("from pathlib import Path\nfrom nezha_hf.version import package_version\n"
             f"print(package_version(Path({str(tmp_path / 'copy' / 'nezha_hf')!r})))\n"
             f"print(package_version(Path({str(tmp_path / 'other' / 'nezha_hf')!r})))\n")
    done = subprocess.run([sys.executable, "-S", "-c", probe], env=environment, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0+unknown", "0+unknown"]
