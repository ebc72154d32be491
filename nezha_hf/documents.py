"""Read plain-text corpora: `.txt` files, folders of them, and JSONL files with a `text` field.

A file is read as a file: its encoding is decided once, from the whole file (`read_text`), and a file that cannot
be decoded is refused whole, never read in part. A file named directly that cannot be used is an `InputFileError`;
one found in a folder is reported (a `Problem` without a line) and left out, and reading goes on. Malformed JSONL
lines are reported with file and line number and skipped. Problems go to the `problems` list the caller passes
(which the caller reports), else to a logged warning.
"""

import codecs
import functools
import logging as std_logging
import os
import stat
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import logging

from .json_files import JSONFileError, parse_json

logger = logging.get_logger(__name__)

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
TXT_SPLITS = ("file", "blank-lines", "lines")

# Byte-order marks, longest first (UTF-32-LE's begins with UTF-16-LE's), with the codec that reads a file that
# starts with one (and drops the mark) and the encoding's name.
BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32", "UTF-32-LE"), (codecs.BOM_UTF32_BE, "utf-32", "UTF-32-BE"),
                    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"), (codecs.BOM_UTF16_LE, "utf-16", "UTF-16-LE"),
                    (codecs.BOM_UTF16_BE, "utf-16", "UTF-16-BE"))


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
    """An input line that could not be used, or (`line` None) a whole file left out, and why."""

    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.line is None else f"{self.path}:{self.line}: {self.message}"


class InputFileError(ValueError):
    """A file that cannot be used as a whole (its encoding, its kind, no text in it); the message names it."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


@dataclass
class InputFile:
    """A file to read: its path, its name as an input (`2019/001` for `judgments/2019/001.txt` found in
    `judgments/`; its stem when named directly), and whether the user named it directly."""

    path: Path
    name: str
    named: bool


def is_blank(text: str) -> bool:
    """Whether `text` holds nothing but white space (full-width spaces and line breaks included)."""
    return not text.strip()


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def input_files(paths, problems: list | None = None) -> list[InputFile]:
    """The files `paths` name, in the order given: files named directly (of any kind: `read_documents` and
    `read_judgments` refuse kinds they do not read), and the `.txt` / `.jsonl` / `.json` files below named folders
    (suffixes in any case; sorted).

    Walking a folder leaves out hidden files and folders (`.DS_Store`, `.git/`, `._*` files, editor swap files) and
    does not follow symbolic links: one to a file or folder inside the folder is read where its target lies; one
    that points outside it, or nowhere, is reported (a `Problem` without a line) and left out, as a folder from
    elsewhere could otherwise make its reader take in any file on the machine. Name such a file directly to read it.
    """
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += [InputFile(found, found.relative_to(path).with_suffix("").as_posix(), named=False)
                      for found in _walk(path, problems)]
        elif path.exists():
            files.append(InputFile(path, path.stem, named=True))
        else:
            raise FileNotFoundError(f"No such file or folder: {path}")
    return files


def _walk(folder: Path, problems: list | None) -> list[Path]:
    """The input files below `folder`, sorted: see `input_files`."""
    root, found = folder.resolve(), []
    for directory, subfolders, names in os.walk(folder):  # goes into no linked folder
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        here = Path(directory)
        for name in subfolders:
            if (here / name).is_symlink():
                _link_out(here / name, root, folder, problems)
        for name in names:
            path = here / name
            if name.startswith(".") or _suffix(path) not in TEXT_SUFFIXES + JSONL_SUFFIXES:
                continue
            if path.is_symlink():
                _link_out(path, root, folder, problems)
            elif path.is_file():
                found.append(path)
            else:  # a pipe or a device: reading it could wait, or run, for ever
                report_problem(problems, path, None, "not a regular file: left out")
    return sorted(found)


def _link_out(link: Path, root: Path, folder: Path, problems: list | None) -> None:
    """Report the link `link` if it points out of the folder `folder` (resolved: `root`), or nowhere."""
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):  # nothing there, or a loop of links
        report_problem(problems, link, None, "a broken link: left out")
        return
    if not target.is_relative_to(root):
        report_problem(problems, link, None, f"a link to {target}, outside {folder}: not followed (name it directly "
                                             "to read it)")


def report_problem(problems: list | None, path, line: int | None, message: str) -> None:
    """A skipped input line (or file, `line` None): added to `problems` when the caller collects them (and reports
    them), else logged."""
    problem = Problem(str(path), line, message)
    if problems is not None:
        problems.append(problem)
    else:
        logger.warning(f"skipped {problem}")


def refused_files(problems: list) -> list[Problem]:
    """The problems in `problems` that left a whole file out."""
    return [problem for problem in problems if problem.line is None]


def read_text(path, encoding: str | None = None) -> str:
    """The text of the file `path`, decoded as a whole, on one decision about its encoding:

    1. a byte-order mark says it (UTF-8, UTF-16 or UTF-32, either byte order);
    2. else a file with NUL bytes is UTF-16 if it decodes as such in the byte order its NULs point to (ASCII
       characters, line breaks among them, have their NUL on one side) and does not decode as UTF-8: bytes that are
       both (UTF-8 text with a stray NUL, UTF-16 of ASCII alone) are refused, as either reading may be the wrong one;
    3. else it is UTF-8 if it decodes as UTF-8;
    4. else it is `encoding` if one is given and it decodes as that (`gb18030` reads GBK and GB2312 too).

    Nothing is guessed beyond that: GB18030 decodes almost any bytes, so a file in another encoding would be read as
    wrong characters without a word. Anything else is an `InputFileError` naming the file, and where in it the
    decoding failed. A byte-order mark is not part of the text.
    """
    data = _input_bytes(Path(path))
    for mark, codec, name in BYTE_ORDER_MARKS:
        if data.startswith(mark):
            return _decode(path, data, codec, f"its byte-order mark says {name}, but it is not {name} text")
    if b"\x00" in data:
        if _reads_as(data, "utf-8"):  # UTF-8 with NULs, or UTF-16 of ASCII alone: which, the bytes cannot say
            raise InputFileError(path, "holds NUL bytes but reads as UTF-8 too, so its encoding is not certain: save it "
                                       "as UTF-8 without NUL bytes, or as UTF-16 with a byte-order mark")
        at_odd = data[1::2].count(0)
        codec = "utf-16-le" if at_odd > data[0::2].count(0) else "utf-16-be"
        try:
            text = data.decode(codec)
        except UnicodeDecodeError:
            text = "\x00"
        if "\x00" in text:
            raise InputFileError(path, "holds NUL bytes, yet is not UTF-16 text: it is not a text file")
        return text
    if encoding is None:
        return _decode(path, data, "utf-8", "not UTF-8", "; if it is GB18030/GBK pass --encoding gb18030 (or the "
                                                          "encoding it is in)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return _decode(path, data, encoding, f"neither UTF-8 nor {encoding} (--encoding) text")


# An input file's size is bounded before it is read: text beyond it is not one judgment or one corpus file (split a
# larger corpus into files), and reading it whole would take the machine's memory.
MAX_INPUT_BYTES = 2 << 30


def _input_bytes(path: Path) -> bytes:
    """The bytes of the input file `path`, at most `MAX_INPUT_BYTES`: a regular file, or a pipe named directly (what
    a shell's `<(command)` gives); a device (whose reading never ends), a folder or a file the process may not read
    is an `InputFileError` naming it (in a folder, it is left out)."""
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                raise InputFileError(path, "is a device, not a file: its reading would never end")
            data = file.read(MAX_INPUT_BYTES + 1)
    except OSError as error:  # a folder, a file the process may not read
        raise InputFileError(path, f"cannot be read ({error.strerror or type(error).__name__})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise InputFileError(path, f"holds more than {MAX_INPUT_BYTES >> 30} GiB: split it into several files")
    return data


def _reads_as(data: bytes, codec: str) -> bool:
    try:
        data.decode(codec)
    except UnicodeDecodeError:
        return False
    return True


def read_input_text(path: Path, encoding: str | None = None) -> str:
    """The text of an input file (`read_text`); one with nothing but white space is an `InputFileError`."""
    text = read_text(path, encoding)
    if is_blank(text):
        raise InputFileError(path, "holds no text (it is empty, or only white space)")
    return text


def _decode(path, data: bytes, codec: str, failure: str, advice: str = "") -> str:
    """`data` decoded with `codec`; else an `InputFileError` saying `failure`, where (byte, line, offset), `advice`."""
    try:
        return data.decode(codec)
    except UnicodeDecodeError as error:
        line = data[: error.start].decode(codec, errors="replace").count("\n") + 1
        where = f"{error.reason}: byte 0x{data[error.start]:02x} on line {line}, at byte {error.start}"
        raise InputFileError(path, f"{failure} ({where}){advice}") from None


def iter_jsonl(path: Path, problems: list | None = None, encoding: str | None = None) -> Iterator[tuple[int, dict]]:
    """`(line_number, object)` for each well-formed JSON object line; bad lines (not JSON, nested too deeply, a key
    given twice: `json_files.parse_json`) are reported and skipped, blank ones passed over. The file is decoded whole
    first (`read_input_text`): one it cannot decode, one with no line at all, or one that is a single JSON document
    spread over several lines (a pretty-printed `.json`: none of its lines is JSON) is an `InputFileError`."""
    # Lines end at "\n" only: JSON text may hold U+2028 and the like, which `str.splitlines` would split at.
    text = read_input_text(path, encoding)
    lines = text.split("\n")
    if len([line for line in lines if not is_blank(line)]) > 1 and _is_one_document(text):
        raise InputFileError(path, "is one JSON document spread over several lines, not JSON Lines (one JSON object "
                                   "a line): write each record on a line of its own")
    for number, line in enumerate(lines, start=1):
        if is_blank(line):
            continue
        try:
            record = parse_json(line, f"{path}:{number}")
        except JSONFileError as error:
            report_problem(problems, path, number, error.reason)
            continue
        if not isinstance(record, dict):
            report_problem(problems, path, number, "not a JSON object")
            continue
        yield number, record


def _is_one_document(text: str) -> bool:
    """Whether `text` is one JSON value (an object or a list), as a pretty-printed `.json` file is."""
    if not text.lstrip().startswith(("{", "[")):
        return False
    try:
        parse_json(text, "")
    except JSONFileError:
        return False
    return True


def record_id(record: dict, path, number: int) -> str | None:
    """A JSONL record's `id` as a string; `file:line` when it has none (or `null`); None when it is neither a string
    nor an integer (the caller reports the line)."""
    identifier = record.get("id")
    if identifier is None:
        return f"{path}:{number}"
    if isinstance(identifier, bool) or not isinstance(identifier, (str, int)):
        return None
    return str(identifier)


def record_text(text) -> str:
    """The text of a JSONL record's `text` field: a string, or CAIL2020's list of `{"sentence": ...}` items (their
    sentences joined); a `ValueError` saying why there is none otherwise."""
    if isinstance(text, list):
        if not text or not all(isinstance(item, dict) and isinstance(item.get("sentence"), str) for item in text):
            raise ValueError('"text" is a list, but not of {"sentence": str} items (CAIL2020\'s form)')
        text = "".join(item["sentence"] for item in text)
    elif not isinstance(text, str):
        raise ValueError(f'"text" is {"missing" if text is None else "not a string"} (a string, or CAIL2020\'s list '
                         'of {"sentence": str} items)')
    if is_blank(text):
        raise ValueError('"text" is empty or blank')
    return text


def read_files(paths, read, problems: list | None = None) -> list:
    """`read(file)` for each file of `input_files(paths)`, in order, its results together (a list of what each
    returned). An `InputFileError` from a file named directly is raised; from a file found in a folder, it is
    reported (a `Problem` without a line) and the file left out. A file whose kind is not one of the suffixes read
    is refused the same way."""
    results = []
    for file in input_files(paths, problems):
        try:
            if _suffix(file.path) not in TEXT_SUFFIXES + JSONL_SUFFIXES:
                kinds = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES)
                raise InputFileError(file.path, f"not a kind of input read here (files ending in {kinds})")
            results += read(file)
        except InputFileError as error:
            if file.named:
                raise
            report_problem(problems, error.path, None, f"{error.reason}; the whole file is left out")
    return results


def is_jsonl(path: Path) -> bool:
    """Whether `path` is read as JSONL (by its suffix, whatever its case) rather than as text."""
    return _suffix(path) in JSONL_SUFFIXES


def read_documents(paths, txt_split: str = "file", problems: list | None = None,
                   encoding: str | None = None) -> list[Document]:
    """Documents from `.txt` files (whole file, or split on blank lines or on lines) and JSONL `text` fields (a
    string, or CAIL2020's list of sentences: `record_text`).

    Args:
        paths: files and folders (`input_files`: hidden files and links out of a folder are left out).
        txt_split: `"file"` (a `.txt` file is one document), `"blank-lines"` or `"lines"`.
        problems: a list that receives a `Problem` for every skipped line and every file left out.
        encoding: the encoding of files that are not UTF-8 or UTF-16 (`read_text`), e.g. `"gb18030"`.

    A file named directly that cannot be read (its encoding, its kind, no text in it) is an `InputFileError`.
    """
    if txt_split not in TXT_SPLITS:
        raise ValueError(f"txt_split must be one of {TXT_SPLITS}, got {txt_split!r}.")

    def read(file: InputFile) -> list[Document]:
        path = file.path
        if is_jsonl(path):
            documents = []
            for number, record in iter_jsonl(path, problems, encoding):
                identifier = record_id(record, path, number)
                try:
                    text = record_text(record.get("text"))
                except ValueError as error:
                    report_problem(problems, path, number, str(error))
                    continue
                if identifier is None:
                    report_problem(problems, path, number, '"id" is neither a string nor an integer')
                else:
                    documents.append(Document(identifier, text))
            return documents
        content = read_input_text(path, encoding)
        if txt_split == "file":
            return [Document(str(path), content.strip())]
        pieces = re.split(r"\n\s*\n" if txt_split == "blank-lines" else r"\n", content)
        return [Document(f"{path}#{number}", piece.strip()) for number, piece in enumerate(pieces, start=1)
                if not is_blank(piece)]

    return read_files(paths, read, problems)
