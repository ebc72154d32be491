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
    (dict(num_attention_heads=0), "num_attention_heads must be at least 1"),  # was a ZeroDivisionError
    (dict(num_hidden_layers=-1), "num_hidden_layers"),  # was a 0-layer model
    (dict(hidden_size=-32, num_attention_heads=4), "hidden_size must be at least 1"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps must be finite and at least"),  # was NaN outputs
    (dict(layer_norm_eps=1e-46), "layer_norm_eps must be finite and at least"),  # 0 in float32: NaN outputs
    (dict(layer_norm_eps=1e-39), "layer_norm_eps must be finite and at least"),  # a float32 subnormal
    (dict(attention_probs_dropout_prob=1.0), "attention_probs_dropout_prob"),
    (dict(hidden_dropout_prob=-0.1), "hidden_dropout_prob"),
    (dict(classifier_dropout=1.5), "classifier_dropout"),
    (dict(layer_norm_eps=float("inf")), "layer_norm_eps must be"),  # non-finite values were accepted
    (dict(initializer_range=float("nan")), "initializer_range"),
    (dict(copy_loss_weight=float("nan")), "copy_loss_weight"),
    (dict(copy_loss_weight=float("inf")), "copy_loss_weight"),
    (dict(hidden_dropout_prob=float("nan")), "hidden_dropout_prob"),
])
def test_bad_config_values_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_legacy_layout_config_fields_kept():
    config = transformers.AutoConfig.from_pretrained(FIXTURES / "legacy-mlm-bert-prefix")
    assert isinstance(config, nezha_hf.NezhaConfig)
    assert config.architectures == ["NezhaForMaskedLM"]
    assert config.embedding_size == 128 and config.use_relative_position is True
