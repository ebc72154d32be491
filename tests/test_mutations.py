"""The planted bugs of `make mutations` still point at the code: each one's text occurs exactly once in its file."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mutations"))
from mutations import CPU_KINDS, MUTATIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda mutation: mutation.name)
def test_each_mutation_applies_to_the_code_as_it_is(mutation):
    text = (REPO / mutation.file).read_text(encoding="utf-8")
    assert text.count(mutation.original) == 1, f"{mutation.file} holds {text.count(mutation.original)} copies"
    for path in mutation.tests:
        if path.startswith("tests/"):
            assert (REPO / path.split("::")[0]).exists(), path
    assert not mutation.cpu or mutation.cpu in CPU_KINDS, f"unknown kind of CPU {mutation.cpu!r}"


def test_a_mutation_of_code_that_only_some_cpus_run_waits_for_such_a_cpu():
    """On a CPU that does not run the mutated code the mutant behaves like the original and would "survive": the run
    leaves it for another CPU instead (`Mutation.cpu`), and plants it where the CPU has the flags."""
    amx, pairs, packed = (CPU_KINDS[kind] for kind in ("AMX", "AVX512-BF16 without AMX", "AMX or AVX512-BF16"))
    assert amx({"amx_bf16", "avx512_bf16"}) and not amx({"avx512_bf16"})
    assert pairs({"avx512_bf16", "avx512_fp16"}) and not pairs({"amx_bf16", "avx512_bf16"}) and not pairs(set())
    assert packed({"amx_bf16"}) and packed({"avx512_bf16"}) and not packed({"avx512_fp16"})
