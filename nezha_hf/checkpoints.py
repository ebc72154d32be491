"""Model folders and Trainer checkpoints on disk: what is there, and what is complete.

`model_folder` checks that a local model folder exists before any work starts (rather than letting
`from_pretrained` treat a mistyped path as a model-hub id).

A run killed while saving leaves a `checkpoint-N` folder without its `trainer_state.json` (Trainer
writes it last) or with a truncated weights file. transformers' own `get_last_checkpoint` returns the
newest folder regardless, and resuming from it fails on every rerun. `last_complete_checkpoint`
skips such folders, with a warning naming each, and returns the newest checkpoint that is whole.
"""

import json
import re
from pathlib import Path

from safetensors import safe_open
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

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


__all__ = ["checkpoint_problem", "last_complete_checkpoint", "model_folder"]
