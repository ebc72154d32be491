"""Converters: small BERTs saved in every layout, TensorFlow checkpoints written with TensorFlow, old NEZHA."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import (
    FIXTURES,
    SMALL_BERT,
    gamma_beta_name,
    make_tokenizer,
    run_case,
    save_layout,
    small_bert,
    snapshot,
)
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    BertModel,
)

import nezha_hf
from nezha_hf.conversion import (
    REPORT_NAME,
    TIED_DECODER,
    ConversionError,
    convert_bert,
    convert_legacy_nezha,
    convert_tf,
)
from nezha_hf.relative_attention import Engine

POSITION_TENSORS = {"embeddings.position_embeddings.weight", "embeddings.position_ids"}


def source_value(model, source_name):
    """The tensor `model` holds under a saved name (without `bert.`, or with the gamma/beta of `save_layout`)."""
    state = model.state_dict()
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", source_name))
    return state.get(name, state.get("bert." + name))


def expected_names(bert, layout):
    """Saved BERT name -> NEZHA name, from the two models' naming rules (not from the converter): the
    `bert.` prefix becomes `nezha.`, heads keep their names, and a bare encoder (no prefix) becomes a
    bare `NezhaModel`; the absolute position table and the decoder (tied to the word embeddings) have
    no NEZHA counterpart."""
    names = {}
    for name in bert.state_dict():
        if "position_embeddings" in name or name.startswith("cls.predictions.decoder."):
            continue
        if layout == "no-prefix":
            if name.startswith("bert."):
                names[name.removeprefix("bert.")] = name.removeprefix("bert.")
        else:
            names[name] = re.sub(r"^bert\.", "nezha.", name)
    if layout == "gamma-beta":
        names = {gamma_beta_name(source): target for source, target in names.items()}
    return names


def assert_converted_bit_identically(converted, bert, layout) -> dict[str, str]:
    """`converted` (the NEZHA tensors) holds exactly the expected names, each the BERT tensor bit for bit;
    returns the expected saved name -> NEZHA name map."""
    expected = expected_names(bert, layout)
    assert set(converted) == set(expected.values())
    for source_name, target in expected.items():
        assert torch.equal(converted[target], source_value(bert, source_name)), f"{source_name} -> {target}"
    return expected


@pytest.mark.parametrize("layout", ["safetensors", "bin-with-buffers", "gamma-beta", "no-prefix"])
def test_bert_converts_bit_identically(tmp_path, layout):
    bert = small_bert()
    save_layout(bert, tmp_path / "bert", layout)
    report = convert_bert(tmp_path / "bert", tmp_path / "nezha")

    converted = load_file(tmp_path / "nezha" / "model.safetensors")
    expected = assert_converted_bit_identically(converted, bert, layout)
    assert report.mapped == expected
    # Every kind of tensor came across.
    for part in ("word_embeddings", "token_type_embeddings", "embeddings.LayerNorm", "attention.self.query",
                 "attention.output.dense", "intermediate.dense", "output.LayerNorm", "pooler.dense"):
        assert any(part in target for target in converted), part
    if layout != "no-prefix":
        assert {"cls.predictions.bias", "cls.predictions.transform.dense.weight", "cls.seq_relationship.weight"} <= set(converted)

    dropped = {item["name"].removeprefix("bert.") for item in report.dropped if not item["reason"].startswith("tied")}
    expected_dropped = POSITION_TENSORS if layout == "bin-with-buffers" else {"embeddings.position_embeddings.weight"}
    assert dropped == expected_dropped
    tied = {item["name"] for item in report.dropped if item["reason"].startswith("tied")}
    saved_tied = layout in ("bin-with-buffers", "gamma-beta")  # .bin files hold the tied decoder as well
    assert tied == ({"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"} if saved_tied else set())

    saved_report = json.loads((tmp_path / "nezha" / REPORT_NAME).read_text())
    assert saved_report["dropped"] == report.dropped and saved_report["mapped"] == report.mapped
    auto = AutoModel if layout == "no-prefix" else AutoModelForPreTraining
    model, info = auto.from_pretrained(tmp_path / "nezha", output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == ("NezhaModel" if layout == "no-prefix" else "NezhaForPreTraining")
    assert (tmp_path / "nezha" / "vocab.txt").exists()


def test_converted_bert_runs_past_512_tokens(tmp_path):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    convert_bert(tmp_path / "bert", tmp_path / "nezha")
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "nezha").eval()
    with torch.no_grad():
        logits = model(torch.randint(5, 99, (1, 1500))).logits
    assert logits.shape == (1, 1500, 99) and torch.isfinite(logits).all()


def test_classifier_head_and_architecture_choice(tmp_path):
    save_layout(small_bert(BertForSequenceClassification, num_labels=3), tmp_path / "bert", "safetensors")
    report = convert_bert(tmp_path / "bert", tmp_path / "nezha")
    assert report.architecture == "NezhaForSequenceClassification"
    model, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "nezha", output_loading_info=True)
    assert not any(info.values()) and model.config.num_labels == 3


def test_missing_weights_are_an_error_unless_allowed(tmp_path):
    save_layout(small_bert(BertModel), tmp_path / "bert", "safetensors")
    with pytest.raises(ConversionError, match=r"cls\.predictions"):
        convert_bert(tmp_path / "bert", tmp_path / "a", architecture="NezhaForMaskedLM")
    report = convert_bert(tmp_path / "bert", tmp_path / "b", architecture="NezhaForMaskedLM",
                          allow_missing=["cls.predictions.*"])
    assert set(report.missing_allowed) == {
        "cls.predictions.bias", "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
    }
    # The BERT's pooler is kept (a classifier built on the masked LM reads it), and loads with no report.
    assert report.mapped["pooler.dense.weight"] == "nezha.pooler.dense.weight"


@pytest.mark.parametrize("bert_class", [BertModel, BertForMaskedLM])
def test_every_conversion_writes_a_pooler_so_a_classifier_built_on_it_is_the_same_at_every_load(tmp_path, bert_class):
    """Issue 57: BERT's pooler carried over where it has one, else drawn once and saved (a pooler drawn at each load
    made a classifier, and a PEFT adapter of it, differ from one load to the next)."""
    save_layout(small_bert(bert_class), tmp_path / "bert", "safetensors")
    architecture = "NezhaForMaskedLM" if bert_class is BertModel else None
    report = convert_bert(tmp_path / "bert", tmp_path / "nezha", architecture=architecture,
                          allow_missing=["cls.predictions.*"])
    poolers = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "nezha", num_labels=2)
        poolers.append(classifier.nezha.pooler.dense.weight.detach().clone())
    torch.testing.assert_close(poolers[0], poolers[1], rtol=0, atol=0)
    if bert_class is BertModel:
        torch.testing.assert_close(poolers[0], small_bert(bert_class).pooler.dense.weight.detach(), rtol=0, atol=0)
    else:
        assert any("no pooler" in note for note in report.notes)
    _, info = AutoModelForMaskedLM.from_pretrained(tmp_path / "nezha", output_loading_info=True)
    assert not info["unexpected_keys"]


def test_corrupt_inputs_name_the_file(tmp_path):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    weights = tmp_path / "bert" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConversionError, match="model.safetensors"):
        convert_bert(tmp_path / "bert", tmp_path / "out")
    weights.unlink()
    (tmp_path / "bert" / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(ConversionError, match="pytorch_model.bin"):
        convert_bert(tmp_path / "bert", tmp_path / "out")
    (tmp_path / "bert" / "pytorch_model.bin").unlink()
    with pytest.raises(ConversionError, match="No model.safetensors"):
        convert_bert(tmp_path / "bert", tmp_path / "out")


def test_shape_mismatch_is_an_error(tmp_path):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    config["intermediate_size"] = 40
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="intermediate.dense.weight: shape"):
        convert_bert(tmp_path / "bert", tmp_path / "out")


def test_legacy_nezha_release_converts_and_matches_v4_outputs(tmp_path):
    report = convert_legacy_nezha(FIXTURES / "legacy-mlm-bert-prefix", tmp_path / "nezha")
    reasons = {item["reason"] for item in report.dropped}
    assert reasons and all("buffer" in reason or reason.startswith("tied") for reason in reasons)
    assert sum("positions_encoding" in item["name"] for item in report.dropped) == 2  # one per layer
    assert "use_relative_position" in report.config_dropped
    run_case("legacy-mlm-bert-prefix", None, model_folder=tmp_path / "nezha")


def test_cli_convert_prints_the_report(tmp_path):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    done = subprocess.run(
        [sys.executable, "-m", "nezha_hf", "convert", "bert", str(tmp_path / "bert"), str(tmp_path / "nezha")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "position_embeddings" in done.stdout and "absolute position embeddings" in done.stdout
    failed = subprocess.run(
        [sys.executable, "-m", "nezha_hf", "convert", "bert", str(tmp_path / "nowhere"), str(tmp_path / "x")],
        capture_output=True, text=True, timeout=300,
    )
    assert failed.returncode == 2 and "nowhere" in failed.stderr


def tf_variables(bert, naming):
    """The BERT weights under Google's TF names (kernels `[in, out]`), written out here independently of the
    converter. NEZHA naming has no position table and carries Adam slots and a global step, as Huawei's release."""
    values = {}
    for name, tensor in bert.state_dict().items():
        if name.startswith("cls.predictions.decoder") or (naming == "nezha" and "position_embeddings" in name):
            continue
        array = tensor.numpy()
        tf_name = re.sub(r"layer\.(\d+)", r"layer_\1", name).replace(".", "/")
        if "LayerNorm" in tf_name:
            tf_name = re.sub(r"/weight$", "/gamma", re.sub(r"/bias$", "/beta", tf_name))
        elif tf_name.endswith("_embeddings/weight"):
            tf_name = tf_name.removesuffix("/weight")
        elif tf_name.startswith("cls/seq_relationship"):
            tf_name = tf_name.replace("/weight", "/output_weights").replace("/bias", "/output_bias")
        elif tf_name == "cls/predictions/bias":
            tf_name = "cls/predictions/output_bias"
        elif tf_name.endswith("/weight"):
            tf_name, array = tf_name.removesuffix("/weight") + "/kernel", array.T
        values[tf_name] = np.ascontiguousarray(array)
    if naming == "nezha":
        for name in list(values):
            values[name + "/adam_m"] = np.zeros_like(values[name])
            values[name + "/adam_v"] = np.ones_like(values[name])
        values["global_step"] = np.array(900000, dtype=np.int64)
    return values


def write_tf_checkpoint(values, prefix):
    """Save variables with TF1's Saver, as Google BERT and Huawei NEZHA did."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.get_variable(name, initializer=value) for name, value in values.items()]
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, str(prefix))


@pytest.mark.parametrize("naming", ["bert", "nezha"])
def test_tensorflow_checkpoint_converts_tensor_by_tensor(tmp_path, naming):
    bert = small_bert()
    values = tf_variables(bert, naming)
    write_tf_checkpoint(values, tmp_path / "tf" / "model.ckpt-900000")
    config = {k: v for k, v in bert.config.to_dict().items() if k in (*SMALL_BERT, "type_vocab_size", "hidden_act",
              "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range")}
    (tmp_path / "bert_config.json").write_text(json.dumps(config))
    make_tokenizer(tmp_path / "vocab")

    report = convert_tf(tmp_path / "tf" / "model.ckpt-900000", tmp_path / "nezha",
                        config_file=tmp_path / "bert_config.json", vocab_file=tmp_path / "vocab" / "vocab.txt")
    assert report.architecture == "NezhaForPreTraining"
    converted = load_file(tmp_path / "nezha" / "model.safetensors")
    source = bert.state_dict()
    weights = [name for name in values if not name.endswith(("adam_m", "adam_v")) and name != "global_step"]
    assert len(report.mapped) == len(converted) == len(weights) - (naming == "bert")
    for target, tensor in converted.items():
        expected = source["bert." + target.removeprefix("nezha.")] if target.startswith("nezha.") else source[target]
        assert torch.equal(tensor, expected), target
    dropped = {item["name"]: item["reason"] for item in report.dropped}
    if naming == "bert":
        assert set(dropped) == {"bert/embeddings/position_embeddings"}
    else:
        assert dropped.pop("global_step") == "training counter"
        assert dropped and all(reason == "optimizer state" for reason in dropped.values())
        assert len(dropped) == 2 * len(weights)
    model, info = AutoModelForPreTraining.from_pretrained(tmp_path / "nezha", output_loading_info=True)
    assert not any(info.values())


def test_corrupt_tensorflow_checkpoint_names_the_file(tmp_path):
    bert = small_bert()
    write_tf_checkpoint(tf_variables(bert, "bert"), tmp_path / "tf" / "model.ckpt-1")
    data = next((tmp_path / "tf").glob("model.ckpt-1.data-*"))
    data.write_bytes(data.read_bytes()[:100])
    (tmp_path / "bert_config.json").write_text(json.dumps(SMALL_BERT))
    with pytest.raises(ConversionError, match="model.ckpt-1"):
        convert_tf(tmp_path / "tf" / "model.ckpt-1", tmp_path / "nezha", config_file=tmp_path / "bert_config.json")


@pytest.mark.parametrize("head", nezha_hf.NEZHA_HEADS, ids=lambda head: head.model_class.__name__)
def test_every_head_can_be_the_target_architecture(tmp_path, head):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    name = head.model_class.__name__
    # A BertForPreTraining has no classifier or QA outputs: those heads need them named as new.
    report = convert_bert(tmp_path / "bert", tmp_path / "nezha", architecture=name,
                          allow_missing=["classifier.*", "qa_outputs.*"])
    assert report.architecture == name
    model, info = head.model_class.from_pretrained(tmp_path / "nezha", output_loading_info=True)
    assert type(model) is head.model_class and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert set(info["missing_keys"]) <= {n for n in report.missing_allowed} | set(TIED_DECODER)


def test_an_unknown_architecture_lists_the_valid_ones(tmp_path):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    with pytest.raises(ConversionError, match=r"'NezhaEmbeddings' is not a NEZHA model class; choose from .*NezhaForSentenceExtraction"):
        convert_bert(tmp_path / "bert", tmp_path / "nezha", architecture="NezhaEmbeddings")


# --- nothing lost (issue: safe outputs) -------------------------------------------------------------------


@pytest.mark.parametrize("with_vocab", [False, True])
def test_converting_onto_the_source_is_refused_and_the_source_is_untouched(tmp_path, with_vocab, run_cli):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    if not with_vocab:
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (tmp_path / "bert" / name).unlink(missing_ok=True)
    before = snapshot(tmp_path / "bert")
    for destination in (tmp_path / "bert", tmp_path / "bert" / "inside", tmp_path):
        done = run_cli("convert", "bert", tmp_path / "bert", destination)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "source is never written" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert snapshot(tmp_path / "bert") == before


def test_an_existing_model_folder_is_kept_unless_overwrite_and_then_replaced_whole(tmp_path):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    other = tmp_path / "other"
    save_layout(small_bert(BertModel), other, "bin-with-buffers")  # a different model, as pytorch_model.bin
    before = snapshot(other)
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_bert(tmp_path / "bert", other)
    assert snapshot(other) == before
    # A conversion that fails half-way (no such head) leaves the folder as it was, vocab.txt included.
    with pytest.raises(ConversionError):
        convert_bert(tmp_path / "bert", other, architecture="NezhaForQuestionAnswering", overwrite=True)
    assert snapshot(other) == before
    convert_bert(tmp_path / "bert", other, overwrite=True)
    assert not (other / "pytorch_model.bin").exists()  # nothing of the old model is left beside the new one
    assert (other / "model.safetensors").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_non_bert_sources_are_refused_whatever_allow_missing_says(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConversionError, match="gpt2"):
        convert_bert(tmp_path / "gpt2", tmp_path / "out", architecture="NezhaModel", allow_missing=["*"])
    # A BERT-like config whose weights lack the encoder: allow_missing cannot cover core weights either.
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    state = load_file(tmp_path / "bert" / "model.safetensors")
    save_file({k: v for k, v in state.items() if "encoder.layer.1." not in k}, tmp_path / "bert" / "model.safetensors")
    with pytest.raises(ConversionError, match="encoder.layer.1"):
        convert_bert(tmp_path / "bert", tmp_path / "out", allow_missing=["*"])
    assert not (tmp_path / "out").exists()


# --- the command-line converters end to end ------------------------------------------------------------


def test_cli_convert_nezha_gives_the_v4_outputs(tmp_path, run_cli):
    done = run_cli("convert", "nezha", FIXTURES / "legacy-mlm-bert-prefix", tmp_path / "nezha")
    assert done.returncode == 0, done.stderr
    assert "positions_encoding" in done.stdout  # the persisted buffers are reported as dropped
    assert run_case("legacy-mlm-bert-prefix", None, model_folder=tmp_path / "nezha") == {Engine.FUSED}


def test_cli_convert_tf_with_huawei_naming(tmp_path, run_cli):
    bert = small_bert()
    write_tf_checkpoint(tf_variables(bert, "nezha"), tmp_path / "tf" / "model.ckpt-900000")
    config = {k: v for k, v in bert.config.to_dict().items() if k in (*SMALL_BERT, "type_vocab_size")}
    (tmp_path / "bert_config.json").write_text(json.dumps(config))
    make_tokenizer(tmp_path / "vocab")
    done = run_cli("convert", "tf", tmp_path / "tf" / "model.ckpt-900000", tmp_path / "nezha",
                   "--config", tmp_path / "bert_config.json", "--vocab", tmp_path / "vocab" / "vocab.txt")
    assert done.returncode == 0, done.stderr
    assert "optimizer state" in done.stdout and "training counter" in done.stdout
    assert_converted_bit_identically(load_file(tmp_path / "nezha" / "model.safetensors"), bert, "safetensors")
    assert (tmp_path / "nezha" / "vocab.txt").exists()


def save_sharded(model, directory, weight_format):
    """`model` in several shards with an index, as `save_pretrained(max_shard_size=...)` writes (or v4 did for .bin)."""
    directory.mkdir(parents=True)
    model.config.save_pretrained(directory)
    make_tokenizer(directory)
    state = {name: tensor.clone().contiguous() for name, tensor in model.state_dict().items()
             if not name.startswith("cls.predictions.decoder.")}
    names = sorted(state)
    shards = {f"model-0000{n + 1}-of-00003.{weight_format}": names[n::3] for n in range(3)}
    for file, members in shards.items():
        part = {name: state[name] for name in members}
        if weight_format == "safetensors":
            save_file(part, directory / file)
        else:
            torch.save(part, directory / file)
    index_name = "model.safetensors.index.json" if weight_format == "safetensors" else "pytorch_model.bin.index.json"
    weight_map = {name: file for file, members in shards.items() for name in members}
    (directory / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("weight_format", ["safetensors", "bin"])
def test_cli_convert_bert_from_shards_then_load_and_save_nezha_in_shards(tmp_path, run_cli, weight_format):
    bert = small_bert()
    save_sharded(bert, tmp_path / "bert", weight_format)
    done = run_cli("convert", "bert", tmp_path / "bert", tmp_path / "nezha")
    assert done.returncode == 0, done.stderr
    assert_converted_bit_identically(load_file(tmp_path / "nezha" / "model.safetensors"), bert, "safetensors")
    # A NEZHA checkpoint saved in shards loads back to the same weights.
    model = AutoModelForPreTraining.from_pretrained(tmp_path / "nezha")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    again, info = AutoModelForPreTraining.from_pretrained(tmp_path / "sharded", output_loading_info=True)
    assert not any(info.values()), info
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


# --- hierarchical positions: a BERT that reads long inputs untrained (issue 40) -----------------------------------


def hierarchical_reference(table, length, alpha):
    """bert4keras's hierarchical position embedding, position by position, in float64."""
    table = table.double()
    n = table.shape[0]
    rows = []
    for i in range(length):
        u_high = (table[i // n] - alpha * table[0]) / (1 - alpha)
        u_low = (table[i % n] - alpha * table[0]) / (1 - alpha)
        rows.append(alpha * u_high + (1 - alpha) * u_low)
    return torch.stack(rows)


@pytest.mark.parametrize("layout", ["safetensors", "bin-with-buffers"])
def test_hierarchical_positions_extend_a_bert_that_transformers_alone_loads(tmp_path, layout):
    from nezha_hf.conversion import convert_bert_hierarchical

    bert = small_bert()  # 64 learned positions
    save_layout(bert, tmp_path / "bert", layout)
    before = snapshot(tmp_path / "bert")
    report = convert_bert_hierarchical(tmp_path / "bert", tmp_path / "long", alpha=0.3, max_length=2048)
    assert snapshot(tmp_path / "bert") == before
    learned = bert.bert.embeddings.position_embeddings.weight.detach()
    extended = load_file(tmp_path / "long" / "model.safetensors")["bert.embeddings.position_embeddings.weight"]
    assert extended.shape == (2048, 32)
    assert torch.equal(extended[:64], learned)  # copied, not recomputed
    torch.testing.assert_close(extended.double(), hierarchical_reference(learned, 2048, 0.3), atol=1e-6, rtol=0)
    assert "extended to 2,048" in report.summary() and json.loads((tmp_path / "long" / REPORT_NAME).read_text())
    assert json.loads((tmp_path / "long" / "tokenizer_config.json").read_text())["model_max_length"] == 2048
    # Every other tensor as it was; a 2,000-token input runs with transformers alone (nezha_hf never imported).
    probe = ("import sys, torch, transformers\n"
             f"model = transformers.AutoModelForPreTraining.from_pretrained({str(tmp_path / 'long')!r}).eval()\n"
             "with torch.no_grad():\n"
             "    out = model(torch.randint(5, 99, (1, 2000)))\n"
             "assert torch.isfinite(out.prediction_logits).all() and out.prediction_logits.shape == (1, 2000, 99)\n"
             "print(type(model).__name__, 'nezha_hf' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["BertForPreTraining", "False"], done.stderr[-2000:]
    kept = BertForPreTraining.from_pretrained(tmp_path / "long").state_dict()
    for name, tensor in bert.state_dict().items():
        if "position" not in name:
            assert torch.equal(kept[name], tensor), name


def test_hierarchical_options_are_checked_in_one_line(tmp_path, run_cli):
    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    source, out = tmp_path / "bert", tmp_path / "long"
    # Round four: not only 0.5 but the range around it (and near 0 and 1), where positions (nearly) coincide.
    for alpha in ("0", "1e-9", "0.04", "0.46", "0.5", "0.5000001", "0.54", "0.96", "0.999999"):
        done = run_cli("convert", "bert", source, out, "--hierarchical-positions", "--alpha", alpha)
        assert done.returncode == 2 and "alpha must lie in [0.05, 0.45] or [0.55, 0.95]" in done.stderr, done.stderr
    assert run_cli("convert", "bert", source, out, "--hierarchical-positions", "--alpha", "1").returncode == 2
    assert not out.exists()
    for length in ("64", "4097"):
        done = run_cli("convert", "bert", source, out, "--hierarchical-positions", "--max-length", length)
        assert done.returncode == 2 and "at most 64^2 = 4,096" in done.stderr, done.stderr
    done = run_cli("convert", "bert", source, out, "--alpha", "0.3")
    assert done.returncode == 2 and "go with --hierarchical-positions" in done.stderr
    done = run_cli("convert", "bert", source, out, "--hierarchical-positions", "--max-relative-position", "8")
    assert done.returncode == 2 and "writes a BERT" in done.stderr
    assert not out.exists()
    done = run_cli("convert", "bert", source, out, "--hierarchical-positions")
    assert done.returncode == 0 and "extended to 4,096" in done.stdout  # n^2 by default (under 16,384)
