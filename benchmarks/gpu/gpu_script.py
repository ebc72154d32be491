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


def number(value, digits: int) -> str:
    """A table cell: `value` with `digits` decimals, "-" for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def attention_cells(row: dict) -> dict[str, str]:
    """The cells both attention tables (gpu_attention.py's results, gpu_check.py's summary) give one row: NEZHA's and
    SDPA's ms (or the error of a step that failed), their ratio, the yardstick's three cells (ms, NEZHA / yardstick,
    yardstick / SDPA) and the blocks NEZHA's kernels ran."""
    return {"nezha": row.get("nezha_error") or number(row["nezha_ms"], 3),
            "sdpa": row.get("sdpa_error") or number(row["sdpa_ms"], 3),
            "ratio": number(row["ratio"], 2),
            "yardstick": f"{number(row.get('yardstick_ms'), 3)} | {number(row.get('nezha_over_yardstick'), 2)} | "
                         f"{number(row.get('yardstick_over_sdpa'), 2)}",
            "blocks": "; ".join(f"{kernel} {config}" for kernel, config in row.get("configs", {}).items()) or "-"}
