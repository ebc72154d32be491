"""Convert a Hugging Face BERT folder (any head; safetensors or .bin, sharded or not) into NEZHA.

    python convert/convert_bert.py BERT_DIR OUT_DIR [--architecture NezhaForMaskedLM] [--allow-missing PATTERN] [--max-relative-position K]

The same as `nezha-hf convert bert` (`--help` lists every option); the library function is
`nezha_hf.conversion.convert_bert`. Needs nezha_hf installed (`pip install -e .` in this repository).
"""

import sys

from nezha_hf_cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "bert", *sys.argv[1:]], progs={"convert bert": f"python {sys.argv[0]}"}))
