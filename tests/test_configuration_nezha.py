"""NezhaConfig: v4-era configs load; values the model cannot honour are refused."""

import pytest
import transformers
from helpers import FIXTURES, tiny_config

import nezha_hf


@pytest.mark.parametrize("overrides,message", [
    (dict(hidden_act="relu9"), "hidden_act"),
    (dict(max_relative_position=0), "max_relative_position"),
    (dict(hidden_size=30, num_attention_heads=4), "multiple"),
    (dict(hidden_size=12, num_attention_heads=4), "even"),
])
def test_bad_config_values_are_rejected(overrides, message):
    with pytest.raises(Exception, match=message):
        tiny_config(**overrides)


def test_legacy_layout_config_fields_kept():
    config = transformers.AutoConfig.from_pretrained(FIXTURES / "legacy-mlm-bert-prefix")
    assert isinstance(config, nezha_hf.NezhaConfig)
    assert config.architectures == ["NezhaForMaskedLM"]
    assert config.embedding_size == 128 and config.use_relative_position is True
