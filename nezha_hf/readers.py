"""One reader per kind of file nezha_hf reads that is neither JSON (`json_files`) nor text (`documents`): weights
(safetensors and torch files), Trainer's small state files, PyTorch distributed checkpoints, ONNX programs, and the
manifest of a folder nezha_hf wrote as one piece (a checkpoint, a summariser, an exported summariser).

Every file here comes from whoever made the folder it is in. A reader opens it as a regular file only (a FIFO would
hang it, a device never end), reads it with the library that owns the format, and turns whatever that library raises
into an `UnusableFile`: a `ValueError` in one line naming the file and why, never a library's message naming nothing
(`Error parsing message with type 'onnx.ModelProto'`). docs/robustness.md lists every file and its reader
(`nezha_hf.inventory`).

A folder written as one piece carries a manifest (`MANIFEST_FILE`, written last): each file's size and SHA-256. Its
reader (`manifest_problem`, `check_manifest`) finds what no format check can: a flipped byte in weights (which still
load, as other numbers), a file copied from another folder of the same kind, half of two folders, a file added or
removed since. A checkpoint whose manifest does not hold is skipped for the last intact one; a summariser whose
manifest does not hold is refused, naming the file.
"""

import hashlib
import os
import re
from pathlib import Path

from .json_files import Integer, Object, String, read_json
from .named_files import file_in_folder
from .regular_files import UnusableFile, open_regular_file


def first_line(error: BaseException, limit: int = 200) -> str:
    """What a library said when it failed, in one line of at most `limit` characters (its type when it said nothing)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def file_digest(path) -> str:
    """The SHA-256 of the regular file `path`, in hex (`open_regular_file`'s errors otherwise)."""
    with open_regular_file(path) as file:
        try:
            return hashlib.file_digest(file, "sha256").hexdigest()
        except OSError as error:
            raise UnusableFile(path, f"cannot be read ({error.strerror or type(error).__name__})") from None


# --- weights ------------------------------------------------------------------------------------------------------

# The dtypes a weight may have; a tensor named as a weight (`...weight`, `...bias`, LayerNorm's old `gamma` / `beta`)
# of another dtype (an integer, a bool, float8) is no weight nezha_hf loads, and transformers would cast it without a
# word. Tensors of other names (an old release's integer `position_ids`) are the loader's to keep or drop.
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")
WEIGHT_NAMES = ("weight", "bias", "gamma", "beta")
# torch's names of the weight dtypes, as safetensors names them.
_SAFETENSORS_DTYPE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}


def _check_weight_dtypes(path, dtypes: dict[str, str]) -> None:
    """An `UnusableFile` naming the first weight in `dtypes` (name -> safetensors dtype name) of a dtype no weight
    has."""
    for name, dtype in dtypes.items():
        if dtype not in WEIGHT_DTYPES and name.rsplit(".", 1)[-1] in WEIGHT_NAMES:
            raise UnusableFile(path, f"weight {name} is of dtype {dtype}, which no weight has (one of "
                                     f"{', '.join(WEIGHT_DTYPES)}): it is not a model's weights file")


def check_weights_file(path) -> None:
    """Check a weights file before transformers or a converter reads it: a safetensors file whose header reads and
    whose tensors all lie within the file, or a torch file (`.bin`) that loads as a flat `name -> tensor` dict
    (weights only: no pickle runs code); every tensor named as a weight of a weight's dtype (`WEIGHT_DTYPES`). An
    `UnusableFile` (or a `FileNotFoundError`) naming the file otherwise."""
    read_weights(Path(path), load=False)


def read_weights(path, load: bool = True) -> dict:
    """Every tensor of the weights file `path` (`.safetensors`, else a torch file), checked as `check_weights_file`
    checks it; `load=False` checks only (for safetensors, the header alone)."""
    import torch
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    open_regular_file(path).close()
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
                dtypes = {name: handle.get_slice(name).get_dtype() for name in names}
                _check_weight_dtypes(path, dtypes)
                return {name: handle.get_tensor(name) for name in names} if load else {}
        except SafetensorError as error:
            raise UnusableFile(path, f"is not a whole safetensors file ({first_line(error)})") from None
        except OSError as error:
            raise UnusableFile(path, f"cannot be read ({error.strerror or type(error).__name__})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=not load and _is_zip(path))
    # What torch's unpickler meets in bytes from elsewhere (an AttributeError for a float8 tensor in the legacy format,
    # a KeyError, a zip error, its weights-only refusal): each an unreadable file, named.
    except Exception as error:
        raise UnusableFile(path, f"is not a plain weights file (corrupt, truncated, or a pickle that is not plain "
                                 f"tensors: {first_line(error)})") from None
    if not isinstance(state, dict):
        raise UnusableFile(path, f"holds a {type(state).__name__}, not a name -> tensor dict of weights")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise UnusableFile(path, f"does not hold a flat name -> tensor dict: its entry {name!r} is a "
                                     f"{type(value).__name__} under a {type(name).__name__} key")
    _check_weight_dtypes(path, {name: _SAFETENSORS_DTYPE.get(str(value.dtype).removeprefix("torch."),
                                                             str(value.dtype).removeprefix("torch."))
                                for name, value in state.items()})
    return state


def _is_zip(path: Path) -> bool:
    with open_regular_file(path) as file:
        return file.read(4) == b"PK\x03\x04"


def load_state_file(path) -> object:
    """A small state file Trainer writes into a checkpoint (`scheduler.pt`, `rng_state*.pth`), loaded as Trainer
    loads it (weights only, numpy's arrays allowed); an `UnusableFile` naming it if it does not load."""
    import torch
    from transformers.trainer_pt_utils import safe_globals

    open_regular_file(path).close()
    try:
        with safe_globals():
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # pickle, zip and torch's own errors alike: a file that does not load
        raise UnusableFile(path, f"does not load ({first_line(error, 120)})") from None


# --- PyTorch distributed checkpoints ---------------------------------------------------------------------------------


def distributed_checkpoint_problem(folder) -> str | None:
    """Why the PyTorch distributed checkpoint `folder` is not whole (its `.metadata` unreadable, a piece it lists
    outside the folder, not a regular file, missing or shorter than the metadata says), or None. The bytes of the
    pieces are the manifest's to check (`manifest_problem`)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    metadata_file = folder / ".metadata"
    try:
        open_regular_file(metadata_file).close()
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # a missing or cut metadata file: pickle and file errors alike
        return f"{folder.name}/.metadata is missing or unreadable ({first_line(error, 120)})"
    for info in (metadata.storage_data or {}).values():
        try:
            piece = file_in_folder(folder, info.relative_path, metadata_file)
        except ValueError as error:
            return str(error)
        if piece.stat().st_size < info.offset + info.length:
            return f"{folder.name}/{info.relative_path} is missing or cut short"
    return None


# --- ONNX programs ---------------------------------------------------------------------------------------------------


def check_onnx_program(path, folder) -> None:
    """Check the ONNX program `path` of the exported folder `folder` before onnxruntime opens it: a regular file
    inside the folder that parses as an ONNX model and passes ONNX's checker, whose weights stored beside it
    (external data) are regular files inside the folder holding every byte the program says. An `UnusableFile`
    naming the file (the program, or its weights file) otherwise."""
    import onnx

    path, folder = Path(path), Path(folder)
    with open_regular_file(path) as file:
        data = file.read()
    try:
        model = onnx.load_model_from_string(data)
        onnx.checker.check_model(str(path))  # by path: it follows the program's external data from its folder
    except Exception as error:  # protobuf's DecodeError, the checker's ValidationError, ...
        raise UnusableFile(path, f"is not an ONNX program ({first_line(error, 120)}): export the summariser "
                                 "again") from None
    sizes = {}
    for tensor in _initializers(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        name = entries.get("location", "")
        try:
            weights = file_in_folder(path.parent, name, path)
            end = int(entries.get("offset", 0)) + int(entries.get("length", 0))
        except ValueError as error:
            raise UnusableFile(path, f"names its weights file badly ({error})") from None
        if weights not in sizes:
            open_regular_file(weights).close()
            sizes[weights] = weights.stat().st_size
        if end > sizes[weights]:
            raise UnusableFile(weights, f"holds {sizes[weights]:,} bytes, but {path.name} reads {tensor.name} up to "
                                        f"byte {end:,}: it is cut short or another program's")


def _initializers(graph):
    """Every initializer of `graph` and of the graphs inside its nodes (loops, branches)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            for inner in [attribute.g, *attribute.graphs]:
                yield from _initializers(inner)


# --- manifests of folders written as one piece ---------------------------------------------------------------------

MANIFEST_FILE = "nezha_manifest.json"
# Files a manifest does not cover: model cards, which no loader reads (a Hub upload rewrites them), and a summariser's
# settings, which a user may edit (`summarizer.json`: every value is checked where it is read, any valid one works).
NOT_IN_MANIFESTS = ("README.md", "summarizer.json")
MANIFEST_SCHEMA = Object({
    "kind": String(max_length=64),
    "files": Object({}, others=Object({"size": Integer(minimum=0), "sha256": String(max_length=64)},
                                      required=["size", "sha256"])),
}, required=["kind", "files"])


# Files of the writers' own, never part of what a folder holds: locks and staging siblings (`safe_output`).
_TRANSIENT = re.compile(r"\..*\.(lock|partial(-\w+)?|replaced-\w+)")


def _covered_files(folder: Path) -> list[str]:
    """The files below `folder` a manifest covers, as paths below it: every one (a distributed checkpoint's
    `.metadata` included) but the writers' locks and staging siblings, model cards (`NOT_IN_MANIFESTS`), the
    manifest itself and hidden folders (a Hub download's `.cache/`). Links count as the files they are (links out
    are refused apart)."""
    names = []
    for directory, folders, files in os.walk(folder):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in sorted(files):
            relative = (Path(directory) / name).relative_to(folder).as_posix()
            if not _TRANSIENT.fullmatch(name) and name not in NOT_IN_MANIFESTS and relative != MANIFEST_FILE:
                names.append(relative)
    return names


def write_manifest(folder, kind: str) -> None:
    """Write `folder`'s manifest (`MANIFEST_FILE`): each file below it with its size and SHA-256, and `kind` (what
    wrote it: "checkpoint", "summarizer", "exported summarizer"). Written last, once every other file is in place:
    a folder whose manifest is missing was not finished."""
    import json

    folder = Path(folder)
    files = {name: {"size": (folder / name).stat().st_size, "sha256": file_digest(folder / name)}
             for name in _covered_files(folder)}
    staging = folder / f".{MANIFEST_FILE}.partial"
    staging.write_text(json.dumps({"kind": kind, "files": files}, indent=1) + "\n", encoding="utf-8")
    os.replace(staging, folder / MANIFEST_FILE)


def manifest_problem(folder, kind: str) -> str | None:
    """Why `folder` is not what its manifest says it was when written (`write_manifest`), or None: the manifest is
    missing or unreadable or of another `kind`; a file it lists is missing, not a regular file inside the folder, or
    differs (size, then SHA-256); a file it does not list was added. The first difference, naming the file."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    try:
        manifest = read_json(path, MANIFEST_SCHEMA)
    except FileNotFoundError:
        return f"it has no {MANIFEST_FILE} (written last: the save did not finish, or an older nezha_hf wrote it)"
    except (OSError, ValueError) as error:
        return str(error).rstrip(".")
    if manifest["kind"] != kind:
        return f"{path} says it is a {manifest['kind']}, not a {kind}"
    for name, expected in manifest["files"].items():
        try:
            file = file_in_folder(folder, name, path, must_exist=False)
        except ValueError as error:
            return str(error).rstrip(".")
        if file is None:
            return f"{folder / name} is missing"
        try:
            if file.stat().st_size != expected["size"] or file_digest(file) != expected["sha256"]:
                return f"{file} is not the file that was written there (its contents differ from what {MANIFEST_FILE} records)"
        except (OSError, ValueError) as error:
            return str(error).rstrip(".")
    added = [name for name in _covered_files(folder) if name not in manifest["files"]]
    if added:
        return f"{folder / added[0]} was not written with the rest (it is not in {MANIFEST_FILE})"
    return None


def check_manifest(folder, kind: str, remedy: str) -> None:
    """`manifest_problem` as an error: a `ValueError` naming the file that differs, and `remedy` (what to do)."""
    problem = manifest_problem(folder, kind)
    if problem:
        raise ValueError(f"{Path(folder)} is damaged or mixed: {problem}. {remedy}")


__all__ = ["MANIFEST_FILE", "UnusableFile", "check_manifest", "check_onnx_program", "check_weights_file",
           "distributed_checkpoint_problem", "file_digest", "first_line", "load_state_file", "manifest_problem",
           "open_regular_file", "read_weights", "write_manifest"]
