"""Files that one file of a folder names: held to that folder.

A model folder comes from whoever published it, and some of its files name others: a weight index its shards
(`model.safetensors.index.json`), an export manifest its programs (`export.json`), a distributed checkpoint its pieces,
a tokenizer config its `fast_tokenizer_files`. `file_in_folder` is the one check every such name passes before
anything is opened: it must resolve inside the folder (no `..`, no absolute path, no link leading out) and be a
regular file (not a FIFO, whose reading never ends, nor a device), or it is a `ValueError` naming the file that
names it and the entry. This module imports only `json_files` (the one JSON reader), so that remote code
(`loading_nezha.py`) uses it too.
"""

import os
import re
import stat
from pathlib import Path

from .json_files import Anything, Object, read_json
from .regular_files import kind_of

# The weight files a model folder holds when it has no index, in the order transformers looks for them.
SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Weight indexes, with transformers' variants (`model.safetensors.index.fp16.json`).
INDEX_PATTERNS = ("*.safetensors.index.json", "*.safetensors.index.*.json", "*.bin.index.json", "*.bin.index.*.json")
# A shard of sharded weights (`model-00001-of-00002.safetensors`), which an index names.
SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")
# A weight index: a `weight_map` of tensor names to file names (each name then passes `file_in_folder`).
INDEX_SCHEMA = Object({"weight_map": Object({}, others=Anything())}, required=["weight_map"], others=Anything())


def allowed_roots(folder) -> list[Path]:
    """Where the files of `folder` may lie once links are followed: the folder itself, and for a snapshot of the
    Hugging Face cache its repository's `blobs/` (the cache's own layout: a snapshot is links into them)."""
    root = Path(folder).resolve()
    snapshot = next((path for path in [root, *root.parents] if path.parent.name == "snapshots"), None)
    return [root] if snapshot is None else [root, snapshot.parent.parent / "blobs"]


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


def check_links(folder) -> None:
    """A `ValueError` naming the first symbolic link below `folder` that leads out of it (or nowhere): a model folder
    comes from whoever published it, and a link in it would have nezha_hf read, and copy into what it writes, any
    file on the machine. The Hugging Face cache's own layout is allowed: a snapshot's links into its repository's
    `blobs/`."""
    folder = Path(folder)
    allowed = allowed_roots(folder)
    for directory, folders, files in os.walk(folder):
        for name in [*folders, *files]:
            path = Path(directory) / name
            if path.is_symlink():
                target = path.resolve()
                if not target.exists() or not any(target.is_relative_to(inside) for inside in allowed):
                    raise ValueError(f"{path} is a link to {target}, outside the model folder {folder}: copy the file "
                                     "into the folder if it belongs to the model.")


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
    shards = sorted(path.name for path in folder.glob("*-of-[0-9]*.*") if SHARD.fullmatch(path.name))
    if shards:
        index = f"{shards[0].split('-')[0]}.{shards[0].rsplit('.', 1)[1]}.index.json"
        raise FileNotFoundError(f"{folder / index} is missing: the folder holds the shards {', '.join(shards[:3])}"
                                f"{' ...' if len(shards) > 3 else ''} but no index to say which tensor each holds.")
    return []


__all__ = ["allowed_roots", "check_links", "file_in_folder", "weight_files"]
