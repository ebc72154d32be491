"""`python -m nezha_hf`: the `nezha-hf` command line (also for launchers, e.g. `accelerate launch -m nezha_hf ...`)."""

import sys

from .cli import main

sys.exit(main())
