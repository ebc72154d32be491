"""The attention op as the GPU check runs it (`gpu_correctness.py`, `gpu_attention.py`): inputs, masks, the check that
`nezha_triton` is what runs a problem, SDPA under a named backend, timing, and the float64 reference.

NEZHA's op is `nezha_hf.triton_attention.triton_attention(query, key, value, table, problem)`: inputs `[batch, heads,
length, head_size]`, output `[batch, queries, heads, head_size]`. SDPA takes the same tensors and returns `[batch,
heads, queries, head_size]`. On the CPU (`--rehearse`) the Triton kernels run under Triton's interpreter, which a script
switches on before it imports this module (`benchmarks/gpu/gpu_script.py`).
"""

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # reference.py: the plain float64 formula, which imports nothing of nezha_hf

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import reference  # noqa: E402
from nezha_hf.attention_ops import AttentionProblem, EngineUnavailable, RelativeAttentionMask  # noqa: E402
from nezha_hf.attention_ops import sinusoid_relative_table  # noqa: E402
from nezha_hf.relative_attention import Engine, recorded_attention_calls, relative_attention  # noqa: E402
from nezha_hf.triton_attention import triton_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# SDPA pinned to FlashAttention, the backend NEZHA is measured against; the others in the order SDPA itself tries them,
# for shapes or devices FlashAttention refuses (which the results then name).
FLASH = (SDPBackend.FLASH_ATTENTION,)
ANY_BACKEND = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class CheckFailed(RuntimeError):
    """The GPU check cannot give a trustworthy figure (the Triton engine did not run, SDPA refused its backend): the
    message is the one line the script ends with."""


def device_for(rehearse: bool) -> str:
    """`"cpu"` for a rehearsal, else `"cuda"`, which must be there."""
    if rehearse:
        return "cpu"
    if not torch.cuda.is_available():
        raise CheckFailed("no CUDA GPU is visible to PyTorch (run with --rehearse to rehearse on the CPU)")
    return "cuda"


def random_inputs(batch, heads, queries, keys, head_size, dtype, device, seed=0) -> list[torch.Tensor]:
    """Query `[batch, heads, queries, head_size]`, key and value `[batch, heads, keys, head_size]`: standard normal
    (never zeros, which hide unwritten outputs), drawn in float32 on the CPU (the same values on any device)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, head_size, generator=generator).to(device, dtype)
            for length in (queries, keys, keys)]


def relative_table(K: int, head_size: int, dtype, device) -> torch.Tensor:
    """The model's `(2K + 1) x head_size` table (float32, as the model holds it) in `dtype`, as a model passes it."""
    return sinusoid_relative_table(K, head_size).to(device, dtype)


def mask_case(kind: str, batch: int, queries: int, keys: int, offset: int, device) -> tuple[RelativeAttentionMask,
                                                                                            torch.Tensor | None]:
    """The op's mask of `kind` ("none", "padding", "causal", "causal+padding", "unilm-prefix") for queries at
    positions `offset ..` and the reference's `[batch or 1, 1, queries, keys]` bool (None for "none").

    Padding drops the last fifth of the last row's keys and the first 3 keys of the first row (left padding: under a
    causal mask its first queries see no key). The UniLM prefix gives row b a source of `(b + 1) * keys // (batch + 2)`
    keys."""
    padded = kind in ("padding", "causal+padding", "unilm-prefix")
    causal = kind in ("causal", "causal+padding", "unilm-prefix")
    valid = source = None
    if padded:
        valid = torch.ones(batch, keys, dtype=torch.bool)
        valid[-1, keys - keys // 5:] = False
        valid[0, :3] = False
    if kind == "unilm-prefix":
        source_lengths = torch.tensor([(row + 1) * keys // (batch + 2) for row in range(batch)])
        source = torch.arange(keys)[None, :] < source_lengths[:, None]
    allowed = (None if kind == "none" else
               reference.allowed_mask(queries, valid, causal, source, offset, keys).to(device))
    on_device = (lambda flags: None if flags is None else flags.to(device))  # noqa: E731
    return RelativeAttentionMask(on_device(valid), causal, on_device(source), offset), allowed


def problem_for(mask: RelativeAttentionMask, head_size: int, dropout: float = 0.0, seed: int = 0) -> AttentionProblem:
    """One call's `AttentionProblem`: the score scale `head_size ** -0.5`, and dropout with its seed."""
    return AttentionProblem(mask, head_size**-0.5, dropout, torch.tensor(seed, dtype=torch.int64))


def require_triton(query, key, value, table, problem: AttentionProblem, what: str) -> None:
    """Ask for `nezha_triton` through `relative_attention`, as a model does (with gradients if the inputs need them,
    so that its backward is compiled too), and raise `CheckFailed` unless the engine's own record says the Triton
    engine ran: a fallback to another engine must never be timed or checked as if it were Triton's."""
    module = torch.nn.Module().train(problem.dropout > 0)  # relative_attention applies dropout in training only
    try:
        with recorded_attention_calls() as calls:
            relative_attention(module, query, key, value, problem.mask, problem.scaling, problem.dropout,
                               relative_table=table, requested=Engine.TRITON)
    except EngineUnavailable as error:
        raise CheckFailed(f"nezha_triton cannot run {what}: {error}") from error
    ran = {call.ran for call in calls}
    if ran != {Engine.TRITON}:
        engines = " and ".join(sorted(engine.label for engine in ran)) or "no"
        why = "; ".join(sorted({call.why for call in calls if call.why})) or "no reason recorded"
        raise CheckFailed(f"nezha_triton did not run {what}: the {engines} engine ran instead ({why})")


def nezha(table: torch.Tensor, problem: AttentionProblem) -> Callable:
    """`attend(query, key, value)` by the Triton op (no fallback: the op is the kernels; a failure raises)."""
    return lambda query, key, value: triton_attention(query, key, value, table, problem)


def sdpa(dropout: float = 0.0) -> Callable:
    """`attend(query, key, value)` by SDPA (no mask; the active `sdpa_kernel` context picks the backend)."""
    return lambda query, key, value: F.scaled_dot_product_attention(query, key, value, dropout_p=dropout)


def under_backend(step: Callable, backends: Iterable[SDPBackend], what: str) -> tuple[str, Callable]:
    """`(backend name, step run under it)` for the first of `backends` SDPA runs `step` with (tried once here), or
    `CheckFailed` naming why each refused."""
    refusals = []
    for backend in backends:
        def pinned(backend=backend):
            with sdpa_kernel(backend):
                return step()

        try:
            pinned()
        except RuntimeError as error:
            refusals.append(f"{backend.name}: {str(error).strip().splitlines()[0]}")
            continue
        return backend.name.lower(), pinned
    raise CheckFailed(f"SDPA refused {what} ({'; '.join(refusals)})")


def forward_step(attend: Callable, inputs: list[torch.Tensor]) -> Callable:
    """One forward call, without autograd."""

    def step():
        with torch.no_grad():
            return attend(*inputs)

    return step


def training_step(attend: Callable, inputs: list[torch.Tensor], grad_output: torch.Tensor) -> Callable:
    """One forward and backward call (gradients into `inputs`, which need them; cleared before each call)."""

    def step():
        for tensor in inputs:
            tensor.grad = None
        attend(*inputs).backward(grad_output)

    return step


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(step: Callable, device: str, repeats: int = 3) -> float:
    """Median milliseconds of `step()` after a warm-up call (compilation and autotuning happen there, outside the
    timed calls): `triton.testing.do_bench` on a GPU (CUDA events, the L2 cache flushed before each call, about 100 ms
    of calls); on the CPU, `repeats` synchronous calls timed with `perf_counter`."""
    step()
    synchronize(device)
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(step, warmup=25, rep=100, return_mode="median")
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_memory_mb(step: Callable, device: str) -> float | None:
    """Memory one `step()` allocates at its peak beyond what was allocated before it (MB), after a warm-up call, so
    that neither compilation nor the autotuner's buffers count; None off a GPU (the allocator's statistics are
    CUDA's)."""
    if device != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def attention_flops(batch, heads, queries, keys, head_size, backward=False, causal=False) -> float:
    """FLOPs by the convention FlashAttention's benchmarks use: forward `4 * batch * heads * queries * keys *
    head_size` (the two block products), forward+backward 3.5 times that, halved under a causal mask."""
    flops = 4 * batch * heads * queries * keys * head_size
    return flops * (3.5 if backward else 1.0) * (0.5 if causal else 1.0)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """`||got - expected|| / ||expected||` (Frobenius, in float64); infinite where `got` has NaN or inf (an element
    no kernel wrote, under `nan_filled_memory`)."""
    got, expected = got.detach().double(), expected.detach()
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - expected).norm() / expected.norm().clamp_min(torch.finfo(torch.float64).tiny))


@contextlib.contextmanager
def nan_filled_memory():
    """Every tensor made with `torch.empty` inside (an op's output, before its kernel writes it) starts as NaN, so an
    element no kernel writes shows (PyTorch fills uninitialised memory in its deterministic mode; warnings only)."""
    was_on, was_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = filling
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


def reference_attention(query, key, value, K, allowed, offset, table, keep=None, dropout=0.0) -> torch.Tensor:
    """tests/reference.py's plain formula in float64 on the inputs' device, `[batch, heads, queries, head_size]`,
    with the model's table (float32, upcast) and, for dropout, the keep mask the kernel drew."""
    output, _ = reference.attention(query, key, value, K, allowed, query_offset=offset, table=table.double(), keep=keep,
                                    dropout=dropout)
    return output
