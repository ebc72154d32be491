"""The `nezha-hf` command line.

    nezha-hf demo [--tokens N] [--checkpoint DIR]   load a v4 checkpoint and run a long input
"""

import argparse
import sys


def main(argv=None):
    """Entry point of the `nezha-hf` console script."""
    parser = argparse.ArgumentParser(prog="nezha-hf", description="NEZHA for transformers v5")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="load a transformers 4.x checkpoint and run a 4,096-token input", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
