"""Writing outputs so that nothing is lost: checked first, written beside the destination, renamed into place.

Every command and function here that writes a model folder or a result file does it this way:

1. `check_destination` before any work: the destination is not a source (nor inside one, nor holding
   one), its parent folder exists, and an existing non-empty destination is only replaced when asked
   (`overwrite=True`, `--overwrite`).
2. `staged_folder` / `staged_file`: the output is written into a temporary sibling of the destination
   (same folder, so the final rename is atomic) and renamed into place only after the caller's work,
   verification included, succeeded. A failure removes the sibling and leaves the destination as it was.
   A replaced folder is replaced whole: no file of the old model is left beside the new one.
"""

import contextlib
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def check_destination(destination, sources=(), overwrite: bool = False, kind: str = "folder") -> Path:
    """Refuse a destination that would lose data; returns it as a `Path`.

    Args:
        destination: the folder (`kind="folder"`) or file (`kind="file"`) to be written.
        sources: paths read to make it: the destination may not be one of them, inside one, or hold one.
        overwrite: allow replacing an existing non-empty folder (files are replaced only when allowed too).
        kind: `"folder"` or `"file"`.

    Raises:
        ValueError: the destination is a source, inside one, or holds one.
        FileExistsError: it exists (a non-empty folder, or a file) and `overwrite` is False.
        FileNotFoundError: its parent folder does not exist (a file's) .
        IsADirectoryError / NotADirectoryError: it exists as the other kind.
    """
    destination = Path(destination)
    resolved = destination.resolve()
    for source in map(Path, sources):
        source = source.resolve()
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise ValueError(
                f"{destination} is the source {source}, inside it or holds it: the source is never written. "
                "Choose another destination."
            )
    if kind == "file":
        if destination.is_dir():
            raise IsADirectoryError(f"{destination} is a folder; give a file name.")
        if not resolved.parent.is_dir():
            raise FileNotFoundError(f"The folder {destination.parent} does not exist.")
        if destination.exists() and not overwrite:
            raise FileExistsError(f"{destination} exists; pass --overwrite (overwrite=True) to replace it.")
    else:
        if destination.exists() and not destination.is_dir():
            raise NotADirectoryError(f"{destination} is a file, not a folder.")
        if destination.is_dir() and any(destination.iterdir()) and not overwrite:
            raise FileExistsError(
                f"{destination} is not empty; pass --overwrite (overwrite=True) to replace it whole."
            )
    return destination


@contextlib.contextmanager
def staged_folder(destination) -> Iterator[Path]:
    """Yield an empty temporary sibling folder; on success it replaces `destination` whole (created if absent)."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.partial-"))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if destination.exists():
        retired = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.replaced-"))
        os.replace(destination, retired / destination.name)
        os.replace(staging, destination)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, destination)


@contextlib.contextmanager
def staged_file(destination) -> Iterator[Path]:
    """Yield a temporary sibling file path; on success it replaces `destination` atomically."""
    destination = Path(destination)
    handle, name = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.partial-")
    os.close(handle)
    staging = Path(name)
    try:
        yield staging
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    os.replace(staging, destination)


# Weight files a model save may leave behind; a new save replaces all of them (as transformers' own save does).
WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


@contextlib.contextmanager
def staged_files_into(destination) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success its files move into `destination`, which keeps its other
    contents (a Trainer's checkpoints, say). Weight files of an earlier save that the new one does not have are
    removed, and `config.json` moves last, so that the folder never pairs a new config with old weights."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.partial-"))
    try:
        yield staging
        written = {path.name for path in staging.iterdir()}
        if any(fnmatch.fnmatch(name, pattern) for name in written for pattern in WEIGHT_FILES):
            for old in destination.iterdir():
                if old.name not in written and any(fnmatch.fnmatch(old.name, pattern) for pattern in WEIGHT_FILES):
                    old.unlink()
        for path in sorted(staging.iterdir(), key=lambda path: path.name == "config.json"):
            if path.is_dir() and (destination / path.name).exists():
                shutil.rmtree(destination / path.name)
            os.replace(path, destination / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_text_atomically(destination, text: str) -> None:
    """Write `text` (UTF-8) to `destination` through a temporary sibling: never half-written."""
    with staged_file(destination) as staging:
        staging.write_text(text, encoding="utf-8")


__all__ = ["check_destination", "staged_file", "staged_files_into", "staged_folder", "write_text_atomically"]
