"""Model folders and Trainer runs on disk: what is there, what is complete, what a run may resume, when it must stop.

`model_folder` checks that a local model folder exists before any work starts (rather than letting
`from_pretrained` treat a mistyped path as a model-hub id).

A run killed while saving leaves a `checkpoint-N` folder without its `trainer_state.json` (Trainer
writes it last) or with a truncated weights file. transformers' own `get_last_checkpoint` returns the
newest folder regardless, and resuming from it fails on every rerun. `last_complete_checkpoint`
skips such folders, with a warning naming each, and returns the newest checkpoint that is whole.

A run's checkpoints folder holds a `RunRecord` (`nezha_run.json`): what the run started from (the base
model's and the data's content, the settings that shape training). `prepare_checkpoints` resumes only a
run with the same record and refuses any other with one line naming the difference. `StopWhenNotFinite`
ends a run whose loss or weights stop being finite before anything of it is saved. `TrainingRun` is the skeleton
every training command (`pretrain`, `train-summarizer`) is written on: these pieces, in their order.
"""

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .distributed import (
    CHECKPOINT_KIND,
    OPTIMIZER_DCP,
    SCHEDULER_FILE,
    DistributedCheckpointTrainer,
    all_true,
    claimed_by_main,
    local_tensor,
    on_main,
    processes,
    shared_staged_folder,
)
from .json_files import (
    Anything,
    Boolean,
    Integer,
    ListOf,
    Nullable,
    Number,
    Object,
    String,
    read_json,
)
from .named_files import check_links, file_in_folder, weight_files
from .readers import (
    check_weights_file,
    first_line,
    distributed_checkpoint_problem,
    load_state_file,
    manifest_problem,
    open_regular_file,
)
from .regular_files import UnusableFile, kind_of
from .safe_output import check_destination, write_text_atomically

logger = logging.get_logger(__name__)
TRAINER_STATE = "trainer_state.json"
# What `TrainerState.load_from_json` takes (it passes every key on to `TrainerState`): a state of another shape is a
# checkpoint to skip, not one to fail on later.
_STEPS = Nullable(Number(minimum=0))
TRAINER_STATE_SCHEMA = Object({
    "global_step": Integer(minimum=0), "max_steps": Integer(), "epoch": Nullable(Number(minimum=0)),
    "logging_steps": _STEPS, "eval_steps": _STEPS, "save_steps": _STEPS, "train_batch_size": Nullable(Integer(1)),
    "num_train_epochs": Number(minimum=0), "num_input_tokens_seen": Integer(minimum=0), "total_flos": Number(),
    "log_history": ListOf(Object({}, others=Anything())), "best_metric": Nullable(Number()),
    "best_global_step": Nullable(Integer(minimum=0)), "best_model_checkpoint": Nullable(String()),
    "is_local_process_zero": Boolean(), "is_world_process_zero": Boolean(), "is_hyper_param_search": Boolean(),
    "trial_name": Nullable(String()), "trial_params": Nullable(Object({}, others=Anything())),
    "stateful_callbacks": Nullable(Object({}, others=Anything())),
}, required=["global_step", "max_steps"])


def model_folder(path, needs: str | None = "config.json") -> Path:
    """`path` as a `Path` if it is a local folder (holding the file `needs`, unless None) whose symbolic links stay
    inside it (`check_links`); otherwise a `FileNotFoundError` naming it, which says that model-hub ids are not
    fetched when `path` looks like one (or `check_links`' `ValueError`)."""
    path = Path(path)
    if not path.is_dir():
        hint = ""
        try:
            validate_repo_id(str(path))
            hint = (f" (nezha-hf reads local folders and fetches nothing from the model hub: download it first, e.g. "
                    f"`hf download {path} --local-dir {path}`)")
        except HFValidationError:
            pass
        raise FileNotFoundError(f"No such folder: {path}{hint}.")
    if needs is not None and not (path / needs).is_file():
        if os.path.lexists(path / needs) and not (path / needs).is_symlink():
            raise UnusableFile(path / needs, f"is {kind_of((path / needs).stat().st_mode)}, not a regular file")
        raise FileNotFoundError(f"{path} is not a model folder: it has no {needs}.")
    check_links(path)
    return path


# What transformers' tokenizer loaders parse as JSON in a local folder (`config.json` names the class when the
# tokenizer's config does not), beside the `fast_tokenizer_files` a `tokenizer_config.json` names. A `tokenizer.json`
# holds the whole vocabulary: tens of MB for a large multilingual one, hence its own bound.
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
                        "config.json")
TOKENIZER_FILE_MAX_BYTES = 256 << 20
TOKENIZER_CONFIG_SCHEMA = Object({"fast_tokenizer_files": ListOf(String())}, others=Anything())


def check_tokenizer_files(folder) -> None:
    """Read what a tokenizer loader reads of the local folder `folder` the way `json_files.read_json` reads any file,
    before transformers reads it raw: every file at its top and among its chat templates is a regular file inside it
    (`named_files.file_in_folder`: a FIFO would hang the loader), and each JSON file the loader parses
    (`TOKENIZER_JSON_FILES` and the `fast_tokenizer_files` that `tokenizer_config.json` names, held to the folder) is
    bounded in size and depth and gives no key twice. A `ValueError` in one line naming the file otherwise. A path
    that is no local folder (a Hub id) is left to transformers."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    templates = folder / "additional_chat_templates"  # transformers' CHAT_TEMPLATE_DIR: its `*.jinja` are read
    entries = [*folder.iterdir(), *(templates.iterdir() if templates.is_dir() and not templates.is_symlink() else [])]
    for path in sorted(entries):
        if not path.is_dir():
            file_in_folder(folder, path.relative_to(folder).as_posix(), folder)
    config_file = folder / "tokenizer_config.json"
    named = []  # transformers reads the newest of the `fast_tokenizer_files` it names, joined to the folder
    if config_file.exists():
        named = read_json(config_file, TOKENIZER_CONFIG_SCHEMA).get("fast_tokenizer_files") or []
    files = [(name, folder) for name in TOKENIZER_JSON_FILES if name != config_file.name]
    for name, named_by in [*files, *((name, config_file) for name in named)]:
        path = file_in_folder(folder, name, named_by, must_exist=False)
        if path is not None:
            read_json(path, max_bytes=TOKENIZER_FILE_MAX_BYTES)


def load_tokenizer(folder):
    """`AutoTokenizer.from_pretrained(folder)` for a model folder, its files checked first (`check_tokenizer_files`),
    without what its `tokenizer_config.json` names for a loader to fetch and run (`auto_map`): dropped with a warning,
    so that a tokenizer that passes through nezha_hf is saved without it."""
    from transformers import AutoTokenizer

    check_tokenizer_files(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # the tokenizers library's and transformers' own messages name no file
        raise ValueError(f"The tokenizer of {folder} does not load {tokenizer_source(folder)} "
                         f"({type(error).__name__}: {first_line(error)}).") from None
    _check_added_tokens(Path(folder), tokenizer)
    code = tokenizer.init_kwargs.pop("auto_map", None)
    if code is not None:
        logger.warning(f"Ignoring auto_map={code!r} in {folder}'s tokenizer config: it names code for transformers "
                       "to fetch and run.")
    return tokenizer


# Models pad their vocabulary to a round number (a multiple of 128 at most) for speed; a tokenizer short of its
# model's vocabulary by more is some other model's tokenizer.
VOCABULARY_PADDING = 128


ADDED_TOKENS_SCHEMA = Object({"added_tokens": ListOf(Object({"id": Integer(minimum=0), "content": String()},
                                                             others=Anything()))}, others=Anything())


def _check_added_tokens(folder: Path, tokenizer) -> None:
    """A `ValueError` naming `tokenizer.json` if the loaded tokenizer gives one of the tokens the file lists with an
    id ([CLS], [SEP], ...) another id: the file's vocabulary lacks it, and transformers appended it anew."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return
    for token in read_json(path, ADDED_TOKENS_SCHEMA, max_bytes=TOKENIZER_FILE_MAX_BYTES).get("added_tokens", []):
        loaded = tokenizer.convert_tokens_to_ids(token["content"])
        if loaded != token["id"]:
            raise ValueError(f"{path} gives {token['content']} the id {token['id']}, but its vocabulary does not hold "
                             f"it there (the tokenizer gives it {loaded}): the file is damaged or of two tokenizers.")


# The files a tokenizer is read from, in what its messages name.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt")


def tokenizer_source(folder) -> str:
    """Which tokenizer files the folder `folder` holds, in words for a message: "from tokenizer.json, vocab.txt
    (it has no tokenizer_config.json)"."""
    folder = Path(folder)
    present = [name for name in TOKENIZER_FILES if os.path.lexists(folder / name)]
    absent = "" if "tokenizer_config.json" in present else " (it has no tokenizer_config.json)"
    return f"from {', '.join(present) or 'no tokenizer file'}{absent}"


def check_tokenizer(tokenizer, config, where, needs=("cls_token", "sep_token", "pad_token")) -> None:
    """A `ValueError` unless `tokenizer` is `config`'s model's own: as many tokens as its vocabulary (up to its
    padding), the special tokens `needs` present, and the padding id the model's. `where` names the model's folder;
    the message names the files the tokenizer was read from."""
    size, vocabulary = len(tokenizer), config.vocab_size
    read = f"The tokenizer of {where}, read {tokenizer_source(tokenizer.name_or_path)},"
    if size > vocabulary or vocabulary - size >= VOCABULARY_PADDING:
        raise ValueError(f"{read} has {size:,} tokens but its model a vocabulary of {vocabulary:,}: it is not the "
                         "model's own tokenizer. Save the model's tokenizer beside it.")
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if largest >= vocabulary:
        raise ValueError(f"{read} gives ids up to {largest:,}, beyond its model's vocabulary of {vocabulary:,}: it is "
                         "not the model's own tokenizer.")
    missing = [name for name in needs if getattr(tokenizer, f"{name}_id", None) is None]
    if missing:
        raise ValueError(f"{read} has no {', '.join(missing)}, which NEZHA's inputs need.")
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and tokenizer.pad_token_id != pad:
        raise ValueError(f"{read} pads with id {tokenizer.pad_token_id}, its model with {pad}: it is not the model's "
                         "own tokenizer.")
    framed = tokenizer("法")["input_ids"]  # NEZHA's inputs, as BERT's: [CLS] text [SEP]
    if "cls_token" in needs and "sep_token" in needs and (
            framed[:1] != [tokenizer.cls_token_id] or framed[-1:] != [tokenizer.sep_token_id]):
        raise ValueError(f"{read} does not put [CLS] before a text and [SEP] after it (it gives {framed}): its "
                         "post-processor or special tokens are damaged.")


def checkpoint_problem(folder: Path) -> str | None:
    """Why `folder` (a `checkpoint-N`) cannot be resumed from, or None if it is whole: what a resume reads loading as
    Trainer loads it (its trainer state, its weights, its optimizer state: a distributed checkpoint `optimizer/` whose
    every piece is whole, or Trainer's `optimizer.pt`; its scheduler), then every file as its save wrote it (its
    manifest, `readers.manifest_problem`: a flipped byte in an optimizer piece, a file of another checkpoint, a save
    cut short). Without the optimizer or the scheduler, a resume would start them afresh without a word."""
    try:
        step = read_trainer_state(folder)["global_step"]
    except FileNotFoundError:
        return f"no {TRAINER_STATE} (the run stopped while saving it)"
    except (OSError, ValueError) as error:  # `JSONFileError` among them: the file and the field named
        return f"{TRAINER_STATE} is unusable ({error})"
    if f"{PREFIX_CHECKPOINT_DIR}-{step}" != folder.name:
        return f"{TRAINER_STATE} is for step {step}"
    try:
        weights = weight_files(folder) or sorted(folder.glob("*.safetensors"))
        if not weights:
            return "no model weights (no model.safetensors)"
        for path in weights:
            check_weights_file(path)
    except (OSError, ValueError) as error:
        return str(error)
    if (folder / OPTIMIZER_DCP).is_dir():
        problem = distributed_checkpoint_problem(folder / OPTIMIZER_DCP)
        if problem:
            return problem
    elif not (folder / "optimizer.pt").is_file():
        return f"no optimizer state ({OPTIMIZER_DCP}/ or optimizer.pt)"
    if not (folder / SCHEDULER_FILE).is_file() or (folder / SCHEDULER_FILE).stat().st_size == 0:
        return f"no {SCHEDULER_FILE}"
    for path in [folder / SCHEDULER_FILE, *sorted(folder.glob("rng_state*.pth"))]:
        try:
            load_state_file(path)
        except (OSError, ValueError) as error:
            return str(error)
    return manifest_problem(folder, CHECKPOINT_KIND)  # last: it reads every byte


def read_trainer_state(checkpoint: Path) -> dict:
    """A checkpoint's `trainer_state.json`, checked to be what Trainer can resume from (`TRAINER_STATE_SCHEMA`); a
    `JSONFileError` naming the file and the field otherwise."""
    return read_json(Path(checkpoint) / TRAINER_STATE, TRAINER_STATE_SCHEMA)


def last_complete_checkpoint(output_dir, record: "RunRecord | None" = None) -> Path | None:
    """The newest `checkpoint-N` in `output_dir` that is complete and, given the run's `record`, of this run (it
    carries the record of the run that saved it: `TrainingRun.trainer`); newer ones that are not are skipped with a
    warning naming each and why."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = sorted(
        (int(match.group(1)), path) for path in output_dir.iterdir()
        if path.is_dir() and (match := pattern.match(path.name))
    )
    for _, folder in reversed(found):
        problem = checkpoint_problem(folder)
        if problem is None and record is not None:
            problem = record.checkpoint_problem(folder)
        if problem is None:
            return folder
        logger.warning(f"Skipping the checkpoint {folder}, which cannot be resumed from: {problem}.")
    return None


def fingerprint(paths) -> str:
    """A digest of `paths` in the order given: each file's name and contents; for a folder, every file below it
    (sorted; hidden ones, such as locks, left out) with its path below the folder. Reordering the paths changes it."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        if path.is_file():
            files = [(path.name, path)]
        else:
            files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        digest.update(f"{len(files)} files\0".encode())
        for name, file in files:
            digest.update(name.encode() + b"\0")
            with open_regular_file(file) as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


_DIGEST = String(max_length=64)  # `fingerprint`s
RUN_RECORD_SCHEMA = Object({
    "command": String(max_length=64), "base": String(), "base_content": _DIGEST, "data": ListOf(String()),
    "data_content": _DIGEST, "settings": Object({}, others=Anything())},
    required=["command", "base", "base_content", "data", "data_content", "settings"])


@dataclass
class RunRecord:
    """What a training run started from; a resume must match it."""

    FILE = "nezha_run.json"

    command: str
    base: str
    base_content: str
    data: list[str]
    data_content: str
    settings: dict

    @classmethod
    def create(cls, command: str, base, data, settings: dict) -> "RunRecord":
        """The record of a run of `command` from the model folder `base` (every file in it: weights, config, tokenizer,
        generation settings) on the files `data`, in their order (which decides the order of the examples)."""
        base = Path(base)
        return cls(command, str(base.resolve()), fingerprint([base]), [str(Path(d).resolve()) for d in data],
                   fingerprint(data), json.loads(json.dumps(settings)))

    @classmethod
    def read(cls, path) -> "RunRecord":
        """The record saved at `path`; a `JSONFileError` naming the file and the field if it is not one."""
        return cls(**read_json(path, RUN_RECORD_SCHEMA))

    def text(self) -> str:
        """The record as its file holds it."""
        return json.dumps(asdict(self), indent=1) + "\n"

    def checkpoint_problem(self, checkpoint: Path) -> str | None:
        """Why `checkpoint` is not of this run (none, another, or an unreadable record in it), or None."""
        try:
            saved = RunRecord.read(Path(checkpoint) / self.FILE)
        except FileNotFoundError:
            return f"it does not say which run saved it (no {self.FILE}): it is not of this run"
        except ValueError as error:
            return f"its record of the run that saved it is unusable ({error})"
        difference = self.difference(saved)
        return f"it is a checkpoint of another run ({difference})" if difference else None

    def difference(self, other: "RunRecord") -> str | None:
        """What differs from `other`, in words (None if nothing does)."""
        if self.command != other.command:
            return f"that run was {other.command}, this one is {self.command}"
        if self.base_content != other.base_content:
            return f"the base model differs (those started from {other.base}, this run from {self.base})"
        if self.data_content != other.data_content:
            return ("the input files are the same but in another order" if sorted(self.data) == sorted(other.data)
                    and self.data != other.data else "the input files or their contents differ")
        changed = sorted(k for k in {*self.settings, *other.settings} if self.settings.get(k) != other.settings.get(k))
        if changed:
            return "the settings differ: " + ", ".join(
                f"{k} {other.settings.get(k)!r} then, {self.settings.get(k)!r} now" for k in changed)
        return None


def resumed_settings(training_arguments: dict, processes: int) -> dict:
    """What a resumed run must share with the run it resumes, as its `RunRecord` keeps them: the examples of a step
    (the global batch: per process, times the processes, times the accumulation steps; a run may resume on another
    number of processes with a batch per process that keeps it) and how a step is computed (bf16). Others
    (max_steps, the learning rate) may change between a run and its continuation."""
    global_batch = (training_arguments.get("per_device_train_batch_size", 8) * processes
                    * training_arguments.get("gradient_accumulation_steps", 1))
    return {"global_batch": global_batch,
            "bf16": bool(training_arguments.get("bf16", False))}


def prepare_checkpoints(folder, record: RunRecord, resume: bool = True) -> Path | None:
    """Get a run's checkpoints folder ready; returns the checkpoint to resume from, or None.

    With `resume`, checkpoints of a run with the same record are resumed; those of any other run are refused
    (a `ValueError` naming the difference). Without it, the folder is emptied (if it holds only a run's
    checkpoints) and the run starts over. A folder that holds anything else is never touched.
    """
    folder = Path(folder)
    saved = folder / RunRecord.FILE
    # The record's own leftovers (a kill while it was being staged) are a run's files too.
    if folder.is_dir() and any(not p.name.startswith(f".{RunRecord.FILE}.") for p in folder.iterdir()):
        if not os.path.lexists(saved):
            raise FileExistsError(f"{folder} holds files but no {RunRecord.FILE} saying which nezha-hf run wrote them; "
                                  "move them, or write elsewhere.")
        if not resume:  # whatever state the record is in
            shutil.rmtree(folder)
        else:
            try:
                previous = RunRecord.read(saved)
            except (OSError, ValueError) as error:
                raise ValueError(f"{folder} holds checkpoints whose run record is unusable ({error}). Pass "
                                 "--no-resume (resume=False) to start over, which deletes them.") from None
            difference = record.difference(previous)
            if difference:
                raise ValueError(f"{folder} holds checkpoints of another run ({saved.name} says: {difference}). Pass "
                                 "--no-resume (resume=False) to start over, which deletes them, or write elsewhere.")
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(saved, record.text())  # staged beside and renamed in: a full disk leaves the old one
    return last_complete_checkpoint(folder, record) if resume else None


def finished(checkpoint: Path | None, max_steps: int) -> bool:
    """Whether `checkpoint` already ends the run (`max_steps`, or the run's own end when that is -1)."""
    if checkpoint is None:
        return False
    state = read_trainer_state(checkpoint)
    return state["global_step"] >= (max_steps if max_steps > 0 else state["max_steps"])


class NotFiniteError(FloatingPointError):
    """Training produced a loss or weights that are not finite."""


class StopWhenNotFinite(TrainerCallback):
    """Ends a run, with one line, as soon as its loss or its weights are not finite: after the optimizer step
    and before that step's checkpoint is saved, so nothing non-finite is written."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # Each process checks its own part of a sharded model; all of them stop, or none.
        weights = [local_tensor(p.detach()) for p in model.parameters()]
        finite = not weights or bool(torch.stack(torch._foreach_norm(weights)).isfinite().all())
        if not all_true(processes(), finite):
            raise NotFiniteError(f"training diverged at step {state.global_step}: the weights are not finite "
                                 f"(learning rate {args.learning_rate:g}); nothing was written")

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise NotFiniteError(f"training diverged at step {state.global_step}: the loss is {loss} "
                                 f"(learning rate {args.learning_rate:g}); nothing was written")


class TrainingRun:
    """One run of a training command (`pretrain`, `train-summarizer`), from its checked destinations to its output in
    place:

        run = TrainingRun("pretrain", base, data, output_dir, overwrite)
        with run.claimed():                             # the output and its checkpoints held by the main process
            record = run.record(settings, training_arguments)
            on_main(run.state, lambda: prepare_checkpoints(run.checkpoints, record, resume))
            trainer = run.trainer(model=..., args=TrainingArguments(str(run.checkpoints), ...), ...)
            run.train(trainer, run.last_checkpoint())   # resumed from the last complete checkpoint, if any
            with run.staged_output() as staging:        # written there, put in place whole
                trainer.save_model(staging)

    The output folder may not be `base` nor inside the data (`safe_output.check_destination`); an existing non-empty
    one is replaced only with `overwrite`. Trainer checkpoints go to its sibling `<output_dir>.checkpoints/` (a
    subfolder per stage of a run with several), with the `RunRecord` a resume must match."""

    def __init__(self, command: str, base, data, output_dir, overwrite: bool = False):
        self.command, self.base, self.data, self.overwrite = command, base, list(data), overwrite
        self.run_record = None  # `record` makes it; each checkpoint carries it, and a resume checks it
        self.state = processes()
        self.output_dir = check_destination(output_dir, [base, *self.data], overwrite)
        self.checkpoints = self.output_dir.with_name(self.output_dir.name + ".checkpoints")
        check_destination(self.checkpoints, [base, *self.data], overwrite=True)

    def claimed(self):
        """The output folder and the checkpoints held by the main process for the block (`claimed_by_main`)."""
        return claimed_by_main(self.state, self.output_dir, self.checkpoints)

    def record(self, settings: dict, training_arguments: dict) -> RunRecord:
        """The run's `RunRecord`: `settings` (what shapes the training) and what a resume keeps of the
        `TrainingArguments` (`resumed_settings`)."""
        self.run_record = RunRecord.create(self.command, self.base, self.data,
                                           {**settings, **resumed_settings(training_arguments, self.state.num_processes)})
        return self.run_record

    def trainer(self, callbacks=(), **trainer_arguments) -> DistributedCheckpointTrainer:
        """Trainer (`DistributedCheckpointTrainer`, for any number of processes), ending the run as soon as its loss or
        weights are not finite (`StopWhenNotFinite`)."""
        return DistributedCheckpointTrainer(callbacks=[*callbacks, StopWhenNotFinite()],
                                            checkpoint_files={RunRecord.FILE: self.run_record.text()}, **trainer_arguments)

    def last_checkpoint(self, stage: str | None = None) -> Path | None:
        """The last complete checkpoint of the run (of its `stage`), found by the main process for all."""
        folder = self.checkpoints / stage if stage else self.checkpoints
        return on_main(self.state, lambda: last_complete_checkpoint(folder, self.run_record))

    def train(self, trainer, last: Path | None) -> dict:
        """`trainer.train()`, resumed from `last` when there is one (a line says so); returns Trainer's metrics."""
        if last and self.state.is_main_process:
            logger.warning(f"Resuming from {last}.")
        return trainer.train(resume_from_checkpoint=str(last) if last else None).metrics

    def staged_output(self):
        """The folder to write the output into, put in place whole once the block ends (`shared_staged_folder`)."""
        return shared_staged_folder(self.state, self.output_dir, self.overwrite)


__all__ = ["NotFiniteError", "RunRecord", "StopWhenNotFinite", "TrainingRun", "check_links", "check_tokenizer",
           "check_tokenizer_files", "checkpoint_problem", "finished", "fingerprint", "last_complete_checkpoint",
           "load_tokenizer", "model_folder", "prepare_checkpoints", "resumed_settings"]
