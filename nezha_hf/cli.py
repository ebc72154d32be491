"""The `nezha-hf` command line.

    nezha-hf demo                                    the main job, end to end
    nezha-hf convert bert SRC_DIR OUT_DIR            a Hugging Face BERT (any head) into NEZHA
    nezha-hf convert tf CKPT OUT_DIR --config bert_config.json --vocab vocab.txt
    nezha-hf convert nezha SRC_DIR OUT_DIR           an older PyTorch NEZHA release
    nezha-hf pretrain MODEL_DIR FILE... --output OUT continue masked-LM training (after converting a BERT)

`nezha-hf COMMAND --help` lists each command's options. Errors are printed as one line naming
the file at fault, with exit status 1.
"""

import argparse
import sys


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

    sub.add_parser("demo", help="the main job, end to end (see `nezha-hf demo --help`)", add_help=False)

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

    sub.add_parser("pretrain", help="continue masked-LM training (see `nezha-hf pretrain --help`)", add_help=False)
    return parser


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


def main(argv=None) -> int:
    """Entry point of the `nezha-hf` console script."""
    args, rest = build_parser().parse_known_args(argv)
    try:
        if args.command == "demo":
            from .demo import main as demo_main

            return demo_main(rest) or 0
        if args.command == "pretrain":
            from .pretraining import main as pretrain_main

            return pretrain_main(rest) or 0
        if rest:
            build_parser().error(f"unrecognised arguments: {' '.join(rest)}")
        _convert(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"nezha-hf {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
