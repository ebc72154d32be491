"""Serving NEZHA from onnxruntime against BERT from onnxruntime: time and peak memory per length, one run of each.

    python benchmarks/serving.py                      # 12 layers at 128 / 512 / 2,048; 4 layers at 8,192 and 16,384
    python benchmarks/serving.py --layers 2 --lengths 128 512 --long-lengths --repeats 3 --output serving-quick
    python benchmarks/serving.py --summarizer          # the exported summariser against PyTorch's (serving-summarizer)

Base width (hidden 768, 12 heads, K = 64 for NEZHA), sequence classifiers with random weights, float32, batch 1, a
batch of random ids with no padding (the mask is still an input of every graph). Rows, each a file exported here:

- `nezha-ort`: `nezha_hf.export.export_onnx` (the exported attention of `nezha_hf.onnx_attention`);
- `nezha-ort-optimized`: that file through onnxruntime's transformer optimizer (`onnxruntime.transformers.optimizer`,
  `model_type="bert"`), kept only if its logits equal `nezha-ort`'s within 1e-4;
- `bert-ort`: `BertForSequenceClassification` (SDPA) through transformers' `OnnxExporter`;
- `bert-ort-optimized`: that file through onnxruntime's transformer optimizer;
- `bert-ort-fused`: transformers' `OnnxExporter` with `OnnxConfig(ort_fusions="cpu")`, which fuses BERT's attention
  into onnxruntime's own attention op;
- `nezha-pytorch`: the NEZHA model in PyTorch (the default attention, the compiled kernel), for reference.

Every run happens in a child process of its own, with onnxruntime (and PyTorch) on 1 thread: it loads the model, runs
one warm-up call and one timed call, and reports the call's time (wall and the thread's CPU time, which a busy machine
disturbs less) and the process's peak resident memory (model, runtime and the call's buffers). The kinds alternate
within each of `--repeats` rounds; a cell is the median of its rounds, its memory the largest. Lengths from
`--long-lengths` use `--long-layers` layers; from `--nezha-only-from` on only NEZHA runs (BERT's `L x L` scores alone
would need more memory than the machine has). Writes `benchmarks/results/<machine kind>/<output>.md` and `.json`
(`machine.results_directory`), after every length.

`--summarizer` times the demo's toy summariser (trained as `nezha-hf demo` trains it, quickly) and its export
(`export_summarizer`, greedy) on the longest bundled judgment: extraction and 120 greedy tokens, PyTorch and
onnxruntime on 1 thread, alternating, median of `--repeats`; writes `serving-summarizer.md` / `.json`.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("nezha-ort", "nezha-ort-optimized", "bert-ort", "bert-ort-optimized", "bert-ort-fused", "nezha-pytorch")


def batch(length: int) -> dict[str, np.ndarray]:
    input_ids = np.random.default_rng(length).integers(1, 21128, (1, length))
    return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "token_type_ids": np.zeros_like(input_ids)}


def resident_bytes(field: str) -> int:
    """`VmHWM` (the process's peak resident memory) or `VmRSS` from /proc/self/status: per process image, unlike
    `ru_maxrss`, which a child started from a large parent inherits."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (the memory figures need Linux)")


def run_once(kind: str, path: str, length: int) -> dict:
    """In the child: load `path` as `kind`, one warm-up call, one timed call at `length`; the call's times and the
    process's peak resident memory (and what it held once loaded)."""
    inputs = batch(length)
    if kind == "nezha-pytorch":
        import torch

        from nezha_hf import NezhaForSequenceClassification

        torch.set_num_threads(1)
        model = NezhaForSequenceClassification.from_pretrained(path).eval()
        tensors = {name: torch.from_numpy(value) for name, value in inputs.items()}

        def call():
            with torch.no_grad():
                return model(**tensors).logits.numpy()
    else:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]

        def call():
            return session.run(None, {name: inputs[name] for name in names})[0]
    loaded = resident_bytes("VmHWM")
    call()
    wall, cpu = time.perf_counter(), time.thread_time()
    logits = call()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu, "loaded_bytes": loaded,
            "peak_bytes": resident_bytes("VmHWM"), "logits": logits.tolist()}


def in_child(kind: str, path: Path, length: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", kind, str(path), str(length)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        return {"failed": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_models(layers: int, work: Path) -> dict[str, Path]:
    """The files of every kind for `layers` layers (and the PyTorch folder), in `work`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.exporters import OnnxConfig, OnnxExporter

    from benchmarks.attention import BASE
    from nezha_hf import NezhaConfig, NezhaForSequenceClassification
    from nezha_hf.export import exporter_notes_held_back, export_onnx

    sizes = {**BASE, "num_hidden_layers": layers}
    torch.manual_seed(0)
    nezha = NezhaForSequenceClassification(NezhaConfig(**sizes, max_relative_position=64, num_labels=2)).eval()
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(**sizes, max_position_embeddings=16384, num_labels=2)).eval()
    paths = {"nezha-pytorch": work / "nezha", "nezha-ort": work / "nezha.onnx", "bert-ort": work / "bert" / "model.onnx"}
    nezha.save_pretrained(paths["nezha-pytorch"])
    print(export_onnx(nezha, paths["nezha-ort"]).summary(), flush=True)
    sample = {name: torch.from_numpy(value) for name, value in batch(16).items()}
    with exporter_notes_held_back():
        OnnxExporter().export(bert, sample, OnnxConfig(dynamic=True)).save_pretrained(work / "bert")
        OnnxExporter().export(bert, sample, OnnxConfig(dynamic=True, ort_fusions="cpu")).save_pretrained(work / "fused")
    paths["bert-ort-fused"] = work / "fused" / "model.onnx"
    for kind in ("nezha-ort", "bert-ort"):
        optimized = optimize(paths[kind], work / f"{kind}-optimized.onnx")
        if optimized is not None:
            paths[f"{kind}-optimized"] = optimized
    return paths


def optimize(source: Path, target: Path) -> Path | None:
    """`source` through onnxruntime's transformer optimizer, if its logits match the source's within 1e-4 at 40 and
    300 tokens (None, with the reason printed, if not)."""
    import onnxruntime
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        optimize_model(str(source), model_type="bert", num_heads=12, hidden_size=768).save_model_to_file(
            str(target), use_external_data_format=True)
        sessions = [onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                    for path in (source, target)]
    except Exception as error:  # the optimizer's fusions assume BERT's graph (and may write one that does not load)
        print(f"onnxruntime's optimizer failed on {source.name}: {type(error).__name__}: {error}", flush=True)
        return None
    difference = 0.0
    for length in (40, 300):
        inputs = batch(length)
        a, b = (s.run(None, {i.name: inputs[i.name] for i in s.get_inputs()})[0] for s in sessions)
        difference = max(difference, float(np.abs(a - b).max()))
    fused = sorted({node.op_type for node in __import__("onnx").load(str(target), load_external_data=False).graph.node}
                   - {node.op_type for node in __import__("onnx").load(str(source), load_external_data=False).graph.node})
    print(f"onnxruntime's optimizer on {source.name}: new ops {fused}, logits differ by {difference:.1e}", flush=True)
    return target if difference <= 1e-4 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[128, 512, 2048])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--long-lengths", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--long-layers", type=int, default=4)
    parser.add_argument("--nezha-only-from", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="serving", help="file name stem in benchmarks/results/<machine kind>/")
    parser.add_argument("--summarizer", action="store_true", help="time the exported summariser against PyTorch's")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, length = args.child
        print(json.dumps(run_once(kind, path, int(length))))
        return
    if args.summarizer:
        time_summarizer(args)
        return

    import torch

    from benchmarks.machine import describe, summary

    torch.set_num_threads(1)
    machine = describe(torch.float32)
    print(summary(machine), flush=True)
    plan = [(length, args.layers) for length in args.lengths] + [(length, args.long_layers) for length in args.long_lengths]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        models = {}
        for length, layers in plan:
            if layers not in models:
                models[layers] = export_models(layers, Path(work) / f"layers-{layers}")
            paths = models[layers]
            kinds = [kind for kind in KINDS if kind in paths
                     and (length < args.nezha_only_from or kind.startswith("nezha"))]
            runs = {kind: [] for kind in kinds}
            for _ in range(args.repeats if length < args.nezha_only_from else 1):
                for kind in kinds:
                    runs[kind].append(in_child(kind, paths[kind], length))
            rows.append(cell(length, layers, runs))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "logits"}), flush=True)
            write_results(rows, args, machine)


def time_summarizer(args):
    """The toy summariser and its export on the longest bundled judgment, alternating: seconds per judgment."""
    import contextlib
    import io

    import torch

    from benchmarks.machine import describe, results_directory, summary
    from nezha_hf.cail import read_judgments
    from nezha_hf.demo import EXAMPLES, summarizer_pipeline
    from nezha_hf.export import export_summarizer
    from nezha_hf.summarization import Summarizer, encode_document, load_exported_summarizer

    torch.set_num_threads(1)
    machine = describe(torch.float32)
    print(summary(machine), flush=True)
    judgment = max(read_judgments([EXAMPLES]), key=lambda j: len(j.text))
    with tempfile.TemporaryDirectory() as work:
        with contextlib.redirect_stdout(io.StringIO()):
            summarizer_pipeline(Path(work), quick=True)
        print(export_summarizer(Path(work) / "toy-summarizer", Path(work) / "onnx", greedy=True).summary(), flush=True)
        summarizers = {"pytorch": Summarizer.from_pretrained(Path(work) / "toy-summarizer", num_beams=1),
                       "onnxruntime": load_exported_summarizer(Path(work) / "onnx")}
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1  # as PyTorch
        for part in (summarizers["onnxruntime"].extractor, summarizers["onnxruntime"].generator):
            part.exported.to(session_options=options)
        times = {name: [] for name in summarizers}
        results = {}
        for _ in range(args.repeats + 1):
            for name, model in summarizers.items():
                start = time.perf_counter()
                results[name] = model.summarize([judgment], max_new_tokens=120)[0]
                times[name].append(time.perf_counter() - start)
        tokens = len(encode_document(summarizers["pytorch"].tokenizer, judgment.sentences)["input_ids"])
    median = {name: statistics.median(samples[1:]) for name, samples in times.items()}
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:])
    lines = [f"Command: `{command.strip()}` (the demo's toy summariser and its export, greedy, the longest bundled "
             f"judgment: {len(judgment.text):,} characters, {tokens:,} tokens; extraction and up to 120 new tokens; "
             f"seconds, median of {args.repeats} after one warm-up, alternating)", "", summary(machine), "",
             "| summariser | seconds | / PyTorch | same summary as PyTorch |", "|---|---|---|---|"]
    for name in summarizers:
        lines.append(f"| {name} | {median[name]:.3f} | {median[name] / median['pytorch']:.2f} | "
                     f"{results[name] == results['pytorch']} |")
    results_path = results_directory(machine)
    (results_path / "serving-summarizer.md").write_text("\n".join(lines) + "\n")
    (results_path / "serving-summarizer.json").write_text(json.dumps(
        {"command": command, "machine": machine, "seconds": median, "samples": times, "tokens": tokens}, indent=1))
    print("\n".join(lines), flush=True)


def cell(length: int, layers: int, runs: dict[str, list[dict]]) -> dict:
    """One length's figures: per kind the median times and the largest peak memory of its runs; the ratios to
    bert-ort and bert-ort-optimized; the largest logit difference of each kind from nezha-ort (NEZHA) or bert-ort."""
    row = {"tokens": length, "layers": layers, "kinds": {}}
    for kind, results in runs.items():
        done = [r for r in results if "failed" not in r]
        if not done:
            row["kinds"][kind] = {"failed": results[0]["failed"]}
            continue
        reference = runs["nezha-ort" if kind.startswith("nezha") else "bert-ort"]
        reference = next((r for r in reference if "failed" not in r), None)
        row["kinds"][kind] = {
            "cpu_s": statistics.median(r["cpu_s"] for r in done), "wall_s": statistics.median(r["wall_s"] for r in done),
            "peak_gib": max(r["peak_bytes"] for r in done) / 2**30,
            "run_gib": max(r["peak_bytes"] - r["loaded_bytes"] for r in done) / 2**30,
            "runs": len(done),
            "logit_difference": None if reference is None else float(np.abs(np.array(done[0]["logits"])
                                                                            - np.array(reference["logits"])).max()),
        }
    for base in ("bert-ort", "bert-ort-optimized"):
        if "cpu_s" in row["kinds"].get(base, {}):
            for kind, figures in row["kinds"].items():
                if kind.startswith("nezha") and "cpu_s" in figures:
                    figures[f"time_vs_{base}"] = figures["cpu_s"] / row["kinds"][base]["cpu_s"]
                    figures[f"peak_vs_{base}"] = figures["peak_gib"] / row["kinds"][base]["peak_gib"]
    return row


def write_results(rows, args, machine):
    from benchmarks.machine import results_directory, summary

    results = results_directory(machine)
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{command.strip()}` (base-width sequence classifiers, random weights, float32, batch 1, onnxruntime "
        "and PyTorch on 1 thread, each run in a process of its own: one warm-up call, one timed call; time: the "
        f"thread's CPU seconds of the call, median of {args.repeats} rounds, the kinds alternating; memory: the "
        "process's peak resident memory, largest of the rounds)",
        "",
        summary(machine),
        "",
        "| tokens | layers | kind | seconds (CPU) | seconds (wall) | peak memory GiB | of it, the call | "
        "time / bert-ort | time / bert-ort-optimized | peak / bert-ort | max logit difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for kind, f in row["kinds"].items():
            if "failed" in f:
                lines.append(f"| {row['tokens']} | {row['layers']} | {kind} | failed: {f['failed']} |||||||")
                continue
            ratio = lambda name: f"{f[name]:.2f}" if name in f else ""  # noqa: E731
            difference = "" if f["logit_difference"] is None else f"{f['logit_difference']:.1e}"
            lines.append(f"| {row['tokens']} | {row['layers']} | {kind} | {f['cpu_s']:.3f} | {f['wall_s']:.3f} | "
                         f"{f['peak_gib']:.2f} | {f['run_gib']:.2f} | {ratio('time_vs_bert-ort')} | "
                         f"{ratio('time_vs_bert-ort-optimized')} | {ratio('peak_vs_bert-ort')} | {difference} |")
    (results / f"{args.output}.md").write_text("\n".join(lines) + "\n")
    (results / f"{args.output}.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows},
                                                            indent=1))


if __name__ == "__main__":
    main()
