"""Issue 69: the fault matrix, generated from `nezha_hf.inventory`. Every row of `FILES` meets every fault of
`FAULTS` (a case here) or excuses it in the table with the reason; a case damages one file of a real artifact (a model
folder, a summariser trained or exported, a training run's checkpoints, a journal, inputs, a TensorFlow checkpoint,
the kernel's build) and runs what reads it, as the commands do. Each case ends as its row says (`OUTCOMES`): refused in
one line naming the file, a checkpoint skipped for the last intact one, a file left out and named, a build redone;
never a traceback naming nothing, a hang, or a silent wrong answer. Nothing a case reads is written.

The cases that run a whole command (summarising, resuming a training run) are `slow`; the loaders' cases run in the
fast set."""

import contextlib
import errno
import io
import json
import os
import random
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, make_tokenizer, snapshot, synthetic_judgment, tiny_config, write_jsonl
from safetensors.torch import load_file, save_file

import nezha_hf_cli as cli
from nezha_hf import NezhaForSentenceExtraction, NezhaForUniLM, inventory
from nezha_hf.checkpoints import check_tokenizer, load_tokenizer, model_folder

ROWS = {row.id: row for row in inventory.FILES}
# Faults of a file itself, which every file can meet (`apply_file_fault`).
FILE_FAULTS = ("missing", "empty", "truncated", "garbage", "flipped", "folder", "fifo", "device", "link_out",
               "unreadable")
NAMING_FAULTS = ("subfolder", "hub_cache", "relative")
# What no reader may raise: a Python error of its own, which names nothing.
INTERNAL_ERRORS = (AttributeError, KeyError, IndexError, TypeError, RecursionError, UnicodeDecodeError, ZeroDivisionError,
                   AssertionError, NameError)
CASE_SECONDS = 120


def row_cases(row: str, targets: list[str], forms: dict, naming=()):
    """`(fault, target)` for each fault `row` does not excuse: a file's own faults (`FILE_FAULTS`) on every target,
    the `naming` faults on the first, the others on the targets whose `forms[target]` holds them."""
    for fault in inventory.FAULTS:
        if fault in ROWS[row].excused:
            continue
        for target in targets:
            if (fault in FILE_FAULTS or fault in forms.get(target, ())
                    or (fault in naming and target == targets[0])):
                yield fault, target  # a reader that waits on a FIFO or reads a device for ever fails the case instead of hanging


# --- faults -----------------------------------------------------------------------------------------------------


def apply_file_fault(fault: str, path: Path, tmp_path: Path) -> None:
    """Damage `path` (a file) with one of `FILE_FAULTS`; a link out leads to `tmp_path / "outside"`."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    data = path.read_bytes()
    if fault == "missing":
        path.unlink()
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "garbage":
        path.write_bytes(random.Random(len(data)).randbytes(max(len(data), 64)))
    elif fault == "flipped":
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x5A
        path.write_bytes(bytes(flipped))
    elif fault == "folder":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("a folder, not the file")
    elif fault == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif fault == "device":
        path.unlink()
        try:
            os.mknod(path, 0o20666, os.makedev(1, 5))  # /dev/zero: reading it never ends
        except PermissionError:  # no CAP_MKNOD here: the device through a link
            path.symlink_to("/dev/zero")
    elif fault == "link_out":
        copy = outside / f"copy-of-{path.name}"
        copy.write_bytes(data)  # the same bytes: only where it lies is wrong
        path.unlink()
        path.symlink_to(copy)
    elif fault == "unreadable":
        pass  # `unreadable` below: as root, permissions would not stop the read
    else:
        raise AssertionError(fault)


@contextlib.contextmanager
def unreadable(path: Path):
    """Opening `path` fails with EACCES, as for a file the process may not read (tests run as root, whom permissions
    do not stop): every open of Python and of the readers, `os.open` included."""
    target = os.path.realpath(path)
    identity = _identity(target)  # this file: a new one written in its place is readable
    real_os_open, real_open = os.open, io.open

    def refused(file):
        if not isinstance(file, (str, bytes, os.PathLike)) or os.path.realpath(os.fsdecode(file)) != target:
            return False
        try:
            return _identity(target) == identity
        except FileNotFoundError:
            return False

    def os_open(file, *args, **kwargs):
        if refused(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(file))
        return real_os_open(file, *args, **kwargs)

    def open_(file, *args, **kwargs):
        if refused(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(os, "open", os_open)
        patched.setattr(io, "open", open_)
        patched.setattr("builtins.open", open_)
        yield


def _identity(path):
    status = os.stat(path)
    return status.st_dev, status.st_ino, status.st_mtime_ns, status.st_ctime_ns


@contextlib.contextmanager
def time_limit(seconds: int):
    def expired(signum, frame):
        raise TimeoutError(f"the case took more than {seconds} s: a reader waits on something that never comes")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- what a case ends in ----------------------------------------------------------------------------------------


@dataclass
class Ended:
    """How a reader's call ended: exit status (0 or 2), its one error line (or the exception), what it warned."""

    code: int
    line: str
    warnings: str
    error: BaseException | None = None
    result: object = None


def library_call(call) -> Ended:
    """`call()` as the commands make it; an exception is status 2 with its message as the line. What the call
    returned is `result`."""
    warnings = io.StringIO()
    handler = _warnings_to(warnings)
    try:
        result = call()
    except Exception as error:  # what the command line would print in one line
        return Ended(2, " ".join(str(error).split()), warnings.getvalue(), error)
    finally:
        _stop(handler)
    return Ended(0, "", warnings.getvalue(), result=result)


def command(*args) -> Ended:
    """`nezha-hf ARGS` in this process: its status, its one error line, and the rest of what it printed."""
    err = io.StringIO()
    handler = _warnings_to(err)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main([str(arg) for arg in args])
    finally:
        _stop(handler)
    lines = [line for line in err.getvalue().splitlines() if line.startswith(f"nezha-hf {args[0]}: ")]
    assert len(lines) <= 1 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
    return Ended(code, lines[0] if lines else "", err.getvalue())


def _warnings_to(stream):
    import logging

    handler = logging.StreamHandler(stream)
    for name in ("nezha_hf", "transformers"):
        logging.getLogger(name).addHandler(handler)
    return handler


def _stop(handler):
    import logging

    for name in ("nezha_hf", "transformers"):
        logging.getLogger(name).removeHandler(handler)


def assert_correct_or_refused(ended: Ended, intact, *names: str) -> None:
    """The intact artifact's result, or refused (`assert_refused`)."""
    if ended.code == 0:
        assert ended.result == intact, f"a silent wrong answer: {ended.result} where the intact file gives {intact}"
    else:
        assert_refused(ended, *names)


def assert_refused(ended: Ended, *names: str) -> None:
    """One line naming one of `names` (a file), status 2, no internal error."""
    assert ended.code == 2, f"it went on (status {ended.code}); warnings: {ended.warnings[-1500:]}"
    assert not isinstance(ended.error, INTERNAL_ERRORS), f"{type(ended.error).__name__}: {ended.line}"
    assert ended.line and "\n" not in ended.line, ended.line
    assert any(name in ended.line for name in names), f"names none of {names}: {ended.line}"


# --- artifacts, built once --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """What the cases damage copies of: a model folder (one weights file), a sharded one, and inputs."""
    root = tmp_path_factory.mktemp("artifacts")
    tokenizer = make_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config(vocab_size=VOCAB))
    model.generation_config.eos_token_id = tokenizer.sep_token_id
    for name, shard in (("model", "5GB"), ("sharded", "30KB")):
        model.save_pretrained(root / name, max_shard_size=shard)
        tokenizer.save_pretrained(root / name)
        shutil.copy(root / "tokenizer" / "vocab.txt", root / name)  # as BERT folders hold it beside tokenizer.json
    torch.manual_seed(1)
    NezhaForUniLM(tiny_config(vocab_size=VOCAB * 2, hidden_size=48)).save_pretrained(root / "other-model")
    # Another model's tokenizer: a larger vocabulary, padding with [UNK].
    other = root / "other-model" / "tokenizer"
    other.mkdir()
    (other / "vocab.txt").write_text("\n".join(["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]",
                                                 *map(chr, range(0x4E00, 0x4E00 + 3 * VOCAB))]) + "\n",
                                     encoding="utf-8")
    import transformers

    transformers.BertTokenizerFast.from_pretrained(other, pad_token="[UNK]").save_pretrained(other)
    return root


def artifact_copy(artifacts: Path, name: str, tmp_path: Path) -> Path:
    copy = tmp_path / "case" / name
    shutil.copytree(artifacts / name, copy, symlinks=True)
    return copy


# --- a model folder: what every command that loads a model reads ------------------------------------------------

MODEL_ROWS = {"config": ["config.json"], "weights": ["model.safetensors"], "weight_index": ["model.safetensors.index.json"],
              "generation_config": ["generation_config.json"],
              "tokenizer_files": ["tokenizer_config.json", "tokenizer.json", "vocab.txt"]}


def load_model_folder(folder, **naming) -> list:
    """What a command does with a model folder: check it, load the model and its tokenizer, check they fit, and
    generate (which reads the generation settings). Returns what came of it, to compare with the intact folder's."""
    if not naming:
        model_folder(folder)
    model = NezhaForUniLM.from_pretrained(folder, **naming)
    probe = torch.arange(5, 15)[None]
    logits = model(probe).logits
    if naming:
        return [round(float(logits.sum()), 3)]
    tokenizer = load_tokenizer(folder)
    check_tokenizer(tokenizer, model.config, folder)
    prompt = tokenizer(["原告被告"], return_tensors="pt")
    return [round(float(logits.sum()), 3), model.generate(**prompt, max_new_tokens=2).tolist()]


def model_content_fault(row: str, fault: str, folder: Path, target: str, artifacts: Path) -> list[str] | None:
    """Apply a fault of what a model folder's file holds, or of where it came from; returns the files a refusal may
    name (the target, and the file it was swapped with); None if `fault` has no form for `target`."""
    path = folder / target
    other = artifacts / "other-model"
    if row == "config":
        config = json.loads(path.read_text())
        changes = {"wrong_shape": lambda: path.write_text(json.dumps([config])),
                   "out_of_range": lambda: path.write_text(json.dumps({**config, "num_attention_heads": 0})),
                   "foreign": lambda: shutil.copy(other / "config.json", path)}
    elif row == "weights":
        state = load_file(path)
        name = "nezha.embeddings.word_embeddings.weight"

        def with_tensor(tensor):
            save_file({**state, name: tensor}, str(path), metadata={"format": "pt"})

        changes = {"wrong_shape": lambda: with_tensor(state[name][:, :-1].contiguous()),
                   "wrong_dtype": lambda: with_tensor(state[name].to(torch.int32)),
                   "non_finite": lambda: with_tensor(state[name].index_fill(0, torch.tensor([3]), float("nan"))),
                   "foreign": lambda: shutil.copy(other / "model.safetensors", path)}
    elif row == "weight_index":
        index = json.loads(path.read_text())
        first = next(iter(index["weight_map"]))
        changes = {"wrong_shape": lambda: path.write_text(json.dumps({**index, "weight_map": list(index["weight_map"])})),
                   "out_of_range": lambda: path.write_text(json.dumps(
                       {**index, "weight_map": {**index["weight_map"], first: "model-00009-of-00009.safetensors"}})),
                   "foreign": lambda: path.write_text(json.dumps(
                       {**index, "weight_map": {name: "model.safetensors" for name in index["weight_map"]}})),
                   "swapped": lambda: _swap(path, folder / index["weight_map"][first])}
    elif row == "generation_config":
        settings = json.loads(path.read_text())
        changes = {"wrong_shape": lambda: path.write_text(json.dumps({**settings, "eos_token_id": "[SEP]"})),
                   "out_of_range": lambda: path.write_text(json.dumps({**settings, "eos_token_id": VOCAB + 500})),
                   "foreign": lambda: path.write_text(json.dumps({**settings, "pad_token_id": 2 * VOCAB + 1}))}
    elif row == "tokenizer_files":
        changes = {}
        if target == "vocab.txt":
            changes = {"tokenizer": lambda: path.write_text("[PAD]\n[UNK]\n原\n告\n", encoding="utf-8"),
                       "foreign": lambda: (shutil.copy(other / "tokenizer" / "vocab.txt", path),
                                           (folder / "tokenizer.json").unlink())}
            changes["swapped"] = lambda: _swap(path, folder / "tokenizer.json")
            changes["mixed"] = lambda: [shutil.copy(other / "tokenizer" / name, folder / name)
                                        for name in ("vocab.txt", "tokenizer_config.json")]
        elif target == "tokenizer.json":
            data = json.loads(path.read_text())
            vocab = data["model"]["vocab"]
            changes = {"wrong_shape": lambda: path.write_text(json.dumps({**data, "model": [1, 2]})),
                       "out_of_range": lambda: path.write_text(json.dumps(
                           {**data, "model": {**data["model"], "vocab": {**vocab, "院": VOCAB + 1000}}})),
                       "tokenizer": lambda: path.write_text(json.dumps(
                           {**data, "model": {**data["model"], "vocab": {k: v for k, v in vocab.items()
                                                                         if k != "[SEP]"}}})),
                       "foreign": lambda: shutil.copy(other / "tokenizer" / "tokenizer.json", path),
                       "swapped": lambda: _swap(path, folder / "tokenizer_config.json")}
        elif target == "tokenizer_config.json":
            data = json.loads(path.read_text())
            changes = {"wrong_shape": lambda: path.write_text(json.dumps([data])),
                       "out_of_range": lambda: path.write_text(json.dumps({**data, "model_max_length": -5})),
                       "tokenizer": lambda: path.write_text(json.dumps({**data, "sep_token": None,
                                                                        "tokenizer_class": "BertTokenizer"})),
                       "foreign": lambda: shutil.copy(other / "tokenizer" / "tokenizer_config.json", path)}
    else:
        raise AssertionError(row)
    if fault not in changes:
        return None
    swapped = changes[fault]()
    return [Path(target).name, *([swapped] if isinstance(swapped, str) else [])]


def _swap(first: Path, second: Path) -> str:
    """Exchange two files; returns the name of the second."""
    staging = first.with_name(first.name + ".swap")
    os.replace(first, staging)
    os.replace(second, first)
    os.replace(staging, second)
    return second.name


# The faults of what a file holds, or of where it came from, that `model_content_fault` has a form of, by file.
MODEL_FORMS = {
    ("config", "config.json"): {"wrong_shape", "out_of_range", "foreign"},
    ("weights", "model.safetensors"): {"wrong_shape", "wrong_dtype", "non_finite", "foreign"},
    ("weight_index", "model.safetensors.index.json"): {"wrong_shape", "out_of_range", "foreign", "swapped"},
    ("generation_config", "generation_config.json"): {"wrong_shape", "out_of_range", "foreign"},
    ("tokenizer_files", "vocab.txt"): {"tokenizer", "foreign", "swapped", "mixed"},
    ("tokenizer_files", "tokenizer.json"): {"wrong_shape", "out_of_range", "tokenizer", "foreign", "swapped"},
    ("tokenizer_files", "tokenizer_config.json"): {"wrong_shape", "out_of_range", "tokenizer", "foreign"},
}


def model_cases():
    """Every fault the model rows do not excuse, on each file of the row that can have it."""
    for row, targets in MODEL_ROWS.items():
        for fault, target in row_cases(row, targets, {t: MODEL_FORMS[row, t] for t in targets}, NAMING_FAULTS):
            yield pytest.param(row, fault, target, id=f"{row}-{fault}-{target}")


@pytest.fixture(scope="module")
def intact_results(artifacts):
    """What each intact model folder gives, as `load_model_folder` returns it, by name (and naming)."""
    return {name: load_model_folder(artifacts / name) for name in ("model", "sharded")}


@pytest.mark.parametrize(("row", "fault", "target"), list(model_cases()))
def test_a_model_folder_file_with_a_fault_gives_its_result_or_is_refused_naming_it(row, fault, target, artifacts,
                                                                                    intact_results, tmp_path,
                                                                                    monkeypatch):
    name = "sharded" if row == "weight_index" else "model"
    folder = artifact_copy(artifacts, name, tmp_path)
    path = folder / target
    naming, names, intact = {}, [Path(target).name], intact_results[name]
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    elif fault in NAMING_FAULTS:
        apply_file_fault("garbage", path, tmp_path)  # damaged, and reached as transformers' loaders name it
        folder, naming = name_the_folder(fault, folder, tmp_path, monkeypatch)
        intact = intact[:1] if naming else intact
    else:
        names = model_content_fault(row, fault, folder, target, artifacts)
        assert names, f"no {fault} for {target}: make one, or excuse it in the inventory"
    before = snapshot(folder) if fault not in ("fifo", "device", "folder", "unreadable") and not naming else None
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        ended = library_call(lambda: load_model_folder(folder, **naming))
    if fault == "missing" and ROWS[row].excused.get("missing", "").startswith("optional"):
        assert ended.code == 0, ended.line
        return
    assert_correct_or_refused(ended, intact, *names)
    if before is not None:
        assert snapshot(folder) == before


def name_the_folder(fault, folder: Path, tmp_path: Path, monkeypatch):
    """`folder` as transformers' loaders may be told to find it: a `subfolder=` of a repository folder, a snapshot
    of the Hub cache (`cache_dir=`, `revision=`), or a path relative to the working folder."""
    if fault == "subfolder":
        return folder.parent, {"subfolder": folder.name}
    if fault == "relative":
        monkeypatch.chdir(folder.parent)
        return Path(folder.name), {}
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repository = cache / "models--owner--tiny-nezha"
    blobs, snapshot_folder = repository / "blobs", repository / "snapshots" / commit
    blobs.mkdir(parents=True)
    snapshot_folder.mkdir(parents=True)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    for file in folder.iterdir():
        blob = blobs / f"blob-{file.name}"
        shutil.move(file, blob)
        (snapshot_folder / file.name).symlink_to(os.path.relpath(blob, snapshot_folder))
    return "owner/tiny-nezha", {"cache_dir": cache, "revision": "main"}


# --- summarisers, trained and exported: `nezha-hf summarize` -------------------------------------------------------

SUMMARIZE = ["--max-new-tokens", "3", "--batch-size", "2"]
SUMMARIZER_ROWS = {
    "summarizer_settings": {"trained": ["summarizer.json"], "exported": ["summarizer.json"]},
    "summarizer_manifest": {"trained": ["nezha_manifest.json", "extractor/model.safetensors", "generator/config.json",
                                        "tokenizer.json"],
                            "exported": ["nezha_manifest.json", "extractor/model.onnx.data",
                                         "generator/generation_config.json", "tokenizer_config.json"]},
    "export_manifest": {"exported": ["extractor/export.json", "generator/export.json"]},
    "onnx_program": {"exported": ["extractor/model.onnx", "generator/decode.onnx", "generator/prefill.onnx.data"]},
}
SUMMARIZER_FORMS = {
    "summarizer.json": {"wrong_shape", "out_of_range"},
    "nezha_manifest.json": {"wrong_shape", "out_of_range", "foreign", "swapped", "mixed"},
    "extractor/model.safetensors": {"wrong_dtype", "non_finite", "foreign", "mixed"},
    "extractor/model.onnx.data": {"foreign", "mixed"},
    "tokenizer.json": {"tokenizer", "foreign"},
    "tokenizer_config.json": {"tokenizer", "foreign"},
    "generator/config.json": {"wrong_shape", "out_of_range", "foreign", "swapped"},
    "generator/generation_config.json": {"out_of_range", "foreign", "swapped"},
    "extractor/export.json": {"wrong_shape", "out_of_range", "foreign", "swapped", "mixed"},
    "generator/export.json": {"wrong_shape", "out_of_range", "foreign"},
    "extractor/model.onnx": {"wrong_shape", "out_of_range", "foreign", "swapped", "mixed"},
    "generator/decode.onnx": {"foreign", "swapped"},
    "generator/prefill.onnx.data": {"foreign"},
}


@pytest.fixture(scope="module")
def summarizers(tmp_path_factory):
    """Two summarisers of the same shapes (seeds 0 and 1), trained (untrained weights: what matters is which files
    are read) and exported to ONNX, and judgments to summarise."""
    from nezha_hf.export import export_summarizer
    from nezha_hf.summarization import Summarizer

    root = tmp_path_factory.mktemp("summarizers")
    tokenizer = make_tokenizer(root / "tokenizer")
    for seed, suffix in ((0, ""), (1, "-other")):
        torch.manual_seed(seed)
        config = tiny_config(vocab_size=VOCAB)
        Summarizer(NezhaForSentenceExtraction(config), NezhaForUniLM(config), tokenizer, num_beams=1).save_pretrained(
            root / f"trained{suffix}")
        export_summarizer(root / f"trained{suffix}", root / f"exported{suffix}")
    rng = random.Random(0)
    write_jsonl(root / "judgments.jsonl", [synthetic_judgment(rng, i, sentences=4) for i in range(2)])
    return root


def summarizer_content_fault(fault: str, folder: Path, target: str, other: Path) -> list[str]:
    """Apply a fault of what a summariser's file holds, or of where it came from (`other`: a summariser of the same
    shapes); returns the files a refusal may name."""
    path = folder / target
    name = Path(target).name
    if fault == "foreign":
        shutil.copy(other / target, path)
        return [name]
    if fault == "mixed":  # the part holding `target` from the other summariser
        part = Path(target).parts[0] if len(Path(target).parts) > 1 else "extractor"
        shutil.rmtree(folder / part)
        shutil.copytree(other / part, folder / part)
        return [str(Path(part) / file.relative_to(other / part)) for file in (other / part).rglob("*")] + [part]
    if fault == "swapped":
        partner = {"nezha_manifest.json": "summarizer.json", "generator/config.json": "extractor/config.json",
                   "generator/generation_config.json": "generator/config.json",
                   "extractor/export.json": "generator/export.json", "extractor/model.onnx": "generator/decode.onnx",
                   "generator/decode.onnx": "generator/prefill.onnx"}[target]
        return [name, _swap(path, folder / partner), partner]
    if target.endswith(".onnx"):
        import onnx

        if fault == "wrong_shape":  # a valid program of another graph
            graph = onnx.helper.make_graph(
                [onnx.helper.make_node("Identity", ["input_ids"], ["scores"])], "other",
                [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "length"])],
                [onnx.helper.make_tensor_value_info("scores", onnx.TensorProto.INT64, ["batch", "length"])])
            onnx.save(onnx.helper.make_model(graph), str(path))
        else:  # a weight read past the end of its weights file
            program = onnx.load(str(path), load_external_data=False)
            tensor = next(t for t in program.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
            next(entry for entry in tensor.external_data if entry.key == "length").value = str(1 << 30)
            onnx.save(program, str(path))
        return [name, f"{name}.data"]
    if target.endswith(".safetensors"):
        state = load_file(path)
        key = next(iter(state))
        change = {"wrong_dtype": state[key].to(torch.int64), "non_finite": state[key].clone().fill_(float("inf"))}
        save_file({**state, key: change[fault]}, str(path), metadata={"format": "pt"})
        return [name]
    if target in ("tokenizer.json", "tokenizer_config.json"):
        data = json.loads(path.read_text())
        data = ({**data, "model": {**data["model"], "vocab": {**data["model"]["vocab"], "[SEP]": 7}}}
                if target == "tokenizer.json" else {**data, "pad_token": "[MASK]"})
        path.write_text(json.dumps(data))
        return [name]
    data = json.loads(path.read_text())
    if fault == "wrong_shape":
        data = ({"files": list(data["files"]), "kind": data["kind"]} if name == "nezha_manifest.json"
                else {**data, "components": list(data["components"])} if name == "export.json"
                else {**data, "threshold": "half"} if name == "summarizer.json"
                else {**data, "hidden_size": [32]})
    elif fault == "out_of_range":
        if name == "nezha_manifest.json":
            data = {**data, "files": {**data["files"], "../outside.json": {"size": 1, "sha256": "0" * 64}}}
        elif name == "export.json":
            component = next(iter(data["components"]))
            data = {**data, "components": {**data["components"], component: {
                **data["components"][component], "file": "../../outside.onnx"}}}
        elif name == "summarizer.json":
            data = {**data, "num_beams": 10_000}
        elif name == "generation_config.json":
            data = {**data, "eos_token_id": VOCAB + 7}
        else:
            data = {**data, "num_hidden_layers": 100_000}
    else:
        raise AssertionError((fault, target))
    path.write_text(json.dumps(data))
    return [name]


def summarizer_cases():
    for row, kinds in SUMMARIZER_ROWS.items():
        for kind, targets in kinds.items():
            for fault, target in row_cases(row, targets, SUMMARIZER_FORMS, ("relative",)):
                yield pytest.param(row, kind, fault, target, id=f"{row}-{kind}-{fault}-{target}")


@pytest.fixture(scope="module")
def intact_summaries(summarizers):
    return {kind: command("summarize", summarizers / kind, summarizers / "judgments.jsonl", *SUMMARIZE)
            for kind in ("trained", "exported")}


@pytest.mark.slow  # a summarising run per case
@pytest.mark.parametrize(("row", "kind", "fault", "target"), list(summarizer_cases()))
def test_a_summariser_file_with_a_fault_gives_its_summaries_or_is_refused_naming_it(row, kind, fault, target,
                                                                                     summarizers, intact_summaries,
                                                                                     tmp_path, monkeypatch):
    folder = artifact_copy(summarizers, kind, tmp_path)
    path = folder / target
    names = [Path(target).name]
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    elif fault == "relative":  # damaged, and the folder named relative to the working folder
        apply_file_fault("garbage", path, tmp_path)
        monkeypatch.chdir(folder.parent)
        folder = Path(folder.name)
    else:
        names = summarizer_content_fault(fault, folder, target, summarizers / f"{kind}-other")
    output = tmp_path / "summaries.jsonl"
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        ended = command("summarize", folder, summarizers / "judgments.jsonl", *SUMMARIZE, "--output", output)
    intact = intact_summaries[kind]
    assert intact.code == 0, intact.line
    if ended.code == 0:
        assert output.read_text(encoding="utf-8").splitlines() == intact_output(summarizers, kind, tmp_path)
    else:
        assert_refused(ended, *names)
        assert not output.exists()


def intact_output(summarizers, kind, tmp_path) -> list[str]:
    output = tmp_path / f"intact-{kind}.jsonl"
    assert command("summarize", summarizers / kind, summarizers / "judgments.jsonl", *SUMMARIZE, "--output",
                   output).code == 0
    return output.read_text(encoding="utf-8").splitlines()


# --- a training run's state: `nezha-hf pretrain` run again ----------------------------------------------------------

PRETRAIN = ["--max-length", "64", "--batch-size", "4", "--save-steps", "2", "--learning-rate", "2e-3"]
CHECKPOINT_TARGETS = ["trainer_state.json", "model.safetensors", "optimizer/.metadata", "optimizer/__0_0.distcp",
                      "scheduler.pt", "rng_state.pth", "nezha_run.json", "nezha_manifest.json"]
RUN_STATE_FORMS = {
    ("checkpoint", "trainer_state.json"): {"wrong_shape", "out_of_range", "mixed"},
    ("checkpoint", "model.safetensors"): {"wrong_shape", "wrong_dtype", "non_finite", "foreign"},
    ("checkpoint", "optimizer/__0_0.distcp"): {"foreign", "mixed"},
    ("checkpoint", "scheduler.pt"): {"swapped"},
    ("checkpoint", "nezha_run.json"): {"wrong_shape", "foreign"},
    ("checkpoint", "nezha_manifest.json"): {"wrong_shape", "out_of_range", "foreign"},
    ("run_record", "nezha_run.json"): {"wrong_shape", "out_of_range", "foreign", "mixed"},
}


@pytest.fixture(scope="module")
def training_run(tmp_path_factory):
    """A base model, a corpus, and the checkpoints of a pretraining run of 4 steps (checkpoint-2 and -4; its output
    removed, so that a rerun goes on), and of another run (another seed) for files of another run."""
    from test_pretraining import chinese_corpus

    from nezha_hf import NezhaForMaskedLM

    root = tmp_path_factory.mktemp("training")
    tokenizer = make_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB, max_relative_position=16)).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    chinese_corpus(root / "corpus")
    for run, seed in (("run", "1"), ("other", "2")):
        done = command("pretrain", root / "base", root / "corpus", "--output", root / run, *PRETRAIN, "--max-steps", "4",
                       "--seed", seed)
        assert done.code == 0, done.warnings[-2000:]
        shutil.rmtree(root / run)
    return root


def run_state_fault(row: str, fault: str, checkpoints: Path, target: str, other: Path) -> list[str]:
    """Apply a fault of what a run's file holds or where it came from (`other`: the checkpoints of another run);
    returns the files a refusal or a skip may name."""
    folder = checkpoints if row == "run_record" else checkpoints / "checkpoint-4"
    path, name = folder / target, Path(target).name
    source = other if row == "run_record" else other / "checkpoint-4"
    if fault == "foreign":
        assert path.read_bytes() != (source / target).read_bytes(), "the other run's file is the same"
        shutil.copy(source / target, path)
        return [name]
    if fault == "mixed":  # the optimizer or state of another checkpoint; a record of two runs
        if row == "run_record":
            mine, theirs = json.loads(path.read_text()), json.loads((source / target).read_text())
            path.write_text(json.dumps({**mine, "settings": theirs["settings"], "base_content": "0" * 16}))
        elif name == "trainer_state.json":
            shutil.copy(checkpoints / "checkpoint-2" / target, path)
        else:
            shutil.rmtree(folder / "optimizer")
            shutil.copytree(checkpoints / "checkpoint-2" / "optimizer", folder / "optimizer")
            return ["optimizer", "__0_0.distcp", ".metadata", "trainer_state.json"]
        return [name]
    if fault == "swapped":
        return [name, _swap(path, folder / "rng_state.pth")]
    if name == "model.safetensors":
        state = load_file(path)
        key = next(iter(state))
        change = {"wrong_dtype": state[key].to(torch.int64), "non_finite": state[key].clone().fill_(float("nan")),
                  "wrong_shape": state[key].flatten()[:3].contiguous()}
        save_file({**state, key: change[fault]}, str(path), metadata={"format": "pt"})
        return [name]
    data = json.loads(path.read_text())
    if fault == "wrong_shape":
        data = ({**data, "global_step": "4"} if name == "trainer_state.json" else
                {**data, "files": list(data["files"])} if name == MANIFEST else {**data, "data": "corpus"})
    elif fault == "out_of_range":
        data = ({**data, "global_step": -4} if name == "trainer_state.json" else
                {**data, "files": {**data["files"], "../../outside.bin": {"size": 0, "sha256": "0" * 64}}}
                if name == MANIFEST else {**data, "settings": {**data["settings"], "global_batch": -1}})
    else:
        raise AssertionError((row, fault, target))
    path.write_text(json.dumps(data))
    return [name]


MANIFEST = "nezha_manifest.json"


def run_state_cases():
    for row, targets in (("run_record", ["nezha_run.json"]), ("checkpoint", CHECKPOINT_TARGETS)):
        forms = {target: RUN_STATE_FORMS.get((row, target), set()) for target in targets}
        for fault, target in row_cases(row, targets, forms):
            yield pytest.param(row, fault, target, id=f"{row}-{fault}-{target}")


@pytest.mark.slow  # a training run per case
@pytest.mark.parametrize(("row", "fault", "target"), list(run_state_cases()))
def test_a_run_state_file_with_a_fault_is_skipped_for_the_last_intact_checkpoint_or_refused(row, fault, target,
                                                                                          training_run, tmp_path):
    root = tmp_path / "case"
    shutil.copytree(training_run, root, symlinks=True)
    checkpoints = root / "run.checkpoints"
    folder = checkpoints if row == "run_record" else checkpoints / "checkpoint-4"
    path = folder / target
    names = [Path(target).name]
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    else:
        names = run_state_fault(row, fault, checkpoints, target, root / "other.checkpoints")
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        ended = command("pretrain", root / "base", root / "corpus", "--output", root / "run", *PRETRAIN,
                        "--max-steps", "6", "--seed", "1")
    if row == "run_record":
        assert_refused(ended, *names)
        assert not (root / "run").exists()
        return
    assert ended.code == 0, ended.line or ended.warnings[-2000:]
    skipped = [line for line in ended.warnings.splitlines() if "Skipping the checkpoint" in line]
    assert len(skipped) == 1 and "checkpoint-4" in skipped[0] and any(n in skipped[0] for n in names), skipped
    assert f"Resuming from {checkpoints / 'checkpoint-2'}" in ended.warnings
    assert (root / "run" / "model.safetensors").is_file()


# --- summarize's journal: `nezha-hf summarize` run again -------------------------------------------------------------

JOURNAL_TARGETS = ["record.json", "done-0.jsonl"]
JOURNAL_FORMS = {"record.json": {"wrong_shape", "out_of_range", "foreign", "mixed"},
                 "done-0.jsonl": {"wrong_shape", "out_of_range", "foreign", "swapped"}}


@pytest.fixture(scope="module")
def journals(summarizers, tmp_path_factory):
    """The journals `summarize` left when its output could not be written: of the judgments, and of other judgments
    (for the files of other work)."""
    from nezha_hf import summarization

    root = tmp_path_factory.mktemp("journals")
    rng = random.Random(5)
    write_jsonl(root / "other.jsonl", [{**synthetic_judgment(rng, i, sentences=4), "id": f"other{i}"} for i in range(2)])

    def cannot_write(*args, **kwargs):
        raise OSError("the output could not be written")

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(summarization, "write_summaries", cannot_write)
        for name, inputs in (("mine", summarizers / "judgments.jsonl"), ("theirs", root / "other.jsonl")):
            assert command("summarize", summarizers / "trained", inputs, *SUMMARIZE, "--output",
                           root / f"{name}.jsonl").code == 2
    return root


def journal_fault(fault: str, journal: Path, target: str, other: Path) -> list[str]:
    path, name = journal / target, target
    if fault == "foreign":
        shutil.copy(other / target, path)
    elif fault == "swapped":
        return [name, _swap(path, journal / "record.json")]
    elif fault == "mixed":  # the record of two works
        mine, theirs = json.loads(path.read_text()), json.loads((other / target).read_text())
        path.write_text(json.dumps({**mine, "data_content": theirs["data_content"]}))
    elif target == "record.json":
        data = json.loads(path.read_text())
        data = {**data, "data": "judgments"} if fault == "wrong_shape" else {**data, "settings": {"batch_size": -2}}
        path.write_text(json.dumps(data))
    else:
        lines = path.read_text().splitlines()
        entry = json.loads(lines[0])
        entry = ({**entry, "result": ["a summary"]} if fault == "wrong_shape" else {**entry, "index": 99})
        path.write_text("\n".join([json.dumps(entry), *lines[1:]]) + "\n")
    return [name]


def journal_cases():
    for fault, target in row_cases("journal", JOURNAL_TARGETS, JOURNAL_FORMS):
        yield pytest.param(fault, target, id=f"journal-{fault}-{target}")


@pytest.mark.slow  # a summarising run per case
@pytest.mark.parametrize(("fault", "target"), list(journal_cases()))
def test_a_journal_file_with_a_fault_gives_the_summaries_or_is_refused_naming_it(fault, target, summarizers, journals,
                                                                                tmp_path):
    root = tmp_path / "case"
    shutil.copytree(journals, root, symlinks=True)
    journal = root / ".mine.jsonl.progress"
    path = journal / target
    names = [target]
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    else:
        names = journal_fault(fault, journal, target, root / ".theirs.jsonl.progress")
    output = root / "mine.jsonl"
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        ended = command("summarize", summarizers / "trained", summarizers / "judgments.jsonl", *SUMMARIZE, "--output",
                        output)
    if ended.code == 0:
        assert output.read_text(encoding="utf-8").splitlines() == intact_output(summarizers, "trained", tmp_path)
    else:
        assert_refused(ended, *names)
        assert not output.exists()


# --- inputs: judgments and corpora found in a folder, predictions named directly -------------------------------------

INPUT_FORMS = {"judgments": {"wrong_shape", "out_of_range"}, "corpus": {"wrong_shape"},
               "predictions": {"wrong_shape", "out_of_range", "foreign"}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Judgments in a folder (`a.jsonl`, the file the cases damage, and `b.jsonl`), predictions for them, and a
    corpus folder (`a.jsonl`, `b.txt`)."""
    root = tmp_path_factory.mktemp("inputs")
    rng = random.Random(3)
    (root / "judgments").mkdir()
    judgments = [{**synthetic_judgment(rng, i, sentences=4), "id": f"a{i}"} for i in range(2)]
    write_jsonl(root / "judgments" / "a.jsonl", judgments)
    write_jsonl(root / "judgments" / "b.jsonl", [{**synthetic_judgment(rng, 9, sentences=4), "id": "b9"}])
    write_jsonl(root / "predictions.jsonl", [{"id": j["id"], "summary": j["summary"][:6]} for j in judgments]
                + [{"id": "b9", "summary": "判决"}])
    write_jsonl(root / "other-predictions.jsonl", [{"id": "x1", "summary": "判决"}])
    (root / "corpus").mkdir()
    write_jsonl(root / "corpus" / "a.jsonl", [{"text": "原告被告法院判决" * 4}, {"text": "中国人民法院"}])
    (root / "corpus" / "b.txt").write_text("他们来到法院。", encoding="utf-8")
    return root


def input_content_fault(row: str, fault: str, path: Path, root: Path) -> None:
    if fault == "foreign":
        shutil.copy(root / "other-predictions.jsonl", path)
    elif fault == "wrong_shape":  # a line of another schema
        lines = path.read_text(encoding="utf-8").splitlines()
        path.write_text("\n".join([json.dumps({"id": ["x"], "text": 5, "summary": 7}), *lines[1:]]) + "\n",
                        encoding="utf-8")
    elif fault == "out_of_range":  # a judgment far longer than any (--max-characters), an id no judgment has
        record = ({"id": "a0", "text": "判" * 200_001} if row == "judgments" else {"id": "nobody", "summary": "判决"})
        path.write_text(path.read_text(encoding="utf-8") + json.dumps(record, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    else:
        raise AssertionError(fault)


def input_cases():
    for row in ("judgments", "corpus", "predictions"):
        for fault, _ in row_cases(row, [row], {row: INPUT_FORMS[row]}, ("relative",)):
            yield pytest.param(row, fault, id=f"{row}-{fault}")


def read_input(row: str, root: Path):
    """What the commands read of the row's inputs: the judgments of the folder (`summarize`'s and
    `train-summarizer`'s reader), the corpus (`pretrain`'s), the scores of the predictions (`evaluate`'s)."""
    from nezha_hf.cail import read_judgments, read_predictions
    from nezha_hf.documents import read_documents
    from nezha_hf.summarization import evaluate_summaries

    problems = []
    if row == "judgments":
        return [(j.id, j.text) for j in read_judgments([root / "judgments"], problems)], problems
    if row == "corpus":
        return sorted(document.text for document in read_documents([root / "corpus"], problems=problems)), problems
    judgments = read_judgments([root / "judgments"])
    predictions = root / "predictions.jsonl"
    return evaluate_summaries(judgments, read_predictions(predictions), predictions_file=predictions), problems


@pytest.mark.parametrize(("row", "fault"), list(input_cases()))
def test_an_input_with_a_fault_is_left_out_and_named_or_refused(row, fault, inputs, tmp_path, monkeypatch):
    root = tmp_path / "case"
    shutil.copytree(inputs, root, symlinks=True)
    path = root / {"judgments": "judgments/a.jsonl", "corpus": "corpus/a.jsonl", "predictions": "predictions.jsonl"}[row]
    intact, _ = read_input(row, inputs)
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    elif fault == "relative":  # a link out of the folder, the folder named relative to the working folder
        apply_file_fault("link_out", path, tmp_path)
        monkeypatch.chdir(root)
        root = Path(".")
    else:
        input_content_fault(row, fault, path, root)
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        ended = library_call(lambda: read_input(row, root))
    if ended.code == 2:
        assert_refused(ended, path.name)
        return
    got, problems = ended.result
    if row == "predictions":
        assert got == intact
        return
    assert set(got) <= set(intact), "a silent wrong answer: an input read as something else"
    if set(got) != set(intact) and fault not in ("missing", "folder"):  # what is left out is named (a folder: a folder)
        assert any(Path(problem.path).name == path.name for problem in problems), problems


# --- a TensorFlow checkpoint: `nezha-hf convert tf` -------------------------------------------------------------

TF_TARGETS = ["model.ckpt.index", "model.ckpt.data-00000-of-00001", "bert_config.json"]
TF_FORMS = {"bert_config.json": {"wrong_shape", "out_of_range", "foreign"},
            "model.ckpt.data-00000-of-00001": {"foreign"}, "model.ckpt.index": {"swapped"}}


@pytest.fixture(scope="module")
def tf_checkpoints(tmp_path_factory):
    """A Google-BERT TensorFlow checkpoint with its `bert_config.json`, and another of other weights."""
    from helpers import SMALL_BERT, small_bert
    from test_conversion import tf_variables, write_tf_checkpoint

    root = tmp_path_factory.mktemp("tf")
    for name, seed in (("tf", 0), ("other", 1)):
        torch.manual_seed(seed)
        bert = small_bert()
        write_tf_checkpoint(tf_variables(bert, "bert"), root / name / "model.ckpt")
        config = {k: v for k, v in bert.config.to_dict().items() if k in (*SMALL_BERT, "type_vocab_size")}
        (root / name / "bert_config.json").write_text(json.dumps(config))
    return root


def convert_tf(folder: Path, output: Path) -> Ended:
    return command("convert", "tf", folder / "model.ckpt", output, "--config", folder / "bert_config.json")


def tf_cases():
    for fault, target in row_cases("tf_checkpoint", TF_TARGETS, TF_FORMS):
        yield pytest.param(fault, target, id=f"tf-{fault}-{target}")


@pytest.mark.slow  # TensorFlow reads each case
@pytest.mark.parametrize(("fault", "target"), list(tf_cases()))
def test_a_tensorflow_checkpoint_with_a_fault_converts_as_it_is_or_is_refused_naming_it(fault, target, tf_checkpoints,
                                                                                        tmp_path):
    folder = tmp_path / "case" / "tf"
    shutil.copytree(tf_checkpoints / "tf", folder)
    path, names = folder / target, [target]
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    elif fault == "foreign":
        shutil.copy(tf_checkpoints / "other" / target, path)
    elif fault == "swapped":
        names.append(_swap(path, folder / "model.ckpt.data-00000-of-00001"))
    else:
        config = json.loads(path.read_text())
        path.write_text(json.dumps([config] if fault == "wrong_shape" else {**config, "hidden_size": 33}))
    output = tmp_path / "out"
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        ended = convert_tf(folder, output)
    if ended.code == 0:  # then it is the checkpoint's own weights
        intact = tmp_path / "intact"
        assert convert_tf(tf_checkpoints / "tf", intact).code == 0
        assert load_file(output / "model.safetensors").keys() == load_file(intact / "model.safetensors").keys()
        assert all(torch.equal(a, b) for a, b in zip(load_file(output / "model.safetensors").values(),
                                                     load_file(intact / "model.safetensors").values()))
    else:
        assert_refused(ended, *names)
        assert not output.exists()


# --- the kernel's build cache ---------------------------------------------------------------------------------------

KERNEL_TARGETS = ["library", "nezha_build.json"]


def kernel_cases():
    for fault, target in row_cases("kernel_cache", KERNEL_TARGETS, {"nezha_build.json": {"wrong_shape"}}):
        yield pytest.param(fault, target, id=f"kernel-{fault}-{target}")


@pytest.fixture(scope="module")
def kernel_build(tmp_path_factory):
    """A copy of this environment's build of the kernel: its library and its record."""
    from nezha_hf import fused_attention

    assert fused_attention.fused_kernel() is not None, "the kernel did not build here"
    build = fused_attention.build_directory()
    assert fused_attention.built_kernel_problem(build) is None
    copy = tmp_path_factory.mktemp("kernel") / build.name
    copy.mkdir()
    for name in (f"{build.name}.so", fused_attention.BUILD_RECORD):
        shutil.copy(build / name, copy / name)
    return copy


@pytest.mark.parametrize(("fault", "target"), list(kernel_cases()))
def test_a_damaged_build_of_the_kernel_is_named_and_built_again(fault, target, kernel_build, tmp_path):
    """What `fused_attention` decides of a build before it loads it: a library that is not the one built here, or that
    cannot be checked, is built again, with a warning naming it (`built_kernel_problem`); a missing library is built
    (no problem to name). The rebuild itself runs in `test_a_replaced_kernel_library_is_built_again`."""
    from nezha_hf.fused_attention import built_kernel_problem

    build = tmp_path / kernel_build.name
    shutil.copytree(kernel_build, build)
    name = f"{build.name}.so" if target == "library" else target
    path = build / name
    if fault in FILE_FAULTS:
        apply_file_fault(fault, path, tmp_path)
    else:
        path.write_text(json.dumps(["sha256"]))
    with time_limit(CASE_SECONDS), (unreadable(path) if fault == "unreadable" else contextlib.nullcontext()):
        problem = built_kernel_problem(build)
    if fault == "missing" and target == "library":
        assert problem is None  # nothing built: it is built
    else:
        assert problem and name in problem, problem


@pytest.mark.slow  # builds the kernel (about a minute)
def test_a_replaced_kernel_library_is_built_again(tmp_path):
    """A library in the build cache that is not the one built here (a copy from elsewhere, a damaged disk) is built
    again with a warning naming it, and the kernel then gives the model's outputs."""
    import subprocess

    from nezha_hf import fused_attention

    cache = tmp_path / "extensions"
    build = fused_attention.build_directory()
    shutil.copytree(build, cache / build.name, ignore=shutil.ignore_patterns("*.lock", "lock"))
    library = cache / build.name / f"{build.name}.so"
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    code = ("import torch; from nezha_hf import fused_attention as f; kernel = f.fused_kernel(); "
            "assert kernel is not None; print('loaded')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)})
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
    assert f"is built again: {library}" in done.stderr, done.stderr[-3000:]
    assert fused_attention.built_kernel_problem(cache / build.name) is None


# --- the GPU check's carried Triton cache --------------------------------------------------------------------------


def archive_cases():
    for fault, _ in row_cases("triton_cache_archive", ["part"], {}):
        yield pytest.param(fault, id=f"archive-{fault}")


@pytest.mark.parametrize("fault", list(archive_cases()))
def test_a_damaged_carried_triton_cache_is_named_and_its_kernels_compile(fault, tmp_path):
    """`gpu_check.restore_cache` with a damaged part: one line of its log naming the part, nothing unpacked, and
    the check goes on (its kernels compile in the run)."""
    import tarfile

    from benchmarks.gpu import gpu_check

    source = tmp_path / "source"
    (source / "kernels").mkdir(parents=True)
    (source / "kernels" / "a.cubin").write_bytes(random.Random(0).randbytes(4096))
    carried = tmp_path / "carried"
    carried.mkdir()
    with tarfile.open(carried / "triton-cache.tar.gz.00", "w:gz") as archive:
        archive.add(source / "kernels", arcname="kernels")
    part = carried / "triton-cache.tar.gz.00"
    apply_file_fault(fault, part, tmp_path)
    cache, log = tmp_path / "cache", gpu_check.Log(tmp_path / "gpu-check.log")
    parts = gpu_check.carried_cache(carried)
    with time_limit(CASE_SECONDS), (unreadable(part) if fault == "unreadable" else contextlib.nullcontext()):
        gpu_check.restore_cache(cache, parts, log)
    text = (tmp_path / "gpu-check.log").read_text()
    if fault == "missing":  # no part carried: nothing to name
        assert "no Triton cache carried" in text, text
    elif "restored" in text:  # a link out is read as the bytes it leads to: the same archive
        assert fault == "link_out" and (cache / "kernels" / "a.cubin").read_bytes() == (
            source / "kernels" / "a.cubin").read_bytes(), text
    else:
        assert part.name in text and "kernels compile in this run" in text, text
        assert not cache.exists() or not any(cache.rglob("*.cubin")), sorted(cache.rglob("*"))


# Each row's cases, as (fault, target): the parametrisations above, read back.
ROW_CASES = {
    **{row: [(p.values[1], p.values[2]) for p in model_cases() if p.values[0] == row] for row in MODEL_ROWS},
    **{row: [(p.values[2], p.values[3]) for p in summarizer_cases() if p.values[0] == row] for row in SUMMARIZER_ROWS},
    **{row: [(p.values[1], p.values[2]) for p in run_state_cases() if p.values[0] == row]
       for row in ("run_record", "checkpoint")},
    "journal": [tuple(p.values) for p in journal_cases()],
    **{row: [(p.values[1], row) for p in input_cases() if p.values[0] == row]
       for row in ("judgments", "corpus", "predictions")},
    "tf_checkpoint": [tuple(p.values) for p in tf_cases()],
    "kernel_cache": [tuple(p.values) for p in kernel_cases()],
    "triton_cache_archive": [(p.values[0], "part") for p in archive_cases()],
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_every_fault_of_every_row_is_a_case_or_excused(row):
    """Every row of the table has its cases here, and every fault of `FAULTS` is one of them or excused in the row
    (with the reason, in nezha_hf/inventory.py)."""
    assert row in ROW_CASES, f"{row}: no cases in the matrix"
    tried = {fault for fault, _ in ROW_CASES[row]}
    missing = [fault for fault in inventory.FAULTS if fault not in ROWS[row].excused and fault not in tried]
    assert not missing, f"{row}: no case of {missing}; make one, or excuse it in nezha_hf/inventory.py"
    assert not tried & set(ROWS[row].excused), f"{row}: tried and excused both: {tried & set(ROWS[row].excused)}"
