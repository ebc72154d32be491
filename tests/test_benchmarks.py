"""Benchmark results say where they come from: the command that made them and the machine it ran on."""

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks are scripts of the repository, not part of the package
# The CPU benchmarks' results (benchmarks/results/) and the GPU check's (benchmarks/gpu/results/).
RESULTS = sorted((ROOT / "benchmarks").rglob("results/**/*.md"))


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


@pytest.mark.parametrize("result", [path for path in RESULTS if path.parent != ROOT / "benchmarks" / "results"],
                         ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_result_lies_in_the_folder_of_its_kind_of_machine(result):
    """Speed figures of an AMX machine, of an AVX512-BF16 machine and of a GPU differ: each lies in its kind's folder,
    which the benchmarks choose from the machine they describe (`machine.results_directory`)."""
    from benchmarks.machine import machine_kind, results_folder

    recorded = json.loads(result.with_suffix(".json").read_text())["machine"]
    assert result.parent == results_folder(machine_kind(recorded))


def test_the_kind_of_machine_is_the_first_whose_flag_it_has(tmp_path, monkeypatch):
    from benchmarks import machine

    assert machine.machine_kind({"flags": ["amx_bf16", "avx512_bf16"]}) == "amx"
    assert machine.machine_kind({"flags": ["avx512_bf16", "avx512_fp16"]}) == "avx512-bf16"
    assert machine.machine_kind({"flags": []}) == "cpu"
    assert machine.machine_kind({"flags": ["amx_bf16"], "gpu": "NVIDIA H100"}) == "gpu"
    monkeypatch.setattr(machine, "RESULTS", tmp_path)
    assert machine.results_directory({"flags": ["avx512_bf16"]}) == tmp_path / "avx512-bf16"
    assert (tmp_path / "avx512-bf16").is_dir()
    assert machine.results_folder("gpu") == ROOT / "benchmarks" / "gpu" / "results"  # beside the GPU check


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


class OneBitOff:
    """A kernel whose forward output differs from the real one's in the lowest bit of one element."""

    def __init__(self, kernel):
        self.kernel = kernel

    def forward(self, *args):
        output, lse = self.kernel.forward(*args)
        output = output.clone()
        bits = output.view(-1).view(torch.int16 if output.element_size() == 2 else torch.int32)
        bits[0] ^= 1
        return output, lse

    def backward(self, *args):
        return self.kernel.backward(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_kernel_ab_tells_the_same_bits_from_a_bit_off(dtype):
    """`kernel_ab.py` says whether two kernel versions compute the same bits (a change to how operands are packed must,
    one to the arithmetic need not); a bit off in one output element is reported."""
    from benchmarks.kernel_ab import SAME_BITS_CASES, same_bits
    from nezha_hf import fused_attention

    kernel = fused_attention.fused_kernel()
    if kernel is None:
        pytest.skip("the compiled kernel is unavailable here")
    assert same_bits(kernel, kernel, dtype) == []
    assert len(same_bits(kernel, OneBitOff(kernel), dtype)) == len(SAME_BITS_CASES)


@pytest.mark.slow
def test_the_kernel_ab_builds_a_revisions_kernel_and_times_it_beside_the_working_trees(capsys, monkeypatch):
    """Against HEAD: its kernel built under a name of its own, the bits compared, one line of times per length and pass."""
    import subprocess

    from benchmarks import kernel_ab
    from nezha_hf import fused_attention

    if fused_attention.fused_kernel() is None:
        pytest.skip("the compiled kernel is unavailable here")
    for timed_pass in ("forward", "training"):
        monkeypatch.setattr(sys, "argv", ["kernel_ab.py", "--against", "HEAD", "--lengths", "64", "--seconds", "0.05",
                                          "--dtype", "float32", "--pass", timed_pass])
        kernel_ab.main()
    printed = capsys.readouterr().out
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "nezha_hf/csrc/fused_attention.cpp"],
                               cwd=ROOT).returncode == 0
    if unchanged:  # as in CI's clean clone: the same source built twice computes the same bits
        assert "HEAD against the working tree, float32: the same bits in every case checked" in printed
    for timed_pass in ("forward", "training"):
        assert re.search(rf"^64 tokens, {timed_pass}, \d+ rounds: SDPA [\d.]+ ms \(1\.000x SDPA\), HEAD [\d.]+ ms",
                         printed, re.M)


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
    # The checkout as it travels (git's files): without the `nezha_hf.egg-info/` an editable install leaves in it.
    checkout = folder.with_name(f"{folder.name}-checkout")
    checkout.mkdir()
    for entry in ROOT.iterdir():
        if not entry.name.endswith(".egg-info"):
            (checkout / entry.name).symlink_to(entry)
    return {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{folder}"}


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
    found, version, module = done.stdout.split()
    assert (found, version, Path(module).resolve()) == ("none", expected, ROOT / "nezha_hf" / "__init__.py")
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


# --- the GPU check (benchmarks/gpu/gpu_check.py and its steps), rehearsed on the CPU under Triton's interpreter -----


@pytest.fixture
def unmeasured_machine(monkeypatch):
    """The machine described without timing its matrix products (seconds on 2 cores; not what these tests check)."""
    from benchmarks import machine

    monkeypatch.setattr(machine, "matmul_throughput", lambda *args, **kwargs: 1.0)


@pytest.fixture
def triton_unusable(monkeypatch):
    """The Triton engine unusable, as after kernels that failed to compile: `nezha_triton` falls back to the chunked
    engine (what a GPU run must never time as if it were Triton's)."""
    import dataclasses

    from nezha_hf import relative_attention as ra

    spec = dataclasses.replace(ra.ENGINES[ra.Engine.TRITON], unusable=lambda situation: "simulated: kernels failed")
    monkeypatch.setitem(ra.ENGINES, ra.Engine.TRITON, spec)


def test_the_model_benchmark_fails_in_one_line_when_the_engine_it_names_did_not_run(triton_unusable, unmeasured_machine,
                                                                                     monkeypatch, tmp_path, capsys):
    """`attention.py --attention nezha_triton` timed the chunked engine and printed its ratio; now it ends with the
    engine's record in one line before timing anything (on a GPU the same holds without `--attention`)."""
    from benchmarks import attention, machine

    monkeypatch.setattr(machine, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["attention.py", "--attention", "nezha_triton", "--layers", "1", "--lengths",
                                      "16", "--no-train", "--memory-lengths", "--eager-up-to", "0", "--repeats", "1"])
    with pytest.raises(SystemExit) as ended:
        attention.main()
    assert str(ended.value) == ("attention.py: nezha_triton did not run on cpu: the chunked engine ran instead "
                                "(simulated: kernels failed)")
    assert "ratio" not in capsys.readouterr().out and not list(tmp_path.rglob("*.md"))


def test_the_model_benchmark_requires_the_triton_engine_on_a_gpu_and_the_named_one_anywhere():
    from benchmarks.attention import required_engine
    from nezha_hf.relative_attention import Engine

    assert required_engine(None, "cuda") is Engine.TRITON
    assert required_engine(None, "cpu") is None  # the CPU default falls back by length and build, as documented
    assert required_engine("nezha_chunked", "cuda") is Engine.CHUNKED


def test_the_op_benchmark_fails_in_one_line_when_nezha_triton_does_not_run(triton_unusable, unmeasured_machine, tmp_path,
                                                                             capsys):
    from benchmarks.gpu import gpu_attention

    code = gpu_attention.main(["--rehearse", "--dtypes", "bfloat16", "--lengths", "16", "--cache", "0", "--results",
                               str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.splitlines() == ["gpu_attention.py: nezha_triton did not run the bfloat16 forward at 16 keys: the "
                                "chunked engine ran instead (simulated: kernels failed)"]
    assert "ratio" not in out and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_op_benchmark_rehearsed_times_every_case_against_sdpa(unmeasured_machine, tmp_path):
    from benchmarks.gpu import gpu_attention

    assert gpu_attention.main(["--rehearse", "--dtypes", "float16", "--lengths", "16", "--cache", "24", "--profile",
                               "--results", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-attention.json").read_text())
    # the profile: the training cases at the longest length and the decoding step, each kernel's share of the time
    assert sorted({profile["case"] for profile in result["profiles"]}) == [
        "float16 decoding step, 24 keys", "float16 forward+backward, 16 keys", "float16 forward+backward, dropout, 16 keys"]
    assert any(profile["kernel"] == "nezha_hf::triton_backward" for profile in result["profiles"])
    assert [(row["case"], row["queries"], row["keys"]) for row in result["rows"]] == [
        ("forward", 16, 16), ("forward+backward", 16, 16), ("forward+backward, dropout", 16, 16),
        ("decoding step", 1, 24)]
    for row in result["rows"]:
        assert row["ratio"] == pytest.approx(row["nezha_ms"] / row["sdpa_ms"]) and row["sdpa_backend"]
        assert row["target"] is None  # the targets are for a GPU, not a rehearsal
    forward = result["rows"][0]
    assert forward["nezha_tflops"] == pytest.approx(4 * 1 * 2 * 16 * 16 * 16 / (forward["nezha_ms"] * 1e-3) / 1e12)
    assert (tmp_path / "gpu-attention.md").read_text().startswith("Command: `python benchmarks/gpu/gpu_attention.py ")


@pytest.mark.slow
def test_the_correctness_half_rehearsed_passes_every_case(unmeasured_machine, tmp_path):
    """Every mask, dtype, decoding, dropout, TF32 and launch case against the float64 formula, under the
    interpreter: what the GPU run checks, at the interpreter's sizes (about a minute)."""
    from benchmarks.gpu import gpu_correctness

    assert gpu_correctness.main(["--rehearse", "--workers", "1", "--results", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-correctness.json").read_text())
    assert result["complete"] and len(result["cases"]) == len(gpu_correctness.cases()) == 26
    assert not [case["case"] for case in result["cases"] if case["failure"]]
    assert {row["dtype"] for row in result["against_sdpa"]} == {"bfloat16", "float16"}


@pytest.mark.slow
def test_the_correctness_cases_run_each_in_a_process_of_its_own(unmeasured_machine, tmp_path):
    """As on a GPU (12 processes), rehearsed with 2: a case and its arguments reach a fresh process and come back."""
    from benchmarks.gpu import gpu_correctness

    assert gpu_correctness.main(["--rehearse", "--workers", "2", "--results", str(tmp_path), "--cases",
                                 "float32 decode", "float32 sdpa"]) == 0
    cases = json.loads((tmp_path / "gpu-correctness.json").read_text())["cases"]
    assert [(case["case"], case["failure"]) for case in cases] == [("float32 decode", ""), ("float32 sdpa", "")]


def sabotaged(monkeypatch, change):
    """The Triton op with `change(output, query, key, value, table, problem)` applied to what it computes."""
    from benchmarks.gpu import gpu_ops

    real = gpu_ops.triton_attention
    monkeypatch.setattr(gpu_ops, "triton_attention", lambda q, k, v, table, problem: change(
        real, q, k, v, table, problem))


def correctness_failures(tmp_path, case) -> dict:
    from benchmarks.gpu import gpu_correctness

    assert gpu_correctness.main(["--rehearse", "--workers", "1", "--results", str(tmp_path), "--cases", case]) == 1
    cases = json.loads((tmp_path / "gpu-correctness.json").read_text())["cases"]
    return {entry["case"]: entry["failure"] for entry in cases}


def test_the_correctness_half_fails_an_element_no_kernel_wrote(monkeypatch, unmeasured_machine, tmp_path):
    """An op that leaves its last query unwritten: its output starts NaN (PyTorch's fill of new memory), and fails."""

    def last_query_unwritten(real, q, k, v, table, problem):
        output = real(q, k, v, table, problem)
        partial = torch.empty_like(output)
        partial[:, :-1] = output[:, :-1]
        return partial

    sabotaged(monkeypatch, last_query_unwritten)
    assert correctness_failures(tmp_path, "float32 decode") == {
        "float32 decode": "1 queries: output has NaN or unwritten elements"}


@pytest.mark.slow
def test_the_correctness_half_fails_a_wrong_relative_term(monkeypatch, unmeasured_machine, tmp_path):
    sabotaged(monkeypatch, lambda real, q, k, v, table, problem: real(q, k, v, table.flip(0), problem))
    failure = correctness_failures(tmp_path, "float16 causal")["float16 causal"]
    assert failure.startswith("output relative error") and failure.endswith("> 4e-03")


@pytest.mark.slow
def test_the_correctness_half_fails_a_backward_that_draws_another_dropout_mask(monkeypatch, unmeasured_machine,
                                                                               tmp_path):
    """The keep mask the reference is given differs from the kernel's in one entry per row, as a backward redrawing
    another mask would make it: the case fails."""
    from benchmarks.gpu import gpu_correctness

    real = gpu_correctness.kernel_keep_mask

    def one_entry_per_row_flipped(*args):
        kept = real(*args)
        kept[..., 0] = ~kept[..., 0]
        return kept

    monkeypatch.setattr(gpu_correctness, "kernel_keep_mask", one_entry_per_row_flipped)
    assert correctness_failures(tmp_path, "float32 dropout")["float32 dropout"].startswith("output relative error")


def test_the_environment_check_names_what_is_missing(monkeypatch, capsys):
    from benchmarks.gpu import gpu_environment

    assert gpu_environment.main(["--rehearse"]) == 0
    monkeypatch.setattr(gpu_environment, "INTERFACES", [("torch.library.frobnicate (a newer PyTorch)",
                                                         "torch.library", "frobnicate")])
    assert gpu_environment.main(["--rehearse"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gpu_environment.py: missing: torch.library.frobnicate (a newer PyTorch)"]
    assert gpu_environment.unmet(["packaging>=999", "torch>=1", "pywin32; sys_platform == 'win32'"]) == [
        f"packaging>=999 (installed: {__import__('packaging').__version__})"]


def test_a_gpu_machine_is_named_with_its_matmul_rate_and_software():
    from benchmarks.machine import machine_kind, software_versions, summary

    versions = software_versions()
    assert versions["torch"] == torch.__version__ and versions["transformers"] and versions["python"]
    machine = {"cpu": "AMD EPYC", "gpu": "NVIDIA H100 80GB HBM3 (compute capability 9.0)", "torch": "2.11.0+cu130",
               "dtype": "bfloat16", "matmul_tflops": 791.234, "flags": [],
               "software": {"cuda": "13.0", "driver": "580.159.04", "triton": "3.6.0", "transformers": "5.24.0",
                            "python": "3.12.3"}}
    assert summary(machine) == (
        "GPU: NVIDIA H100 80GB HBM3 (compute capability 9.0), torch 2.11.0+cu130; bfloat16 matmul 791.2 TFLOP/s "
        "(8,192 square, median of 20 timed with CUDA events, measured in this run); cuda 13.0, driver 580.159.04, "
        "triton 3.6.0, transformers 5.24.0, python 3.12.3; CPU: AMD EPYC")
    assert machine_kind(machine) == "gpu"


def test_the_gpu_check_packs_triton_cache_in_parts_the_device_tool_brings_back_and_restores_them(monkeypatch,
                                                                                               tmp_path):
    from benchmarks.gpu import gpu_check

    cache, work, results = tmp_path / "cache", tmp_path / "work", tmp_path / "results"
    for folder in (cache / "ab12", work, results):
        folder.mkdir(parents=True)
    kernels = {f"ab12/kernel{i}.cubin": __import__("os").urandom(3000) for i in range(4)}  # incompressible
    for name, data in kernels.items():
        (cache / name).write_bytes(data)
    (work / "gpu-attention.json").write_text("{}")
    log = gpu_check.Log(results / "gpu-check.log")
    monkeypatch.setattr(gpu_check, "PART_SIZE", 4000)  # 12 kB packed: more parts than the carry may take
    gpu_check.pack(results, work, cache, log)
    assert not list(results.glob("triton-cache*")) and "not kept" in (results / "gpu-check.log").read_text()
    monkeypatch.setattr(gpu_check, "PART_SIZE", 8000)
    gpu_check.pack(results, work, cache, log)
    parts = sorted(results.glob("triton-cache.tar.gz*"))
    assert [part.name for part in parts] == ["triton-cache.tar.gz.00", "triton-cache.tar.gz.01"]
    assert all(part.stat().st_size <= 8000 for part in parts)
    with tarfile.open(results / "results.tar.gz") as archive:
        assert archive.getnames() == ["gpu-attention.json"]
    assert gpu_check.carried_cache(results) == parts
    restored = tmp_path / "restored"
    gpu_check.restore_cache(restored, parts, log)
    assert {name: (restored / name).read_bytes() for name in kernels} == kernels


def test_a_gpu_check_step_past_its_budget_is_stopped_with_its_workers(tmp_path):
    """A step's process group is stopped at its budget (the correctness step's workers too), and reads as 124."""
    from benchmarks.gpu import gpu_check

    marker = tmp_path / "worker-alive"
    worker = f"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).write_text('x')"
    step = [sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                                  "print('started', flush=True); time.sleep(60)"]
    log = gpu_check.Log(tmp_path / "log")
    assert gpu_check.run_step(step, dict(__import__("os").environ), 1, log) == 124
    time.sleep(5)
    assert not marker.exists()
    assert (tmp_path / "log").read_text() == "started\n"


def test_a_failed_gpu_check_step_ends_the_run_and_the_summary_says_so(monkeypatch, tmp_path, capsys):
    from benchmarks.gpu import gpu_check

    ran = tmp_path / "second-ran"
    monkeypatch.setattr(gpu_check, "steps", lambda rehearse, work, variants: [
        gpu_check.Step("first", ["-c", "import sys; print('wrong result'); sys.exit(1)"], 30),
        gpu_check.Step("second", ["-c", f"open({str(ran)!r}, 'w')"], 30)])
    monkeypatch.setattr(gpu_check, "CARRIED", tmp_path / "nothing-carried")
    assert gpu_check.main(["--rehearse", "--results", str(tmp_path / "out")]) == 1
    assert not ran.exists()
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| setup | done |" in summary and "| first | FAILED (exit 1, " in summary and "second" not in summary
    assert capsys.readouterr().out.rstrip().endswith(summary.rstrip())  # the table is what it prints last
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["gpu-check.log", "results.tar.gz",
                                                                          "summary.md"]


def _archive(path, members):
    """A gzipped tar at `path` of `members`: (name, kind, data or link target), as a hostile carried cache would be."""
    with tarfile.open(path, "w:gz") as archive:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                         "chardevice": tarfile.CHRTYPE, "blockdevice": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("symlink", "hardlink"):
                info.linkname = payload
            if kind.endswith("device"):
                info.devmajor, info.devminor = 1, 3
            archive.addfile(info)
    return path


# Each archive holds a good kernel first, then one member that is no plain file or folder inside the cache.
HOSTILE_MEMBERS = {
    "symlink inside": [("ab12/link", "symlink", "kernel.cubin")],
    "symlink out": [("ab12/link", "symlink", "../../outside"), ("ab12/link/evidence", "file", b"x")],
    "symlink chain": [(f"ab12/{'d' * 50}{i}", "symlink", f"{'d' * 50}{i + 1}" if i < 40 else "../../..")
                      for i in range(41)] + [("ab12/" + "d" * 50 + "0/evidence", "file", b"x")],
    "hard link": [("ab12/hard", "hardlink", "ab12/kernel.cubin")],
    "hard link out": [("ab12/hard", "hardlink", "../outside/evidence")],
    "parent": [("../evidence", "file", b"x")],
    "absolute": [("/tmp/nezha-hf-test-evidence-absolute", "file", b"x")],
    "device": [("ab12/null", "chardevice", None)],
    "block device": [("ab12/disk", "blockdevice", None)],
    "fifo": [("ab12/pipe", "fifo", None)],
}


@pytest.mark.parametrize("case", HOSTILE_MEMBERS)
def test_a_carried_triton_cache_with_anything_but_files_and_folders_is_refused_whole(tmp_path, case):
    """`restore_cache` unpacks plain files and folders inside the cache only; an archive holding a link of any kind, a
    device, a FIFO or a name outside is refused before anything of it is written (Python's `filter="data"` is passed
    by a long symlink chain on 3.11.7, CVE-2025-4517)."""
    from benchmarks.gpu import gpu_check

    (tmp_path / "outside").mkdir()
    cache = tmp_path / "run" / "cache"
    members = [("ab12", "dir", None), ("ab12/kernel.cubin", "file", b"kernel"), *HOSTILE_MEMBERS[case]]
    part = _archive(tmp_path / "triton-cache.tar.gz", members)
    log = gpu_check.Log(tmp_path / "gpu-check.log")
    gpu_check.restore_cache(cache, [part], log)
    text = (tmp_path / "gpu-check.log").read_text()
    assert "refused" in text and "kernels compile in this run" in text, text
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))
    written = [p for p in tmp_path.rglob("*") if p.name in ("evidence", "link", "hard")]
    assert not written and not Path("/tmp/nezha-hf-test-evidence-absolute").exists(), written


def test_a_carried_triton_cache_of_files_and_folders_is_restored(tmp_path):
    from benchmarks.gpu import gpu_check

    part = _archive(tmp_path / "triton-cache.tar.gz", [("ab12", "dir", None), ("ab12/kernel.cubin", "file", b"k"),
                                                       ("ab12/deeper/kernel.json", "file", b"{}")])
    gpu_check.restore_cache(tmp_path / "cache", [part], gpu_check.Log(tmp_path / "gpu-check.log"))
    assert (tmp_path / "cache" / "ab12" / "kernel.cubin").read_bytes() == b"k"
    assert (tmp_path / "cache" / "ab12" / "deeper" / "kernel.json").read_bytes() == b"{}"


@pytest.mark.slow
def test_the_host_overhead_benchmark_times_tritons_launch_path_beside_sdpa(tmp_path):
    """`benchmarks/host_overhead.py` runs the Triton engine's calls through Triton's whole launch path against a fake
    H100 (Triton compiling, so in a process of its own, without the interpreter) and SDPA's beside them: a row per
    call with both host times fitted from three sizes each, the ratio, and what one call of each runs (its Python
    and C calls; NEZHA's Python calls more than SDPA's)."""
    from benchmarks import host_overhead

    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--calls", "2", "--repeats", "1",
                           "--results", str(tmp_path)], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "host-overhead.md").read_text()
    assert text.startswith("Command: `python benchmarks/host_overhead.py --calls 2 --repeats 1 --results ")
    rows = json.loads((tmp_path / "host-overhead.json").read_text())["rows"]
    assert [row["call"] for row in rows] == list(host_overhead.CALLS)
    for row in rows:
        assert row["ratio"] == row["nezha_us"] / row["sdpa_us"]
        assert all(len(points) == 3 and min(points.values()) > 0 for points in row["points"].values()), row
        assert row["calls"]["nezha"]["python"] > row["calls"]["sdpa"]["python"] > 0, row
