"""The `nezha-hf` command line (`python -m nezha_hf` runs it too, e.g. under `accelerate launch` or `torchrun`).

    nezha-hf demo                                         the main jobs, end to end
    nezha-hf convert bert|tf|nezha SOURCE OUT_DIR         BERT and older NEZHA checkpoints into NEZHA
    nezha-hf pretrain MODEL_DIR FILE... --output OUT      continue masked-LM training (after converting a BERT)
    nezha-hf train-summarizer DATA.jsonl --base MODEL_DIR --output DIR
    nezha-hf summarize SUMMARIZER INPUT... [--output F]   summarise judgments (.txt, folders, JSONL)
    nezha-hf evaluate DATA.jsonl [--predictions P.jsonl]  ROUGE / CAIL scores beside lead-N and the oracle
    nezha-hf export onnx MODEL_DIR OUT                    ONNX for serving, checked with onnxruntime first
    nezha-hf accelerate-config one-machine|two-machines   the path of an `accelerate launch` config

`nezha-hf COMMAND --help` lists a command's options, their defaults and an example. Arguments, input files and
output paths are checked before any long work starts. Every failure is one line naming the problem, with exit status
2 and no traceback (`--debug` shows it); Ctrl-C and SIGTERM end with 130 and 143. Outputs are written beside their
destination and renamed into place once complete; an existing output is replaced only with `--overwrite`.

This module lives outside the `nezha_hf` package so that `--help` and `--version` answer at once: importing the
package loads PyTorch and transformers, which a command only does when it runs.
"""

import _thread
import argparse
import importlib.util
import math
import signal
import sys
import threading
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (not usage plus error) and exit status 2, and defaults in the help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_HelpFormatter, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (unless it is none, off, or already in the help), keeps the examples' lines."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {action.default})"


def _package_version() -> str:
    """nezha_hf's version by `nezha_hf/version.py`, loaded from the package folder without importing the package
    (which loads PyTorch): pyproject.toml's in a checkout, else the installed metadata's."""
    package = importlib.util.find_spec("nezha_hf")
    spec = importlib.util.spec_from_file_location("nezha_hf_version",
                                                  Path(package.submodule_search_locations[0]) / "version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.package_version()


def _number(kind, low=None, high=None, high_open=False):
    """An argparse type: a `kind` (int or float) in `[low, high]` (or `[low, high)`)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (low is not None and value < low) or (high is not None and (value >= high if high_open else value > high)):
            upper = "" if high is None else f" and {'below' if high_open else 'at most'} {high}"
            raise argparse.ArgumentTypeError(f"must be at least {low}{upper}, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse calls the type in its messages
    return parse


# The `accelerate launch` configs that install with the package (nezha_hf/launch_configs/NAME.yaml).
LAUNCH_CONFIGS = ("one-machine", "two-machines")

COUNT = _number(int, 1)  # at least 1
STEPS = _number(int, 0)
RATE = _number(float, 0.0, 1.0, high_open=True)  # a fraction in [0, 1)
PROBABILITY = _number(float, 0.0, 1.0)
POSITIVE = _number(float, 1e-12)


def _encoding(name: str) -> str:
    """An argparse type: the name of a text encoding Python knows (gb18030, big5, shift_jis, ...)."""
    try:
        b"a".decode(name)  # a byte: empty bytes decode without looking the encoding up
    except LookupError:  # unknown, or not text (base64)
        raise argparse.ArgumentTypeError(f"unknown text encoding {name!r} (e.g. gb18030)")
    except UnicodeDecodeError:  # not a whole character in UTF-16 and the like: a text encoding all the same
        pass
    return name


def _examples(*lines: str) -> str:
    return "example:\n" + "\n".join(f"  {line}" for line in lines)


def _add_conversion_options(parser):
    parser.add_argument("output", help="folder to write (not the source, nor inside it)")
    parser.add_argument("--architecture", help="NEZHA class to produce, e.g. NezhaForMaskedLM (default: the source's)")
    parser.add_argument("--allow-missing", action="append", default=[], metavar="PATTERN",
                        help="glob of NEZHA head weights that may stay uninitialised (repeatable)")
    parser.add_argument("--remote-code", action="store_true",
                        help="also make the output loadable with trust_remote_code=True without nezha_hf")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output folder")


def build_parser(progs: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command (no heavy import: see the module docstring). `progs` names a command's program
    in its usage and help (`{"convert bert": "python convert/convert_bert.py"}`) where a script runs it."""
    parser = _Parser(prog="nezha-hf", description=__doc__.split("\n\n")[1])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    # --debug after the command too; its default there is "not given", so as not to undo one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")

    def command(subparsers, name, help, example, parent=""):
        prog = (progs or {}).get(f"{parent} {name}".strip())
        return subparsers.add_parser(name, parents=[common], help=help, description=help, epilog=example,
                                     **({"prog": prog} if prog else {}))

    demo = command(sub, "demo", "the main jobs, end to end: convert a real BERT, long inputs, the summariser",
                   _examples("nezha-hf demo --workdir demo-output"))
    demo.add_argument("--workdir", type=Path, default=Path("demo-output"), help="folder the demo writes into")
    demo.add_argument("--tokens", type=COUNT, default=4096, help="input length of step 2 (the v4 checkpoint)")
    demo.add_argument("--quick", action="store_true", help="train the step-3 summariser for a few steps only")
    demo.add_argument("--copy", action="store_true", help="step 3 with the SPACES copy mechanism")

    convert = command(sub, "convert", "convert BERT or older NEZHA checkpoints into NEZHA",
                      _examples("nezha-hf convert bert bert-base-chinese/ nezha-from-bert/")).add_subparsers(
        dest="source_format", required=True, metavar="SOURCE_FORMAT", help="what the source is")
    bert = command(convert, "bert", "a Hugging Face BERT folder (safetensors or .bin, any head)",
                   _examples("nezha-hf convert bert bert-base-chinese/ nezha-from-bert/"), parent="convert")
    bert.add_argument("source", help="BERT folder with config.json and weights")
    _add_conversion_options(bert)
    bert.add_argument("--max-relative-position", type=COUNT, help="K of the new model (default: NezhaConfig's)")
    bert.add_argument("--add-characters", nargs="+", default=[], metavar="CORPUS",
                      help=".txt / .jsonl files or folders: add the characters of their text that the BERT reads as "
                           "[UNK] to its vocabulary (new rows: the mean of the old), then `pretrain` on them")
    bert.add_argument("--hierarchical-positions", action="store_true",
                      help="instead of NEZHA: a BERT of the same head whose learned positions are extended "
                           "hierarchically (no training; loads with transformers alone)")
    bert.add_argument("--alpha", type=_number(float, 0.0, 1.0, high_open=True),
                      help="with --hierarchical-positions: the decomposition's alpha, in [0.05, 0.45] or [0.55, 0.95] "
                           "(default: 0.4)")
    bert.add_argument("--max-length", type=COUNT,
                      help="with --hierarchical-positions: positions to write, more than the BERT's and at most their "
                           "square (default: that square, at most 16,384)")
    tf = command(convert, "tf", "a TensorFlow checkpoint, Google BERT or Huawei NEZHA naming (needs nezha_hf[tf])",
                 _examples("nezha-hf convert tf chinese_L-12_H-768_A-12/bert_model.ckpt nezha-tf/ \\",
                           "    --config chinese_L-12_H-768_A-12/bert_config.json --vocab chinese_L-12_H-768_A-12/vocab.txt"),
                 parent="convert")
    tf.add_argument("checkpoint", help="checkpoint prefix, e.g. model.ckpt-900000")
    _add_conversion_options(tf)
    tf.add_argument("--config", required=True, help="bert_config.json")
    tf.add_argument("--vocab", help="vocab.txt (copied beside the model, with a tokenizer config)")
    tf.add_argument("--max-relative-position", type=COUNT, help="K (default: the config's, else NezhaConfig's)")
    tf.add_argument("--cased", action="store_true", help="do not lower-case (the Chinese releases lower-case)")
    legacy = command(convert, "nezha", "an older PyTorch NEZHA release (bert. prefix, persisted buffers), or any "
                     "NEZHA folder whose tokenizer caps the length at 512",
                     _examples("nezha-hf convert nezha nezha-cn-base-old/ nezha-cn-base/"), parent="convert")
    legacy.add_argument("source", help="the release's folder")
    _add_conversion_options(legacy)

    pretrain = command(sub, "pretrain", "continue masked-LM training (after converting a BERT)",
                       _examples("nezha-hf pretrain nezha-from-bert/ corpus/ --output nezha-adapted/ --max-steps 20000",
                                 "accelerate launch --num_processes 4 -m nezha_hf pretrain nezha-from-bert/ corpus/ \\",
                                 "    --output nezha-adapted/ --max-steps 20000 --fsdp"))
    pretrain.add_argument("model", help="NEZHA checkpoint folder (with tokenizer)")
    pretrain.add_argument("files", nargs="+", help=".txt / .jsonl files or folders")
    pretrain.add_argument("--output", required=True,
                          help="the final model's folder (Trainer checkpoints go to OUTPUT.checkpoints, resumed on rerun)")
    pretrain.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output folder")
    pretrain.add_argument("--max-length", type=_number(int, 8), default=1024, help="tokens per packed sequence")
    pretrain.add_argument("--mlm-probability", type=_number(float, 1e-6, 1.0, high_open=True), default=0.15,
                          help="share of the tokens masked (whole jieba words)")
    pretrain.add_argument("--txt-split", default="blank-lines",
                          help="how a .txt file splits into documents: file, blank-lines or lines")
    _add_encoding(pretrain)
    pretrain.add_argument("--max-steps", type=_number(int, -1), default=-1,
                          help="optimizer steps; -1: as many as --epochs make")
    pretrain.add_argument("--epochs", type=POSITIVE, default=1.0, help="passes over the data (unless --max-steps)")
    pretrain.add_argument("--batch-size", type=COUNT, default=8, help="sequences per step and process")
    pretrain.add_argument("--gradient-accumulation-steps", type=COUNT, default=1, help="batches per optimizer step")
    pretrain.add_argument("--learning-rate", type=POSITIVE, default=5e-5, help="peak learning rate (linear decay)")
    pretrain.add_argument("--save-steps", type=COUNT, default=500, help="steps between checkpoints")
    pretrain.add_argument("--bf16", action="store_true", help="train in bfloat16 mixed precision")
    pretrain.add_argument("--no-resume", action="store_true",
                          help="start over, deleting the checkpoints of an earlier run in OUTPUT.checkpoints")
    pretrain.add_argument("--seed", type=int, default=42, help="seed of the masking and the data order")
    pretrain.add_argument("--fsdp", action="store_true",
                          help="with several processes (accelerate launch, torchrun): shard the model with "
                               "transformers' FSDP2 instead of a whole copy per process (DDP)")

    summarize = command(sub, "summarize", "summarise judgments: extract with NEZHA, then generate",
                        _examples("nezha-hf summarize my-summarizer/ judgments/ more.jsonl --output summaries.jsonl",
                                  "torchrun --nproc_per_node 4 -m nezha_hf summarize my-summarizer/ judgments/ "
                                  "--output summaries.jsonl"))
    summarize.add_argument("model", help="a summariser folder (from train-summarizer)")
    summarize.add_argument("inputs", nargs="+", help=".txt files, folders, or JSONL (CAIL2020 or a `text` string)")
    summarize.add_argument("--output", type=Path,
                           help="JSONL (one {id, summary, extracted} per input) or .txt (id line, summary line, blank "
                                "line; a summary's line breaks written as spaces); default: standard output")
    summarize.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    summarize.add_argument("--no-resume", action="store_true",
                           help="start over, deleting the finished batches an earlier run kept beside --output")
    summarize.add_argument("--extract-only", action="store_true", help="output the extracted sentences")
    summarize.add_argument("--batch-size", type=COUNT, default=4, help="judgments generated together")
    summarize.add_argument("--threshold", type=PROBABILITY,
                           help="extraction probability threshold (default: the summariser's own)")
    summarize.add_argument("--token-budget", type=COUNT,
                           help="tokens of extracted source given to the generator (default: the summariser's own)")
    summarize.add_argument("--num-beams", type=COUNT, help="beams of the generator (default: the summariser's own)")
    summarize.add_argument("--no-copy-constraint", action="store_true",
                           help="decode freely even if the generator has a copy head")
    summarize.add_argument("--max-new-tokens", type=COUNT, default=512, help="longest summary, in tokens")
    _add_length_limit(summarize)
    _add_encoding(summarize)

    train = command(sub, "train-summarizer", "train the extractor and the generator from CAIL2020 JSONL",
                    _examples("nezha-hf train-summarizer cail2020_train.jsonl --base nezha-cn-base/ "
                              "--output my-summarizer/"))
    train.add_argument("data", nargs="+", help="CAIL2020 JSONL with summaries (labels optional: oracle otherwise)")
    train.add_argument("--base", required=True, help="NEZHA checkpoint with tokenizer to start from")
    train.add_argument("--output", required=True, type=Path,
                       help="the summariser folder (Trainer checkpoints go to OUTPUT.checkpoints, resumed on rerun)")
    train.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output folder")
    train.add_argument("--no-resume", action="store_true",
                       help="start over, deleting the checkpoints of an earlier run in OUTPUT.checkpoints")
    train.add_argument("--validation-fraction", type=RATE, default=0.1, help="share of judgments held out")
    train.add_argument("--epochs", type=POSITIVE, default=3.0,
                       help="passes over the training judgments, for each stage (one judgment per step and process)")
    train.add_argument("--extractor-steps", type=STEPS, help="training steps of the extractor (instead of --epochs)")
    train.add_argument("--generator-steps", type=STEPS, help="training steps of the generator (instead of --epochs)")
    train.add_argument("--max-length", type=_number(int, 8), default=1024, help="generator source + summary tokens")
    train.add_argument("--learning-rate", type=POSITIVE, default=5e-5, help="peak learning rate of both stages")
    train.add_argument("--save-steps", type=COUNT, default=500, help="steps between checkpoints")
    train.add_argument("--copy", action="store_true",
                       help="SPACES copy mechanism: copy tags trained jointly, copied spans follow source n-grams")
    _add_length_limit(train)
    _add_encoding(train)

    export = command(sub, "export", "export a model for serving",
                     _examples("nezha-hf export onnx my-nezha/ my-nezha.onnx")).add_subparsers(
        dest="format", required=True, metavar="FORMAT", help="the format to write")
    onnx = command(export, "onnx", "ONNX (dynamic batch and length), checked with onnxruntime before it is written",
                   _examples("nezha-hf export onnx my-nezha/ my-nezha.onnx",
                             "nezha-hf export onnx my-summarizer/ my-summarizer-onnx/"), parent="export")
    onnx.add_argument("model", help="a NEZHA model folder (an encoder head), or a summariser folder (train-summarizer)")
    onnx.add_argument("output", help="the .onnx file to write; for a summariser, the folder to write")
    onnx.add_argument("--atol", type=POSITIVE, default=1e-4, help="largest allowed |onnxruntime - PyTorch|")
    onnx.add_argument("--overwrite", action="store_true", help="replace an existing output")
    onnx.add_argument("--greedy", action="store_true",
                      help="for a summariser that decodes with beams: export it decoding greedily (an exported "
                           "summariser has no beam search, so its summaries can differ from the trained one's)")

    launch = command(sub, "accelerate-config", "print the path of an `accelerate launch` config installed with nezha_hf",
                     _examples('accelerate launch --config_file "$(nezha-hf accelerate-config one-machine)" \\',
                               "    --num_processes 2 -m nezha_hf pretrain MODEL CORPUS --output OUT --fsdp"))
    launch.add_argument("name", choices=LAUNCH_CONFIGS, help="one machine with several processes, or two machines")

    evaluate = command(sub, "evaluate", "ROUGE-1/2/L and CAIL score, over characters and jieba words",
                       _examples("nezha-hf evaluate cail2020_test.jsonl --predictions summaries.jsonl"))
    evaluate.add_argument("data", nargs="+", help="judgments with reference summaries (CAIL2020 JSONL)")
    evaluate.add_argument("--predictions", type=Path, help="JSONL of {id, summary} to score (e.g. from summarize)")
    evaluate.add_argument("--lead", type=COUNT, default=3, help="N of the lead-N baseline")
    evaluate.add_argument("--output", type=Path, help="write the scores as JSON here")
    evaluate.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    _add_length_limit(evaluate)
    _add_encoding(evaluate)
    return parser


def _add_length_limit(parser):
    parser.add_argument("--max-characters", type=COUNT,
                        help="refuse a judgment longer than this, before any work (default: 100,000 characters; real "
                             "judgments have up to about 13,000, and attention time grows with the square of the length)")


def _add_encoding(parser):
    parser.add_argument("--encoding", type=_encoding,
                        help="the encoding of input files that are neither UTF-8 nor UTF-16 (told from their bytes), "
                             "e.g. gb18030, which reads GBK and GB2312 too (default: such files are refused)")


def _summarize(args) -> None:
    from nezha_hf.cail import input_files
    from nezha_hf.summarization import summaries_text, summarize_files

    done = summarize_files(
        args.model, args.inputs, args.output, overwrite=args.overwrite, resume=not args.no_resume,
        extract_only=args.extract_only, batch_size=args.batch_size, threshold=args.threshold,
        token_budget=args.token_budget, num_beams=args.num_beams,
        copy_constraint=False if args.no_copy_constraint else None, max_new_tokens=args.max_new_tokens,
        max_characters=args.max_characters, encoding=args.encoding)
    if done is None:  # not the main process of a multi-process run
        return
    if args.output:
        count = len(done.results)
        print(f"wrote {count} summar{'y' if count == 1 else 'ies'} to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(summaries_text(done.results))
    if done.left_out:  # said again at the end, where a long run's reader looks
        print(f"left out {input_files(done.left_out)} that could not be read (named before the work began)",
              file=sys.stderr)


def _train_summarizer(args) -> None:
    from nezha_hf.cail import read_command_inputs
    from nezha_hf.checkpoints import model_folder
    from nezha_hf.distributed import processes
    from nezha_hf.summarization import train_summarizer

    model_folder(args.base)
    judgments, _ = read_command_inputs(args.data, args.max_characters, args.encoding)
    metrics = train_summarizer(
        judgments, args.base, args.output,
        validation_fraction=args.validation_fraction,
        epochs=args.epochs, extractor_steps=args.extractor_steps, generator_steps=args.generator_steps, max_length=args.max_length,
        learning_rate=args.learning_rate, save_steps=args.save_steps, copy_mechanism=args.copy,
        overwrite=args.overwrite, resume=not args.no_resume, encoding=args.encoding,
    )
    if processes().is_main_process:
        print(f"saved {args.output}; " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))


def _evaluate(args) -> None:
    import json

    from nezha_hf.cail import read_command_inputs, read_predictions
    from nezha_hf.safe_output import check_destination, write_text_atomically
    from nezha_hf.summarization import evaluate_summaries, format_scores

    if args.output:
        check_destination(args.output, [*args.data, *([args.predictions] if args.predictions else [])], args.overwrite,
                          kind="file")
    predictions = None
    if args.predictions:
        if not args.predictions.is_file():
            raise FileNotFoundError(f"No such predictions file: {args.predictions}")
        predictions = read_predictions(args.predictions, args.encoding)
    judgments, _ = read_command_inputs(args.data, args.max_characters, args.encoding)
    results = evaluate_summaries(judgments, predictions, lead_count=args.lead, predictions_file=args.predictions)
    print(format_scores(results))
    if args.output:
        write_text_atomically(args.output, json.dumps(results, indent=2, ensure_ascii=False) + "\n",
                              overwrite=args.overwrite)


def _convert(args) -> None:
    from nezha_hf.conversion import convert_bert, convert_legacy_nezha, convert_tf

    if args.source_format == "bert" and args.hierarchical_positions:
        from nezha_hf.conversion import HIERARCHICAL_ALPHA, convert_bert_hierarchical

        if (args.architecture or args.allow_missing or args.max_relative_position or args.remote_code
                or args.add_characters):
            raise ValueError("--hierarchical-positions writes a BERT: --architecture, --allow-missing, "
                             "--max-relative-position, --remote-code and --add-characters are for NEZHA outputs")
        report = convert_bert_hierarchical(args.source, args.output, HIERARCHICAL_ALPHA if args.alpha is None
                                           else args.alpha, args.max_length, overwrite=args.overwrite)
    elif args.source_format == "bert":
        if args.alpha is not None or args.max_length is not None:
            raise ValueError("--alpha and --max-length go with --hierarchical-positions")
        report = convert_bert(args.source, args.output, args.architecture, args.allow_missing,
                              args.max_relative_position, args.remote_code, overwrite=args.overwrite,
                              add_characters_from=args.add_characters)
    elif args.source_format == "tf":
        report = convert_tf(args.checkpoint, args.output, args.config, args.vocab, args.architecture, args.allow_missing,
                            args.max_relative_position, do_lower_case=not args.cased, remote_code=args.remote_code,
                            overwrite=args.overwrite)
    else:
        report = convert_legacy_nezha(args.source, args.output, args.architecture, args.allow_missing,
                                      args.remote_code, overwrite=args.overwrite)
    print(report.summary())


def _demo(args) -> None:
    from nezha_hf.demo import run_demo

    run_demo(args.workdir, args.tokens, args.quick, args.copy)


def _pretrain(args) -> None:
    from nezha_hf.checkpoints import model_folder
    from nezha_hf.distributed import processes
    from nezha_hf.documents import TXT_SPLITS
    from nezha_hf.pretraining import continue_pretraining

    if args.txt_split not in TXT_SPLITS:  # not an argparse choice: listing them there would load PyTorch
        raise ValueError(f"--txt-split must be one of {', '.join(TXT_SPLITS)}; got {args.txt_split!r}")
    model_folder(args.model)
    metrics = continue_pretraining(
        args.model, args.files, args.output, max_length=args.max_length, mlm_probability=args.mlm_probability,
        txt_split=args.txt_split, encoding=args.encoding, resume=not args.no_resume, max_steps=args.max_steps,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, save_steps=args.save_steps, bf16=args.bf16, seed=args.seed,
        overwrite=args.overwrite, fsdp=args.fsdp,
    )
    if processes().is_main_process:
        print(f"saved {args.output}; " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))


def _export(args) -> None:
    from nezha_hf.export import export_onnx, export_summarizer
    from nezha_hf.summarization import SETTINGS_FILE

    if (Path(args.model) / SETTINGS_FILE).is_file():
        report = export_summarizer(args.model, args.output, atol=args.atol, overwrite=args.overwrite,
                                   greedy=args.greedy)
    elif args.greedy:
        raise ValueError(f"--greedy is for summarisers; {args.model} has no {SETTINGS_FILE}")
    else:
        report = export_onnx(args.model, args.output, atol=args.atol, overwrite=args.overwrite)
    print(report.summary())


def _accelerate_config(args) -> None:
    from importlib import resources

    print(resources.files("nezha_hf") / "launch_configs" / f"{args.name}.yaml")


COMMANDS = {"accelerate-config": _accelerate_config, "export": _export, "demo": _demo, "convert": _convert, "pretrain": _pretrain, "summarize": _summarize,
            "train-summarizer": _train_summarizer, "evaluate": _evaluate}


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that what it was writing is cleaned up on the way out."""


_STOPPED_BY = {signal.SIGINT: ("interrupted", 130), signal.SIGTERM: ("terminated", 143)}


class _StopOnSignals:
    """While the command runs: SIGINT raises `KeyboardInterrupt` and SIGTERM `Terminated` where the main thread is,
    and `received` records them, however a library wraps the exception.

    Python runs a handler between any two bytecodes of the main thread, a finalizer's (`__del__`, a weakref or garbage
    collector callback) too, where the exception it raises is reported as unraisable and dropped: the command would go
    on as if no signal had come. So an exception of ours that reaches `sys.unraisablehook` is delivered again (the
    signal simulated with `_thread.interrupt_main`) from a watcher thread, every 50 ms until one is raised outside a
    finalizer; one simulated after that (the watcher's race with the raise) is ignored, so that it cannot cut short
    the cleanup the raise set off."""

    def __init__(self):
        self.received: list[int] = []
        self.dropped = threading.Event()  # our exception was dropped: deliver it again
        self.redelivered = False  # a delivery the watcher simulated, not yet handled
        self.finished = threading.Event()

    def stop(self, signum, frame):
        self.received.append(signum)
        simulated, self.redelivered = self.redelivered, False
        if simulated and not self.dropped.is_set():
            return  # the raise it was for already happened
        if _running(frame, self.note_dropped.__code__):
            return  # raised here it would be dropped for good; the watcher delivers it again
        self.dropped.clear()
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()

    def note_dropped(self, unraisable):
        if self.received and isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
            self.dropped.set()
        else:
            self.previous_hook(unraisable)

    def watch(self):
        while not self.finished.wait(0.05):
            if self.dropped.is_set():
                self.redelivered = True
                _thread.interrupt_main(self.received[0])

    def __enter__(self):
        self.previous = {signum: signal.signal(signum, self.stop) for signum in _STOPPED_BY}
        self.previous_hook, sys.unraisablehook = sys.unraisablehook, self.note_dropped
        self.watcher = threading.Thread(target=self.watch, name="nezha-hf signal watcher", daemon=True)
        self.watcher.start()
        return self

    def __exit__(self, *exception):
        self.finished.set()
        self.watcher.join()
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if sys.unraisablehook == self.note_dropped:  # not if the command's end silenced finalizers on purpose
            sys.unraisablehook = self.previous_hook


def _running(frame, code) -> bool:
    """Whether `frame` or a frame it was called from runs `code`."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _leave_process_group() -> None:
    """End a multi-process run's process group (`accelerate launch`, `torchrun`) before exit: gloo's threads, left
    running, can abort the interpreter at teardown, failing a run that succeeded."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


def _new_line_if_a_progress_bar_is_drawing() -> str:
    bar = getattr(sys.modules.get("tqdm.std"), "tqdm", None)
    return "\n" if bar is not None and any(not getattr(b, "disable", True) for b in list(bar._instances)) else ""


def main(argv=None, progs: dict[str, str] | None = None) -> int:
    """Entry point of the `nezha-hf` console script; returns the exit status: 0; 2 on any failure; 130 after
    Ctrl-C and 143 after SIGTERM, with what the command was writing removed. `progs`: see `build_parser`."""
    process = argv is None  # run as the `nezha-hf` process, not called from Python: it ends with this call
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(progs)
    if not argv:  # what there is to do, rather than "the following arguments are required"
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    signals = _StopOnSignals()
    received = signals.received  # the signal that stopped the command, however a library wrapped the exception
    try:
        with signals:
            COMMANDS[args.command](args)
            _leave_process_group()
    except SystemExit:
        raise
    # BaseException: PyTorch's distributed checkpoints wrap what interrupted them in a non-`Exception` of their own.
    except BaseException as error:
        if args.debug:
            raise
        if received or isinstance(error, (KeyboardInterrupt, Terminated)):
            how, code = _STOPPED_BY[received[0] if received else signal.SIGINT]
            # What the signal cut short (a distributed-checkpoint writer mid-save) may fail again in its finalizer as
            # the interpreter exits, printing "Exception ignored in ..." after the one line below; it is the same stop.
            sys.unraisablehook = lambda unraisable: None
            # On a line of its own: a progress bar may have been drawing when the signal came.
            print(f"\nnezha-hf {args.command}: {how}; outputs not yet in place were removed", file=sys.stderr)
            return code
        # Every failure: one line naming the problem, unless --debug asks for more.
        message = " ".join(str(error).split()) or type(error).__name__
        if process:
            # What failed may fail again in a finalizer as it is freed, up to the interpreter's exit: torch's
            # distributed-checkpoint writer, cut short by a full disk, flushes a file its failed save closed
            # ("Exception ignored in ... ValueError: flush of closed file"; Python 3.13 prints what an `io` finalizer
            # raises, 3.11 did not). It is the same failure, said in the one line below.
            sys.unraisablehook = lambda unraisable: None
        print(f"{_new_line_if_a_progress_bar_is_drawing()}nezha-hf {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
