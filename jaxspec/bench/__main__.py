"""`python -m jaxspec.bench`: the Spec-Bench / agent-workload runner (`bench.cli.main`)
under the CLI contract (one `error:` line and exit 2 on bad input, 130 on Ctrl-C)."""

import sys

from jaxspec.bench.cli import main
from jaxspec.cli_support import run as run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
