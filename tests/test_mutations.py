"""The planted bugs of `make mutations` still point at the code: each one's text occurs exactly once in its file."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mutations"))
from mutations import MUTATIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda mutation: mutation.name)
def test_each_mutation_applies_to_the_code_as_it_is(mutation):
    text = (REPO / mutation.file).read_text(encoding="utf-8")
    assert text.count(mutation.original) == 1, f"{mutation.file} holds {text.count(mutation.original)} copies"
    for path in mutation.tests:
        if path.startswith("tests/"):
            assert (REPO / path.split("::")[0]).exists(), path
