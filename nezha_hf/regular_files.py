"""Opening a file nezha_hf reads: a regular file only, and every failure one line naming it.

Every reader (`json_files`, `readers`, `documents`) opens what it reads through `open_regular_file`: a FIFO would hang
a reader for ever and a device never end, a folder is no file, and an unreadable file is named with the system's
reason. Imports nothing of nezha_hf, so that every reader, remote code's included, can use it.
"""

import os
import stat
from pathlib import Path


class UnusableFile(ValueError):
    """A file that cannot be used: the message names it and says why, in one line."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def kind_of(mode: int) -> str:
    """What a file of `mode` (`os.stat`'s `st_mode`) is, in words: "a FIFO", "a device", "a folder", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a folder" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "no regular file")


def open_regular_file(path):
    """`path` opened for reading in binary if it is a regular file: a `FileNotFoundError` naming it if it is missing,
    an `UnusableFile` if it is a FIFO, a device, a folder, or cannot be read (the system's reason). A FIFO is opened
    without waiting for a writer, and refused."""
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing.") from None
    except OSError as error:
        raise UnusableFile(path, f"cannot be read ({error.strerror or type(error).__name__})") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise UnusableFile(path, f"is {kind_of(mode)}, not a regular file")
    return open(descriptor, "rb")


__all__ = ["UnusableFile", "kind_of", "open_regular_file"]
