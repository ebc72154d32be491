"""More than one process: NEZHA's commands under `accelerate launch` / `torchrun`, and a Trainer that resumes models
sharded by transformers' own `DistributedConfig`.

    accelerate launch --num_processes 2 -m nezha_hf pretrain MODEL corpus/ --output OUT          # DDP
    accelerate launch --num_processes 2 -m nezha_hf pretrain MODEL corpus/ --output OUT --fsdp   # FSDP2
    torchrun --nproc_per_node 2 -m nezha_hf summarize SUMMARIZER judgments/ --output S.jsonl

Which process does what (`accelerate.PartialState`, so any launcher works): every process reads, trains and
computes; the main process alone claims an output, prepares the checkpoints folder and puts the output in place
(`claimed_by_main`, `shared_staged_folder`), and nobody returns before the output is there.

`DistributedCheckpointTrainer` is `Trainer` with checkpoints that resume on any number of processes, including for a
model loaded with `from_pretrained(..., distributed_config=...)` (FSDP2 or tensor parallel): transformers 5.24's
Trainer trains such a model but refuses to checkpoint its optimizer, and cannot load its own checkpoint weights back
into sharded parameters. The optimizer goes into a PyTorch distributed checkpoint (DCP), which loads into any sharding.
"""

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object, reduce
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from tqdm.auto import tqdm
from transformers import Trainer
from transformers.distributed.checkpoint import load_optimizer_distributed, save_optimizer_distributed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .json_files import Anything, Integer, JSONFileError, Nullable, Object, String, checked, parse_json
from .named_files import weight_files
from .readers import load_state_file, open_regular_file, read_weights as read_weights_file, write_manifest
from .safe_output import NoRoomError, claimed, disk_of, naming, no_room, staged_folder

logger = logging.get_logger(__name__)
OPTIMIZER_DCP, SCHEDULER_FILE = "optimizer", "scheduler.pt"
CHECKPOINT_KIND = "checkpoint"  # what a checkpoint's manifest (`readers.MANIFEST_FILE`) says it is


def cpu_only() -> bool:
    """No GPU (or other accelerator) here. accelerate and Trainer must then be told to use the CPU
    (`PartialState(cpu=True)`, `TrainingArguments(use_cpu=True)`): otherwise every process of a multi-process launch
    runs as if it were alone, each training on all the data."""
    return not torch.accelerator.is_available()


def processes():
    """This process's place in the run: accelerate's `PartialState` (one process unless launched with several; then
    the process group is up, gloo on CPU, NCCL on GPUs)."""
    return PartialState(cpu=cpu_only())


@contextlib.contextmanager
def claimed_by_main(state, *destinations) -> Iterator[None]:
    """The main process holds `destinations` (`safe_output.claimed`: a second run is refused, leftovers of killed
    runs cleaned) for the whole block; the others start once that is done."""
    with contextlib.ExitStack() as stack:
        if state.is_main_process:
            for destination in destinations:
                stack.enter_context(claimed(destination))
        state.wait_for_everyone()
        yield


@contextlib.contextmanager
def shared_staged_folder(state, destination, overwrite: bool = False) -> Iterator[Path]:
    """`safe_output.staged_folder` for several processes: every process gets the main process's staging folder (to
    join the collective saves of a sharded model); once all are done with it, the main process puts it in place, and
    none returns before that."""
    if state.num_processes == 1:
        with staged_folder(destination, overwrite) as staging:
            yield staging
        return
    if state.is_main_process:
        with staged_folder(destination, overwrite) as staging:
            broadcast_object_list([str(staging)])
            yield staging
            state.wait_for_everyone()
    else:
        path = [None]
        broadcast_object_list(path)
        yield Path(path[0])
        state.wait_for_everyone()
    state.wait_for_everyone()


def on_main(state, work):
    """`work()` on the main process (files only it may write); every process gets its result, or the error it raised
    (so that no process waits for a result that will not come)."""
    outcome = [(None, None)]
    if state.is_main_process:
        try:
            outcome = [(work(), None)]
        except Exception as error:
            if state.num_processes == 1:
                raise
            outcome = [(None, error)]
    if state.num_processes > 1:
        broadcast_object_list(outcome)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def all_true(state, flag: bool) -> bool:
    """`flag` and the same flag of every other process (one all-reduce when there are several)."""
    if state.num_processes == 1:
        return flag
    return bool(reduce(torch.tensor([float(flag)], device=state.device), reduction="sum").item() == state.num_processes)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded (DTensor) parameter; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def run_batches(state, count: int, batch_size: int, work, journal=None, record=None, keys: list[str] | None = None,
                resume: bool = True, show_progress: bool = False, unit: str = "items",
                result_schema=None, item_progress: bool = False) -> list | None:
    """`work(start, stop)` (a list of JSON-able results, one per item) for each batch `[start, stop)` of `count` items,
    the batches shared out among the processes; returns every result in item order on the main process, None on the
    others. Batches are the same whatever the number of processes, so results are too.

    With `journal` (a folder beside the output being made), each finished batch is appended there at once, one JSONL
    file per process, each result with its item's key (`keys`, e.g. a judgment's id). A rerun with the same `record`
    (a `checkpoints.RunRecord`: what the results depend on) skips the batches already there, whatever its number of
    processes, and checks that every result it reuses is the one of the item it claims (its index and key, and, with
    `result_schema(index)`, a `json_files` schema, the result itself). A journal holding results of
    another record is refused (a `ValueError` naming what differs), never deleted, unless `resume=False`, which
    starts over. The caller removes the journal when done.

    `show_progress`: a bar counting items (`unit`), resumed ones included, on the main process only. It moves a batch
    at a time, unless `item_progress`: then `work(start, stop, progress)` is given an `ItemProgress` to count each
    item as it is done and to say what it is doing meanwhile.
    """
    batches = [(start, min(start + batch_size, count)) for start in range(0, count, batch_size)]
    done = {}
    if journal is not None:
        journal = Path(journal)
        earlier_run = journal.is_dir() and resume
        with naming(journal):
            on_main(state, lambda: _open_journal(journal, record, resume))
        done = _read_journal(journal, count, keys, result_schema)
        if earlier_run and state.is_main_process:
            logger.warning(f"Resuming: {len(done)} of {count} {unit} already done ({journal}).")
    mine = [b for b in batches if any(i not in done for i in range(*b))][state.process_index :: state.num_processes]
    computed = []
    log = open(journal / f"done-{state.process_index}.jsonl", "a", encoding="utf-8") if journal is not None else None
    bar = tqdm(total=count, initial=len(done), desc=unit, unit=unit.rstrip("s"),
               disable=not (show_progress and state.is_main_process))
    progress = ItemProgress(bar, state.num_processes)
    try:
        for start, stop in mine:
            progress.counted = 0
            batch = work(start, stop, progress) if item_progress else work(start, stop)
            progress.done(stop - start - progress.counted)  # what the work did not count itself
            results = [{"index": index, "key": keys[index] if keys else None, "result": result}
                       for index, result in enumerate(batch, start=start)]
            if log is not None:
                with naming(journal):
                    log.write("".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in results))
                    log.flush()
                    os.fsync(log.fileno())
            computed += results
    finally:
        bar.close()
        if log is not None:
            log.close()
    if state.num_processes > 1:
        computed = gather_object(computed)
    if not state.is_main_process:
        return None
    done.update((entry["index"], entry["result"]) for entry in computed)
    missing = [i for i in range(count) if i not in done]
    if missing:
        raise RuntimeError(f"no result for items {missing[:5]}: a process ended without its share")
    return [done[i] for i in range(count)]


class ItemProgress:
    """What `run_batches`' work tells its progress bar (shown on the main process only): `done()` when an item is
    finished, `stage(text)` what it is doing meanwhile (shown beside the count, at most every `tqdm.mininterval`
    seconds, so that a long stage shows it is alive without flooding a log). With several processes, the main
    process counts each of its items as one per process (the others go at about its pace), never past the total."""

    def __init__(self, bar, processes: int = 1):
        self.bar, self.processes = bar, processes
        self.counted = 0  # items of the current batch counted (`run_batches` counts the rest at the batch's end)
        self.shown = 0.0

    def done(self, count: int = 1) -> None:
        self.counted += count
        step = min(count * self.processes, (self.bar.total or 0) - self.bar.n)
        if step > 0:
            self.bar.update(step)

    def stage(self, text: str) -> None:
        if self.bar.disable:
            return
        self.bar.set_postfix_str(text, refresh=False)
        if time.monotonic() - self.shown >= self.bar.mininterval:
            self.bar.refresh()
            self.shown = time.monotonic()


JOURNAL_FILES = re.compile(r"record\.json(\.partial)?|done-\d+\.jsonl")
JOURNAL_RECORD = "record.json"


def _open_journal(journal: Path, record, resume: bool) -> None:
    """Keep a journal of the same record, with any line a kill cut short removed, or start one where there is none
    (or, with `resume=False`, in place of the old one). Results of another record, or of an unreadable one, are
    refused with one line naming the difference and the way out, never deleted. What this tool did not write (a
    link, a file, a folder with other files) is refused and left as it is."""
    if journal.is_symlink() or (journal.exists() and not journal.is_dir()):
        raise FileExistsError(f"{journal} is not a progress journal of nezha-hf (it is a link or a file): move it away.")
    if journal.is_dir():
        foreign = sorted(p.name for p in journal.iterdir() if not JOURNAL_FILES.fullmatch(p.name) or p.is_symlink())
        if foreign:
            raise FileExistsError(f"{journal} holds files nezha-hf did not write ({', '.join(foreign[:3])}): move them "
                                  "away, or the folder.")
        if not resume:
            shutil.rmtree(journal)
        elif any(part.stat().st_size for part in journal.glob("done-*.jsonl")):
            difference = _journal_difference(journal, record)
            if difference:
                raise ValueError(f"{journal} holds the finished batches of another run ({JOURNAL_RECORD} says: "
                                 f"{difference}). Rerun as that "
                                 "run was to go on from them, or pass --no-resume (resume=False) to start over, which "
                                 "deletes them.")
    journal.mkdir(exist_ok=True)
    for part in journal.glob("done-*.jsonl"):
        text = _journal_part(part)
        if text and not text.endswith(b"\n"):
            part.write_bytes(text[: text.rfind(b"\n") + 1])
    # Written beside and renamed in: a kill mid-write leaves the old record, never a cut one.
    partial = journal / f"{JOURNAL_RECORD}.partial"
    partial.write_text(json.dumps(asdict(record)), encoding="utf-8")
    os.replace(partial, journal / JOURNAL_RECORD)


def _journal_part(part: Path) -> bytes:
    """The bytes of a journal's `done-N.jsonl`, a regular file (`open_regular_file`: a FIFO or a device there would
    hang the reader or never end); an error naming it, and the way out, otherwise."""
    try:
        with open_regular_file(part) as file:
            return file.read()
    except (OSError, ValueError) as error:
        raise ValueError(f"The progress journal {part.parent} is damaged ({error}): delete it, or pass --no-resume, to "
                         "start over.") from None


def _journal_difference(journal: Path, record) -> str | None:
    """How the run that wrote `journal` differs from `record` (in words), or None if it is the same run."""
    try:
        saved = type(record).read(journal / JOURNAL_RECORD)
    except (OSError, ValueError) as error:  # none, cut short, not text, another shape: the file and field named
        return f"its {JOURNAL_RECORD}, which says which run, is missing or unreadable ({error})"
    return record.difference(saved)


def _read_journal(journal: Path, count: int, keys: list[str] | None, result_schema=None) -> dict:
    """The results a journal holds by item; a `ValueError` naming the file and line, and what to do, for a damaged
    line or a result that is not of the item it claims (an index outside the run, another key, a result that
    `result_schema(index)` refuses or whose `id` is another item's)."""
    entry_schema = Object({"index": Integer(minimum=0, maximum=count - 1), "key": Nullable(String(max_length=1 << 16)),
                           "result": Anything()}, required=["index", "key", "result"])
    done = {}
    for part in sorted(journal.glob("done-*.jsonl")):
        for number, line in enumerate(_journal_part(part).splitlines(), start=1):
            try:
                entry = parse_json(line.decode("utf-8"), f"line {number}", entry_schema)
                index, result = entry["index"], entry["result"]
                if keys is not None and entry["key"] != keys[index]:
                    raise KeyError(f"item {index} is {keys[index]!r}, the line says {entry['key']!r}")
                if result_schema is not None:
                    result = checked(result, result_schema(index), f"line {number}")
                    if keys is not None and result.get("id", keys[index]) != keys[index]:
                        raise KeyError(f"item {index} is {keys[index]!r}, its result is {result['id']!r}'s")
                done.setdefault(index, result)
            except (UnicodeDecodeError, ValueError, KeyError) as error:
                reason = error.args[0] if isinstance(error, KeyError) else (
                    f"{error.field}: {error.reason}" if isinstance(error, JSONFileError) and error.field
                    else error.reason if isinstance(error, JSONFileError) else type(error).__name__)
                raise ValueError(f"The progress journal {part} is damaged at line {number} ({reason}): "
                                 f"delete {journal}, or pass --no-resume, to start over.") from None
    return done


class DistributedCheckpointTrainer(Trainer):
    """`Trainer` whose checkpoints resume on any number of processes, including models sharded by
    `from_pretrained(..., distributed_config=...)` (transformers' FSDP2 and tensor parallel).

    Each `checkpoint-N` holds the gathered model weights and `trainer_state.json` (Trainer's `save_only_model=True`
    part, which this class sets), plus the optimizer state as a PyTorch distributed checkpoint (`optimizer/`, which
    loads into any sharding), the scheduler and every process's random state, all written before
    `trainer_state.json`, so a checkpoint that has it is complete. `train(resume_from_checkpoint=...)` loads them back,
    whether the checkpoint was written by one process or several. transformers 5.24's own Trainer trains a sharded
    model but refuses to checkpoint its optimizer, and cannot load its checkpoint weights into sharded parameters.

        model = NezhaForMaskedLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
        DistributedCheckpointTrainer(model=model, args=TrainingArguments(...), ...).train(resume_from_checkpoint=True)
    """

    def __init__(self, model=None, args=None, checkpoint_files: dict[str, str] | None = None, **kwargs):
        # Files written into every checkpoint before its trainer state (the run's record: which run it belongs to).
        self.checkpoint_files = dict(checkpoint_files or {})
        if args is not None:
            # Trainer then writes the model and its state only; the rest is written by `_save_checkpoint` below.
            args.save_only_model = True
        # Trainer sets `config.use_cache` to `args.use_cache` (False) for training; saved so, a model would decode
        # without a cache (summaries at half speed) and export without one. Saves keep the model's own.
        self.model_use_cache = getattr(getattr(model, "config", None), "use_cache", None)
        super().__init__(model=model, args=args, **kwargs)

    def _save(self, output_dir=None, state_dict=None):
        config = self.model.config
        training_value = config.use_cache
        if self.model_use_cache is not None:
            config.use_cache = self.model_use_cache
        try:
            super()._save(output_dir, state_dict)
        finally:
            config.use_cache = training_value

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            self._write_checkpoint(folder, model, trial)
        except BaseException as error:
            cause = _first_failure(error)
            if not isinstance(cause, Exception):  # an interrupt, however the writer wrapped it: as it came
                raise
            room = no_room(error)
            reason = (f"{room}: no room on {disk_of(folder)}" if room else
                      f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}")
            raise (NoRoomError if room else OSError)(
                f"could not save the checkpoint {folder} ({reason}); the run stopped there, and a rerun resumes from "
                "the last whole checkpoint") from error

    def _write_checkpoint(self, folder: Path, model, trial):
        if self.args.should_save:  # a checkpoint of this step left by a killed run, or skipped: none of it may remain
            shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        with _one_process_is_fine():
            save_optimizer_distributed(self.model, self.optimizer, str(folder / OPTIMIZER_DCP))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
            for name, text in self.checkpoint_files.items():
                (folder / name).write_text(text, encoding="utf-8")
        self._save_rng_state(str(folder))
        super()._save_checkpoint(model, trial)
        # Last, once every process has written its part: what each file holds, which a resume checks.
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            write_manifest(folder, CHECKPOINT_KIND)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self.is_distributed_loading_by_transformers:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        weights = read_weights(resume_from_checkpoint)
        for target, source in self.model.all_tied_weights_keys.items():  # saved once, under the source's name
            if target not in weights and source in weights:
                weights[target] = weights[source]
        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DCP)):
            return super()._load_optimizer_and_scheduler(checkpoint)  # none, or a plain Trainer checkpoint
        with _one_process_is_fine():
            load_optimizer_distributed(self.model, self.optimizer, os.path.join(checkpoint, OPTIMIZER_DCP))
        self.lr_scheduler.load_state_dict(load_state_file(os.path.join(checkpoint, SCHEDULER_FILE)))


def _first_failure(error: BaseException) -> BaseException:
    """What failed under `error`: the first failure a PyTorch distributed checkpoint wraps (its message is every
    process's traceback), else `error` itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    while isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return error


@contextlib.contextmanager
def _one_process_is_fine():
    """A distributed checkpoint written or read by a single process is intended here: no warning about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors weights in a model folder (one file, or the shards its index lists)."""
    weights = {}
    for path in weight_files(folder) or [Path(folder) / "model.safetensors"]:
        weights.update(read_weights_file(path))
    return weights


__all__ = [
    "CHECKPOINT_KIND",
    "DistributedCheckpointTrainer",
    "ItemProgress",
    "all_true",
    "claimed_by_main",
    "cpu_only",
    "local_tensor",
    "on_main",
    "processes",
    "read_weights",
    "run_batches",
    "shared_staged_folder",
]
