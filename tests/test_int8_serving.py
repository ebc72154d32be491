"""int8 CPU serving (`benchmarks/int8_serving.py`, docs/serving.md): torchao's int8 NEZHA classifier stays close to
float32, runs int8 products, and the benchmark writes what it measured with the machine it measured on."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks are scripts of the repository, not part of the package
pytest.importorskip("torchao", reason="int8 serving needs torchao: pip install -e '.[serving]'")

from benchmarks import int8_serving  # noqa: E402


def test_a_task_label_is_the_lexicon_with_most_cue_words():
    """Counted here from the ids: each text has `CUES` cue words, `[CLS]` first, `[SEP]` last, padding after it, and
    its label says which lexicon has the majority."""
    task = int8_serving.sentiment_task(64, 40, seed=3)
    positive = torch.isin(task["input_ids"], torch.tensor(list(int8_serving.POSITIVE))).sum(-1)
    negative = torch.isin(task["input_ids"], torch.tensor(list(int8_serving.NEGATIVE))).sum(-1)
    assert ((positive + negative) == int8_serving.CUES).all()
    assert torch.equal(task["labels"], (positive > negative).long())
    assert 0 < int(task["labels"].sum()) < 64
    lengths = task["attention_mask"].sum(-1)
    assert (task["input_ids"][:, 0] == int8_serving.CLS).all()
    assert (task["input_ids"][torch.arange(64), lengths - 1] == int8_serving.SEP).all()
    assert ((task["input_ids"] != 0) == task["attention_mask"].bool()).all()
    assert lengths.min() >= 20 and lengths.max() <= 40


def test_every_linear_becomes_int8_runs_int8_products_and_stays_near_float32():
    from torchao.quantization import Int8Tensor

    model = int8_serving.build_model(layers=2, hidden=128)
    quantized, report = int8_serving.quantized_int8(model)
    linears = [module for module in quantized.modules() if isinstance(module, torch.nn.Linear)]
    assert report["int8_linear_layers"] == report["linear_layers"] == len(linears) == 2 * 6 + 2
    assert all(isinstance(module.weight, Int8Tensor) and module.weight.qdata.dtype == torch.int8 for module in linears)
    assert not isinstance(model.classifier.weight, Int8Tensor)  # a copy was quantised, not the float32 model
    inputs = int8_serving.padded_batch(2, 48)
    with torch.no_grad():
        reference = model.nezha(**inputs).last_hidden_state
        ops = int8_serving.profiled_ops(lambda: quantized(**inputs))
        states = quantized.nezha(**inputs).last_hidden_state
    assert ops["aten::_int_mm"] == len(linears) and not any(op.startswith(int8_serving.FLOAT_PRODUCTS) for op in ops)
    error = (states - reference).norm(dim=-1) / reference.norm(dim=-1)
    real = inputs["attention_mask"].bool()
    assert error[real].max() < 0.05, error[real].max()
    assert error[real].median() > 0  # it did change something: int8, not float32 under another name


def test_a_model_quantize_left_in_float32_is_refused(monkeypatch):
    import torchao.quantization

    monkeypatch.setattr(torchao.quantization, "quantize_", lambda model, config: None)
    with pytest.raises(RuntimeError, match="14 of 14 nn.Linear layers without int8 weights"):
        int8_serving.quantized_int8(int8_serving.build_model(layers=2, hidden=128))


def test_a_variant_called_int8_that_multiplies_in_float_is_refused():
    """What the benchmark checks before it times anything: a model left in float32 (a `quantize_` that did nothing,
    a config that skipped the linears) is not reported as int8."""
    model = int8_serving.build_model(layers=2, hidden=128)
    inputs = int8_serving.padded_batch(2, 16)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"int8 eager ran 0 int8 and \d+ float matrix products"):
        int8_serving.checked_ops({"float32 eager": model, "int8 eager": model}, inputs, linear_layers=14)


@pytest.mark.slow
def test_the_benchmark_writes_its_figures_with_its_command_and_machine(tmp_path, monkeypatch):
    """Tiny sizes (about two minutes on 2 cores: each variant compiles): both files, one row per shape, the checks of
    int8 recorded, and int8's labels and logits near float32's."""
    from benchmarks import machine

    monkeypatch.setattr(machine, "RESULTS", tmp_path)
    monkeypatch.setattr(machine, "matmul_throughput", lambda *args, **kwargs: 1.0)
    argv = ["--layers", "2", "--hidden", "128", "--shapes", "1x32", "4x32", "--task-shape", "4x32", "--task-layers",
            "2", "--task-hidden", "128", "--train-examples", "64", "--train-steps", "20", "--eval-examples", "32",
            "--timed-model-examples", "16", "--repeats", "2", "--warmups", "1", "--output", "tiny"]
    int8_serving.main(argv)
    [folder] = tmp_path.iterdir()
    text = (folder / "tiny.md").read_text()
    recorded = json.loads((folder / "tiny.json").read_text())
    assert machine.machine_kind(recorded["machine"]) == folder.name
    assert text.startswith(f"Command: `python benchmarks/int8_serving.py {' '.join(argv)}`")
    assert re.search(r"^CPU: .+ \(has .+; lacks .+\), \d+ threads, torch \S+; float32 matmul [\d.]+ TFLOP/s", text,
                     flags=re.M)
    assert re.search(r"^int8 instructions: has .+; lacks .+\.$", text, flags=re.M)
    assert [(row["batch"], row["tokens"]) for row in recorded["rows"]] == [(1, 32), (4, 32)]
    for row in recorded["rows"]:
        assert all(len(row["samples_s"][name]) == 2 for name in int8_serving.VARIANTS)
        assert row["int8_vs_float32_compiled"] == row["int8 compiled_s"] / row["float32 compiled_s"] > 0
    assert recorded["profiled_ops"]["int8 compiled"]["aten::_int_mm"] == recorded["profiled_ops"]["int8 eager"][
        "aten::_int_mm"] == 14
    assert "aten::_int_mm" not in recorded["profiled_ops"]["float32 compiled"]
    assert recorded["attention"]["int8 compiled"] == recorded["attention"]["float32 compiled"]
    assert recorded["attention"]["int8 compiled"][0].startswith("nezha_hf::") and recorded["attention"]["eager"]
    for model in ("classifier", "timed model"):
        figures = recorded["accuracy"][model]
        assert figures["float32 compiled"]["relative_logit_error_overall"] < 1e-4
        for name in ("int8 eager", "int8 compiled"):
            assert 0 < figures[name]["relative_logit_error_overall"] < 0.05, (model, name, figures[name])
            assert figures[name]["agreement_with_float32_eager"] >= 0.9
    for line in text.splitlines():
        if line.startswith("| classifier | int8 compiled"):
            assert f"{recorded['accuracy']['classifier']['int8 compiled']['accuracy']:.4f}" in line


@pytest.mark.slow
def test_the_docs_int8_example_serves_a_saved_classifier(tmp_path, monkeypatch):
    """docs/serving.md's code, as written, on a tiny classifier saved where it looks: int8 linears, compiled, labels
    equal to the float32 model's."""
    from torchao.quantization import Int8Tensor

    from helpers import CHARACTERS, make_tokenizer
    from nezha_hf import NezhaConfig, NezhaForSequenceClassification

    folder = tmp_path / "my-nezha-classifier"
    tokenizer = make_tokenizer(folder)
    config = NezhaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, num_labels=3)
    torch.manual_seed(0)
    NezhaForSequenceClassification(config).save_pretrained(folder)
    texts = ["".join(CHARACTERS[:30]), "".join(CHARACTERS[5:12]), "".join(CHARACTERS[::-1][:20])]
    section = (ROOT / "docs" / "serving.md").read_text().split("## int8 on a CPU (torchao)")[1]
    code = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    namespace = {"texts": texts}
    exec(code, namespace)
    assert isinstance(namespace["model"]._orig_mod.classifier.weight, Int8Tensor)
    reference = NezhaForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference(**tokenizer(texts, padding=True, return_tensors="pt")).logits.argmax(-1)
    assert torch.equal(namespace["labels"], expected)
