"""Windows and macOS, as far as Linux can show them: every path a user takes, in fresh processes where what those
systems lack is taken away. `WINDOWS` makes `fcntl` and `resource` unimportable and `/proc` unreadable (and so
`filelock` falls back to its portable lock); `NO_SWAP` takes away Linux's one-step folder swap, as on macOS and
Windows. What no simulation shows (a real Windows or macOS machine, MSVC, Apple's Clang) is said in
docs/robustness.md."""

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import VOCAB, make_tokenizer, snapshot, synthetic_judgment, tiny_config, write_jsonl

from nezha_hf import NezhaForMaskedLM

# psutil's Linux backend itself needs `resource` (its Windows one does not): it is imported before `resource` goes.
WINDOWS = """
import builtins, importlib.abc, io, sys
import psutil
class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("fcntl", "resource"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Missing())
for _name in ("fcntl", "resource"):
    sys.modules.pop(_name, None)
_open = io.open
def _no_proc(file, *args, **kwargs):
    if str(file).startswith("/proc"):
        raise FileNotFoundError(2, "No such file or directory", str(file))
    return _open(file, *args, **kwargs)
builtins.open = io.open = _no_proc
"""
NO_SWAP = """
import nezha_hf.safe_output as _safe_output
_safe_output._exchange = lambda first, second: False
"""


def simulated(shims: str, code: str, *, cwd, timeout=600) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter after `shims`."""
    return subprocess.run([sys.executable, "-c", shims + code], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def cli(shims: str, *args, cwd, expect=0) -> subprocess.CompletedProcess:
    """`nezha-hf ARGS` in a fresh interpreter after `shims`."""
    code = f"import sys, nezha_hf_cli\nsys.exit(nezha_hf_cli.main({[str(a) for a in args]!r}))"
    done = simulated(shims, code, cwd=cwd)
    assert done.returncode == expect, (done.returncode, done.stdout[-1000:], done.stderr[-3000:])
    return done


@pytest.mark.slow
def test_import_save_and_load_without_fcntl_or_proc(tmp_path):
    """`import nezha_hf` failed on Windows (`safe_output` imported `fcntl`); saving a model over an existing one
    replaces it whole without the one-step swap, and the lock files go with the run."""
    code = """
import sys, torch
import filelock, nezha_hf
from nezha_hf import NezhaConfig, NezhaForMaskedLM
assert "fcntl" not in sys.modules and filelock.FileLock is filelock.SoftFileLock
config = NezhaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
for seed in (0, 1):  # the second save replaces the first, in two renames
    torch.manual_seed(seed)
    model = NezhaForMaskedLM(config)
    model.save_pretrained("model")
loaded = NezhaForMaskedLM.from_pretrained("model")
assert torch.equal(loaded.cls.predictions.bias, model.cls.predictions.bias)
print("ok")
"""
    done = simulated(WINDOWS + NO_SWAP, code, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no lock, staging or replaced folder left


@pytest.mark.slow
def test_a_second_writer_is_refused_and_a_killed_one_does_not_block(tmp_path):
    """With filelock's portable lock (no `fcntl`): a second run on the same output is refused with one line; once the
    first is killed, its lock does not hold the output forever."""
    from helpers import save_layout, small_bert

    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    holder = subprocess.Popen(
        [sys.executable, "-c", WINDOWS + "import sys, time\nfrom nezha_hf.safe_output import claimed\n"
         "with claimed('out'):\n    print('holding', flush=True); time.sleep(600)"],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        refused = cli(WINDOWS, "convert", "bert", "bert", "out", cwd=tmp_path, expect=2)
        assert "another run is writing" in refused.stderr and not (tmp_path / "out").exists()
    finally:
        holder.kill()
        holder.wait()
    cli(WINDOWS, "convert", "bert", "bert", "out", cwd=tmp_path)
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.slow
def test_a_replacement_killed_between_its_two_renames_is_recovered(tmp_path):
    """Without the one-step swap, a replacement is two renames: a kill between them leaves the old output aside; the
    next run on that destination puts it back before anything else."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("old")
    code = """
import os, signal
import nezha_hf.safe_output as safe_output
_replace = os.replace
def replace(source, target):
    _replace(source, target)
    if ".replaced-" in str(target):  # the old output is aside: die before the new one moves in
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
with safe_output.staged_folder("out", overwrite=True) as staging:
    (staging / "config.json").write_text("new")
"""
    killed = simulated(WINDOWS + NO_SWAP, code, cwd=tmp_path)
    assert killed.returncode == -9 and not (tmp_path / "out").exists()
    recovered = simulated(WINDOWS + NO_SWAP, "from nezha_hf.safe_output import claimed\nwith claimed('out'): pass\n",
                          cwd=tmp_path)
    assert recovered.returncode == 0, recovered.stderr[-3000:]
    assert snapshot(tmp_path / "out") == {"config.json": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
def test_train_summarize_and_evaluate_as_on_windows(tmp_path):
    """The summariser's commands end to end, without `fcntl`, `resource`, `/proc` or the one-step swap."""
    rng = random.Random(4)
    data = write_jsonl(tmp_path / "train.jsonl", [synthetic_judgment(rng, i) for i in range(6)])
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB, max_relative_position=16)).save_pretrained(tmp_path / "base")
    make_tokenizer(tmp_path / "base")
    shims = WINDOWS + NO_SWAP
    cli(shims, "train-summarizer", data, "--base", "base", "--output", "model", "--extractor-steps", 4,
        "--generator-steps", 4, "--max-length", 128, cwd=tmp_path)
    cli(shims, "summarize", "model", data, "--output", "summaries.jsonl", "--max-new-tokens", 8, cwd=tmp_path)
    results = [json.loads(line) for line in (tmp_path / "summaries.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(results) == 6
    done = cli(shims, "evaluate", data, "--predictions", "summaries.jsonl", "--output", "scores.json", cwd=tmp_path)
    assert "| predictions | char |" in done.stdout and (tmp_path / "scores.json").is_file()


@pytest.mark.slow
def test_the_demo_as_on_windows(tmp_path):
    """`nezha-hf demo` read `/proc/self/status`: a `FileNotFoundError` on macOS and Windows."""
    done = cli(WINDOWS + NO_SWAP, "demo", "--quick", "--tokens", "600", "--workdir", "demo-output", cwd=tmp_path)
    assert "peak resident memory" in done.stdout and "[3]" in done.stdout
