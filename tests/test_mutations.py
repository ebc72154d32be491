"""The planted bugs of `make mutations` still point at the code: each one's text occurs exactly once in its file."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mutations"))
from mutations import MUTATIONS, Mutation  # noqa: E402
from run import left_for_another_cpu  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda mutation: mutation.name)
def test_each_mutation_applies_to_the_code_as_it_is(mutation):
    text = (REPO / mutation.file).read_text(encoding="utf-8")
    assert text.count(mutation.original) == 1, f"{mutation.file} holds {text.count(mutation.original)} copies"
    for path in mutation.tests:
        if path.startswith("tests/"):
            assert (REPO / path.split("::")[0]).exists(), path
    from benchmarks.machine import KINDS

    assert set(mutation.cpu) <= set(KINDS), f"unknown kind of CPU in {mutation.cpu!r}"


def test_a_mutation_of_code_that_only_some_cpus_run_waits_for_such_a_cpu():
    """On a CPU that does not run the mutated code the mutant behaves like the original and would "survive": the run
    leaves it for another CPU instead (`Mutation.cpu`), and plants it where the CPU has the flags."""
    from benchmarks.machine import machine_kind

    amx, pairs, packed, anywhere = (Mutation(name, "f", "a", "b", cpu=cpu) for name, cpu in (
        ("amx", ("amx",)), ("pairs", ("avx512-bf16",)), ("packed", ("amx", "avx512-bf16")), ("anywhere", ())))
    mutations = [amx, pairs, packed, anywhere]

    def planted(flags):
        left = left_for_another_cpu(mutations, machine_kind({"flags": flags}))
        return {mutation.name for mutation in mutations if mutation not in left}

    assert planted(["amx_bf16", "avx512_bf16"]) == {"amx", "packed", "anywhere"}
    assert planted(["avx512_bf16", "avx512_fp16"]) == {"pairs", "packed", "anywhere"}
    assert planted([]) == planted(["avx512_fp16"]) == {"anywhere"}
