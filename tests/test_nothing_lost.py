"""Nothing lost, round two: races between writers, destinations that appear mid-run, replacements a kill cannot
split, the user's own files, symlinks, resumes that check what they resume, non-finite values, signals.

Each test names the finding it reproduces; each asserts the one-line error and that the files outside the
destination (and the old destination itself) are byte-identical."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import VOCAB, snapshot, synthetic_judgment, tiny_config, write_jsonl

from nezha_hf import NezhaForMaskedLM, NezhaForTokenClassification
from nezha_hf import safe_output
from nezha_hf.hub import export_remote_code

CLI = [sys.executable, "-m", "nezha_hf"]


def one_line_failure(done, *needles, code=2):
    assert done.returncode == code, (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("nezha-hf")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def small_bert(directory):
    from helpers import save_layout
    from helpers import small_bert as build

    save_layout(build(), directory, "safetensors")
    return directory


def base_model(directory, tokenizer, seed=0):
    torch.manual_seed(seed)
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB, max_relative_position=16)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def corpus(directory):
    from test_pretraining import chinese_corpus

    return chinese_corpus(directory)


# --- a destination that appears during a run; two writers ---------------------------------------------------


def test_a_folder_that_appears_during_a_run_is_not_replaced(tmp_path, run_cli, monkeypatch):
    """`convert` checked the destination only at the start: one created meanwhile was deleted by the final rename."""
    from nezha_hf import conversion

    source = small_bert(tmp_path / "bert")
    destination = tmp_path / "out"
    original = conversion._write_and_verify

    def meanwhile(*args, **kwargs):
        destination.mkdir()
        (destination / "mine.txt").write_text("the user's file")
        return original(*args, **kwargs)

    monkeypatch.setattr(conversion, "_write_and_verify", meanwhile)
    done = run_cli("convert", "bert", source, destination)
    one_line_failure(done, str(destination), "--overwrite")
    assert snapshot(destination) == {"mine.txt": b"the user's file"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert", "out"]  # nothing left beside it


@contextlib.contextmanager
def claimed_elsewhere(destination):
    """Another process holding `destination`, as a second nezha-hf run would."""
    code = ("import sys, time; from nezha_hf.safe_output import claimed\n"
            "with claimed(sys.argv[1]):\n    print('ready', flush=True); time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code, str(destination)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        yield
    finally:
        process.kill()
        process.wait()


def test_a_second_writer_to_the_same_output_is_refused(tmp_path, run_cli):
    source = small_bert(tmp_path / "bert")
    destination = tmp_path / "out"
    with claimed_elsewhere(destination):  # another run holds it
        done = run_cli("convert", "bert", source, destination)
    one_line_failure(done, str(destination), "another")
    assert not destination.exists()
    assert run_cli("convert", "bert", source, destination).returncode == 0  # free again


def test_leftovers_of_killed_runs_are_cleaned_by_the_next_run(tmp_path):
    destination = tmp_path / "out"
    (tmp_path / ".out.partial-abc123").mkdir()
    (tmp_path / ".out.partial-abc123" / "half.bin").write_bytes(b"x")
    with safe_output.staged_folder(destination) as staging:
        (staging / "done.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("kill_after", ["first rename"])
def test_a_replacement_killed_half_way_is_recovered(tmp_path, kill_after):
    """A kill between the two renames of a replacement (where the file system cannot swap two folders at once) left
    no output: the old one only in a hidden `.replaced-` folder. The next run on that destination puts it back."""
    destination = tmp_path / "out"
    retired = tmp_path / ".out.replaced-xyz"
    retired.mkdir()
    (retired / "out").mkdir()
    (retired / "out" / "config.json").write_text("old")
    with safe_output.claimed(destination):
        pass
    assert snapshot(destination) == {"config.json": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_replacement_swaps_old_for_new_in_one_step(tmp_path, monkeypatch):
    """Folders are exchanged by one rename (Linux renameat2): at no instant is the destination missing or mixed."""
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "config.json").write_text("old")
    renames = []
    monkeypatch.setattr(os, "rename", lambda *a: renames.append(a) or os.replace(*a))
    with safe_output.staged_folder(destination, overwrite=True) as staging:
        (staging / "config.json").write_text("new")
    assert snapshot(destination) == {"config.json": b"new"} and renames == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- save_pretrained: the user's files, and a kill while it moves files in ------------------------------------


def test_save_pretrained_keeps_the_users_weight_files(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    mine = {"model_best.safetensors": b"my best", "pytorch_model_old.bin": b"my old", "notes.txt": b"notes"}
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a shard of an earlier save")
    (folder / "model.safetensors.index.json").write_text("{}")
    NezhaForTokenClassification(tiny_config(num_labels=3)).save_pretrained(folder)
    after = snapshot(folder)
    assert {name: after.get(name) for name in mine} == mine
    assert "model-00001-of-00002.safetensors" not in after and "model.safetensors.index.json" not in after
    assert "model.safetensors" in after


def test_a_save_interrupted_while_moving_in_leaves_the_old_model_whole(tmp_path, monkeypatch):
    """A kill during save_pretrained's moves left new weights beside the old config.json. Now the new folder is
    built beside the old one (new files, links to the rest) and swapped in by one rename: interrupted while it
    is built, the old folder is untouched; once swapped, it is whole and new."""
    folder = tmp_path / "model"
    NezhaForTokenClassification(tiny_config(num_labels=3)).save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")
    before = snapshot(folder)

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(safe_output, "_link_into", killed)  # while the old files are being linked in
    with pytest.raises(KeyboardInterrupt):
        NezhaForTokenClassification(tiny_config(num_labels=5)).save_pretrained(folder)
    monkeypatch.undo()
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    swaps = []
    exchange = safe_output._exchange
    monkeypatch.setattr(safe_output, "_exchange", lambda *a: swaps.append(a) or exchange(*a))
    NezhaForTokenClassification(tiny_config(num_labels=5)).save_pretrained(folder)
    assert len(swaps) == 1 and (folder / "notes.txt").read_text() == "mine"
    assert json.loads((folder / "config.json").read_text())["id2label"].keys() == {str(i) for i in range(5)}


def test_export_remote_code_does_not_write_through_symlinks(tmp_path):
    """A hub cache snapshot links its files to shared blobs; rewriting them would change the blobs for everyone."""
    folder = tmp_path / "snapshot"
    NezhaForTokenClassification(tiny_config(num_labels=3)).save_pretrained(folder)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("config.json", "modeling_nezha.py", "relative_attention.py"):
        blob = blobs / name
        if (folder / name).exists():
            blob.write_bytes((folder / name).read_bytes())
            (folder / name).unlink()
        else:
            blob.write_text("# an older copy\n")
        (folder / name).symlink_to(blob)
    before = snapshot(blobs)
    export_remote_code(folder)
    assert snapshot(blobs) == before
    assert not (folder / "modeling_nezha.py").is_symlink() and "auto_map" in (folder / "config.json").read_text()


# --- resumes check what they resume; finished runs; --overwrite everywhere ------------------------------------


def pretrain(*args, timeout=600):
    return subprocess.run([*CLI, "pretrain", *map(str, args)], capture_output=True, text=True, timeout=timeout)


PRETRAIN = ["--max-length", "64", "--batch-size", "4", "--save-steps", "4", "--learning-rate", "2e-3"]


def test_pretrain_refuses_an_existing_folder_without_overwrite(tmp_path, tokenizer):
    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_best.safetensors").write_bytes(b"the user's model")
    (other / "pytorch_model_old.bin").write_bytes(b"and an old one")
    before = snapshot(tmp_path)
    one_line_failure(pretrain(base, data, "--output", other, "--max-steps", "4", *PRETRAIN), str(other), "--overwrite")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_resume_of_another_run_is_refused(tmp_path, tokenizer):
    """Base B into an output holding base A's checkpoints resumed A and saved A's weights, exit 0."""
    data = corpus(tmp_path / "corpus")
    first, second = base_model(tmp_path / "a", tokenizer, seed=0), base_model(tmp_path / "b", tokenizer, seed=1)
    output = tmp_path / "out"
    killed = pretrain(first, data, "--output", output, "--max-steps", "8", *PRETRAIN)
    assert killed.returncode == 0, killed.stderr[-2000:]
    checkpoints = output.with_name("out.checkpoints")
    assert checkpoints.is_dir()
    shutil.rmtree(output)  # as if the first run had been killed before writing its result
    before = snapshot(tmp_path)
    line = one_line_failure(pretrain(second, data, "--output", output, "--max-steps", "12", *PRETRAIN),
                            str(checkpoints), "base model", "--no-resume")
    assert str(first) in line or "differs" in line
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_rerunning_a_finished_pretrain_trains_nothing_more(tmp_path, tokenizer):
    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    output = tmp_path / "out"
    assert pretrain(base, data, "--output", output, "--max-steps", "8", *PRETRAIN).returncode == 0
    checkpoints = sorted(p.name for p in output.with_name("out.checkpoints").iterdir())
    again = pretrain(base, data, "--output", output, "--max-steps", "8", *PRETRAIN, "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in output.with_name("out.checkpoints").iterdir()) == checkpoints


@pytest.mark.slow
def test_train_summarizer_with_another_base_does_not_reuse_the_old_checkpoints(tmp_path, tokenizer):
    rng = __import__("random").Random(3)
    data = write_jsonl(tmp_path / "train.jsonl", [synthetic_judgment(rng, i) for i in range(4)])
    first, second = base_model(tmp_path / "a", tokenizer, seed=0), base_model(tmp_path / "b", tokenizer, seed=1)
    common = ["--extractor-steps", "2", "--generator-steps", "2", "--max-length", "128", "--save-steps", "1",
              "--validation-fraction", "0"]
    done = subprocess.run([*CLI, "train-summarizer", data, "--base", first, "--output", tmp_path / "s", *common],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    before = snapshot(tmp_path)
    done = subprocess.run([*CLI, "train-summarizer", data, "--base", second, "--output", tmp_path / "s", "--overwrite",
                           *common], capture_output=True, text=True, timeout=600)
    one_line_failure(done, "base model", "--no-resume")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_train_summarizer_works_with_its_defaults(tmp_path, tokenizer):
    """Validation 0.1 and no --copy: evaluation had no loss (`'eval_loss'`) after training both stages."""
    rng = __import__("random").Random(5)
    data = write_jsonl(tmp_path / "train.jsonl", [synthetic_judgment(rng, i) for i in range(10)])
    base = base_model(tmp_path / "base", tokenizer)
    done = subprocess.run([*CLI, "train-summarizer", data, "--base", base, "--output", tmp_path / "s",
                           "--extractor-steps", "2", "--generator-steps", "2", "--max-length", "128"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "extractor_eval_loss=" in done.stdout and "generator_eval_loss=" in done.stdout


# --- non-finite values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, option, value", [
    ("pretrain", "--learning-rate", "inf"), ("pretrain", "--epochs", "nan"), ("train-summarizer", "--learning-rate", "inf"),
    ("train-summarizer", "--validation-fraction", "nan"), ("summarize", "--threshold", "nan"),
    ("export onnx", "--atol", "nan"), ("pretrain", "--mlm-probability", "nan"),
])
def test_non_finite_numbers_are_refused(command, option, value, tmp_path, run_cli):
    positional = {"pretrain": ["model", "corpus", "--output", tmp_path / "o"],
                  "train-summarizer": ["data.jsonl", "--base", "model", "--output", tmp_path / "o"],
                  "summarize": ["model", "data.jsonl"], "export onnx": ["model", tmp_path / "m.onnx"]}[command]
    done = run_cli(*command.split(), *positional, option, value)
    one_line_failure(done, option, "finite")


@pytest.mark.slow
def test_training_that_diverges_stops_with_one_line_and_writes_nothing(tmp_path, tokenizer):
    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    before = snapshot(tmp_path)
    done = pretrain(base, data, "--output", tmp_path / "out", "--max-steps", "6", *PRETRAIN[:-2],
                    "--learning-rate", "1e30")
    one_line_failure(done, "not finite")
    assert not (tmp_path / "out").exists()
    checkpoints = tmp_path / "out.checkpoints"
    saved = [p for p in checkpoints.rglob("*.safetensors")] if checkpoints.exists() else []
    for path in saved:  # whatever was saved before the divergence is finite
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("out.checkpoints")} == before


def test_summarize_refuses_a_model_with_non_finite_weights(tmp_path, tokenizer, run_cli):
    from nezha_hf import NezhaForSentenceExtraction, NezhaForUniLM
    from nezha_hf.summarization import Summarizer

    torch.manual_seed(0)
    extractor = NezhaForSentenceExtraction(tiny_config(vocab_size=VOCAB))
    with torch.no_grad():
        extractor.classifier.weight.fill_(float("nan"))
    Summarizer(extractor, NezhaForUniLM(tiny_config(vocab_size=VOCAB)), tokenizer).save_pretrained(tmp_path / "s")
    data = write_jsonl(tmp_path / "d.jsonl", [synthetic_judgment(__import__("random").Random(0), 0)])
    one_line_failure(run_cli("summarize", tmp_path / "s", data, "--extract-only"), "not finite")


# --- Ctrl-C and SIGTERM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_that_lands_in_a_finalizer_still_stops_the_command(monkeypatch, capsys, how, code):
    """Python runs a signal's handler between any two bytecodes of the main thread, a finalizer's (`__del__`, a
    weakref callback, the garbage collector's) too, where the exception it raises is reported as unraisable and
    dropped: the command would go on as if no signal had come (one suspect of a pretraining run that outlived its
    SIGTERM in CI). It must still stop, with the signal's one line and code."""
    import nezha_hf_cli

    class SignalsWhileFreed:
        def __del__(self):
            os.kill(os.getpid(), how)
            time.sleep(0.01)  # more bytecode in the finalizer: the handler runs here, inside it

    steps = []

    def command(args):
        SignalsWhileFreed()  # freed at once: its finalizer runs
        for step in range(200):
            time.sleep(0.01)
            steps.append(step)

    monkeypatch.setitem(nezha_hf_cli.COMMANDS, "accelerate-config", command)
    assert nezha_hf_cli.main(["accelerate-config", "one-machine"]) == code
    assert len(steps) < 50, f"the command ran {len(steps)} steps (10 ms each) past the signal"
    assert "accelerate-config: " + ("interrupted" if how == signal.SIGINT else "terminated") in capsys.readouterr().err


@pytest.mark.parametrize("how, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.slow
def test_a_signal_ends_in_one_line_and_removes_the_staging(tmp_path, tokenizer, how, code):
    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    # PYTHONFAULTHANDLER: if it outlives the signal, SIGABRT makes it print where each of its threads is.
    process = subprocess.Popen([*CLI, "pretrain", str(base), str(data), "--output", str(tmp_path / "out"),
                                "--max-steps", "100000", *PRETRAIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    deadline = time.monotonic() + 300
    while not any((tmp_path / "out.checkpoints").glob("checkpoint-*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    process.send_signal(how)
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        stderr = process.communicate(timeout=60)[1]
        pytest.fail(f"pretraining did not end within 120 s of {how!r}; its threads then:\n{stderr[-8000:]}")
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    one_line_failure(done, "interrupted" if how == signal.SIGINT else "terminated", code=code)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".lock" in p.name]
    assert not (tmp_path / "out").exists()
