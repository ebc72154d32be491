"""One reader for every JSON file nezha_hf reads: bounded, checked against a schema, its failures one line.

A JSON file in a model folder, a checkpoint or a journal comes from whoever made it. `read_json` reads one as
data, never trusting its shape: the file must be a regular file of at most `max_bytes` (no FIFO to hang on, no
gigabytes to load), UTF-8, nested at most `max_depth` brackets deep (checked before the standard library's `json`
parses it, whose recursion 10 KB of brackets exhausts), with no key given twice; then `schema` checks its types,
ranges and required keys. Every failure is a `JSONFileError` (a `ValueError`), one line naming the file and the
field: `trainer_state.json: global_step: must be a whole number, got "4"`. `parse_json` does the same for one JSON
text (a JSONL line). Callers get back values of the types the schema promises.

A schema is built from `Integer`, `Number`, `String`, `Boolean`, `Anything`, `Nullable`, `ListOf` and `Object`.
"""

import json
import math
import os
import re
from pathlib import Path

from .regular_files import UnusableFile, open_regular_file

MAX_BYTES = 16 << 20  # configs, records and states are kilobytes; a trainer state with a long log a few megabytes
MAX_DEPTH = 64  # the deepest file nezha_hf reads nests 4 levels


class JSONFileError(ValueError):
    """A JSON file (or text) that cannot be used: the message names the file, the field when there is one, and why."""

    def __init__(self, where, reason: str, field: str | None = None):
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")
        self.where, self.field, self.reason = str(where), field, reason


class _Invalid(Exception):
    """A schema check failed at `field`."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field, self.reason = field, reason


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, (dict, list)) else type(value).__name__
    text = {"dict": "an object", "list": "a list"}.get(text, text)
    return text if len(text) <= 40 else text[:37] + "..."


class Schema:
    """What a JSON value must be; `check(value, field)` returns it, or raises `_Invalid` naming the field."""

    def check(self, value, field: str):
        raise NotImplementedError


class Anything(Schema):
    def check(self, value, field):
        return value


class Boolean(Schema):
    def check(self, value, field):
        if not isinstance(value, bool):
            raise _Invalid(field, f"must be true or false, got {_shown(value)}")
        return value


class Number(Schema):
    """A finite number (whole numbers included) in [`minimum`, `maximum`]."""

    kind = "a number"

    def __init__(self, minimum=None, maximum=None):
        self.minimum, self.maximum = minimum, maximum

    def accepts(self, value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def check(self, value, field):
        if not self.accepts(value):
            raise _Invalid(field, f"must be {self.kind}, got {_shown(value)}")
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            low = "" if self.minimum is None else f" from {self.minimum:,}"
            high = "" if self.maximum is None else f" up to {self.maximum:,}"
            raise _Invalid(field, f"must be {self.kind}{low}{high}, got {_shown(value)}")
        return value


class Integer(Number):
    """A whole number (not a boolean) in [`minimum`, `maximum`]."""

    kind = "a whole number"

    def accepts(self, value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)


class String(Schema):
    """A string, of at most `max_length` characters, matching `pattern` (whole) when one is given."""

    def __init__(self, max_length: int = 4096, pattern: str | None = None):
        self.max_length, self.pattern = max_length, re.compile(pattern) if pattern else None

    def check(self, value, field):
        if not isinstance(value, str):
            raise _Invalid(field, f"must be a string, got {_shown(value)}")
        if len(value) > self.max_length:
            raise _Invalid(field, f"must be a string of at most {self.max_length:,} characters, got {len(value):,}")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise _Invalid(field, f"must match {self.pattern.pattern}, got {_shown(value)}")
        return value


class Nullable(Schema):
    """`null`, or what `schema` accepts."""

    def __init__(self, schema: Schema):
        self.schema = schema

    def check(self, value, field):
        return None if value is None else self.schema.check(value, field)


class ListOf(Schema):
    """A list of at most `max_items` values, each what `item` accepts."""

    def __init__(self, item: Schema, max_items: int | None = None):
        self.item, self.max_items = item, max_items

    def check(self, value, field):
        if not isinstance(value, list):
            raise _Invalid(field, f"must be a list, got {_shown(value)}")
        if self.max_items is not None and len(value) > self.max_items:
            raise _Invalid(field, f"must hold at most {self.max_items:,} items, got {len(value):,}")
        return [self.item.check(item, f"{field}[{number}]") for number, item in enumerate(value)]


class Object(Schema):
    """A JSON object with the keys `fields` names (each checked by its schema; those in `required` must be there);
    other keys are refused unless `others` is a schema for their values."""

    def __init__(self, fields: dict[str, Schema], required=(), others: Schema | None = None):
        self.fields, self.required, self.others = fields, tuple(required), others

    def check(self, value, field):
        if not isinstance(value, dict):
            raise _Invalid(field, f"must be a JSON object, got {_shown(value)}")
        prefix = f"{field}." if field else ""
        unknown = next((key for key in value if key not in self.fields), None) if self.others is None else None
        if unknown is not None:
            raise _Invalid(prefix + unknown, f"is not a key this file has (it has {', '.join(self.fields)})")
        missing = [key for key in self.required if key not in value]
        if missing:
            raise _Invalid(prefix + missing[0], "is missing")
        return {key: self.fields.get(key, self.others).check(item, prefix + key) for key, item in value.items()}


JSON_OBJECT = Object({}, others=Anything())  # any JSON object: a file whose keys its reader checks itself

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """How deeply `text` (JSON) nests brackets, strings left out; counted without recursion."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


class RepeatedKey(ValueError):
    """A JSON object that gives one key twice."""


def _object_with_distinct_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object as a dict; a `RepeatedKey` if it gives a key twice (`json.loads` alone keeps the last value)."""
    record = dict(pairs)
    if len(record) < len(pairs):
        repeated = sorted({key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1})
        raise RepeatedKey(f"a JSON object gives the key{'s' if len(repeated) > 1 else ''} "
                          f"{', '.join(map(repr, repeated))} twice")
    return record


def parse_json(text: str, where, schema: Schema | None = None, max_depth: int = MAX_DEPTH):
    """The JSON value of `text`, checked by `schema`; a `JSONFileError` naming `where` (a file, or `file:line`) and
    the field otherwise: not JSON, nested deeper than `max_depth`, a key given twice, or not what `schema` says."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONFileError(where, f"nests {depth:,} levels deep, more than the {max_depth} accepted: it is not a file "
                                   "nezha-hf wrote")
    try:
        value = json.loads(text, object_pairs_hook=_object_with_distinct_keys)
    except json.JSONDecodeError as error:
        raise JSONFileError(where, f"not valid JSON ({error.msg}: line {error.lineno} column {error.colno})") from None
    except (RepeatedKey, RecursionError) as error:
        raise JSONFileError(where, str(error) or "nested too deeply") from None
    return value if schema is None else checked(value, schema, where)


def checked(value, schema: Schema, where):
    """`value` (parsed JSON) as `schema` accepts it; a `JSONFileError` naming `where` and the field otherwise."""
    try:
        return schema.check(value, "")
    except _Invalid as error:
        raise JSONFileError(where, error.reason, error.field or None) from None


def read_json(path, schema: Schema | None = None, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """The JSON file `path`, checked (see the module's docstring); a `FileNotFoundError` if there is none, a
    `JSONFileError` naming the file (and the field) for anything else."""
    path = Path(path)
    try:
        file = open_regular_file(path)
    except UnusableFile as error:
        raise JSONFileError(path, error.reason) from None
    with file:
        status = os.fstat(file.fileno())
        if status.st_size > max_bytes:
            raise JSONFileError(path, f"holds {status.st_size:,} bytes, more than the {max_bytes:,} accepted")
        try:
            data = file.read(max_bytes + 1)
        except OSError as error:
            raise JSONFileError(path, f"cannot be read ({error.strerror or type(error).__name__})") from None
    if len(data) > max_bytes:
        raise JSONFileError(path, f"holds more than the {max_bytes:,} bytes accepted")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise JSONFileError(path, f"not UTF-8 text (byte 0x{data[error.start]:02x} at {error.start})") from None
    return parse_json(text, path, schema, max_depth)


__all__ = ["JSON_OBJECT", "Anything", "Boolean", "Integer", "JSONFileError", "ListOf", "Nullable", "Number", "Object", "RepeatedKey",
           "String", "checked", "nesting_depth", "parse_json", "read_json"]
