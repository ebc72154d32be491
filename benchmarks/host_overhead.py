"""Host time of one attention call, Triton's launcher included: what Python, PyTorch and Triton cost before any kernel
runs, measured on the CPU against a fake H100.

    python benchmarks/host_overhead.py [--triton-python PYTHON]    # writes benchmarks/results/<kind>/host-overhead.md

On a GPU, a short call's kernels take a few microseconds to a millisecond, so the host's work per call (the engine's
arguments and tensors, the op's dispatch and autograd, Triton's launcher) decides the time unless it stays below
that: the H100 run of 2026-11-27 (docs/performance.md) spent 1.85 ms of host time per training step against 0.8 ms of
kernels. Here the Triton engine runs its whole launch path against `gpu_fake_driver.fake_hopper` (Triton's JIT
binder, its autotuner's key and cache, argument specialisation, the launcher's C code; only the final
`cuLaunchKernelEx` returns at once), on CPU tensors standing for the GPU's. `--triton-python` runs it under another
Python's Triton (the GPU machine's 3.6; `make gpu-gates` makes such a venv), with this Python's packages.

Each call: the engine's own (`triton_attention.triton_attention`, as the model calls it), bfloat16, head size 64,
K = 64: a forward (no autograd) and a training step (forward and backward, the inputs' gradients cleared first),
without a mask and with key padding (the training step then with dropout 0.1, the fine-tuning call), and a decoding
step (one query against the keys of a cache: a static cache's mask, with padding flags and the offset a tensor, and
a dynamic cache's, the offset an int; and a dynamic cache as a 12-layer model's decoding loop calls it, a key longer
at every step, each step's length called by every layer: `LAYERS`, `GROWTH`). Beside each, SDPA's host time for the
same call (the padded ones with a boolean mask; the dropout call without dropout, which on CPU tensors would leave
SDPA's fused kernel for its many-op math path; the growing cache's, the dynamic cache's at one length: SDPA keeps
nothing per length).

SDPA computes on CPU tensors, so its host time is separated from its compute by size: it runs at batch 1 x 1 head
for three lengths (`LENGTHS`), and its host time is the least-squares line's value at no work (work = queries x
keys). NEZHA's is measured the same way (its host-side tensor work, on the CPU, computes too), its decoding step at
`DECODING_KEYS` keys so that it splits its keys over the H100's multiprocessors as at full size (a merge kernel
more). A mask's flags and bounds and the table in the queries' dtype are made once per mask and table
(`triton_attention._derived`), as a model's layers share them: every timed call here reuses them.

Each figure: microseconds of this thread's CPU time per call (CPU time, not wall time: a shared machine's other
work barely shows), the median of `--repeats` runs of `--calls` calls, every row's runs interleaved, one thread.
Beside them, what one call runs, counted by `sys.setprofile` (at the middle size, this script's own step included):
its Python function calls and its calls of C functions (PyTorch's and Triton's bindings, builtins).
Writes `host-overhead.md` and `.json` to the machine's results folder.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import gpu_fake_driver  # noqa: E402  (imports nothing that needs Triton or PyTorch)

LENGTHS = (16, 32, 64)  # tokens of the small calls the host time is fitted from
DECODING_KEYS = (1024, 2048, 4096)  # a decoding step's keys in those calls (each splits over the H100's processors)
HEAD_SIZE, K, DROPOUT = 64, 64, 0.1
# Each call: (step: "forward", "training" or "decoding", mask: "none", "padding", "static", "dynamic" or "growing",
# dropout).
CALLS = {"forward": ("forward", "none", 0.0), "forward, padded": ("forward", "padding", 0.0),
         "training step": ("training", "none", 0.0),
         "training step, padded, dropout 0.1": ("training", "padding", DROPOUT),
         "decoding step, static cache": ("decoding", "static", 0.0),
         "decoding step, dynamic cache": ("decoding", "dynamic", 0.0),
         "decoding step, growing dynamic cache (12 layers)": ("decoding", "growing", 0.0)}
LAYERS = 12  # a growing cache's calls at each length: the base model's layers
GROWTH = 1024  # keys a growing cache adds at most (one a step), within key-length classes tuned before the timing
TARGET = 1.5  # issue 70: host time per call at most 1.5x SDPA's


def _call(engine: str, name: str, batch: int, heads: int, tokens: int):
    """`step()` running call `name` once by `engine` ("nezha" or "sdpa") at `batch` x `heads` x `tokens` (a decoding
    step: 1 query against `tokens` keys), and its work (queries x keys per head, summed)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.gpu import gpu_ops
    from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask, sinusoid_relative_table
    from nezha_hf.triton_attention import triton_attention

    step, mask_kind, dropout = CALLS[name]
    growing = mask_kind == "growing" and engine == "nezha"
    queries, keys = (1, tokens) if step == "decoding" else (tokens, tokens)
    generator = torch.Generator().manual_seed(0)
    # `[batch, heads, length, d]` views of `[batch, length, heads, d]` as the model's projections; a cache's keys and
    # values `[batch, heads, length, d]` as transformers' caches hold them
    query = torch.randn(batch, queries, heads, HEAD_SIZE, generator=generator).to(torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(batch, heads, keys + GROWTH * growing, HEAD_SIZE, generator=generator).to(torch.bfloat16)
                  if step == "decoding" else
                  torch.randn(batch, keys, heads, HEAD_SIZE, generator=generator).to(torch.bfloat16).transpose(1, 2)
                  for _ in range(2))
    valid = torch.arange(keys)[None, :] < keys - torch.arange(batch)[:, None] * (keys // (2 * batch))  # right padding
    if mask_kind == "none":
        mask, sdpa_mask = RelativeAttentionMask(), None
    elif mask_kind == "padding":
        mask, sdpa_mask = RelativeAttentionMask(key_is_valid=valid), valid[:, None, None, :]
    elif mask_kind == "static":
        mask, sdpa_mask = (RelativeAttentionMask(key_is_valid=valid, causal=True, query_offset=torch.tensor(keys - 1)),
                           valid[:, None, None, :])
    else:
        mask, sdpa_mask = RelativeAttentionMask(causal=True, query_offset=keys - 1), None
    if growing:
        return _growing_step(query, key, value, keys), batch * heads * queries * keys
    if engine == "nezha":
        table = sinusoid_relative_table(K, HEAD_SIZE).to(torch.bfloat16)
        problem = AttentionProblem(mask, HEAD_SIZE**-0.5, dropout, torch.tensor(0x1234_5678_9ABC_DEF1))
        attend = lambda q, k, v: triton_attention(q, k, v, table, problem)  # noqa: E731
    else:  # `[batch, queries, heads, d]` as NEZHA's; dropout left out (module docstring)
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask).transpose(1, 2)  # noqa
    inputs = [query, key, value]
    if step != "training":
        return gpu_ops.forward_step(attend, inputs), batch * heads * queries * keys
    for tensor in inputs:
        tensor.requires_grad_()
    grad_output = torch.randn(batch, queries, heads, HEAD_SIZE, generator=generator).to(torch.bfloat16)
    return gpu_ops.training_step(attend, inputs, grad_output), batch * heads * queries * keys


def _growing_step(query, key, value, keys: int):
    """A decoding step with a dynamic cache as a model's decoding loop calls it: at each step a key more than at the
    last (from `keys`, up to `key`'s length), every step's length called `LAYERS` times, with that step's cache and
    problem (made before the timing: the cache's work and the model's, not the engine's)."""
    import torch

    from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask, sinusoid_relative_table
    from nezha_hf.triton_attention import triton_attention

    table = sinusoid_relative_table(K, HEAD_SIZE).to(torch.bfloat16)
    steps = [(key[:, :, :length], value[:, :, :length],
              AttentionProblem(RelativeAttentionMask(causal=True, query_offset=length - 1), HEAD_SIZE**-0.5))
             for length in range(keys + 1, key.shape[-2] + 1)]
    calls = (arguments for arguments in steps for _ in range(LAYERS))

    def step():
        arguments = next(calls, None)
        if arguments is None:
            raise SystemExit(f"the growing cache ran out of keys: --calls x (--repeats + 1) at most "
                             f"{len(steps) * LAYERS - 2}")
        with torch.no_grad():
            return triton_attention(query, *arguments[:2], table, arguments[2])

    return step


def microseconds(steps: dict, calls: int, repeats: int) -> dict:
    """The median of `repeats` runs of `calls` calls of each step (`name -> step`), in microseconds of this thread's
    CPU time per call, every step's runs interleaved (after one round of warm-up)."""
    runs = {name: [] for name in steps}
    for repeat in range(repeats + 1):
        for name, step in steps.items():
            start = time.thread_time()
            for _ in range(calls):
                step()
            if repeat:
                runs[name].append((time.thread_time() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in runs.items()}


def calls_made(step) -> dict:
    """What one call of `step` runs: `{"python": Python function calls, "c": calls of C functions}`."""
    counts = {"python": 0, "c": 0}

    def count(frame, event, argument):
        if event in ("call", "c_call"):
            counts["python" if event == "call" else "c"] += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    counts["c"] -= 1  # `sys.setprofile(None)` itself
    return counts


def at_no_work(points: list[tuple[float, float]]) -> float:
    """The least-squares line's value at work 0 through `(work, microseconds)` points."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return mean_y - slope * mean_x


def measure(calls: int, repeats: int) -> list[dict]:
    """Every row of the table (module docstring), against the fake H100."""
    import torch

    steps, work = {}, {}
    for name in CALLS:
        for engine in ("nezha", "sdpa"):
            for tokens in _sizes(name, engine):
                steps[(name, engine, tokens)], work[(name, engine, tokens)] = _call(engine, name, 1, 1, tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread's; a second only adds its scheduling noise
    try:
        for step in steps.values():  # compiles and tunes every kernel before anything is timed
            step()
        times = microseconds(steps, calls, repeats)
        made = {(name, engine): calls_made(steps[(name, engine, _sizes(name, engine)[1])])
                for name in CALLS for engine in ("nezha", "sdpa")}
    finally:
        torch.set_num_threads(threads)
    rows = []
    for name in CALLS:
        points = {engine: {n: times[(name, engine, n)] for n in _sizes(name, engine)} for engine in ("nezha", "sdpa")}
        fitted = {engine: at_no_work([(work[(name, engine, n)], us) for n, us in points[engine].items()])
                  for engine in points}
        rows.append({"call": name, "nezha_us": fitted["nezha"], "sdpa_us": fitted["sdpa"],
                     "ratio": fitted["nezha"] / fitted["sdpa"], "points": points,
                     "calls": {engine: made[(name, engine)] for engine in ("nezha", "sdpa")}})
    return rows


def _sizes(name: str, engine: str) -> tuple[int, ...]:
    """The lengths a call is timed at (`LENGTHS`; NEZHA's decoding step `DECODING_KEYS`, so that it splits)."""
    return DECODING_KEYS if CALLS[name][0] == "decoding" and engine == "nezha" else LENGTHS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--triton-python", help="run under this Python's Triton (e.g. the GPU machine's 3.6)")
    parser.add_argument("--results", type=Path, help="folder to write to (default: the machine's results folder)")
    parser.add_argument(gpu_fake_driver.PACKAGES, help=argparse.SUPPRESS)  # under --triton-python
    args = parser.parse_args(argv)
    arguments = sys.argv[1:] if argv is None else argv
    if args.triton_python and not args.packages:
        return gpu_fake_driver.run_under(args.triton_python, __file__, arguments)
    gpu_fake_driver.append_packages(args.packages)
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    from benchmarks.machine import describe, results_directory, summary

    # Kernels compile once into a cache of this benchmark's own (kept, so a second run starts at once).
    cache = Path(tempfile.gettempdir()) / f"nezha-host-overhead-triton-{triton.__version__}"
    with mock.patch.dict(os.environ, TRITON_CACHE_DIR=str(cache)), gpu_fake_driver.fake_hopper():
        rows = measure(args.calls, args.repeats)
    machine = describe(torch.bfloat16)
    shown = arguments[:arguments.index(gpu_fake_driver.PACKAGES)] if args.packages else arguments
    command = " ".join(["python benchmarks/host_overhead.py", *shown])
    lines = [f"Command: `{command}`", "", summary(machine) + f"; Triton {triton.__version__} against a fake H100 "
             "(benchmarks/gpu/gpu_fake_driver.py: Triton's whole launch path, the launch itself stubbed)", "",
             f"Host CPU time per call, microseconds (median of {args.repeats} interleaved runs of {args.calls} calls, "
             f"one thread); bfloat16, head size {HEAD_SIZE}, K = {K}; each engine's host time is the least-squares "
             f"line's value at no work through its times at batch 1 x 1 head x {', '.join(map(str, LENGTHS))} tokens "
             f"(NEZHA's decoding step: 1 query x {', '.join(map(str, DECODING_KEYS))} keys, so that it splits as at "
             "full size); the times themselves in the .json. Python / C calls: what one call runs (`sys.setprofile`, "
             "at the middle size, this script's step included):", "",
             f"| call | NEZHA (Triton) | SDPA | NEZHA / SDPA (target {TARGET}) | Python / C calls, NEZHA | SDPA |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {row['call']} | {row['nezha_us']:.1f} | {row['sdpa_us']:.1f} | {row['ratio']:.2f} "
              f"{'met' if row['ratio'] <= TARGET else 'NOT met'} | "
              + " | ".join(f"{calls['python']} / {calls['c']}" for calls in row["calls"].values()) + " |"
              for row in rows]
    output = (args.results or results_directory(machine)) / "host-overhead.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n")
    record = {"command": command, "machine": machine, "triton": triton.__version__, "rows": rows}
    output.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print("\n".join(lines), f"\n\nwritten to {output} and its .json", sep="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
