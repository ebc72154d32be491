"""Serving latency of a base-size NEZHA: eager PyTorch, torch.compile and onnxruntime, measured in one run.

    python benchmarks/serving.py                                  # 128, 512 and 2,048 tokens, batch 1 and 8
    python benchmarks/serving.py --lengths 128 --batches 1 --repeats 2 --output serving-quick

A `NezhaForSequenceClassification` of base width (12 layers unless `--layers`, hidden 768, 12 heads, K = 64, random
weights), float32, inference (`torch.no_grad`), a batch of random ids with the last row padded to
half its length. Rows:

- eager: the default attention (the compiled kernel on CPU), plain PyTorch;
- compiled: the same model through `torch.compile` (inductor), compiled before timing;
- onnxruntime: the file `nezha_hf.export.export_onnx` writes (the gather attention, `L x L` scores
  per head) on onnxruntime's CPU provider with its default threads.

Each cell is the median of `--repeats` calls after one warm-up call; the rows alternate within a
cell. Writes `benchmarks/results/<machine kind>/<output>.md` and `.json` (default `serving`; `machine.results_directory`).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import BASE  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402
from nezha_hf import NezhaConfig, NezhaForSequenceClassification  # noqa: E402
from nezha_hf.export import export_onnx  # noqa: E402



def padded_batch(batch: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    input_ids = torch.randint(1, BASE["vocab_size"], (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, length // 2 :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}


def median_seconds(call, repeats: int) -> float:
    call()  # warm-up (and, for torch.compile, compilation)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="serving", help="file name stem in benchmarks/results/<machine kind>/")
    parser.add_argument("--layers", type=int, default=12, help="layers of the model")
    args = parser.parse_args()
    import onnxruntime

    machine = describe(torch.float32)
    print(summary(machine), flush=True)
    torch.manual_seed(0)
    model = NezhaForSequenceClassification(NezhaConfig(**{**BASE, "num_hidden_layers": args.layers}, max_relative_position=64,
                                                          num_labels=2)).eval()
    compiled = torch.compile(model)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        onnx_file = Path(work) / "nezha.onnx"
        report = export_onnx(model, onnx_file)
        print(report.summary(), flush=True)
        session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
        for length, batch in ((length, batch) for length in args.lengths for batch in args.batches):
            inputs = padded_batch(batch, length)
            arrays = {name: value.numpy() for name, value in inputs.items()}
            with torch.no_grad():  # the timed calls too: serving builds no autograd graph
                eager_logits = model(**inputs).logits
                compiled_logits = compiled(**inputs).logits
                onnx_logits = torch.from_numpy(session.run(["logits"], arrays)[0])
                row = {
                    "tokens": length,
                    "batch": batch,
                    "eager_s": median_seconds(lambda: model(**inputs), args.repeats),
                    "compiled_s": median_seconds(lambda: compiled(**inputs), args.repeats),
                    "onnxruntime_s": median_seconds(lambda: session.run(["logits"], arrays), args.repeats),
                    "compiled_max_difference": float((compiled_logits - eager_logits).abs().max()),
                    "onnxruntime_max_difference": float((onnx_logits - eager_logits).abs().max()),
                }
                fastest = min(row["eager_s"], row["compiled_s"])
                row["compiled_vs_eager"] = row["compiled_s"] / row["eager_s"]
                row["onnxruntime_vs_fastest_pytorch"] = row["onnxruntime_s"] / fastest
                print(json.dumps(row), flush=True)
                rows.append(row)
                write_results(rows, args, machine)  # after every cell, so a cell that runs out of memory loses only itself


def write_results(rows, args, machine):
    results = results_directory(machine)
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{command.strip()}` ({args.layers} layers, base-width NezhaForSequenceClassification, float32, "
        f"inference, last row padded to half its length; seconds per call, median of {args.repeats})",
        "",
        summary(machine),
        "",
        "| tokens | batch | eager (default attention) | torch.compile | onnxruntime (gather attention) | compile / eager "
        "| onnxruntime / fastest PyTorch | max logit difference compile / onnxruntime |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['batch']} | {r['eager_s']:.3f} | {r['compiled_s']:.3f} | {r['onnxruntime_s']:.3f} | "
            f"{r['compiled_vs_eager']:.2f} | {r['onnxruntime_vs_fastest_pytorch']:.2f} | "
            f"{r['compiled_max_difference']:.1e} / {r['onnxruntime_max_difference']:.1e} |"
        )
    table = "\n".join(lines) + "\n"
    (results / f"{args.output}.md").write_text(table)
    (results / f"{args.output}.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
