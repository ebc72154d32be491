"""`--rehearse`: the GPU check's scripts run on the CPU, their Triton kernels through Triton's interpreter.

Triton reads `TRITON_INTERPRET` once, when it is imported, and transformers may import it: a script calls
`rehearsing(sys.argv)` before it imports anything else (this module imports nothing heavy).
"""

import os


def rehearsing(argv: list[str]) -> bool:
    """Whether `argv` asks for a rehearsal (`--rehearse`); if so, switch Triton's interpreter on."""
    if "--rehearse" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False
