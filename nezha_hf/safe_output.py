"""Writing outputs so that nothing is lost: claimed, checked first, written beside the destination, swapped in.

Every command and function here that writes a model folder or a result file does it this way:

1. `check_destination` before any work: the destination is not a source (nor inside one, nor holding
   one), its parent folder exists, and an existing non-empty destination is only replaced when asked
   (`overwrite=True`, `--overwrite`).
2. `claimed`: a lock beside the destination (`.<name>.lock`, through `filelock`, released by the system if the
   process dies, on Linux, macOS and Windows) for the whole run. A second writer is refused with `OutputBusyError`.
   Whoever claims a destination first cleans what killed runs left there: staging folders (`.<name>.partial-*`),
   and a replaced output a kill left aside (`.<name>.replaced-*`), which is put back if the destination is missing.
3. `staged_folder` / `staged_file`: the output is written into a temporary sibling of the destination and
   put in place only after the caller's work, verification included, succeeded. At that moment the
   destination is checked again: one that appeared meanwhile is not replaced without `overwrite`. A folder
   is swapped with the old one in a single rename where the system can (Linux `renameat2(RENAME_EXCHANGE)`), so a
   kill at any instant leaves the old output or the new one, never neither and never a mix; elsewhere (macOS,
   Windows, file systems without it) in two renames, and a kill between them is recovered by the next claim (2.).
   A failure (or Ctrl-C) removes the sibling and leaves the destination as it was. Outputs get the permissions an
   ordinary write gives them (the umask's; a replaced file keeps its own).
4. `staged_files_into`, for `save_pretrained` into a folder that holds other things: the new folder is the
   new files plus hard links to everything else the old one held, and is swapped in the same way. Only the
   weight files an earlier save wrote (`model.safetensors`, `model-00001-of-00002.safetensors`, their
   index, the `pytorch_model` equivalents) are dropped, as transformers' own save drops them.

Nothing here writes through a symbolic link: links are replaced by renames, never opened for writing.
"""

import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout, UnixFileLock


class OutputBusyError(FileExistsError):
    """Another run is writing the same destination."""


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
        FileNotFoundError: its parent folder does not exist (a mistyped path is not created).
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
    if not resolved.parent.is_dir():  # a mistyped parent (/mnt/bakcup/x) is not created
        raise FileNotFoundError(f"The folder {destination.parent} does not exist: create it first, or check the path.")
    if kind == "file":
        if destination.is_dir():
            raise IsADirectoryError(f"{destination} is a folder; give a file name.")
        if _occupied(destination) and not overwrite:
            raise FileExistsError(f"{destination} exists; pass --overwrite (overwrite=True) to replace it.")
    else:
        if destination.exists() and not destination.is_dir():
            raise NotADirectoryError(f"{destination} is a file, not a folder.")
        if _occupied(destination) and not overwrite:
            raise FileExistsError(
                f"{destination} is not empty; pass --overwrite (overwrite=True) to replace it whole."
            )
    return destination


def _occupied(path: Path) -> bool:
    """Whether `path` holds something a write would replace: a file, a link, or a non-empty folder."""
    if path.is_symlink() or path.is_file():
        return True
    return path.is_dir() and any(path.iterdir())


# --- claims -------------------------------------------------------------------------------------------------

_held: dict[tuple[int, Path], int] = {}  # (thread, destination) -> how many nested claims it holds


@contextlib.contextmanager
def claimed(destination) -> Iterator[Path]:
    """Hold `destination` for this run: a second writer (another process, or another thread here) is refused with one
    line. Leftovers of killed runs on it are cleaned first. Claims by the same thread nest."""
    destination = Path(destination).absolute()
    key = (threading.get_ident(), destination)
    if _held.get(key):
        _held[key] += 1
        try:
            yield destination
        finally:
            _held[key] -= 1
        return
    destination.parent.mkdir(parents=True, exist_ok=True)
    lock_path = destination.with_name(f".{destination.name}.lock")
    lock = FileLock(lock_path, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise OutputBusyError(
            f"another run is writing {destination}; wait for it to end, or write elsewhere"
        ) from None
    except OSError as error:  # a read-only or full folder: say which output, not which lock file
        raise type(error)(error.errno, f"{destination} cannot be written: its folder {destination.parent} refuses "
                                       f"new files ({error.strerror})") from None
    _held[key] = 1
    try:
        _clean_leftovers(destination)
        yield destination
    finally:
        del _held[key]
        # The lock file goes with the run: on Linux and macOS removed while still held (a later claim then makes a
        # new one, and filelock never locks a removed file), elsewhere by filelock when it is released.
        if isinstance(lock, UnixFileLock):
            lock_path.unlink(missing_ok=True)
        lock.release()


def _clean_leftovers(destination: Path) -> None:
    """Remove staging siblings of killed runs; put back an output a kill left aside mid-replacement."""
    for leftover in destination.parent.glob(f".{glob_escape(destination.name)}.partial-*"):
        _remove(leftover)
    for retired in destination.parent.glob(f".{glob_escape(destination.name)}.replaced-*"):
        kept = retired / destination.name
        if not destination.exists() and not destination.is_symlink() and (kept.exists() or kept.is_symlink()):
            os.replace(kept, destination)
        _remove(retired)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- putting an output in place ------------------------------------------------------------------------------

# Errors of a write for want of room: the disk or quota is full, or a file grew past the size allowed.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# How libraries that write with their own code say so: the system's words (Rust's `os error 28` in safetensors'),
# Rust's kinds, and torch's archive writer, which says only that a write failed.
_FULL_IN_WORDS = re.compile("|".join([*(re.escape(os.strerror(code)) for code in sorted(_FULL)),
                                      *(rf"os error {code}\b" for code in sorted(_FULL)),
                                      "StorageFull", "FileTooLarge", "QuotaExceeded", "file write failed"]))


class NoRoomError(OSError):
    """A write that failed for want of room, named: the output (or checkpoint) it was for and the file system."""


def no_room(error: BaseException) -> str | None:
    """The reason, in the system's words, when `error` (or what it wraps: its causes, a distributed checkpoint's
    failures) is a write that failed for want of room; None otherwise."""
    seen = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return current.strerror or os.strerror(current.errno)
        found = _FULL_IN_WORDS.search(str(current))
        if found:
            return found.group(0)
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
        pending += [current.__cause__, current.__context__]
    return None


def disk_of(path) -> str:
    """The file system that holds `path` (or would: its nearest existing folder), in words: its mount point and the
    room left on it."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    mount = folder
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return f"the file system at {mount}"
    return f"the file system at {mount} ({_size(free)} free)"


def _size(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:,} {unit}" if unit == "bytes" else f"{count:,.1f} {unit}"
        count /= 1024


@contextlib.contextmanager
def naming(destination) -> Iterator[None]:
    """A write that fails for want of room while writing `destination` (in the block) is an `OSError` naming the
    destination and the disk: the system's error names no file, or a staging file; libraries wrap it in their own
    (`no_room` finds it there)."""
    try:
        yield
    except NoRoomError:  # named already, by a writer inside (a checkpoint of the run that makes the output)
        raise
    except Exception as error:
        reason = no_room(error)
        if reason is None:
            raise
        code = next((e.errno for e in (error, error.__cause__, error.__context__)
                     if isinstance(e, OSError) and e.errno in _FULL), errno.ENOSPC)
        raise NoRoomError(code, f"{destination} could not be written ({reason}): no room on {disk_of(destination)}"
                          ) from error

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one rename (Linux `renameat2`); False where the system or file system cannot."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), str(second))


def _put_in_place(staging: Path, destination: Path, overwrite: bool) -> None:
    """Move `staging` to `destination`, replacing what is there only with `overwrite` (checked now, not only when
    the run started); the old output is removed once the new one is in place."""
    if _occupied(destination) and not overwrite:
        raise FileExistsError(
            f"{destination} appeared while this run was writing it; it was left as it is and nothing was written. "
            "Pass --overwrite (overwrite=True) to replace it."
        )
    if not (destination.exists() or destination.is_symlink()):
        os.replace(staging, destination)
        return
    if not destination.is_symlink() and destination.is_dir() == staging.is_dir():  # as an ordinary rewrite: its mode
        os.chmod(staging, stat.S_IMODE(destination.stat().st_mode))
    if staging.is_dir() and destination.is_dir() and not destination.is_symlink() and _exchange(staging, destination):
        _remove(staging)  # now the old output
        return
    # Two renames: a kill between them leaves the old output aside, where the next claim puts it back.
    retired = _new_sibling(destination, "replaced", folder=True)
    os.replace(destination, retired / destination.name)
    os.replace(staging, destination)
    _remove(retired)


def _new_sibling(destination: Path, kind: str, folder: bool) -> Path:
    """A new hidden sibling `.<name>.<kind>-<random>` of `destination`: an empty folder, or an empty file, made with
    the permissions an ordinary write gives (the umask's), unlike `tempfile`'s private ones."""
    while True:
        path = destination.with_name(f".{destination.name}.{kind}-{uuid.uuid4().hex[:12]}")
        try:
            if folder:
                path.mkdir()
            else:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return path
        except FileExistsError:
            continue


def _give_ordinary_modes(paths, allowed: int) -> None:
    """Give `paths` the permissions an ordinary write gives, `allowed` being 0o777 less the umask (as a folder
    `_new_sibling` made shows it): libraries write some files private (safetensors' `save_file` gives 0600 whatever
    the umask), and a colleague could not load the model. Executable files stay executable."""
    for path in paths:
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        wanted = allowed if path.is_dir() or mode & 0o111 else allowed & 0o666
        if mode != wanted:
            os.chmod(path, wanted)


@contextlib.contextmanager
def _sibling_folder(destination: Path) -> Iterator[Path]:
    """Claim `destination` and yield an empty temporary sibling folder, removed on the way out."""
    with claimed(destination), naming(destination):
        staging = _new_sibling(destination, "partial", folder=True)
        try:
            yield staging
        finally:
            _remove(staging)  # nothing left after a success (moved into place), a failure or an interrupt


@contextlib.contextmanager
def staged_folder(destination, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling folder; on success it takes the place of `destination` whole (created if
    absent; an existing or meanwhile-appeared one is replaced only with `overwrite`). What was written there gets
    the permissions of an ordinary write (the umask's)."""
    destination = Path(destination)
    with _sibling_folder(destination) as staging:
        yield staging
        _give_ordinary_modes(staging.rglob("*"), stat.S_IMODE(staging.stat().st_mode))
        _put_in_place(staging, destination, overwrite)


@contextlib.contextmanager
def staged_file(destination, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling file path; on success it replaces `destination` atomically (an existing or
    meanwhile-appeared file only with `overwrite`)."""
    destination = Path(destination)
    with claimed(destination), naming(destination):
        staging = _new_sibling(destination, "partial", folder=False)
        ordinary = stat.S_IMODE(staging.stat().st_mode)  # 0o666 less the umask
        try:
            yield staging
            _give_ordinary_modes([staging], ordinary | (ordinary & 0o444) >> 2)
            _put_in_place(staging, destination, overwrite)
        finally:
            staging.unlink(missing_ok=True)


# Weight files a model save writes, and so may drop from an earlier save (as transformers' own save does).
SAVED_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)|(model\.safetensors|pytorch_model\.bin)\.index\.json")


@contextlib.contextmanager
def staged_files_into(destination) -> Iterator[Path]:
    """Yield a temporary sibling folder for a save into `destination`; on success `destination` becomes those
    files plus everything else it held (hard links: nothing is copied), swapped in at once. Weight files of an
    earlier save that the new one does not have are dropped, nothing else."""
    destination = Path(destination)
    with _sibling_folder(destination) as staging:
        yield staging
        # Before the old files are linked in: theirs stay as they are.
        _give_ordinary_modes(staging.rglob("*"), stat.S_IMODE(staging.stat().st_mode))
        written = {path.name for path in staging.iterdir()}
        drops_weights = any(SAVED_WEIGHTS.fullmatch(name) for name in written)
        if destination.is_dir():
            for old in destination.iterdir():
                if old.name not in written and not (drops_weights and SAVED_WEIGHTS.fullmatch(old.name)):
                    _link_into(old, staging / old.name)
        _put_in_place(staging, destination, overwrite=True)


def _link_into(source: Path, target: Path) -> None:
    """`source` at `target` without copying data: links as links, files hard-linked, folders rebuilt of links."""
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    elif source.is_dir():
        shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, target)


def _link_or_copy(source, target) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)


def write_text_atomically(destination, text: str, overwrite: bool = True) -> None:
    """Write `text` (UTF-8) to `destination` through a temporary sibling: never half-written, never through a link."""
    with staged_file(destination, overwrite=overwrite) as staging:
        staging.write_text(text, encoding="utf-8")


__all__ = [
    "NoRoomError",
    "OutputBusyError",
    "check_destination",
    "claimed",
    "naming",
    "staged_file",
    "staged_files_into",
    "staged_folder",
    "write_text_atomically",
]
