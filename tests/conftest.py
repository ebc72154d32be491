import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

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
