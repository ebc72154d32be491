"""Read plain-text corpora: `.txt` files, folders of them, and JSONL files with a `text` field.

Files are decoded a line at a time (a byte-order mark at the start is dropped). Lines that are not UTF-8, and
malformed JSONL lines, are reported once with file and line number (in the `problems` list the caller passes, which
the caller reports; else a logged warning) and skipped; reading goes on.
"""

import functools
import json
import logging as std_logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import logging

logger = logging.get_logger(__name__)

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
TXT_SPLITS = ("file", "blank-lines", "lines")


@functools.cache
def _jieba():
    """jieba, imported on first use (it loads its dictionary then), without its dictionary-loading messages."""
    import jieba

    jieba.setLogLevel(std_logging.WARNING)
    return jieba


def jieba_words(text: str) -> Iterator[str]:
    """The words jieba finds in `text` (Chinese word segmentation), in order; joined, they give `text` back."""
    return _jieba().cut(text)


@dataclass
class Document:
    """One document: an identifier (`file` or `file:line` or the JSON `id`) and its text."""

    id: str
    text: str


@dataclass
class Problem:
    """An input line that could not be used, and why."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def expand_paths(paths) -> list[Path]:
    """Files named directly, plus the `.txt` / `.jsonl` / `.json` files inside named folders (sorted), in the order
    given."""
    return [path for path, _ in named_files(paths)]


def named_files(paths) -> list[tuple[Path, str]]:
    """`expand_paths` with each file's name as an input: its path below the folder it was found in, without the
    suffix (`2019/001` for `judgments/2019/001.txt` found in `judgments/`), or its stem when named directly."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
            files += [(p, p.relative_to(path).with_suffix("").as_posix()) for p in found]
        elif path.exists():
            files.append((path, path.stem))
        else:
            raise FileNotFoundError(f"No such file or folder: {path}")
    return files


def report_problem(problems: list | None, path, line: int, message: str) -> None:
    """A skipped input line: added to `problems` when the caller collects them (and reports them), else logged."""
    problem = Problem(str(path), line, message)
    if problems is not None:
        problems.append(problem)
    else:
        logger.warning(f"skipped {problem}")


def iter_lines(path: Path, problems: list | None = None) -> Iterator[tuple[int, str]]:
    """`(line_number, text)` for each line of a UTF-8 file, decoded one line at a time: a line with bytes that
    are not UTF-8 is reported (`file:line`) and skipped, and reading goes on."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                report_problem(problems, path, number, f"not UTF-8 text ({error.reason} at byte {error.start})")


def iter_jsonl(path: Path, problems: list | None = None) -> Iterator[tuple[int, dict]]:
    """`(line_number, object)` for each well-formed JSON object line; bad lines are reported and skipped."""
    for number, line in iter_lines(path, problems):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            report_problem(problems, path, number, f"not valid JSON ({error.msg})")
            continue
        if not isinstance(record, dict):
            report_problem(problems, path, number, "not a JSON object")
            continue
        yield number, record


def record_id(record: dict, path, number: int) -> str:
    """A JSONL record's `id` as a string; `file:line` when it has none (or `null`)."""
    identifier = record.get("id")
    return f"{path}:{number}" if identifier is None else str(identifier)


def read_documents(paths, txt_split: str = "file", problems: list | None = None) -> Iterator[Document]:
    """Documents from `.txt` files (whole file, or split on blank lines or on lines) and JSONL `text` fields.

    Args:
        paths: files and folders.
        txt_split: `"file"` (a `.txt` file is one document), `"blank-lines"` or `"lines"`.
        problems: a list that receives a `Problem` for every skipped line.
    """
    if txt_split not in TXT_SPLITS:
        raise ValueError(f"txt_split must be one of {TXT_SPLITS}, got {txt_split!r}.")
    for path in expand_paths(paths):
        if path.suffix in JSONL_SUFFIXES:
            for number, record in iter_jsonl(path, problems):
                text = record.get("text")
                if not isinstance(text, str) or not text.strip():
                    report_problem(problems, path, number, 'no non-empty "text" string')
                    continue
                yield Document(record_id(record, path, number), text)
            continue
        content = "".join(line for _, line in iter_lines(path, problems))
        if txt_split == "file":
            pieces = [content]
        else:
            pieces = re.split(r"\n\s*\n" if txt_split == "blank-lines" else r"\n", content)
        for number, piece in enumerate(pieces, start=1):
            if piece.strip():
                yield Document(str(path) if txt_split == "file" else f"{path}#{number}", piece.strip())
