"""NEZHA's Triton engine checked on a GPU against the float64 formula, before anything is timed.

    python benchmarks/gpu/gpu_correctness.py             # on a CUDA GPU (part of benchmarks/gpu/gpu_check.py)
    python benchmarks/gpu/gpu_correctness.py --rehearse  # on the CPU: Triton's interpreter, tiny sizes

Each case runs the op (`nezha_hf.triton_attention.triton_attention`) on random inputs and compares its output, and
its three gradients where the case trains, with tests/reference.py's plain formula computed in float64 on the same
device, by relative error `||got - exact|| / ||exact||`:

- every mask (none, padding, causal, causal+padding, UniLM prefix) in float32, bfloat16 and float16, at a length
  whose blocks include tiles left of the band, in it and right of it (GPU: 300 tokens, K = 64, head size 64);
- decoding: 1 query, and 5 queries crossing a block edge, continuing a cache of left-padded keys;
- attention dropout: the keep mask the kernel draws is read off its output (values one-hot over a window of keys, a
  zero table), its rate must be 1 - p within 4 standard deviations and another seed must draw another mask; then the
  reference, given that mask, must give the kernel's output and gradients for the seed, which holds only if the
  backward redrew the forward's mask;
- float32 with TF32 switched on (`torch.backends.cuda.matmul.allow_tf32`): still float32-exact;
- more than 65,535 (batch x heads) programs, the limit of a CUDA grid's second axis (GPU only: 70,000).

Outputs are allocated NaN-filled (`gpu_ops.nan_filled_memory`): an element no kernel writes fails the case. The bounds
catch a wrong kernel, not a rounding: 1e-5 in float32, 3e-2 in bfloat16, 4e-3 in float16 (gradients twice that).
SDPA's own error in each dtype (no mask and causal, against SDPA in float64) is measured on the same kind of inputs
and reported beside NEZHA's: the issue's accuracy target is NEZHA's error no worse than SDPA's.

Cases run in `--workers` processes, a fresh one per case (compiling Triton's kernels for each set of switches takes
most of the time, and compiles in parallel; a kernel that faults or fails to compile spoils only its own case). Writes `gpu-correctness.md` and `.json` to `--results` (default: the machine's folder,
benchmarks/gpu/results/), rewritten as cases finish; exits 1 listing the failed cases, 2 when it cannot run at all.
"""

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.gpu_script import rehearsing, write_staged  # noqa: E402

rehearsing(sys.argv)  # before anything imports Triton

import torch  # noqa: E402

from benchmarks.gpu import gpu_ops  # noqa: E402
from benchmarks.gpu.gpu_ops import DTYPES, CheckFailed  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402

# Relative error above which a case fails: a wrong index or mask gives errors of order 1; these sit well above each
# dtype's rounding (float32 as exact as the CPU engines, whose tests hold 1e-5).
BOUNDS = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}
GRADIENT_SLACK = 2.0  # gradients sum one more product than the output


@dataclass(frozen=True)
class Sizes:
    """The sizes of every case: on a GPU, lengths over several of its blocks; rehearsing, the interpreter's few."""

    batch: int
    heads: int
    length: int
    head_size: int
    K: int
    cache: int  # keys of the decoding cases
    dropout_length: int
    many_programs: int  # batch x heads of the launch case


GPU_SIZES = Sizes(batch=2, heads=3, length=300, head_size=64, K=64, cache=1000, dropout_length=256,
                  many_programs=70_000)
REHEARSAL_SIZES = Sizes(batch=2, heads=2, length=37, head_size=16, K=4, cache=40, dropout_length=32, many_programs=6)
MASK_KINDS = ("none", "padding", "causal", "causal+padding", "unilm-prefix")
DROPOUT = 0.125  # a whole number of the kernels' 1/256 steps, so that the reference scales as they do


@dataclass(frozen=True)
class Case:
    """One check: `kind` is a mask kind, "decode", "dropout", "tf32", "many-programs" or "sdpa" (SDPA's own error)."""

    kind: str
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.dtype} {self.kind}"


@dataclass
class Outcome:
    """What a case measured: relative errors by quantity, and why it failed ("" if not)."""

    case: str
    kind: str
    dtype: str
    errors: dict = field(default_factory=dict)
    failure: str = ""
    notes: list = field(default_factory=list)
    seconds: float = 0.0


def cases() -> list[Case]:
    """Every case, the ones whose kernels the speed benchmarks also need first (bfloat16 and float16 without a mask,
    with dropout, decoding), so that a run cut short has checked those."""
    ordered = [Case(kind, dtype) for dtype in ("bfloat16", "float16") for kind in ("none", "dropout", "decode")]
    ordered += [Case(kind, dtype) for dtype in DTYPES for kind in (*MASK_KINDS, "dropout", "decode", "sdpa")]
    ordered += [Case("tf32", "float32"), Case("many-programs", "bfloat16")]
    return list(dict.fromkeys(ordered))


def compare(outcome: Outcome, got: dict, expected: dict) -> None:
    """Record each quantity's relative error and fail the case on the first over its dtype's bound (gradients: the
    bound times GRADIENT_SLACK)."""
    for name, value in got.items():
        outcome.errors[name] = gpu_ops.relative_error(value, expected[name])
    for name, error in outcome.errors.items():
        limit = BOUNDS[outcome.dtype] * (1 if name == "output" else GRADIENT_SLACK)
        if not error <= limit:  # NaN, or an unwritten (NaN-filled) element: infinite
            what = "has NaN or unwritten elements" if math.isinf(error) else f"relative error {error:.2e} > {limit:.0e}"
            outcome.failure = outcome.failure or f"{name} {what}"


def inputs_and_exact(batch, heads, queries, keys, head_size, dtype, device, train=True, seed=0):
    """Random query, key and value in `dtype` and the same values in float64: the error measured is the computation's,
    not the inputs' rounding (the table's rounding to `dtype`, which a model does too, is NEZHA's)."""
    leaves = gpu_ops.random_inputs(batch, heads, queries, keys, head_size, dtype, device, seed=seed)
    exact = [tensor.double().requires_grad_(train) for tensor in leaves]
    return [tensor.requires_grad_(train) for tensor in leaves], exact


def against_reference(outcome, sizes, device, dtype, queries, keys, mask_kind, offset=0, train=True, batch=None,
                      heads=None, dropout=0.0, seed=0, keep_from=None):
    """The op against the float64 formula on one problem; `keep_from(q, k, table, problem)` gives the keep mask the
    kernel draws (dropout cases)."""
    batch, heads = batch or sizes.batch, heads or sizes.heads
    leaves, exact = inputs_and_exact(batch, heads, queries, keys, sizes.head_size, dtype, device, train, seed)
    table = gpu_ops.relative_table(sizes.K, sizes.head_size, dtype, device)
    mask, allowed = gpu_ops.mask_case(mask_kind, batch, queries, keys, offset, device)
    problem = gpu_ops.problem_for(mask, sizes.head_size, dropout, seed=1234 + seed)
    keep = None if keep_from is None else keep_from(leaves[0].detach(), leaves[1].detach(), table, problem)
    with gpu_ops.nan_filled_memory():
        output = gpu_ops.triton_attention(*leaves, table, problem).transpose(1, 2)
    model_table = gpu_ops.relative_table(sizes.K, sizes.head_size, torch.float32, device)
    expected = gpu_ops.reference_attention(*exact, sizes.K, allowed, offset, model_table,
                                           None if keep is None else keep.double(), dropout)
    got, wanted = {"output": output}, {"output": expected}
    if train:
        grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
        grad = grad.to(device)
        with gpu_ops.nan_filled_memory():
            got.update(zip(("grad_query", "grad_key", "grad_value"),
                           torch.autograd.grad(output, leaves, grad.to(dtype))))
        wanted.update(zip(("grad_query", "grad_key", "grad_value"), torch.autograd.grad(expected, exact, grad)))
    compare(outcome, got, wanted)


def kernel_keep_mask(query, key, table, problem) -> torch.Tensor:
    """The keep mask `[batch, heads, queries, keys]` the kernel draws for `problem`'s seed, read off its output: with
    a zero table and values one-hot over a window of `head_size` keys (`v_j = e_(j - start)`), output entry `[i, m]`
    is the probability of key `start + m` times `1 / (1 - p)` where it is kept, 0 where it is dropped. (Every
    probability is positive: no mask, random scores.)"""
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    kept = torch.empty(batch, heads, queries, keys, dtype=torch.bool, device=query.device)
    for start in range(0, keys, size):
        width = min(size, keys - start)
        value = torch.zeros_like(key)
        value[:, :, start:start + width, :width] = torch.eye(width, dtype=key.dtype, device=key.device)
        output = gpu_ops.triton_attention(query, key, value, torch.zeros_like(table), problem).transpose(1, 2)
        kept[..., start:start + width] = output[..., :width] != 0
    return kept


def dropout_case(outcome, sizes, device, dtype):
    """The kernel's keep mask: its rate, another seed's mask, and the reference given it (forward and backward)."""
    masks = {}

    def keep_from(query, key, table, problem):
        masks["kept"] = kernel_keep_mask(query, key, table, problem)
        other = gpu_ops.problem_for(problem.mask, sizes.head_size, problem.dropout, seed=int(problem.seed) + 1)
        masks["other"] = kernel_keep_mask(query, key, table, other)
        return masks["kept"]

    length = sizes.dropout_length
    against_reference(outcome, sizes, device, dtype, length, length, "none", dropout=DROPOUT, keep_from=keep_from)
    rate = masks["kept"].double().mean().item()
    spread = 4 * math.sqrt(DROPOUT * (1 - DROPOUT) / masks["kept"].numel())
    outcome.notes.append(f"kept {rate:.4f} of {masks['kept'].numel():,} entries (expected {1 - DROPOUT} +- {spread:.4f})")
    if abs(rate - (1 - DROPOUT)) > spread:
        outcome.failure = outcome.failure or f"keep rate {rate:.4f} is not 1 - p = {1 - DROPOUT} within {spread:.4f}"
    if torch.equal(masks["kept"], masks["other"]):
        outcome.failure = outcome.failure or "two seeds drew the same keep mask"


def sdpa_case(outcome, sizes, device, dtype, backends):
    """SDPA's own error in `dtype` against SDPA in float64 (math backend) on the same inputs, no mask and causal."""
    for causal in (False, True):
        leaves, exact = inputs_and_exact(sizes.batch, sizes.heads, sizes.length, sizes.length, sizes.head_size, dtype,
                                         device)
        grad = torch.randn(exact[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
        attend = lambda *inputs: torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=causal)  # noqa: E731
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            expected = attend(*exact)
        backend, pinned = gpu_ops.under_backend(lambda: attend(*leaves), backends, f"{outcome.dtype} attention")
        output = pinned()
        got = {"output": output, **dict(zip(("grad_query", "grad_key", "grad_value"),
                                            torch.autograd.grad(output, leaves, grad.to(dtype))))}
        wanted = {"output": expected, **dict(zip(("grad_query", "grad_key", "grad_value"),
                                                 torch.autograd.grad(expected, exact, grad)))}
        prefix = "causal " if causal else ""
        for name, value in got.items():
            outcome.errors[prefix + name] = gpu_ops.relative_error(value, wanted[name])
        outcome.notes.append(f"{prefix or 'no mask, '}SDPA backend {backend}")


def run_case(case: Case, sizes: Sizes, device: str, any_backend: bool) -> Outcome:
    """One case (SDPA pinned to FlashAttention unless `any_backend`); an exception is its failure (one line), not the
    end of the run."""
    backends = gpu_ops.ANY_BACKEND if any_backend else gpu_ops.FLASH
    outcome = Outcome(case.name, case.kind, case.dtype)
    dtype, start = DTYPES[case.dtype], time.perf_counter()
    try:
        if case.kind in MASK_KINDS:
            against_reference(outcome, sizes, device, dtype, sizes.length, sizes.length, case.kind)
        elif case.kind == "decode":  # forward only, as generation runs it
            for queries in (1, 5):
                part = Outcome(case.name, case.kind, case.dtype)
                against_reference(part, sizes, device, dtype, queries, sizes.cache, "causal+padding",
                                  offset=sizes.cache - queries, train=False, seed=queries)
                outcome.errors[f"{queries} queries output"] = part.errors["output"]
                outcome.failure = outcome.failure or (part.failure and f"{queries} queries: {part.failure}")
        elif case.kind == "dropout":
            dropout_case(outcome, sizes, device, dtype)
        elif case.kind == "tf32":
            matmul, convolution = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            try:
                against_reference(outcome, sizes, device, dtype, sizes.length, sizes.length, "none")
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, convolution
        elif case.kind == "many-programs":
            against_reference(outcome, sizes, device, dtype, 16, 16, "none", batch=sizes.many_programs // 2, heads=2)
            outcome.notes.append(f"batch x heads = {sizes.many_programs:,}")
        elif case.kind == "sdpa":
            # FlashAttention has no float32 kernel: SDPA's float32 on a GPU is its memory-efficient kernel
            sdpa_case(outcome, sizes, device, dtype, gpu_ops.ANY_BACKEND if dtype == torch.float32 else backends)
    except Exception as error:  # a kernel that fails to compile or launch, SDPA refusing: this case's failure
        outcome.failure = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    outcome.seconds = time.perf_counter() - start
    return outcome


def report(outcomes: list[Outcome], machine: dict, command: str, results: Path, complete: bool) -> None:
    """`gpu-correctness.md` and `.json`: every case's errors, NEZHA's largest error in each dtype beside SDPA's."""
    by_case = sorted(outcomes, key=lambda outcome: cases().index(Case(outcome.kind, outcome.dtype)))
    comparison = accuracy_against_sdpa(by_case)
    lines = [f"Command: `{command}`", "", summary(machine), "",
             "Relative errors against the float64 formula (tests/reference.py) on the same device; outputs allocated "
             "NaN-filled." + ("" if complete else " **Incomplete: the run stopped before every case finished.**"), "",
             "| case | errors | bound | result | notes |", "|---|---|---|---|---|"]
    for outcome in by_case:
        errors = ", ".join(f"{name} {error:.2e}" for name, error in outcome.errors.items())
        bound = "-" if outcome.kind == "sdpa" else f"{BOUNDS[outcome.dtype]:.0e}"
        result = f"**FAILED**: {outcome.failure}" if outcome.failure else "passed"
        lines.append(f"| {outcome.case} | {errors} | {bound} | {result} | {'; '.join(outcome.notes)} |")
    if comparison:
        lines += ["", "NEZHA's largest error over the mask cases against SDPA's on the same kind of inputs (the target: "
                  "no worse than SDPA's):", "", "| dtype | quantity | NEZHA | SDPA | ratio |", "|---|---|---|---|---|"]
        lines += [f"| {row['dtype']} | {row['quantity']} | {row['nezha']:.2e} | {row['sdpa']:.2e} | {row['ratio']:.2f} |"
                  for row in comparison]
    write_staged(results / "gpu-correctness.md", "\n".join(lines) + "\n")
    write_staged(results / "gpu-correctness.json", json.dumps(
        {"command": command, "machine": machine, "complete": complete, "cases": [asdict(o) for o in by_case],
         "against_sdpa": comparison}, indent=1))


def accuracy_against_sdpa(outcomes: list[Outcome]) -> list[dict]:
    """Per dtype and quantity (output, each gradient), NEZHA's largest error over the mask cases and SDPA's largest
    over its no-mask and causal runs."""
    rows = []
    for dtype in ("bfloat16", "float16"):
        sdpa = next((o for o in outcomes if o.kind == "sdpa" and o.dtype == dtype and not o.failure), None)
        masks = [o for o in outcomes if o.kind in MASK_KINDS and o.dtype == dtype and not o.failure]
        if sdpa is None or not masks:
            continue
        for quantity in ("output", "grad_query", "grad_key", "grad_value"):
            nezha = max(o.errors[quantity] for o in masks)
            theirs = max(sdpa.errors[quantity], sdpa.errors[f"causal {quantity}"])
            rows.append({"dtype": dtype, "quantity": quantity, "nezha": nezha, "sdpa": theirs, "ratio": nezha / theirs})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU under Triton's interpreter, tiny sizes")
    parser.add_argument("--results", type=Path, help="folder to write to (default: the machine's results folder)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes the cases run in, a fresh one per case (default: 12 on a GPU, 2 rehearsing); "
                             "1: every case in this process")
    parser.add_argument("--cases", nargs="*", help="only the cases whose name contains one of these")
    args = parser.parse_args(argv)
    try:
        device = gpu_ops.device_for(args.rehearse)
    except CheckFailed as error:
        print(f"gpu_correctness.py: {error}", file=sys.stderr)
        return 2
    sizes = REHEARSAL_SIZES if args.rehearse else GPU_SIZES
    workers = args.workers or (2 if args.rehearse else 12)
    machine = describe(torch.bfloat16, device)
    results = args.results or results_directory(machine)
    results.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu/gpu_correctness.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(summary(machine), flush=True)
    selected = [case for case in cases() if not args.cases or any(text in case.name for text in args.cases)]
    outcomes = []

    def finished(outcome: Outcome) -> None:
        outcomes.append(outcome)
        result = f"FAILED: {outcome.failure}" if outcome.failure else "passed"
        errors = ", ".join(f"{name} {error:.1e}" for name, error in outcome.errors.items())
        print(f"{outcome.case:28s} {result} ({errors}) {outcome.seconds:.1f}s", flush=True)
        report(outcomes, machine, command.strip(), results, complete=len(outcomes) == len(selected))

    if workers == 1:
        for case in selected:
            finished(run_case(case, sizes, device, args.rehearse))
    else:
        # A process per case: a kernel that faults leaves its CUDA context unusable, and a kernel that fails to compile
        # leaves the engine unusable in its process; neither may spill into the next case.
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
            # Rehearsing, SDPA takes any backend the CPU has (and the results say which).
            futures = {pool.submit(run_case, case, sizes, device, args.rehearse): case for case in selected}
            for future in as_completed(futures):
                try:
                    finished(future.result())
                except Exception as error:  # its process died (a crash in a kernel)
                    case = futures[future]
                    finished(Outcome(case.name, case.kind, case.dtype, failure=f"its process failed: {error!r}"))
    failed = [outcome for outcome in outcomes if outcome.failure]
    for outcome in failed:
        print(f"gpu_correctness.py: {outcome.case} failed: {outcome.failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
