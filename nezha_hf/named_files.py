"""Files that one file of a folder names: held to that folder.

A model folder comes from whoever published it, and some of its files name others: a weight index its shards
(`model.safetensors.index.json`), an export manifest its programs (`export.json`), a distributed checkpoint its pieces,
a tokenizer config its `fast_tokenizer_files`. `file_in_folder` is the one check every such name passes before
anything is opened: it must resolve inside the folder (no `..`, no absolute path, no link leading out) and be a
regular file (not a FIFO, whose reading never ends, nor a device), or it is a `ValueError` naming the file that
names it and the entry. This module imports only `json_files` (the one JSON reader), so that remote code
(`loading_nezha.py`) uses it too.
"""

import stat
from pathlib import Path

from .json_files import Anything, Object, read_json
from .regular_files import kind_of

# The weight files a model folder holds when it has no index, in the order transformers looks for them.
SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Weight indexes, with transformers' variants (`model.safetensors.index.fp16.json`).
INDEX_PATTERNS = ("*.safetensors.index.json", "*.safetensors.index.*.json", "*.bin.index.json", "*.bin.index.*.json")
# A weight index: a `weight_map` of tensor names to file names (each name then passes `file_in_folder`).
INDEX_SCHEMA = Object({"weight_map": Object({}, others=Anything())}, required=["weight_map"], others=Anything())


def allowed_roots(folder) -> list[Path]:
    """Where the files of `folder` may lie once links are followed: the folder itself, and for a snapshot of the
    Hugging Face cache its repository's `blobs/` (the cache's own layout: a snapshot is links into them)."""
    root = Path(folder).resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def file_in_folder(folder, name, named_by, must_exist: bool = True) -> Path | None:
    """`folder / name` if `name` (read from the file `named_by`) is a regular file inside `folder`; otherwise a
    `ValueError` in one line naming `named_by` and `name`. A name that is not a string, is absolute, climbs out with
    `..`, or leads out through a link is refused without being opened; so is a FIFO, a device, a socket or a folder.
    A missing file is refused too, unless `must_exist` is False (then None)."""
    folder = Path(folder)

    def refuse(why: str):
        raise ValueError(f"{named_by} names {name!r}, {why}: it may only name regular files inside {folder}.")

    if not isinstance(name, str) or not name or "\0" in name:
        refuse("which is not a file name")
    relative = Path(name)
    if relative.is_absolute() or relative.drive or ".." in relative.parts or "\\" in name:
        refuse("a path outside its folder")
    path = folder / relative
    target = path.resolve()
    if not any(target.is_relative_to(root) for root in allowed_roots(folder)):
        refuse(f"which leads to {target}, outside its folder")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if must_exist:
            refuse("which does not exist")
        return None
    except OSError as error:
        refuse(f"which cannot be read ({error.strerror})")
    if not stat.S_ISREG(mode):
        refuse(f"which is {kind_of(mode)}")
    return path


def weight_files(folder) -> list[Path]:
    """The weight files transformers and nezha_hf read from the model folder `folder`: the shards every weight index
    in it names (each passing `file_in_folder`; an index that is no JSON object with a `weight_map` of names is a
    `ValueError` naming it), or else its single weights file. Checked before any weight is read."""
    folder = Path(folder)
    indexes = sorted({path for pattern in INDEX_PATTERNS for path in folder.glob(pattern)})
    files = []
    for index in indexes:
        file_in_folder(folder, index.name, folder)
        weight_map = read_json(index, INDEX_SCHEMA)["weight_map"]
        for name in weight_map.values():
            path = file_in_folder(folder, name, index)
            if path not in files:
                files.append(path)
    if indexes:
        return files
    for name in SINGLE_WEIGHT_FILES:
        path = file_in_folder(folder, name, folder, must_exist=False)
        if path is not None:
            return [path]
    return []


__all__ = ["allowed_roots", "file_in_folder", "weight_files"]
