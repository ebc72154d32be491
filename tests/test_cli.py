"""The demo and the console script run end to end."""

import subprocess
import sys

from nezha_hf import cli


def test_demo_runs_a_long_input(capsys):
    cli.main(["demo", "--tokens", "700"])
    out = capsys.readouterr().out
    assert "load report: missing=none unexpected=none" in out
    assert "700 tokens" in out and "peak resident memory" in out
    difference = float(out.split("implementations: ")[1].split()[0])
    assert difference < 1e-4


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "nezha_hf.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout
