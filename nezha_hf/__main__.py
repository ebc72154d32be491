"""`python -m nezha_hf`: the `nezha-hf` command line, for launchers (`accelerate launch -m nezha_hf ...`, `torchrun`)."""

import sys

from nezha_hf_cli import main

sys.exit(main())
