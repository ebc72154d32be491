"""Issue 69: the fault matrix's writes, generated from `nezha_hf.inventory.OUTPUTS`: every output every command
writes meets every fault of `WRITE_FAULTS`, a full disk, a read-only destination and a kill at each write, in a
process of its own. Each ends in one line naming the output (and, for room, the file system), nothing in place of
the destination but a whole output, and a rerun that completes and leaves nothing behind. (A file of its own so that
the slow set's workers share the matrix.)"""

import errno
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import pytest
from helpers import save_layout, small_bert, snapshot, synthetic_judgment, write_jsonl
from test_fault_matrix import PRETRAIN, SUMMARIZE, command, summarizers, training_run  # noqa: F401 (fixtures)

from nezha_hf import inventory

# --- the writes around every output: a full disk, a read-only folder, a kill at each write ------------------------

KILL_AT = """
import os, signal, sys
folder, count = os.path.realpath(sys.argv[1]), int(sys.argv[2])
seen = [0]

def write(event, args):
    # What writes into the destination's folder: an open for writing, a folder made, a rename, a link, a removal.
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and (
            (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
            or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))):
        path = args[0]
    elif event in ("os.mkdir", "os.rename", "os.link", "os.remove", "os.rmdir", "os.symlink", "shutil.rmtree"):
        path = args[0]
    else:
        return
    try:
        path = os.fsdecode(path)
    except TypeError:
        return
    if not os.path.realpath(path).startswith(folder + os.sep):
        return
    seen[0] += 1
    if seen[0] == count:
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(write)
import nezha_hf_cli
code = nezha_hf_cli.main(sys.argv[3:])
print(f"writes: {seen[0]}", file=sys.stderr)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def outputs(summarizers, training_run, tmp_path_factory):  # noqa: F811 (the fixtures imported above)
    """For each output of `inventory.OUTPUTS`: the command line that writes it into a folder `{out}`, and its
    destination there."""
    root = tmp_path_factory.mktemp("outputs")
    save_layout(small_bert(), root / "bert", "safetensors")
    rng = random.Random(7)
    write_jsonl(root / "train.jsonl", [synthetic_judgment(rng, i, sentences=4) for i in range(3)])
    sources = {
        "converted": (["convert", "bert", root / "bert", "{out}/model"], "model"),
        "pretrained": (["pretrain", training_run / "base", training_run / "corpus", "--output", "{out}/model",
                        *PRETRAIN, "--max-steps", "2", "--save-steps", "1"], "model"),
        "summarizer": (["train-summarizer", root / "train.jsonl", "--base", training_run / "base", "--output",
                        "{out}/model", "--extractor-steps", "1", "--generator-steps", "1", "--validation-fraction", "0",
                        "--max-length", "64"], "model"),
        "summaries": (["summarize", summarizers / "trained", summarizers / "judgments.jsonl", *SUMMARIZE, "--output",
                       "{out}/summaries.jsonl"], "summaries.jsonl"),
        "onnx": (["export", "onnx", training_run / "base", "{out}/model.onnx"], "model.onnx"),
    }
    assert set(sources) == {row.id for row in inventory.OUTPUTS}
    return sources


def command_line(outputs, output_id: str, folder: Path) -> tuple[list[str], Path]:
    args, destination = outputs[output_id]
    return [str(arg).replace("{out}", str(folder)) for arg in args], folder / destination


def run_process(args, timeout=900, preexec_fn=None, kill_at=None, folder=None):
    import subprocess

    prefix = ([sys.executable, "-c", KILL_AT, str(folder), str(kill_at)] if kill_at is not None
              else [sys.executable, "-m", "nezha_hf"])
    return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)


def assert_one_line(done, *needles):
    lines = [line for line in done.stderr.splitlines() if line.startswith("nezha-hf ")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    """What a run left beside its output: staging siblings, retired outputs."""
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".replaced-" in p.name)


@pytest.mark.slow  # a command in a process of its own per output
@pytest.mark.parametrize("output_id", [row.id for row in inventory.OUTPUTS])
def test_a_full_disk_names_the_output_and_the_disk_and_leaves_nothing(output_id, outputs, tmp_path):
    """Files may not grow past a size smaller than the output (`RLIMIT_FSIZE`: every write that would is refused,
    EFBIG, as a full disk refuses it): one line naming the output and the file system, nothing in place, no staging
    left."""
    import resource

    folder = tmp_path / "out"
    folder.mkdir()
    args, destination = command_line(outputs, output_id, folder)
    limit = 200 if output_id == "summaries" else 2048  # two summaries are a few hundred bytes

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails rather than the process being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = run_process(args, preexec_fn=small_files)
    line = assert_one_line(done, "File too large", "no room on the file system at")
    assert destination.name in line, line
    assert not destination.exists() and not leftovers(folder), sorted(p.name for p in folder.iterdir())


@pytest.mark.slow  # a command per output
@pytest.mark.parametrize("output_id", [row.id for row in inventory.OUTPUTS])
def test_a_read_only_destination_is_named_and_nothing_is_written(output_id, outputs, tmp_path, monkeypatch):
    """The destination's folder refuses new files (EROFS, as a read-only mount does; tests run as root, whom
    permissions do not stop): one line naming the output, before any work, and nothing written anywhere."""
    folder = tmp_path / "out"
    folder.mkdir()
    args, destination = command_line(outputs, output_id, folder)
    real_open, real_mkdir = os.open, os.mkdir

    def read_only(path):
        return os.path.realpath(os.fsdecode(path)).startswith(str(folder.resolve()))

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and read_only(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if read_only(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    ended = command(*args)
    assert ended.code == 2 and destination.name in ended.line and "Read-only file system" in ended.line, ended
    assert not any(folder.iterdir())


# Where a kill is tried: every write of the quick commands; for the training commands and the export, whose runs
# write hundreds of files (checkpoints, the exporters' own), spread over the run.
KILLS_TRIED = {"converted": None, "summaries": None, "pretrained": 8, "summarizer": 6, "onnx": 4}


@pytest.mark.slow  # a command per kill
@pytest.mark.parametrize("output_id", [row.id for row in inventory.OUTPUTS])
def test_a_kill_at_each_write_leaves_no_half_output_and_the_rerun_completes(output_id, outputs, tmp_path):
    """SIGKILL at a write into the destination's folder (counted by an audit hook: opens for writing, folders made,
    renames, links, removals), for each write of the run: the destination is absent or whole, never half-written;
    the next run cleans what the kill left and completes."""
    folder = tmp_path / "out"
    folder.mkdir()
    args, destination = command_line(outputs, output_id, folder)
    counted = run_process(args, kill_at=0, folder=folder)
    assert counted.returncode == 0, counted.stderr[-3000:]
    writes = int(counted.stderr.rsplit("writes: ", 1)[1].split()[0])
    whole = snapshot(destination) if destination.is_dir() else destination.read_bytes()
    shutil.rmtree(folder)
    tried = KILLS_TRIED[output_id]
    points = range(1, writes + 1) if tried is None else sorted({1 + i * (writes - 1) // (tried - 1) for i in range(tried)})
    for point in points:
        folder.mkdir()
        killed = run_process(args, kill_at=point, folder=folder)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        in_place = destination.exists()
        if in_place:  # only whole: the kill came after it was put in place
            assert (snapshot(destination).keys() == whole.keys() if destination.is_dir()
                    else destination.read_bytes() == whole), point
        rerun = run_process([*args, "--overwrite"] if in_place else args)
        assert rerun.returncode == 0, (point, rerun.stderr[-3000:])
        assert not leftovers(folder) and not [p for p in folder.iterdir() if p.name.endswith(".progress")], (
            point, sorted(p.name for p in folder.iterdir()))
        shutil.rmtree(folder)
