"""The `nezha-hf` command line.

    nezha-hf demo                                    the main job, end to end
    nezha-hf convert bert SRC_DIR OUT_DIR            a Hugging Face BERT (any head) into NEZHA
    nezha-hf convert tf CKPT OUT_DIR --config bert_config.json --vocab vocab.txt
    nezha-hf convert nezha SRC_DIR OUT_DIR           an older PyTorch NEZHA release
    nezha-hf pretrain MODEL_DIR FILE... --output OUT continue masked-LM training (after converting a BERT)
    nezha-hf summarize MODEL_DIR INPUT... [--output F] summarise judgments (.txt, folders, JSONL)
    nezha-hf train-summarizer DATA.jsonl --base MODEL_DIR --output DIR
    nezha-hf evaluate DATA.jsonl [--predictions P.jsonl] ROUGE / CAIL scores with lead-N and oracle
    nezha-hf export onnx MODEL_DIR OUT.onnx          ONNX for serving, checked with onnxruntime

`nezha-hf COMMAND --help` lists each command's options. Errors are printed as one line naming
the file at fault, with exit status 1.
"""

import argparse
import sys
from pathlib import Path

from .documents import TXT_SPLITS


def _add_conversion_options(parser):
    parser.add_argument("output", help="directory to write")
    parser.add_argument("--architecture", help="NEZHA class to produce, e.g. NezhaForMaskedLM (default: from the source)")
    parser.add_argument("--allow-missing", action="append", default=[], metavar="PATTERN",
                        help="glob of NEZHA weights that may stay uninitialised (repeatable)")
    parser.add_argument("--remote-code", action="store_true",
                        help="also make the output loadable with trust_remote_code=True without nezha_hf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nezha-hf", description="NEZHA for transformers v5")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main jobs, end to end: convert a real BERT, long inputs, the summariser")
    demo.add_argument("--workdir", type=Path, default=Path("demo-output"), help="where to write (default demo-output/)")
    demo.add_argument("--tokens", type=int, default=4096, help="input length for step 2")
    demo.add_argument("--quick", action="store_true", help="train the step-3 summariser for a few steps only")
    demo.add_argument("--copy", action="store_true", help="step 3 with the SPACES copy mechanism")

    convert = sub.add_parser("convert", help="convert BERT or older NEZHA checkpoints").add_subparsers(
        dest="source_format", required=True
    )
    bert = convert.add_parser("bert", help="a Hugging Face BERT directory (safetensors or .bin)")
    bert.add_argument("source", help="BERT directory with config.json and weights")
    _add_conversion_options(bert)
    bert.add_argument("--max-relative-position", type=int, help="K for the new model (default 64)")
    tf = convert.add_parser("tf", help="a TensorFlow checkpoint, Google BERT or Huawei NEZHA naming (needs nezha_hf[tf])")
    tf.add_argument("checkpoint", help="checkpoint prefix, e.g. model.ckpt-900000")
    _add_conversion_options(tf)
    tf.add_argument("--config", required=True, help="bert_config.json")
    tf.add_argument("--vocab", help="vocab.txt")
    tf.add_argument("--max-relative-position", type=int, help="K (default: the config's, else 64)")
    tf.add_argument("--cased", action="store_true", help="do not lower-case (the Chinese releases lower-case)")
    legacy = convert.add_parser("nezha", help="an older PyTorch NEZHA release (bert. prefix, persisted buffers)")
    legacy.add_argument("source")
    _add_conversion_options(legacy)

    pretrain = sub.add_parser("pretrain", help="continue masked-LM training (after converting a BERT)")
    pretrain.add_argument("model", help="NEZHA checkpoint directory (with tokenizer)")
    pretrain.add_argument("files", nargs="+", help=".txt / .jsonl files or folders")
    pretrain.add_argument("--output", required=True, help="output directory (checkpoints and the final model)")
    pretrain.add_argument("--max-length", type=int, default=1024)
    pretrain.add_argument("--mlm-probability", type=float, default=0.15)
    pretrain.add_argument("--txt-split", choices=TXT_SPLITS, default="blank-lines")
    pretrain.add_argument("--max-steps", type=int, default=-1)
    pretrain.add_argument("--epochs", type=float, default=1.0)
    pretrain.add_argument("--batch-size", type=int, default=8)
    pretrain.add_argument("--gradient-accumulation-steps", type=int, default=1)
    pretrain.add_argument("--learning-rate", type=float, default=5e-5)
    pretrain.add_argument("--save-steps", type=int, default=500)
    pretrain.add_argument("--bf16", action="store_true")
    pretrain.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    pretrain.add_argument("--seed", type=int, default=42)

    summarize = sub.add_parser("summarize", help="summarise judgments: extract with NEZHA, then generate")
    summarize.add_argument("model", help="a summariser folder (from train-summarizer)")
    summarize.add_argument("inputs", nargs="+", help=".txt files, folders, or JSONL (CAIL2020 or a `text` string)")
    summarize.add_argument("--output", help="JSONL (one {id, summary, extracted} per input) or .txt; default: stdout")
    summarize.add_argument("--extract-only", action="store_true", help="output the extracted sentences")
    summarize.add_argument("--batch-size", type=int, default=4)
    summarize.add_argument("--threshold", type=float, help="extraction probability threshold")
    summarize.add_argument("--token-budget", type=int, help="tokens of extracted source given to the generator")
    summarize.add_argument("--num-beams", type=int, default=3)
    summarize.add_argument("--no-copy-constraint", action="store_true",
                           help="decode freely even if the generator has a copy head")
    summarize.add_argument("--max-new-tokens", type=int, default=512)

    train = sub.add_parser("train-summarizer", help="train the extractor and the generator from CAIL2020 JSONL")
    train.add_argument("data", nargs="+", help="CAIL2020 JSONL with summaries (labels optional: oracle otherwise)")
    train.add_argument("--base", required=True, help="NEZHA checkpoint with tokenizer to start from")
    train.add_argument("--output", required=True)
    train.add_argument("--validation-fraction", type=float, default=0.1)
    train.add_argument("--extractor-steps", type=int, default=1000)
    train.add_argument("--generator-steps", type=int, default=2000)
    train.add_argument("--max-length", type=int, default=1024, help="generator source + summary tokens")
    train.add_argument("--learning-rate", type=float, default=5e-5)
    train.add_argument("--save-steps", type=int, default=500)
    train.add_argument("--copy", action="store_true",
                       help="SPACES copy mechanism: copy tags trained jointly, copied spans follow source n-grams")

    export = sub.add_parser("export", help="export a model for serving").add_subparsers(dest="format", required=True)
    onnx = export.add_parser("onnx", help="an ONNX file (dynamic batch and length), checked with onnxruntime")
    onnx.add_argument("model", help="a NEZHA model folder (an encoder head)")
    onnx.add_argument("output", help="the .onnx file to write")
    onnx.add_argument("--atol", type=float, default=1e-4, help="largest allowed |onnxruntime - PyTorch|")
    onnx.add_argument("--overwrite", action="store_true", help="replace an existing file")

    evaluate = sub.add_parser("evaluate", help="ROUGE-1/2/L and CAIL score, over characters and jieba words")
    evaluate.add_argument("data", nargs="+", help="judgments with reference summaries (CAIL2020 JSONL)")
    evaluate.add_argument("--predictions", help="JSONL of {id, summary} to score (e.g. from summarize)")
    evaluate.add_argument("--lead", type=int, default=3, help="N of the lead-N baseline")
    evaluate.add_argument("--output", help="write the scores as JSON here")
    return parser


def _read_inputs(paths):
    from .cail import read_judgments

    problems = []
    judgments = read_judgments(paths, problems)
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    if not judgments:
        raise ValueError(f"No judgments found in {', '.join(paths)}.")
    return judgments


def _summarize(args) -> None:
    import json

    from .summarization import Summarizer

    settings = {key: value for key, value in (("threshold", args.threshold), ("token_budget", args.token_budget))
                if value is not None}
    summarizer = Summarizer.from_pretrained(args.model, **settings)
    results = summarizer.summarize(_read_inputs(args.inputs), extract_only=args.extract_only,
                                   batch_size=args.batch_size, show_progress=True, num_beams=args.num_beams,
                                   max_new_tokens=args.max_new_tokens,
                                   **({"copy_constraint": False} if args.no_copy_constraint else {}))
    if args.output and args.output.endswith(".txt"):
        text = "\n\n".join(f"{r['id']}\n{r['summary']}" for r in results) + "\n"
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {len(results)} summaries to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _train_summarizer(args) -> None:
    from .summarization import train_summarizer

    metrics = train_summarizer(
        _read_inputs(args.data), args.base, args.output, validation_fraction=args.validation_fraction,
        extractor_steps=args.extractor_steps, generator_steps=args.generator_steps, max_length=args.max_length,
        learning_rate=args.learning_rate, save_steps=args.save_steps, copy_mechanism=args.copy,
    )
    print(f"saved {args.output}; " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))


def _evaluate(args) -> None:
    import json

    from .documents import iter_jsonl
    from .summarization import evaluate_summaries, format_scores

    predictions = None
    if args.predictions:
        problems = []
        predictions = {str(r["id"]): r["summary"] for _, r in iter_jsonl(Path(args.predictions), problems)
                       if "id" in r and isinstance(r.get("summary"), str)}
        for problem in problems:
            print(f"skipped {problem}", file=sys.stderr)
    results = evaluate_summaries(_read_inputs(args.data), predictions, lead_count=args.lead)
    print(format_scores(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert(args) -> None:
    from .conversion import convert_bert, convert_legacy_nezha, convert_tf

    if args.source_format == "bert":
        report = convert_bert(args.source, args.output, args.architecture, args.allow_missing,
                              args.max_relative_position, args.remote_code)
    elif args.source_format == "tf":
        report = convert_tf(args.checkpoint, args.output, args.config, args.vocab, args.architecture, args.allow_missing,
                            args.max_relative_position, do_lower_case=not args.cased, remote_code=args.remote_code)
    else:
        report = convert_legacy_nezha(args.source, args.output, args.architecture, args.allow_missing, args.remote_code)
    print(report.summary())


def _demo(args) -> None:
    from .demo import run_demo

    run_demo(args.workdir, args.tokens, args.quick, args.copy)


def _pretrain(args) -> None:
    from .pretraining import continue_pretraining

    metrics = continue_pretraining(
        args.model, args.files, args.output, max_length=args.max_length, mlm_probability=args.mlm_probability,
        txt_split=args.txt_split, resume=not args.no_resume, max_steps=args.max_steps, num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, save_steps=args.save_steps, bf16=args.bf16, seed=args.seed,
    )
    print(f"saved {args.output}; " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))


def _export(args) -> None:
    from .export import export_onnx

    print(export_onnx(args.model, args.output, atol=args.atol, overwrite=args.overwrite).summary())


COMMANDS = {"export": _export, "demo": _demo, "convert": _convert, "pretrain": _pretrain, "summarize": _summarize,
            "train-summarizer": _train_summarizer, "evaluate": _evaluate}


def main(argv=None) -> int:
    """Entry point of the `nezha-hf` console script."""
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as error:
        print(f"nezha-hf {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
