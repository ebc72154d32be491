"""The GPU check's A/B parts (benchmarks/gpu/gpu_check.py and its steps), rehearsed on the CPU under Triton's
interpreter: the yardstick timed beside NEZHA, the compiled decoding step, block sizes pinned by an environment switch
and run as variants in fresh processes, the model's per-layer profile, and the CPU gate counts printed beside the
timings."""

import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks are scripts of the repository, not part of the package

from test_benchmarks import triton_unusable, unmeasured_machine  # noqa: E402, F401 - fixtures

GATES_36 = ROOT / "benchmarks" / "gpu" / "results" / "gates.json"
INTERPRETER_BLOCKS = "16x32, 4 warps, 1 stages"  # the kernels' one configuration under the interpreter
TUNED_FORWARD = "64x64, 4 warps, 3 stages"  # the forward's tuned configuration


@pytest.fixture
def pinnable(monkeypatch):
    """NEZHA's autotuned kernels with their configurations restored after the test (pinning replaces them)."""
    from nezha_hf import triton_kernels

    for name in ("nezha_forward_kernel", "nezha_key_value_grad_kernel", "nezha_query_grad_kernel"):
        kernel = getattr(triton_kernels, name)
        monkeypatch.setattr(kernel, "configs", list(kernel.configs))


@pytest.mark.slow
def test_the_op_benchmark_times_the_yardstick_on_nezhas_blocks_and_a_compiled_decoding_step(unmeasured_machine,
                                                                                             tmp_path):
    from benchmarks.gpu import gpu_attention

    assert gpu_attention.main(["--rehearse", "--dtypes", "bfloat16", "--lengths", "32", "--cache", "32", "--yardstick",
                               "--compile", "--cases", "forward", "forward+backward", "decoding step, compiled",
                               "--results", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu-attention.json").read_text())["rows"]
    assert [row["case"] for row in rows] == ["forward", "forward+backward", "decoding step, compiled"]
    forward, training, compiled = rows
    assert forward["configs"] == {"forward": INTERPRETER_BLOCKS}
    assert training["configs"] == {"forward": INTERPRETER_BLOCKS, "dK/dV": INTERPRETER_BLOCKS, "dQ": INTERPRETER_BLOCKS}
    for row in (forward, training):
        assert row["yardstick_ms"] > 0
        assert row["nezha_over_yardstick"] == pytest.approx(row["nezha_ms"] / row["yardstick_ms"])
        assert row["yardstick_over_sdpa"] == pytest.approx(row["yardstick_ms"] / row["sdpa_ms"])
    # compiled (rehearsing with aot_eager): timed, or its failure in one line and no ratio; SDPA compiled is timed
    assert compiled["compile_backend"] == "aot_eager" and compiled["sdpa_ms"] > 0
    if compiled.get("nezha_error"):
        assert "\n" not in compiled["nezha_error"] and compiled["nezha_ms"] is None and compiled["ratio"] is None
    else:
        assert compiled["ratio"] == pytest.approx(compiled["nezha_ms"] / compiled["sdpa_ms"])
    text = (tmp_path / "gpu-attention.md").read_text()
    assert "| yardstick (ms) | NEZHA / yardstick | yardstick / SDPA |" in text and "decoding step, compiled" in text


def test_the_yardstick_is_not_timed_where_the_length_is_not_whole_blocks(pinnable):
    import torch

    from benchmarks.gpu import gpu_attention

    configs = {"forward": __import__("triton").Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)}
    inputs = [torch.randn(1, 2, 40, 16, dtype=torch.bfloat16) for _ in range(3)]
    assert gpu_attention.yardstick_step(inputs, configs, train=False) is None  # 40 tokens: 2.5 blocks
    assert gpu_attention.yardstick_step(inputs, configs, train=True) is None
    whole = [tensor[:, :, :32].contiguous() for tensor in inputs]
    assert gpu_attention.yardstick_step(whole, configs, train=True) is None  # the backward's blocks unknown
    output = gpu_attention.yardstick_step(whole, configs, train=False)()
    assert output.shape == (1, 2, 32, 16)


def test_blocks_pinned_by_the_environment_switch_reach_the_autotuner_and_bad_ones_are_one_line(pinnable):
    from benchmarks.gpu import gpu_attention
    from benchmarks.gpu.gpu_ops import CheckFailed
    from nezha_hf import triton_kernels

    assert gpu_attention.pin_blocks("forward=16x32x2x1x128, dQ=16x32x8x2") == {
        "forward": "16x32, 2 warps, 1 stages, 128 registers", "dQ": "16x32, 8 warps, 2 stages"}
    assert [(c.kwargs, c.num_warps, c.num_stages, c.maxnreg)
            for c in triton_kernels.nezha_forward_kernel.configs] == [({"BLOCK_M": 16, "BLOCK_N": 32}, 2, 1, 128)]
    assert len(triton_kernels.nezha_key_value_grad_kernel.configs) >= 1  # not named: left as tuned
    assert gpu_attention.pin_blocks("") == {} and gpu_attention.pin_blocks(None) == {}
    malformed = "is not KERNEL=MxNxWARPSxSTAGES[xREGISTERS]"
    for text, why in (("forward=16x16", f"'forward=16x16' {malformed}"),
                      ("forward=16x32x2x1x128x1", f"'forward=16x32x2x1x128x1' {malformed}"),
                      ("forward=16x32x2x1x0", f"'forward=16x32x2x1x0' {malformed}"),
                      ("backward=16x16x4x1", "'backward' is none of forward, dK/dV, dQ"),
                      ("dQ=16x16x4x1", "'dQ=16x16x4x1': dropout draws for 16 queries and 32 keys at a time, so "
                                       "blocks are whole multiples of 16 x 32"),
                      ("forward=16x64x4x1", "the forward's key block 64 does not divide the decoding split's "
                                            f"{triton_kernels.SPLIT_GRANULE} keys")):
        with pytest.raises(CheckFailed) as refused:
            gpu_attention.pin_blocks(text)
        assert str(refused.value) == f"NEZHA_CHECK_BLOCKS: {why}"


@pytest.mark.slow
def test_a_pinned_block_is_what_the_timed_row_ran(unmeasured_machine, pinnable, monkeypatch, tmp_path):
    from benchmarks.gpu import gpu_attention

    monkeypatch.setenv("NEZHA_CHECK_BLOCKS", "forward=16x32x2x1")
    assert gpu_attention.main(["--rehearse", "--dtypes", "bfloat16", "--lengths", "32", "--cache", "0", "--cases",
                               "forward", "--yardstick", "--results", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "gpu-attention.json").read_text())["rows"]
    assert row["configs"] == {"forward": "16x32, 2 warps, 1 stages"} and row["yardstick_ms"] > 0


def test_a_variant_is_a_name_and_environment_settings():
    from benchmarks.gpu.gpu_check import Variant

    assert Variant.parse("fwd64 NEZHA_CHECK_BLOCKS=forward=64x64x4x3 OTHER=1") == Variant(
        "fwd64", {"NEZHA_CHECK_BLOCKS": "forward=64x64x4x3", "OTHER": "1"})
    for text in ("fwd64", "A=1 B=2", "bad/name X=1", "name notasetting", "name 1X=2"):
        with pytest.raises(ValueError):
            Variant.parse(text)


@pytest.mark.slow
def test_the_gpu_check_runs_each_variant_in_a_fresh_process_and_one_that_fails_alone(unmeasured_machine, monkeypatch,
                                                                                       tmp_path):
    """Rehearsed: `--only variants` runs each variant's attention rows with its settings; a refused setting fails
    that variant alone, and the summary shows every variant's outcome and rows."""
    from benchmarks.gpu import gpu_check

    monkeypatch.setattr(gpu_check, "CARRIED", tmp_path / "nothing-carried")
    results = tmp_path / "out"
    assert gpu_check.main(["--rehearse", "--only", "variants", "--variant", "bad NEZHA_CHECK_BLOCKS=forward=1x1",
                           "--variant", "narrow NEZHA_CHECK_BLOCKS=forward=16x32x2x1", "--results", str(results),
                           "--gates", str(tmp_path / "no-gates.json")]) == 1
    summary = (results / "summary.md").read_text()
    assert "| variant bad | FAILED (exit 1, " in summary and "| variant narrow | passed (" in summary
    assert "| environment |" not in summary and "| correctness |" not in summary and "| attention op |" not in summary
    assert "Gate counts: none (no-gates.json not found" in summary
    log = (results / "gpu-check.log").read_text()
    assert "=== variant narrow (NEZHA_CHECK_BLOCKS=forward=16x32x2x1)" in log
    assert "NEZHA_CHECK_BLOCKS: 'forward=1x1' is not KERNEL=MxNxWARPSxSTAGES" in log
    with tarfile.open(results / "results.tar.gz") as archive:
        assert "gpu-attention-narrow.json" in archive.getnames()
        rows = json.load(archive.extractfile("gpu-attention-narrow.json"))["rows"]
    assert [row["case"] for row in rows] == ["forward", "forward+backward"]
    assert rows[0]["configs"] == {"forward": "16x32, 2 warps, 1 stages"} and rows[0]["yardstick_ms"] > 0
    assert "Variant narrow:" in summary


@pytest.mark.slow
def test_the_gpu_check_times_host_against_wall_time_per_call_beside_sdpa(unmeasured_machine, monkeypatch, tmp_path):
    """Rehearsed: the check's host-time step (gpu_host_time.py, in a fresh process) times each call NEZHA's and
    SDPA's way, host and wall, profiles NEZHA's training step, and the summary lists every call."""
    from benchmarks.gpu import gpu_check, gpu_host_time

    monkeypatch.setattr(gpu_check, "CARRIED", tmp_path / "nothing-carried")
    results = tmp_path / "out"
    assert gpu_check.main(["--rehearse", "--only", "host time", "--results", str(results)]) == 0
    summary = (results / "summary.md").read_text()
    assert "| host time | passed (" in summary and "Host time per call (ms)" in summary
    assert all(f"- {call}: NEZHA " in summary for call in gpu_host_time.CALLS)
    with tarfile.open(results / "results.tar.gz") as archive:
        rows = json.load(archive.extractfile("gpu-host-time.json"))["rows"]
        profiled = archive.extractfile("gpu-host-time.md").read().decode()
    assert [row["call"] for row in rows] == list(gpu_host_time.CALLS)
    assert all(row[f"{engine}_wall_ms"] >= row[f"{engine}_host_ms"] > 0 for row in rows for engine in ("NEZHA", "SDPA"))
    assert "under cProfile" in profiled and "triton_attention" in profiled


def _attention_results(work: Path, rows: list[dict], triton: str) -> None:
    (work / "gpu-attention.json").write_text(json.dumps({"machine": {"software": {"triton": triton}}, "rows": rows}))


def test_the_summary_prints_the_gate_counts_of_each_configuration_timed(tmp_path):
    """The counts of the configurations the rows ran, as `make gpu-gates` wrote them, beside the yardstick's at the
    same configuration; a configuration the counts lack shows dashes; another Triton's counts are flagged."""
    from benchmarks.gpu import gpu_check

    row = {"case": "forward+backward", "dtype": "bfloat16", "queries": 2048, "keys": 2048, "dropout": 0.0,
           "target": 1.3, "met": False, "nezha_ms": 2.0, "sdpa_ms": 0.7, "ratio": 2.0 / 0.7, "sdpa_backend": "flash",
           "yardstick_ms": 0.8, "nezha_over_yardstick": 2.5, "yardstick_over_sdpa": 0.8 / 0.7,
           "configs": {"forward": TUNED_FORWARD, "dK/dV": "64x128, 8 warps, 2 stages",
                       "dQ": "32x32, 8 warps, 9 stages"}}
    _attention_results(tmp_path, [row], "3.6.0")
    summary = gpu_check.summary_table(tmp_path, {"attention op": "passed (9 s)"}, GATES_36)
    assert ("| forward+backward | bfloat16 | 2,048 | 2.000 | 0.700 | 2.86 | <= 1.3 NOT met | 0.800 | 2.50 | 1.14 |"
            in summary)
    # the expected figures, from the counts file itself: the costliest tail loop, the yardstick's, the band's
    counts = {(r["kernel"], r["case"], r["config_name"]): r for r in json.loads(GATES_36.read_text())["rows"]}

    def loop(kind, name, config):
        case = "yardstick" if name.startswith("yardstick") else "no mask"
        return max((x for x in counts[(name, case, config)]["loops"] if x["class"] == kind),
                   key=lambda x: x["instructions"])

    forward = counts[("nezha_forward_kernel", "no mask", TUNED_FORWARD)]
    tail, band = loop("tail", "nezha_forward_kernel", TUNED_FORWARD), loop(
        "band", "nezha_forward_kernel", TUNED_FORWARD)
    plain = loop("tail", "yardstick_forward_kernel", TUNED_FORWARD)
    assert (f"| forward | no mask | {TUNED_FORWARD} | {forward['registers']} | {forward['stack']} | "
            f"{forward['blocks_per_sm']} | {forward['wgmma']} / {forward['mma_sync']} | "
            f"{tail['per_pair']:.2f} ({tail['per_pair'] / plain['per_pair']:.2f}x) | "
            f"{band['instructions'] / tail['instructions']:.2f} |") in summary
    # a tail loop's spills beside its count (none spills in today's counts: planted in a copy)
    planted = json.loads(GATES_36.read_text())
    key_value = next(r for r in planted["rows"] if (r["kernel"], r["case"], r["config_name"]) == (
        "nezha_key_value_grad_kernel", "no mask", "64x128, 8 warps, 2 stages"))
    max((x for x in key_value["loops"] if x["class"] == "tail"), key=lambda x: x["instructions"])["spills"] = 3
    (tmp_path / "spilling.json").write_text(json.dumps(planted))
    assert ", 3 LDL/STL |" in gpu_check.summary_table(tmp_path, {}, tmp_path / "spilling.json")
    assert "| dQ | no mask | 32x32, 8 warps, 9 stages | - | - | - | - | - | - |" in summary
    assert "gates.json, Triton 3.6.0;" in summary
    _attention_results(tmp_path, [row], "3.9.0")
    assert "Triton 3.6.0, NOT this run's Triton 3.9.0" in gpu_check.summary_table(tmp_path, {}, GATES_36)
    assert "Gate counts: none (gates.json not found" in gpu_check.summary_table(tmp_path, {}, tmp_path / "gates.json")


def test_a_compiled_decoding_step_that_failed_reads_as_its_error_in_the_summary(tmp_path):
    from benchmarks.gpu import gpu_check

    row = {"case": "decoding step, compiled", "dtype": "bfloat16", "queries": 1, "keys": 8192, "dropout": 0.0,
           "target": 1.1, "met": False, "nezha_ms": None, "sdpa_ms": 0.05, "ratio": None, "sdpa_backend": "flash",
           "nezha_error": "Unsupported: call_function ..."}
    _attention_results(tmp_path, [row], "3.6.0")
    summary = gpu_check.summary_table(tmp_path, {}, GATES_36)
    assert ("| decoding step, compiled | bfloat16 | 8,192 | Unsupported: call_function ... | 0.050 | - | "
            "<= 1.1 NOT met | - | - | - | - |") in summary


@pytest.mark.slow
def test_the_model_profile_rehearsed_gives_host_and_kernel_time_per_layer(unmeasured_machine, tmp_path):
    from benchmarks.gpu import gpu_profile

    assert gpu_profile.main(["--rehearse", "--results", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-profile.json").read_text())
    assert [(row["model"], row["batch"]) for row in result["rows"]] == [
        ("NEZHA (nezha_triton)", 1), ("BERT-SDPA", 1), ("NEZHA (nezha_triton)", 2), ("BERT-SDPA", 2)]
    for row in result["rows"]:
        assert row["ranges"] == result["sizes"]["layers"] * result["sizes"]["passes"]  # every layer, every pass
        assert row["host_ms"] > 0 and row["pass_ms"] > 0
        assert row["kernel_ms"] == 0 and row["host_over_kernel"] is None  # the CPU launches no kernels
    assert "Batch 2: NEZHA's host time per layer" in (tmp_path / "gpu-profile.md").read_text()


@pytest.mark.slow
def test_the_model_profile_against_a_fake_gpu_gives_host_time_per_layer(tmp_path):
    """`gpu_profile.py --fake-gpu`: the 12-layer model's host time per layer on the CPU, NEZHA's Triton engine
    launching through Triton's whole launch path against a fake H100 (so Triton compiles: a process without the
    interpreter), beside BERT-SDPA's, each at three lengths and fitted to no tokens, with and without the profiler."""
    import os
    import subprocess

    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "benchmarks/gpu/gpu_profile.py", "--fake-gpu", "--results", str(tmp_path)],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-profile-fake-gpu.json").read_text())
    assert [(row["model"], row["tokens"]) for row in result["rows"]] == [
        (model, tokens) for tokens in (8, 16, 32) for model in ("NEZHA (nezha_triton)", "BERT-SDPA")]
    assert all(row["ranges"] == 12 * result["sizes"]["passes"] and row["pass_cpu_ms"] > 0 for row in result["rows"])
    nezha, bert = result["host_us_per_layer"].values()
    assert result["ratio"] == nezha / bert and "host time per layer" in (tmp_path / "gpu-profile-fake-gpu.md").read_text()


def test_the_model_profile_ends_in_one_line_when_nezha_did_not_run_triton(triton_unusable, unmeasured_machine,
                                                                          tmp_path, capsys):
    from benchmarks.gpu import gpu_profile

    assert gpu_profile.main(["--rehearse", "--batches", "1", "--tokens", "8", "--results", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == ["gpu_profile.py: NEZHA did not run the Triton engine on cpu: the "
                                                    "chunked engine ran (simulated: kernels failed)"]
    assert not list(tmp_path.iterdir())


def test_a_gate_with_nothing_to_compare_with_fails_rather_than_passing_unchecked():
    """The tail loop's gate compares with the yardstick at the same configuration, dropout's with the case without
    dropout: where those counts are missing (the yardstick compiled for one case's configurations only), or a row's
    own tail or band loop was not found, the row fails in words, rather than passing a gate nothing checked. A run of
    the dropout case alone (`--case`) has no case without dropout to ask for."""
    from benchmarks.gpu import gpu_gates

    rows = json.loads(GATES_36.read_text())["rows"]
    today = gpu_gates.gate_failures(rows)
    assert not [line for line in today if "no counts" in line]

    def without(kernel, case, config):
        return [r for r in rows if (r["kernel"], r["case"], r["config_name"]) != (kernel, case, config)]

    failures = gpu_gates.gate_failures(without("yardstick_forward_kernel", "yardstick", TUNED_FORWARD))
    assert f"forward (no mask), {TUNED_FORWARD}: no counts of the yardstick at this configuration to compare " \
           "with" in failures
    failures = gpu_gates.gate_failures(without("nezha_query_grad_kernel", "no mask", "128x32, 8 warps, 2 stages"))
    assert ("dQ (no mask, dropout), 128x32, 8 warps, 2 stages: no counts of the case without dropout at this "
            "configuration to compare with") in failures
    dropout_alone = [r for r in rows if r["case"] in ("no mask, dropout", "padding, dropout", "yardstick")]
    assert not [line for line in gpu_gates.gate_failures(dropout_alone) if "no counts" in line]
    # a row whose band (or tail) loop was not found fails rather than skipping that loop's gates
    bandless = json.loads(json.dumps(rows))
    forward = next(r for r in bandless if (r["kernel"], r["case"]) == ("nezha_forward_kernel", "no mask"))
    forward["loops"] = [loop for loop in forward["loops"] if loop["class"] != "band"]
    assert (f"forward (no mask), {forward['config_name']}: no band loop found in its SASS to count"
            in gpu_gates.gate_failures(bandless))
