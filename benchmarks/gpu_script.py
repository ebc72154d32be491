"""What the GPU check's scripts share before they import anything heavy (this module imports nothing but the standard
library): `--rehearse`, which runs them on the CPU with Triton's kernels through its interpreter, and writing a
results file whole.

Triton reads `TRITON_INTERPRET` once, when it is imported, and transformers may import it: a script calls
`rehearsing(sys.argv)` before it imports anything else.
"""

import os
from pathlib import Path


def rehearsing(argv: list[str]) -> bool:
    """Whether `argv` asks for a rehearsal (`--rehearse`); if so, switch Triton's interpreter on."""
    if "--rehearse" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


def write_staged(path: Path, text: str) -> None:
    """Write `path` whole or not at all: staged beside it, then renamed over it."""
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, path)
