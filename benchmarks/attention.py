"""NEZHA attention speed and memory against a BERT of the same size on SDPA, measured in one run.

    python benchmarks/attention.py                     # full table (about an hour on 2 cores)
    python benchmarks/attention.py --lengths 128 512   # a subset
    python benchmarks/attention.py --lengths --memory-lengths 8192 --no-train --output attention-memory
    python benchmarks/attention.py --dropout 0.1 --layers 4 --lengths 2048 4096 --memory-lengths 4096 --output attention-dropout
    python benchmarks/attention.py --attention nezha_chunked --output attention-chunked
    python benchmarks/attention.py --dtype bfloat16 --lengths 512 2048 8192 --memory-lengths --output attention-bfloat16
    python benchmarks/attention.py --device cuda --dtype bfloat16 --lengths 512 2048 8192 --output attention-cuda-bfloat16
                                                       # on a GPU: NEZHA's Triton engine against BERT-SDPA's FlashAttention

Base width (hidden 768, 12 heads, K = 64; 12 layers unless `--layers`), float32 unless `--dtype`, batch 1.
Every results file starts with the machine it ran on (`benchmarks/machine.py`: CPU model, its AMX and AVX512-BF16/FP16
flags, or with `--device cuda` the GPU, and the matrix-multiply throughput in `--dtype` on that device, measured in the
same run) and the NEZHA engines that ran; the forward table also gives each model's share of that throughput (model
FLOPs per layer: `2 * weights * L + 4 * L^2 * hidden`).
`--dropout P` sets attention and hidden dropout to P in both models (on the CPU BERT-SDPA then leaves its
flash kernel for the math path); NEZHA runs the implementation `--attention` (default: the
default). Times are medians of `--repeats` runs, NEZHA and BERT alternating in one process; the
ratio is NEZHA / BERT. The engine `--attention` names (on a GPU without it, the Triton kernel) must be the one
that ran, by the engine's own record, or the run ends with that one line before it times anything.
On a GPU each pass is timed with CUDA events and BERT-SDPA runs under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)` in
bfloat16 and float16 (FlashAttention takes no float32; there SDPA chooses). Peak memory is measured in a fresh process per configuration, median of
`--memory-runs` processes: on the CPU the resident set high-water mark minus the resident set just
before the pass; on a GPU the allocator's peak minus what was allocated before the pass, warmed up at the
pass's length first (Triton autotunes once per length: its autotuning and buffers stay out of it). Writes
`benchmarks/results/<kind>/<output>.md`, `.json` and `.png` (tokens vs time ratio), `<kind>` being the
machine's (`amx`, `avx512-bf16`, `cpu` or `gpu`: `machine.results_directory`) unless `--results` names a
folder; `--output` defaults to `attention`.

Memory is the resident set the operating system sees, so it includes what glibc's malloc keeps
after frees: which 24 MB activations land in its heap and how they fragment changes from one run
to the next, by up to 40 % for the same model. Running the command with
`MALLOC_MMAP_THRESHOLD_=1048576` (every block of 1 MB or more mapped and unmapped on its own)
removes that and leaves the memory the pass actually holds. `--memory-method tensors` instead counts
the live tensors from the profiler's memory timeline (no heap at all, as a GPU's allocator counts;
the profiled pass is slower, memory is unaffected).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import describe, results_directory, summary  # noqa: E402
from nezha_hf import NezhaConfig, NezhaModel  # noqa: E402
from nezha_hf.relative_attention import Engine, recorded_attention_calls  # noqa: E402

BASE = dict(
    vocab_size=21128, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)


def build(kind: str, dropout: float = 0.0, layers: int = 12, attention: str | None = None, device: str = "cpu",
          dtype: str = "float32", **widths):
    """BERT-SDPA ("bert"), NEZHA with `attention` ("nezha") or NEZHA eager ("nezha-eager"), on `device`, in `dtype`
    ("bert-eager": BERT's eager attention, the float64 reference of `accuracy`); `widths` replace `BASE`'s (e.g.
    `hidden_size`)."""
    torch.manual_seed(0)
    sizes = {**BASE, **widths, "num_hidden_layers": layers, "hidden_dropout_prob": dropout,
             "attention_probs_dropout_prob": dropout}
    if kind.startswith("bert"):
        implementation = "eager" if kind == "bert-eager" else "sdpa"
        model = BertModel._from_config(BertConfig(**sizes, max_position_embeddings=16384),
                                       attn_implementation=implementation)
    else:
        implementation = "eager" if kind == "nezha-eager" else attention
        model = NezhaModel._from_config(NezhaConfig(**sizes, max_relative_position=64), attn_implementation=implementation)
    return model.to(device, getattr(torch, dtype))


def synchronize(device: str) -> None:
    if device != "cpu":
        getattr(torch, torch.device(device).type).synchronize()


def sdpa_backend(kind: str, device: str, dtype: str):
    """The context a model's pass runs in: BERT-SDPA on a GPU in bfloat16 or float16 pinned to FlashAttention (what
    NEZHA is measured against; a refusal is an error, not another backend); anything else as it is."""
    if kind == "bert" and torch.device(device).type == "cuda" and dtype in ("bfloat16", "float16"):
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


def one_pass(model, input_ids, train: bool) -> None:
    if train:
        model.zero_grad(set_to_none=True)
        model(input_ids).last_hidden_state.float().pow(2).mean().backward()
    else:
        with torch.no_grad():
            model(input_ids)


def run_once(model, input_ids, train: bool) -> float:
    """Seconds of one pass: on a GPU between two CUDA events, elsewhere by `perf_counter` after synchronising."""
    if input_ids.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one_pass(model, input_ids, train)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    one_pass(model, input_ids, train)
    synchronize(str(input_ids.device))
    return time.perf_counter() - start


# The exit status of a memory process whose NEZHA did not run the required engine.
ENGINE_DID_NOT_RUN = 3


def required_engine(attention: str | None, device: str) -> Engine | None:
    """The engine NEZHA's attention must run for the figures to be what they say: the one `--attention` names; on a
    GPU without it the Triton kernel (the default engine's choice there); None on the CPU without it (the default
    falls back by length and build, and the results name what ran)."""
    if attention:
        return Engine(attention)
    return None if device == "cpu" else Engine.TRITON


def engine_problem(calls, attention: str | None, device: str) -> str | None:
    """Why the figures would mislead, by the engine's own record of the `calls`: NEZHA's attention did not run
    `required_engine`; None when it did."""
    required, ran = required_engine(attention, device), {call.ran for call in calls}
    if required is None or ran == {required}:
        return None
    engines = " and ".join(sorted(engine.label for engine in ran))
    why = "; ".join(sorted({call.why for call in calls if call.why})) or "no reason recorded"
    return f"{required.value} did not run on {device}: the {engines} engine ran instead ({why})"


def forward_flops(length: int, layers: int) -> float:
    """Model FLOPs of a forward pass at base width: per layer `2 * weights * L + 4 * L^2 * hidden`, the weights being
    the layer's matrices (the same for NEZHA and BERT)."""
    hidden, intermediate = BASE["hidden_size"], BASE["intermediate_size"]
    weights = 4 * hidden * hidden + 2 * hidden * intermediate
    return layers * (2 * weights * length + 4 * length**2 * hidden)


def time_models(kinds, length, train, repeats, args, engines: set):
    """Median seconds per pass of each model; adds the labels of the engines NEZHA's attention ran to `engines`."""
    models = {kind: build(kind, args.dropout, args.layers, args.attention, args.device, args.dtype).train(train)
              for kind in kinds}
    input_ids = torch.randint(1, 21128, (1, length), device=args.device)
    with recorded_attention_calls() as calls:  # warm-up
        run_once(models["nezha"], input_ids, train)
    if problem := engine_problem(calls, args.attention, args.device):
        raise SystemExit(f"attention.py: {problem}")
    engines.update(call.ran.label for call in calls)
    for kind, model in models.items():
        if kind != "nezha":
            with sdpa_backend(kind, args.device, args.dtype):
                run_once(model, input_ids, train)
    samples = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind, model in models.items():
            with sdpa_backend(kind, args.device, args.dtype):
                samples[kind].append(run_once(model, input_ids, train))
    return {kind: statistics.median(values) for kind, values in samples.items()}


def tensor_peak_mb(model, input_ids, train: bool) -> float:
    """Peak of the live tensors during one pass minus those alive before it (MB), from the profiler's
    memory timeline: what a GPU's `max_memory_allocated` measures, free of the heap's noise."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run_once(model, input_ids, train)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        _, sizes = json.loads(Path(path).read_text())
    totals = [sum(by_category) for by_category in sizes]  # the first entry: what existed before the pass
    return (max(totals) - totals[0]) / 2**20


def peak_memory_mb(kind, length, train, args) -> float:
    """Extra memory of one pass, in a fresh process.

    The model is built (which loads the compiled kernel) and run once on 16 tokens (on a GPU at the
    pass's length, so that Triton's autotuning and its buffers are done with), so that
    one-time work of the first call (thread pools, lazy imports) is not counted as memory of the
    pass; that run's gradients are then freed, so that the pass's own `zero_grad` does not free
    them inside the measurement (BERT's are 48 MB larger: position embeddings for 16,384 tokens).
    On the CPU the peak (VmHWM) is then reset (`/proc/self/clear_refs`) and the result is the pass's
    peak minus the resident set before it, or with `--memory-method tensors` `tensor_peak_mb`; on a
    GPU, the allocator's peak minus what was allocated before the pass.
    """
    root = str(Path(__file__).resolve().parents[1])
    code = f"""
import sys, torch
sys.path.insert(0, {root!r})
import benchmarks.attention as b
def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
device = {args.device!r}
model = b.build({kind!r}, {args.dropout!r}, {args.layers!r}, {args.attention!r}, device, {args.dtype!r}).train({train!r})
ids = torch.randint(1, 21128, (1, {length}), device=device)
b.sdpa_backend({kind!r}, device, {args.dtype!r}).__enter__()  # BERT-SDPA's backend for the rest of the process
with b.recorded_attention_calls() as calls:
    b.run_once(model, ids[:, :16] if device == 'cpu' else ids, {train!r})
if device != 'cpu' and {kind!r} == 'nezha' and (problem := b.engine_problem(calls, {args.attention!r}, device)):
    print(problem, file=sys.stderr)
    sys.exit(b.ENGINE_DID_NOT_RUN)
model.zero_grad(set_to_none=True)  # the warm-up's gradients are not part of the pass
if device == 'cpu' and {args.memory_method!r} == 'tensors':
    print(b.tensor_peak_mb(model, ids, {train!r}))
elif device == 'cpu':
    open('/proc/self/clear_refs', 'w').write('5')
    before = status('VmRSS')
    b.run_once(model, ids, {train!r})
    print(status('VmHWM') - before)
else:
    accelerator = getattr(torch, torch.device(device).type)
    accelerator.reset_peak_memory_stats()
    before = accelerator.memory_allocated()
    b.run_once(model, ids, {train!r})
    print((accelerator.max_memory_allocated() - before) / 2**20)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode == ENGINE_DID_NOT_RUN:
        raise SystemExit(f"attention.py: {result.stderr.strip().splitlines()[-1]}")
    if result.returncode != 0:
        print(f"memory run failed ({kind}, {length}, train={train}): {result.stderr[-500:]}", flush=True)
        return float("nan")
    return float(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[128, 512, 1024, 2048, 4096, 8192],
                        help="lengths to time (none: memory only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--memory-runs", type=int, default=3, help="fresh processes per memory cell (median)")
    parser.add_argument("--output", default="attention", help="file name stem in benchmarks/results/<machine kind>/")
    parser.add_argument("--results", type=Path, help="folder to write to (default: benchmarks/results/<machine kind>/)")
    parser.add_argument("--eager-up-to", type=int, default=1024, help="also time the gather path up to this length")
    parser.add_argument("--no-train", action="store_true", help="forward only")
    parser.add_argument("--train-up-to", type=int, default=1 << 30, help="time forward+backward up to this length")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention and hidden dropout in both models")
    parser.add_argument("--layers", type=int, default=12, help="layers of both models")
    parser.add_argument("--attention", default=None, help="NEZHA's attn_implementation (default: the default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (both models)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of both models (with bfloat16 / float16: also their error against float64)")
    parser.add_argument("--accuracy-length", type=int, default=1024, help="tokens of the --dtype accuracy check")
    parser.add_argument("--memory-method", choices=["resident", "tensors"], default="resident",
                        help="on the CPU: the resident set, or the live tensors (the profiler's memory timeline)")
    args = parser.parse_args()
    if args.dropout and args.no_train:
        print("note: dropout only acts in training; with --no-train it changes nothing", flush=True)
    machine = describe(getattr(torch, args.dtype), args.device)
    print(summary(machine), flush=True)

    rows, engines = [], set()
    for length in args.lengths:
        row = {"tokens": length}
        for train in [False] if args.no_train or length > args.train_up_to else [False, True]:
            mode = "train" if train else "fwd"
            kinds = ["nezha", "bert"] + (["nezha-eager"] if length <= args.eager_up_to else [])
            times = time_models(kinds, length, train, args.repeats, args, engines)
            row[f"bert_{mode}_s"] = times["bert"]
            row[f"nezha_{mode}_s"] = times["nezha"]
            row[f"ratio_{mode}"] = times["nezha"] / times["bert"]
            if "nezha-eager" in times:
                row[f"eager_ratio_{mode}"] = times["nezha-eager"] / times["bert"]
            if not train:
                for kind in ("nezha", "bert"):
                    row[f"{kind}_fwd_share"] = forward_flops(length, args.layers) / times[kind] / (
                        machine["matmul_tflops"] * 1e12)
            print(f"{length:6d} {mode:5s} bert {times['bert']:.3f}s nezha {times['nezha']:.3f}s "
                  f"ratio {row[f'ratio_{mode}']:.2f}" + (f" eager {row.get(f'eager_ratio_{mode}'):.2f}"
                                                         if f"eager_ratio_{mode}" in row else ""), flush=True)
        rows.append(row)

    memory = []
    for length in args.memory_lengths:
        entry = {"tokens": length}
        for train in [False] if args.no_train or length > args.train_up_to else [False, True]:
            mode = "train" if train else "fwd"
            runs = {kind: [] for kind in ("bert", "nezha")}
            for _ in range(args.memory_runs):
                for kind, values in runs.items():
                    values.append(peak_memory_mb(kind, length, train, args))
            for kind, values in runs.items():
                entry[f"{kind}_{mode}_mb"] = statistics.median(values)
                entry[f"{kind}_{mode}_runs_mb"] = values
            entry[f"ratio_{mode}"] = entry[f"nezha_{mode}_mb"] / entry[f"bert_{mode}_mb"]
        print("memory", entry, flush=True)
        memory.append(entry)

    errors = accuracy(args) if args.dtype != "float32" else {}
    write_results(rows, memory, args, errors, machine, sorted(engines))


def accuracy(args) -> dict:
    """Each model in `args.dtype` against the same model in float64 on the same input: the relative error of
    the last hidden state (Frobenius norm), and its largest absolute error. The float64 references are NEZHA's
    gather engine (exact against the plain formula in float64, tests/test_relative_attention.py) and BERT's
    eager attention (both in float64 on the CPU); the model under test runs on `--device`."""
    input_ids = torch.randint(1, 21128, (1, args.accuracy_length))
    errors = {}
    for kind, reference_kind in (("nezha", "nezha-eager"), ("bert", "bert-eager")):
        with torch.no_grad():
            expected = build(reference_kind, 0.0, args.layers, None, "cpu", "float64")(input_ids).last_hidden_state
            model = build(kind, 0.0, args.layers, args.attention, args.device, args.dtype)
            with sdpa_backend(kind, args.device, args.dtype):
                got = model(input_ids.to(args.device)).last_hidden_state.double().cpu()
        errors[kind] = {"relative": float((got - expected).norm() / expected.norm()),
                        "max_abs": float((got - expected).abs().max())}
        print(f"accuracy {kind} {args.dtype}: relative {errors[kind]['relative']:.2e}, "
              f"max |error| {errors[kind]['max_abs']:.2e}", flush=True)
    return errors


def write_results(rows, memory, args, errors, machine, engines=()):
    results = args.results or results_directory(machine)
    results.mkdir(parents=True, exist_ok=True)
    malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    command = (f"MALLOC_MMAP_THRESHOLD_={malloc} " if malloc else "") + "python benchmarks/attention.py " + " ".join(sys.argv[1:])
    setting = (f"NEZHA attention {args.attention or 'default'}, {args.layers} layers, dropout {args.dropout}, "
               f"device {args.device}, {args.dtype}")
    lines = [f"Command: `{command.strip()}` ({setting}; medians of {args.repeats}, the two models alternating)", "",
             summary(machine)]
    if engines:
        lines += ["", f"NEZHA's attention ran the {' and '.join(engines)} engine{'s' if len(engines) > 1 else ''}."]
    if rows:
        lines += [
            "",
            "| tokens | BERT-SDPA fwd (s) | NEZHA fwd (s) | fwd ratio | fwd share of matmul throughput, NEZHA / BERT-SDPA | BERT-SDPA fwd+bwd (s) | NEZHA fwd+bwd (s) | fwd+bwd ratio | gather-only fwd / fwd+bwd ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        eager = f"{r['eager_ratio_fwd']:.2f} / {r.get('eager_ratio_train', float('nan')):.2f}" if "eager_ratio_fwd" in r else "-"
        lines.append(
            f"| {r['tokens']} | {r['bert_fwd_s']:.3f} | {r['nezha_fwd_s']:.3f} | {r['ratio_fwd']:.2f} | "
            f"{r['nezha_fwd_share']:.2f} / {r['bert_fwd_share']:.2f} | "
            f"{r.get('bert_train_s', float('nan')):.3f} | {r.get('nezha_train_s', float('nan')):.3f} | "
            f"{r.get('ratio_train', float('nan')):.2f} | {eager} |"
        )
    if memory:
        measured = ("live tensors (profiler memory timeline)" if args.memory_method == "tensors" and args.device == "cpu"
                    else f"with MALLOC_MMAP_THRESHOLD_={malloc}" if malloc else "")
        lines += ["", f"Extra peak memory of one pass, median of {args.memory_runs} fresh processes per cell (MB)"
                  + (f", {measured}" if measured else "") + ":", "",
                  "| tokens | BERT-SDPA fwd | NEZHA fwd | ratio | BERT-SDPA fwd+bwd | NEZHA fwd+bwd | ratio |", "|---|---|---|---|---|---|---|"]
    for m in memory:
        lines.append(
            f"| {m['tokens']} | {m['bert_fwd_mb']:.0f} | {m['nezha_fwd_mb']:.0f} | {m['ratio_fwd']:.2f} | "
            f"{m.get('bert_train_mb', float('nan')):.0f} | {m.get('nezha_train_mb', float('nan')):.0f} | "
            f"{m.get('ratio_train', float('nan')):.2f} |"
        )
    if errors:
        lines += ["", f"Error against the same model in float64 ({args.accuracy_length} tokens, last hidden state; "
                  "NEZHA's reference is its gather engine, BERT's its eager attention):", "",
                  "| model | relative error (Frobenius) | max abs error |", "|---|---|---|"]
        lines += [f"| {'NEZHA' if kind == 'nezha' else 'BERT-SDPA'} {args.dtype} | {e['relative']:.2e} | "
                  f"{e['max_abs']:.2e} |" for kind, e in errors.items()]
    table = "\n".join(lines) + "\n"
    print(table)
    (results / f"{args.output}.md").write_text(table)
    (results / f"{args.output}.json").write_text(json.dumps({"command": command, "machine": machine, "engines": engines,
                                                             "time": rows,
                                                             "memory": memory, "accuracy": errors}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [r["tokens"] for r in rows]
    ax.plot(tokens, [r["ratio_fwd"] for r in rows], "o-", label="NEZHA forward")
    trained = [r for r in rows if "ratio_train" in r]
    if trained:
        ax.plot([r["tokens"] for r in trained], [r["ratio_train"] for r in trained], "s-", label="NEZHA forward+backward")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("time / BERT-SDPA time")
    ax.set_title(f"NEZHA ({args.attention or 'default attention'}) vs BERT-SDPA, {args.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results / f"{args.output}.png", dpi=120)


if __name__ == "__main__":
    main()
