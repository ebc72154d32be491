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
ends a run whose loss or weights stop being finite before anything of it is saved.
"""

import hashlib
import json
import math
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .distributed import all_true, local_tensor, processes

logger = logging.get_logger(__name__)
TRAINER_STATE = "trainer_state.json"


def model_folder(path, needs: str = "config.json") -> Path:
    """`path` as a `Path` if it is a local folder holding `needs`; otherwise a `FileNotFoundError` naming it."""
    path = Path(path)
    if not (path / needs).is_file():
        raise FileNotFoundError(f"{path} is not a model folder: it has no {needs}.")
    return path


def checkpoint_problem(folder: Path) -> str | None:
    """Why `folder` (a `checkpoint-N`) cannot be resumed from, or None if it is complete."""
    state_file = folder / TRAINER_STATE
    if not state_file.is_file():
        return f"no {TRAINER_STATE} (the run stopped while saving it)"
    try:
        step = json.loads(state_file.read_text(encoding="utf-8"))["global_step"]
    except (OSError, ValueError, KeyError) as error:
        return f"{TRAINER_STATE} is unreadable ({error})"
    if f"{PREFIX_CHECKPOINT_DIR}-{step}" != folder.name:
        return f"{TRAINER_STATE} is for step {step}"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "no model weights"
    for path in weights:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as error:  # safetensors raises its own error type for truncated files
            return f"{path.name} is unreadable ({type(error).__name__}: {error})"
    return None


def last_complete_checkpoint(output_dir) -> Path | None:
    """The newest `checkpoint-N` in `output_dir` that is complete; newer incomplete ones are skipped with a warning."""
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
        if problem is None:
            return folder
        logger.warning(f"Skipping the incomplete checkpoint {folder}: {problem}.")
    return None


def fingerprint(paths) -> str:
    """A digest of the contents of `paths` (files, and the files in folders), in a stable order."""
    digest = hashlib.sha256()
    for path in sorted({p for path in map(Path, paths) for p in ([path] if path.is_file() else path.rglob("*"))
                        if p.is_file()}):
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


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
        """The record of a run of `command` from the model folder `base` on the files `data`."""
        base = Path(base)
        weights = [p for p in base.rglob("*") if p.suffix in (".safetensors", ".bin") or p.name == "config.json"]
        return cls(command, str(base.resolve()), fingerprint(weights), sorted(str(Path(d).resolve()) for d in data),
                   fingerprint(data), json.loads(json.dumps(settings)))

    def difference(self, other: "RunRecord") -> str | None:
        """What differs from `other`, in words (None if nothing does)."""
        if self.command != other.command:
            return f"they are {other.command} checkpoints"
        if self.base_content != other.base_content:
            return f"the base model differs (those started from {other.base}, this run from {self.base})"
        if self.data_content != other.data_content:
            return "the training data differs"
        changed = sorted(k for k in {*self.settings, *other.settings} if self.settings.get(k) != other.settings.get(k))
        if changed:
            return "the settings differ: " + ", ".join(
                f"{k} {other.settings.get(k)!r} then, {self.settings.get(k)!r} now" for k in changed)
        return None


def prepare_checkpoints(folder, record: RunRecord, resume: bool = True) -> Path | None:
    """Get a run's checkpoints folder ready; returns the checkpoint to resume from, or None.

    With `resume`, checkpoints of a run with the same record are resumed; those of any other run are refused
    (a `ValueError` naming the difference). Without it, the folder is emptied (if it holds only a run's
    checkpoints) and the run starts over. A folder that holds anything else is never touched.
    """
    folder = Path(folder)
    saved = folder / RunRecord.FILE
    if folder.is_dir() and any(folder.iterdir()):
        if not saved.is_file():
            raise FileExistsError(f"{folder} holds files that no nezha-hf run wrote; move them, or write elsewhere.")
        previous = RunRecord(**{k: v for k, v in json.loads(saved.read_text(encoding="utf-8")).items()})
        difference = record.difference(previous)
        if resume and difference:
            raise ValueError(f"{folder} holds checkpoints of another run: {difference}. Pass --no-resume "
                             "(resume=False) to start over, which deletes them, or write elsewhere.")
        if not resume:
            shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(asdict(record), indent=1) + "\n", encoding="utf-8")
    return last_complete_checkpoint(folder) if resume else None


def finished(checkpoint: Path | None, max_steps: int) -> bool:
    """Whether `checkpoint` already ends the run (`max_steps`, or the run's own end when that is -1)."""
    if checkpoint is None:
        return False
    state = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8"))
    return state["global_step"] >= (max_steps if max_steps > 0 else state.get("max_steps", math.inf))


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


__all__ = ["NotFiniteError", "RunRecord", "StopWhenNotFinite", "checkpoint_problem", "finished", "fingerprint",
           "last_complete_checkpoint", "model_folder", "prepare_checkpoints"]
