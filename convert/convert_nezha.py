"""Convert an older PyTorch NEZHA release (`bert.` prefix, persisted buffers, `NeZha*` class names) into NEZHA.

    python convert/convert_nezha.py OLD_NEZHA_DIR OUT_DIR

The same as `nezha-hf convert nezha` (`--help` lists every option); the library function is
`nezha_hf.conversion.convert_legacy_nezha`. Needs nezha_hf installed (`pip install -e .` in this repository).
"""

import sys

from nezha_hf_cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "nezha", *sys.argv[1:]], progs={"convert nezha": f"python {sys.argv[0]}"}))
