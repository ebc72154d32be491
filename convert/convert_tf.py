"""Convert a TensorFlow checkpoint in Google BERT or Huawei NEZHA naming (needs `pip install "nezha_hf[tf]"`) into NEZHA.

    python convert/convert_tf.py CKPT_PREFIX OUT_DIR --config bert_config.json --vocab vocab.txt

The same as `nezha-hf convert tf` (`--help` lists every option); the library function is
`nezha_hf.conversion.convert_tf`. Needs nezha_hf installed (`pip install -e .` in this repository).
"""

import sys

from nezha_hf_cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "tf", *sys.argv[1:]], progs={"convert tf": f"python {sys.argv[0]}"}))
