"""int8 CPU serving of a NEZHA classifier: torchao int8 against float32, eager and compiled, speed and accuracy in one run.

    python benchmarks/int8_serving.py       # base width, 12 layers: batch 1 at 128, 512 and 2,048 tokens, batch 8 at 128
    python benchmarks/int8_serving.py --layers 2 --hidden 128 --shapes 1x32 4x32 --task-shape 4x32 --task-layers 2 \
        --task-hidden 128 --train-examples 64 --eval-examples 32 --timed-model-examples 16 --output int8-serving-quick

Variants of one model:

- float32 eager: plain PyTorch, NEZHA's default attention (the fused C++ kernel on the CPU);
- float32 compiled: `torch.compile(model, dynamic=True)`;
- int8 eager: `torchao.quantization.quantize_(model, Int8DynamicActivationInt8WeightConfig())` on a copy: every
  `nn.Linear` gets int8 weights (a scale per output row) and quantises its input to int8 per token at run time;
  embeddings, layer norms and attention stay float32;
- int8 compiled: that copy through `torch.compile(..., dynamic=True)`: what a server runs.

Two models:

- the timed model: a `NezhaForSequenceClassification` of base width (12 layers unless `--layers`, hidden 768 unless
  `--hidden`, 64 per head, feed-forward 4x hidden, K = 64, vocabulary 21,128), random weights (speed does not depend
  on the values). Latency per `--shapes` entry (`BATCHxTOKENS`, random ids, the last row padded to half its length):
  the variants alternate, their order rotating each round, and each figure is the median of `--repeats` calls after
  `--warmups` calls (the first compiles), as the machine may be shared;
- the classifier, so that "accuracy" means what it means for a served model: smaller (`--task-layers` 4, hidden 256),
  trained on a synthetic sentiment task (`sentiment_task`: random filler ids with five cue words from a positive and
  a negative lexicon of 8 ids each; the label is the lexicon with the majority). Its top layer, pooler and
  classifier are trained (`train_top_layer`: `--train-steps` steps on `--train-examples` texts; the layers below keep
  their random weights), a few minutes of work that a base-width model on 2 cores could not do.

On `--eval-examples` held-out texts (padded batches of `--task-shape`): each variant's accuracy against the labels
(the classifier), its labels' agreement with float32 eager's, and its logits' relative error against float32 eager's
(both models; the timed model on the first `--timed-model-examples` texts).

The run checks that int8 ran: every `nn.Linear` of the quantised copy holds a torchao `Int8Tensor`, and a profiled
call of each int8 variant runs one int8 matrix product (`aten::_int_mm`, or oneDNN's `qlinear`) per `nn.Linear` and
no float one; it names the attention engine (recorded in eager, and the `nezha_hf::` op every variant calls). Writes
`benchmarks/results/<machine kind>/<output>.md` and `.json` (default `int8-serving`; `machine.results_directory`).
"""

import argparse
import collections
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import BASE  # noqa: E402
from benchmarks.machine import cpu_flags, describe, results_directory, summary  # noqa: E402
from benchmarks.serving import padded_batch  # noqa: E402  (random ids, the last row padded to half its length)
from nezha_hf import NezhaConfig, NezhaForSequenceClassification, recorded_attention_calls  # noqa: E402
from nezha_hf.extras import require_extra  # noqa: E402

CLS, SEP = 101, 102
CUES = 5  # cue words per text: an odd number, so one lexicon always has the majority
LEXICON_SIZE = 8
POSITIVE = range(1000, 1000 + LEXICON_SIZE)  # the two lexicons' ids, kept out of the filler
NEGATIVE = range(2000, 2000 + LEXICON_SIZE)
FILLER_START = 3000
VARIANTS = ("float32 eager", "float32 compiled", "int8 eager", "int8 compiled")
# How the profiler's event names of int8 matrix products begin (torchao's CPU path calls aten::_int_mm; inductor
# may replace it with oneDNN's qlinear ops) and those of float ones, to tell which ran.
INT8_PRODUCTS = ("aten::_int_mm", "onednn::qlinear")
FLOAT_PRODUCTS = ("aten::addmm", "aten::mm", "aten::linear", "mkl::_mkl_linear", "mkldnn::_linear_pointwise")
# The instructions that multiply int8 (AVX512-VNNI, AVX-VNNI, AMX), as Linux names them in /proc/cpuinfo.
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def shape(text: str) -> tuple[int, int]:
    """`BATCHxTOKENS` (e.g. `8x128`) as `(batch, tokens)`."""
    try:
        batch, tokens = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxTOKENS, e.g. 8x128") from None
    if batch < 1 or tokens < 2 * CUES + 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one row and {2 * CUES + 2} tokens")
    return batch, tokens


def sentiment_task(examples: int, tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """`examples` texts padded to `tokens`: `[CLS]`, random filler with `CUES` cue words at random places, `[SEP]`,
    each text 1/2 to all of `tokens` long; `labels` is 1 where positive cues are the majority."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(examples, tokens, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.randint(0, 2, (examples,), generator=generator)
    for row, label in enumerate(labels.tolist()):
        length = int(torch.randint(tokens // 2, tokens + 1, (), generator=generator))
        text = torch.randint(FILLER_START, BASE["vocab_size"], (length - 2,), generator=generator)
        majority = int(torch.randint(CUES // 2 + 1, CUES + 1, (), generator=generator))
        lexicons = [POSITIVE if label else NEGATIVE] * majority + [NEGATIVE if label else POSITIVE] * (CUES - majority)
        places = torch.randperm(length - 2, generator=generator)[:CUES]
        for place, lexicon in zip(places.tolist(), lexicons):
            text[place] = lexicon[int(torch.randint(0, LEXICON_SIZE, (), generator=generator))]
        input_ids[row, :length] = torch.cat([torch.tensor([CLS]), text, torch.tensor([SEP])])
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels}


def model_inputs(batch: dict[str, torch.Tensor], rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    """The model's inputs of `rows` (no labels: served models compute no loss)."""
    return {name: batch[name][rows] for name in ("input_ids", "attention_mask", "token_type_ids")}


def train_top_layer(model: NezhaForSequenceClassification, task: dict[str, torch.Tensor], batch_size: int,
                    steps: int) -> float:
    """Train `model`'s top encoder layer, pooler and classifier on `task` (AdamW, `steps` batches of `batch_size`
    drawn at random); the layers below keep their weights, so their output is computed once and cached (what the top
    layer receives: its hidden states, the relative table and the mask, caught by a forward pre-hook). Returns the
    training accuracy."""
    top = model.nezha.encoder.layer[-1]
    cached = []
    hook = top.register_forward_pre_hook(lambda module, args: cached.append((args[0].detach(), *args[1:3])))
    labels = task["labels"].split(batch_size)
    try:
        with torch.no_grad():
            for start in range(0, len(task["labels"]), batch_size):
                model.nezha(**model_inputs(task, slice(start, start + batch_size)))
    finally:
        hook.remove()

    def logits(batch: int) -> torch.Tensor:
        return model.classifier(model.nezha.pooler(top(*cached[batch])))

    trained = [*top.parameters(), *model.nezha.pooler.parameters(), *model.classifier.parameters()]
    optimizer = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = int(torch.randint(0, len(cached), (), generator=generator))
        loss = torch.nn.functional.cross_entropy(logits(batch), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return float(torch.cat([logits(batch).argmax(-1) == labels[batch] for batch in range(len(cached))]).float().mean())


def quantized_int8(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """A copy of `model` with every `nn.Linear` int8 (torchao's dynamic-activation, int8-weight config), and what
    `quantize_` made of the linears: refused unless every one holds an int8 `Int8Tensor` that quantises its
    activations at run time."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8Tensor, quantize_

    quantized = copy.deepcopy(model)
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    linears = [module for module in quantized.modules() if isinstance(module, torch.nn.Linear)]
    int8 = [module for module in linears if isinstance(module.weight, Int8Tensor)
            and module.weight.qdata.dtype == torch.int8 and module.weight.act_quant_kwargs is not None]
    if len(int8) != len(linears):
        raise RuntimeError(f"quantize_ left {len(linears) - len(int8)} of {len(linears)} nn.Linear layers without "
                           "int8 weights and dynamic int8 activations")
    return quantized, {"linear_layers": len(linears), "int8_linear_layers": len(int8),
                       "weight_type": f"{type(int8[0].weight).__module__}.{type(int8[0].weight).__name__}",
                       "weight_storage": str(int8[0].weight.qdata.dtype)}


def weight_megabytes(model: torch.nn.Module) -> float:
    """The bytes a model's parameters take, in MB (an int8 weight: its int8 values and its float scales)."""
    total = 0
    for parameter in model.parameters():
        parts = [parameter.qdata, parameter.scale] if hasattr(parameter, "qdata") else [parameter]
        total += sum(part.numel() * part.element_size() for part in parts)
    return total / 1e6


def profiled_ops(call) -> collections.Counter:
    """How many times `call()` ran each matrix-product and NEZHA-attention op, by the profiler's names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    tracked = ("nezha_hf::", *INT8_PRODUCTS, *FLOAT_PRODUCTS)
    return collections.Counter(event.name for event in profile.events() if event.name.startswith(tracked))


def first_calls(calls: dict, inputs: dict) -> dict[str, float]:
    """Seconds of one call of each variant on `inputs`: a compiled one's first call of a shape may compile."""
    seconds = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call(**inputs)
        seconds[name] = time.perf_counter() - start
    return seconds


def checked_ops(calls: dict, inputs: dict, linear_layers: int) -> dict[str, collections.Counter]:
    """`profiled_ops` of one call of each variant on `inputs` (run it once before, so that nothing compiles while
    profiled); refused unless each int8 variant ran one int8 matrix product per `nn.Linear` (`linear_layers`) and
    no float one."""
    ops = {name: profiled_ops(lambda call=call: call(**inputs)) for name, call in calls.items()}
    for name in (name for name in calls if name.startswith("int8")):
        int8_products = sum(count for op, count in ops[name].items() if op.startswith(INT8_PRODUCTS))
        float_products = sum(count for op, count in ops[name].items() if op.startswith(FLOAT_PRODUCTS))
        if int8_products != linear_layers or float_products:
            raise RuntimeError(f"{name} ran {int8_products} int8 and {float_products} float matrix products, not one "
                               f"int8 product per nn.Linear ({linear_layers}): {dict(ops[name])}")
    return ops


def eager_engines(model, inputs) -> list[str]:
    """The attention engines an eager call ran (`nezha_hf.recorded_attention_calls`)."""
    with recorded_attention_calls() as calls:
        model(**inputs)
    return sorted({call.ran.label for call in calls})


def relative_errors(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`|logits - reference| / |reference|` per row (Euclidean norms): large for a text whose logits are all near 0."""
    return (logits - reference).norm(dim=-1) / reference.norm(dim=-1)


def time_alternating(calls: dict, inputs: dict, repeats: int, warmups: int) -> dict[str, list[float]]:
    """Seconds of each of `calls` on `inputs`: `warmups` calls each (the first compiles), then `repeats` rounds in
    which every call runs once, the order rotating by one each round."""
    for call in calls.values():
        for _ in range(warmups):
            call(**inputs)
    names = list(calls)
    samples = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            calls[name](**inputs)
            samples[name].append(time.perf_counter() - start)
    return samples


def build_model(layers: int, hidden: int) -> NezhaForSequenceClassification:
    """The random-weight classifier: base width unless `hidden` (64 per head, feed-forward 4x hidden), two labels."""
    torch.manual_seed(0)
    sizes = {**BASE, "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": max(1, hidden // 64),
             "intermediate_size": 4 * hidden}
    return NezhaForSequenceClassification(NezhaConfig(**sizes, max_relative_position=64, num_labels=2)).eval()


def variants(model: NezhaForSequenceClassification) -> tuple[dict, dict]:
    """`VARIANTS` of `model` (float32 and int8, each eager and compiled; compiled with dynamic shapes, so that one
    graph serves every length), and what `quantized_int8` reports."""
    quantized, quantization = quantized_int8(model)
    quantization["weights_mb"] = {"float32": weight_megabytes(model), "int8": weight_megabytes(quantized)}
    calls = dict(zip(VARIANTS, (model, torch.compile(model, dynamic=True), quantized,
                                torch.compile(quantized, dynamic=True))))
    return calls, quantization


def compare(calls: dict, task: dict[str, torch.Tensor], batch_size: int) -> dict:
    """Each variant's labels and logits on `task` in batches of `batch_size`, against the labels and float32 eager:
    accuracy, agreement, relative logit error (per text, median; over all texts), largest logit difference."""
    logits = {name: [] for name in calls}
    for start in range(0, len(task["labels"]), batch_size):
        for name, call in calls.items():
            logits[name].append(call(**model_inputs(task, slice(start, start + batch_size))).logits.float())
    logits = {name: torch.cat(parts) for name, parts in logits.items()}
    reference = logits[VARIANTS[0]]
    figures = {}
    for name, values in logits.items():
        errors = relative_errors(values, reference)
        figures[name] = {
            "accuracy": float((values.argmax(-1) == task["labels"]).float().mean()),
            "agreement_with_float32_eager": float((values.argmax(-1) == reference.argmax(-1)).float().mean()),
            "relative_logit_error_median": float(errors.median()),
            "relative_logit_error_overall": float((values - reference).norm() / reference.norm()),
            "max_logit_difference": float((values - reference).abs().max()),
        }
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=shape, nargs="+", default=[(1, 128), (1, 512), (8, 128), (1, 2048)],
                        help="timed inputs, BATCHxTOKENS")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2, help="untimed calls per variant and shape, the first compiles")
    parser.add_argument("--layers", type=int, default=12, help="layers of the timed model")
    parser.add_argument("--hidden", type=int, default=BASE["hidden_size"], help="width of the timed model")
    parser.add_argument("--task-shape", type=shape, default=(8, 128), help="BATCHxTOKENS of the task's batches")
    parser.add_argument("--task-layers", type=int, default=4, help="layers of the trained classifier")
    parser.add_argument("--task-hidden", type=int, default=256, help="width of the trained classifier")
    parser.add_argument("--train-examples", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--eval-examples", type=int, default=256, help="a multiple of the task shape's batch")
    parser.add_argument("--timed-model-examples", type=int, default=64,
                        help="held-out texts the timed model's int8 logits are compared on (a multiple of the batch)")
    parser.add_argument("--output", default="int8-serving", help="file name stem in benchmarks/results/<machine kind>/")
    args = parser.parse_args(argv)
    task_batch, task_tokens = args.task_shape
    for option in ("eval_examples", "timed_model_examples"):
        if getattr(args, option) < task_batch or getattr(args, option) % task_batch:
            parser.error(f"--{option.replace('_', '-')} ({getattr(args, option)}) must be a positive multiple of the "
                         f"task shape's batch ({task_batch})")
    if args.warmups < 1:
        parser.error("--warmups must be at least 1 (the first call compiles)")
    require_extra("serving", "int8 serving")
    import torchao

    started = time.perf_counter()
    machine = describe(torch.float32)
    machine["int8_flags"] = cpu_flags(INT8_FLAGS)
    print(summary(machine), flush=True)
    held_out = sentiment_task(args.eval_examples, task_tokens, seed=2)
    check_inputs = padded_batch(*args.task_shape)  # what the int8 check profiles

    # The trained classifier: what int8 does to accuracy.
    classifier = build_model(args.task_layers, args.task_hidden)
    train_accuracy = train_top_layer(classifier, sentiment_task(args.train_examples, task_tokens, seed=1), task_batch,
                                     args.train_steps)
    print(f"classifier trained: training accuracy {train_accuracy:.3f}", flush=True)
    classifier_calls, classifier_quantization = variants(classifier)
    with torch.no_grad():
        first_calls(classifier_calls, check_inputs)
        checked_ops(classifier_calls, check_inputs, classifier_quantization["linear_layers"])
        accuracy = {"classifier": compare(classifier_calls, held_out, task_batch)}
    print(json.dumps(accuracy["classifier"]), flush=True)

    # The timed model: speed, and what int8 does to its logits.
    model = build_model(args.layers, args.hidden)
    calls, quantization = variants(model)
    rows = []
    with torch.no_grad():  # serving builds no autograd graph
        first = [{"batch": task_batch, "tokens": task_tokens, **first_calls(calls, check_inputs)}]
        ops = checked_ops(calls, check_inputs, quantization["linear_layers"])
        attention = {"eager": eager_engines(model, check_inputs),
                     **{name: sorted(op for op in ops[name] if op.startswith("nezha_hf::")) for name in calls}}
        for batch, tokens in args.shapes:
            inputs = padded_batch(batch, tokens)
            first.append({"batch": batch, "tokens": tokens, **first_calls(calls, inputs)})  # compiling, timed apart
            samples = time_alternating(calls, inputs, args.repeats, args.warmups - 1)
            row = {"batch": batch, "tokens": tokens, "samples_s": samples,
                   **{f"{name}_s": statistics.median(times) for name, times in samples.items()}}
            row["int8_vs_float32_compiled"] = row["int8 compiled_s"] / row["float32 compiled_s"]
            row["int8_vs_float32_eager"] = row["int8 compiled_s"] / row["float32 eager_s"]
            print(json.dumps({key: value for key, value in row.items() if key != "samples_s"}), flush=True)
            rows.append(row)
        accuracy["timed model"] = compare(calls, {name: values[:args.timed_model_examples]
                                                  for name, values in held_out.items()}, task_batch)
    result = {
        "command": command_line(argv), "machine": machine, "torchao": torchao.__version__,
        "layers": args.layers, "hidden": args.hidden, "repeats": args.repeats, "warmups": args.warmups,
        "task": {"layers": args.task_layers, "hidden": args.task_hidden, "shape": list(args.task_shape),
                 "train_examples": args.train_examples, "train_steps": args.train_steps,
                 "train_accuracy": train_accuracy, "eval_examples": args.eval_examples,
                 "timed_model_examples": args.timed_model_examples, "quantization": classifier_quantization},
        "quantization": quantization, "profiled_ops": {name: dict(counts) for name, counts in ops.items()},
        "attention": attention, "accuracy": accuracy, "first_calls_s": first, "rows": rows,
    }
    result["run_s"] = time.perf_counter() - started
    print(json.dumps(accuracy["timed model"]), flush=True)
    results = results_directory(machine)
    (results / f"{args.output}.md").write_text(markdown(result))
    (results / f"{args.output}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {results / args.output}.md and .json ({result['run_s']:.0f} s)")
    return result


def command_line(argv) -> str:
    """The command as a user types it (the test calls `main(argv)`)."""
    return " ".join(["python benchmarks/int8_serving.py", *(sys.argv[1:] if argv is None else argv)]).strip()


def markdown(result: dict) -> str:
    """The results file: command, machine, what was checked, the speed table and the accuracy table."""
    quantization, task = result["quantization"], result["task"]
    int8_calls = ", ".join(f"`{name}` {count}x" for name, count in sorted(result["profiled_ops"]["int8 compiled"].items()))
    attention = result["attention"]
    compiled_ops = sorted({op for name in VARIANTS[1:] for op in attention[name]})
    first = {name: max(shape[name] for shape in result["first_calls_s"]) for name in ("float32 compiled",
                                                                                   "int8 compiled")}
    lines = [
        f"Command: `{result['command']}` (torchao {result['torchao']}; seconds per call, median of "
        f"{result['repeats']} after {result['warmups']} warm-up calls, the variants alternating; the machine's cores "
        f"were shared with other jobs, so single figures are noisy; the run took {result['run_s']:.0f} s)",
        "",
        summary(result["machine"]),
        "",
        f"int8 instructions: has {', '.join(result['machine']['int8_flags']) or 'none'}; lacks "
        f"{', '.join(flag for flag in INT8_FLAGS if flag not in result['machine']['int8_flags']) or 'none'}.",
        "",
        f"Timed model: NezhaForSequenceClassification, {result['layers']} layers, hidden {result['hidden']}, random "
        f"weights, inference, the last row of a batch padded to half its length. int8: "
        f"{quantization['int8_linear_layers']} of {quantization['linear_layers']} `nn.Linear` weights are "
        f"`{quantization['weight_type']}` ({quantization['weight_storage']} values; activations quantised at run time); "
        f"parameters {quantization['weights_mb']['float32']:.0f} MB in float32, {quantization['weights_mb']['int8']:.0f} "
        f"MB in int8 (the embeddings stay float32). One compiled int8 call ran {int8_calls}. Attention: eager calls ran "
        f"the {', '.join(attention['eager'])} engine; every variant calls `{'`, `'.join(compiled_ops)}`. Slowest first "
        f"call of a shape, compiled (it compiles, or loads inductor's on-disk cache): float32 "
        f"{first['float32 compiled']:.0f} s, int8 {first['int8 compiled']:.0f} s.",
        "",
        "| batch x tokens | " + " | ".join(VARIANTS) + " | int8 compiled / float32 compiled "
        "| int8 compiled / float32 eager |",
        "|---" * (len(VARIANTS) + 3) + "|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} x {r['tokens']} | " + " | ".join(f"{r[f'{name}_s']:.3f}" for name in VARIANTS)
                     + f" | {r['int8_vs_float32_compiled']:.2f} | {r['int8_vs_float32_eager']:.2f} |")
    batch, tokens = task["shape"]
    lines += [
        "",
        f"Accuracy on {task['eval_examples']} held-out texts of the synthetic sentiment task (up to {tokens} tokens, "
        f"padded batches of {batch}). Classifier: {task['layers']} layers, hidden {task['hidden']}, its top layer, "
        f"pooler and classifier trained ({task['train_steps']} steps on {task['train_examples']} texts, training "
        f"accuracy {task['train_accuracy']:.3f}), the layers below random. Timed model: random weights, so its labels "
        f"are compared with float32's only (the first {task['timed_model_examples']} texts). Relative logit error: "
        "`|logits - float32 eager's| / |float32 eager's|`, per text (the median) and over all texts.",
        "",
        "| model | variant | accuracy | labels equal to float32 eager's | relative logit error, median per text "
        "| relative logit error, all texts | largest logit difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, figures_by_variant in result["accuracy"].items():
        for name, figures in figures_by_variant.items():
            accuracy = f"{figures['accuracy']:.4f}" if model == "classifier" else "-"
            lines.append(f"| {model} | {name} | {accuracy} | {figures['agreement_with_float32_eager']:.4f} | "
                         f"{figures['relative_logit_error_median']:.1e} | {figures['relative_logit_error_overall']:.1e} "
                         f"| {figures['max_logit_difference']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
