"""nezha_hf.export: ONNX files checked with onnxruntime, written only once verified."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import tiny_config

from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForSequenceClassification,
    NezhaForUniLM,
    NezhaModel,
)
from nezha_hf.export import export_onnx
from nezha_hf.relative_attention import Engine, recorded_attention_calls

onnxruntime = pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")


def padded_batch(length, rows=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.randint(0, 2, ids.shape, generator=generator)}


@pytest.mark.parametrize("cls", [NezhaModel, NezhaForMaskedLM, NezhaForSequenceClassification], ids=lambda c: c.__name__)
def test_onnx_matches_pytorch_at_any_length_with_padding(cls, tmp_path):
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3)).eval()  # the default attention; the ONNX graph has the gather formulation
    model.save_pretrained(tmp_path / "model")
    report = export_onnx(tmp_path / "model", tmp_path / "model.onnx")
    assert report.max_difference <= 1e-4 and sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.onnx"]
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    for length in (16, 600, 3000):
        inputs = padded_batch(length, seed=length)
        with torch.no_grad():
            expected = model(**inputs)
        got = session.run(None, {name: value.numpy() for name, value in inputs.items()})
        for name, value in zip(report.outputs, got):
            np.testing.assert_allclose(value, expected[name].numpy(), atol=1e-4, rtol=0, err_msg=f"{name} at {length}")


def test_exporting_a_model_object_leaves_its_attention_alone(tmp_path):
    """The export runs an eager copy; the caller's model must keep its linear-memory attention afterwards
    (it used to share the config, so the model was silently switched to the L x L gather path)."""
    model = NezhaForSequenceClassification(tiny_config()).eval()
    export_onnx(model, tmp_path / "model.onnx")
    with torch.no_grad(), recorded_attention_calls() as calls:
        model(**padded_batch(40))
    assert model.config._attn_implementation == Engine.FUSED.value
    assert {call.ran for call in calls} == {Engine.FUSED}, calls


def test_export_refuses_what_it_cannot_do_and_writes_nothing(tmp_path):
    torch.manual_seed(0)
    NezhaForUniLM(tiny_config()).save_pretrained(tmp_path / "unilm")
    with pytest.raises(ValueError, match="not exported"):
        export_onnx(tmp_path / "unilm", tmp_path / "unilm.onnx")
    (tmp_path / "old.onnx").write_bytes(b"keep me")
    NezhaModel(tiny_config()).save_pretrained(tmp_path / "model")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_onnx(tmp_path / "model", tmp_path / "old.onnx")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_onnx(tmp_path / "nowhere", tmp_path / "x.onnx")
    saved = sorted(p.name for p in (tmp_path / "model").iterdir())
    with pytest.raises(ValueError, match="source"):  # never written into its source
        export_onnx(tmp_path / "model", tmp_path / "model" / "model.onnx")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == saved
    assert (tmp_path / "old.onnx").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "old.onnx", "unilm"]


def test_cli_exports_and_says_it_verified(tmp_path):
    torch.manual_seed(0)
    NezhaForSequenceClassification(tiny_config(num_labels=2)).save_pretrained(tmp_path / "model")
    done = subprocess.run([sys.executable, "-m", "nezha_hf.cli", "export", "onnx", str(tmp_path / "model"),
                           str(tmp_path / "model.onnx")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "onnxruntime matches PyTorch to" in done.stdout and (tmp_path / "model.onnx").is_file()
