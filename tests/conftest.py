"""Test-wide setup: no network, and the fixtures every module uses. Shared helpers are in `helpers.py`."""

import ipaddress
import os
import socket

# Triton's kernels run on CPU tensors through its interpreter (tests/test_triton_attention.py), which Triton decides
# when it is imported: before anything imports it. nezha_hf runs them on the CPU only when `nezha_triton` is asked for.
os.environ["TRITON_INTERPRET"] = "1"
from types import SimpleNamespace

import pytest
import torch
from helpers import make_tokenizer
from hypothesis import settings


import nezha_hf_cli as cli

# Tests never reach the network: offline mode for everything transformers and huggingface_hub do
# (inherited by subprocesses), and a guard that refuses any connection that is not loopback.
os.environ["HF_HUB_OFFLINE"] = "1"
_connect = socket.socket.connect


def _loopback_only_connect(self, address):
    host = address[0] if isinstance(address, tuple) else None
    if host is not None:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise OSError(f"tests must not use the network (tried to connect to {address})")
    return _connect(self, address)


socket.socket.connect = _loopback_only_connect

# Property tests draw the same examples on every run: a pass here is a pass in CI (float32 cases sit within a few
# units of their 1e-5 tolerance, and a new draw each run would make that a matter of luck).
settings.register_profile("nezha_hf", derandomize=True)
settings.load_profile("nezha_hf")


@pytest.fixture
def seed():
    torch.manual_seed(0)


@pytest.fixture
def tokenizer(tmp_path):
    return make_tokenizer(tmp_path / "tokenizer")


@pytest.fixture
def run_cli(capsys):
    """`nezha-hf ARGS` in this process: returns (exit status, stdout, stderr)."""

    def run(*args):
        capsys.readouterr()
        try:
            code = cli.main(list(map(str, args)))
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.fixture
def attention_calls():
    """Every attention call the test makes, as `relative_attention.AttentionCall`s (which engine ran, and why)."""
    from nezha_hf.relative_attention import recorded_attention_calls

    with recorded_attention_calls() as calls:
        yield calls
