"""Mutation check: plant each bug of `mutations.py` in a copy of the repository and run the tests meant to catch it.

    python tests/mutations/run.py              # every mutation (`make mutations`)
    python tests/mutations/run.py -k kernel    # those whose name contains "kernel"
    python tests/mutations/run.py --list

First the selected tests run on the unchanged copy (they must pass, or a "caught" bug would mean
nothing); then each mutation is applied alone, its tests run with `-x`, and the file is restored. A
mutation is caught when a test fails (or the run exceeds `--timeout`); it survives when they all
pass. A mutation of code that runs only on some kinds of CPU (`Mutation.cpu`: AMX, or AVX512-BF16 without it) is
planted only on such a CPU; elsewhere it behaves like the original, so the run lists it as left for
another CPU instead. Prints one line per mutation, a summary, and writes the report to
`tests/mutations/last-run.txt`. Exit status: 0 when every mutation planted was caught, 1 otherwise.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutations import MUTATIONS

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.machine import cpu_flags, machine_kind  # noqa: E402
REPORT = Path(__file__).with_name("last-run.txt")
IGNORED = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "demo-output")


def run_tests(copy: Path, tests: list[str], timeout: float, environment: dict) -> tuple[str, str, float]:
    """Run pytest on `tests` inside `copy`: ("passed" | "failed" | "timeout" | "error", detail, seconds)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=copy, env=environment, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout:.0f} s", time.monotonic() - started
    seconds = time.monotonic() - started
    if done.returncode == 0:
        return "passed", "", seconds
    failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.MULTILINE)
    if done.returncode == 1 and failed:
        return "failed", failed[0], seconds
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return "error", f"pytest exited {done.returncode}: " + " | ".join(tail), seconds


def left_for_another_cpu(mutations, kind: str) -> list:
    """The mutations not planted on a CPU of `kind` (`benchmarks.machine.machine_kind`): those of code it never runs."""
    return [mutation for mutation in mutations if mutation.cpu and kind not in mutation.cpu]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="keyword", default="", help="only mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per test run (default 1800)")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if args.keyword.lower() in m.name.lower()]
    if args.list:
        for mutation in selected:
            print(f"{mutation.file}: {mutation.name}")
        return 0
    if not selected:
        print(f"No mutation name contains {args.keyword!r}.", file=sys.stderr)
        return 1
    kind = machine_kind({"flags": cpu_flags()})
    elsewhere = left_for_another_cpu(selected, kind)
    selected = [m for m in selected if m not in elsewhere]

    with tempfile.TemporaryDirectory(prefix="nezha-mutations-") as scratch:
        copy = Path(scratch) / "repo"
        shutil.copytree(REPO, copy, ignore=IGNORED)
        environment = {
            **os.environ,
            "PYTHONPATH": str(copy),  # the copy's nezha_hf, in pytest and in every subprocess it starts
            "TORCH_EXTENSIONS_DIR": str(Path(scratch) / "torch_extensions"),  # mutated kernels never reach your cache
            "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch) / "inductor"),
        }
        for mutation in selected:  # a stale entry is an error, not a silent skip
            count = (copy / mutation.file).read_text(encoding="utf-8").count(mutation.original)
            if count != 1:
                print(f"{mutation.name}: its original text occurs {count} times in {mutation.file}", file=sys.stderr)
                return 1

        baseline = {}
        for tests in dict.fromkeys(tuple(m.tests) for m in selected):
            outcome, detail, seconds = run_tests(copy, list(tests), args.timeout, environment)
            print(f"baseline {outcome:7} {seconds:6.0f} s  {' '.join(tests)} {detail}", flush=True)
            baseline[tests] = outcome
        if any(outcome != "passed" for outcome in baseline.values()):
            print("The tests fail without any mutation: fix them first.", file=sys.stderr)
            return 1

        lines, survivors = [], []
        for mutation in selected:
            path = copy / mutation.file
            original = path.read_text(encoding="utf-8")
            path.write_text(original.replace(mutation.original, mutation.mutant), encoding="utf-8")
            try:
                outcome, detail, seconds = run_tests(copy, mutation.tests, args.timeout, environment)
            finally:
                path.write_text(original, encoding="utf-8")
            verdict = {"failed": "caught", "timeout": "caught", "passed": "SURVIVED"}.get(outcome, "ERROR")
            if verdict != "caught":
                survivors.append(mutation.name)
            line = f"{verdict:8} {seconds:6.0f} s  {mutation.name}  [{mutation.file}]  {detail}"
            print(line, flush=True)
            lines.append(line)

    for mutation in elsewhere:
        line = f"{'other CPU':8} {0:6} s  {mutation.name}  [{mutation.file}]  needs a CPU of kind {' or '.join(mutation.cpu)}"
        print(line)
        lines.append(line)
    summary = (f"{len(selected)} mutations, {len(selected) - len(survivors)} caught, {len(survivors)} not caught"
               + (": " + "; ".join(survivors) if survivors else "")
               + (f"; {len(elsewhere)} left for another CPU (this one is of kind {kind})" if elsewhere else ""))
    print(summary)
    if not args.keyword:
        REPORT.write_text(f"# python tests/mutations/run.py, {time.strftime('%Y-%m-%d')}\n" + "\n".join(lines)
                          + f"\n{summary}\n", encoding="utf-8")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
