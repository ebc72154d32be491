"""Every case saved by transformers 4.39.3 is reproduced at 1e-5, through the Auto classes."""

import json

import pytest
import torch
import transformers
from conftest import FIXTURES
from safetensors.torch import load_file

import nezha_hf
from nezha_hf import relative_attention

AUTO = {
    "NezhaModel": transformers.AutoModel,
    "NezhaForMaskedLM": transformers.AutoModelForMaskedLM,
    "NezhaForPreTraining": transformers.AutoModelForPreTraining,
    "NezhaForNextSentencePrediction": transformers.AutoModelForNextSentencePrediction,
    "NezhaForSequenceClassification": transformers.AutoModelForSequenceClassification,
    "NezhaForMultipleChoice": transformers.AutoModelForMultipleChoice,
    "NezhaForTokenClassification": transformers.AutoModelForTokenClassification,
    "NezhaForQuestionAnswering": transformers.AutoModelForQuestionAnswering,
}
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
INPUT_NAMES = ("input_ids", "token_type_ids", "attention_mask")


def test_all_fixture_cases_present():
    assert len(CASES) == 10, CASES


def run_case(name, attn_implementation, model_folder=None):
    """Load fixture `name` (or, if given, the checkpoint in `model_folder`) and compare with its outputs."""
    folder = FIXTURES / name
    case = json.loads((folder / "case.json").read_text())
    expected = load_file(folder / "expected.safetensors")
    model, info = AUTO[case["architecture"]].from_pretrained(
        model_folder or folder, output_loading_info=True, attn_implementation=attn_implementation
    )
    assert type(model).__name__ == case["architecture"]
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    model.eval()
    inputs = {k: expected[k] for k in INPUT_NAMES if k in expected}
    wants_attentions = any(k.startswith("attentions.") for k in expected)
    with torch.no_grad():
        outputs = model(**inputs, output_hidden_states=True, output_attentions=wants_attentions)
    compared = 0
    for key, reference in expected.items():
        if key in inputs:
            continue
        name, _, index = key.partition(".")
        got = getattr(outputs, name)
        got = got[int(index)] if index else got
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0, msg=f"{name}{index} differs")
        compared += 1
    assert compared >= 3


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("attn_implementation", [None, "eager"])
def test_fixture(name, attn_implementation):
    run_case(name, attn_implementation)


@pytest.mark.parametrize("name", CASES)
def test_fixture_through_three_regions(name, monkeypatch):
    # The fixtures are shorter than the length where the default switches to three regions:
    # force the switch so the fast path runs on real v4 checkpoints too.
    monkeypatch.setattr(relative_attention, "THREE_REGIONS_MIN_LENGTH", 1)
    run_case(name, nezha_hf.PYTORCH_ATTENTION)


def test_legacy_layout_config_fields_kept():
    config = transformers.AutoConfig.from_pretrained(FIXTURES / "legacy-mlm-bert-prefix")
    assert isinstance(config, nezha_hf.NezhaConfig)
    assert config.architectures == ["NezhaForMaskedLM"]
    assert config.embedding_size == 128 and config.use_relative_position is True
