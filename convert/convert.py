"""Convert checkpoints into NEZHA without installing the console script.

    python convert/convert.py bert  BERT_DIR OUT_DIR                 # Hugging Face BERT, any head
    python convert/convert.py tf    CKPT OUT_DIR --config bert_config.json --vocab vocab.txt   # needs nezha_hf[tf]
    python convert/convert.py nezha OLD_NEZHA_DIR OUT_DIR            # older PyTorch NEZHA release

Identical to `nezha-hf convert ...` (options: `--architecture`, `--allow-missing PATTERN`,
`--max-relative-position`; `--help` lists them). The library is `nezha_hf.conversion`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nezha_hf.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
