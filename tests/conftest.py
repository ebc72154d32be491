import ipaddress
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
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

FIXTURES = Path(__file__).parent / "fixtures" / "nezha-v4-reference"


def tiny_config(**overrides):
    from nezha_hf import NezhaConfig

    values = dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_relative_position=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    values.update(overrides)
    return NezhaConfig(**values)


@pytest.fixture
def seed():
    torch.manual_seed(0)


# A tiny Chinese vocabulary: special tokens, then characters (ids 5 onwards).
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CHARACTERS = list("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你原告被判决法院")


def make_tokenizer(directory):
    """A `BertTokenizerFast` over `SPECIAL_TOKENS + CHARACTERS`, saved in `directory`."""
    from transformers import BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL_TOKENS + CHARACTERS) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast.from_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture
def tokenizer(tmp_path):
    return make_tokenizer(tmp_path / "tokenizer")
