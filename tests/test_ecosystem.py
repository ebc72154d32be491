"""Hub (offline stand-in), model cards, remote code, pipelines, Trainer, accelerate."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
import yaml
from conftest import CHARACTERS, SPECIAL_TOKENS, tiny_config
from transformers import Trainer, TrainingArguments, pipeline

import nezha_hf
from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForMultipleChoice,
    NezhaForNextSentencePrediction,
    NezhaForPreTraining,
    NezhaForQuestionAnswering,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaForUniLM,
    NezhaModel,
)
from nezha_hf.hub import CARD_MARKER, build_model_card

VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)
REPO = Path(__file__).resolve().parents[1]


def card_metadata(path):
    text = Path(path).read_text(encoding="utf-8")
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1]), text


# --- model cards and the Hub -----------------------------------------------------------------


def test_save_pretrained_writes_a_model_card(tmp_path):
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB))
    model.save_pretrained(tmp_path / "a", model_card={"license": "mit", "datasets": ["cail2020"]})
    metadata, text = card_metadata(tmp_path / "a" / "README.md")
    assert metadata["library_name"] == "transformers" and "nezha" in metadata["tags"]
    assert metadata["pipeline_tag"] == "fill-mask" and metadata["language"] == "zh"
    assert metadata["license"] == "mit" and metadata["datasets"] == ["cail2020"]
    assert "import nezha_hf" in text
    # A README the user wrote is kept.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "README.md").write_text("my own card")
    model.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "README.md").read_text() == "my own card"
    model.save_pretrained(tmp_path / "c", model_card=False)
    assert not (tmp_path / "c" / "README.md").exists()


@pytest.mark.parametrize("cls, tag", [(NezhaForSequenceClassification, "text-classification"),
                                      (NezhaForQuestionAnswering, "question-answering"),
                                      (NezhaForUniLM, "summarization"), (NezhaModel, "feature-extraction")])
def test_card_template_and_pipeline_tag_follow_the_head(cls, tag):
    card = build_model_card(cls.__name__, {"eval_results": [
        {"task_type": tag, "dataset_type": "cail2020", "dataset_name": "CAIL2020", "metric_type": "rouge",
         "metric_value": 0.5}]})
    assert card.data.pipeline_tag == tag and card.data.library_name == "transformers"
    assert "model-index" in str(card.data.to_dict()) or card.data.eval_results
    assert CARD_MARKER in card.text
    with pytest.raises(ValueError, match="Unknown model-card settings"):
        build_model_card(cls.__name__, {"licence": "typo"})


def test_converted_model_card_names_its_base_model(tmp_path):
    from test_conversion import save_layout, small_bert

    from nezha_hf.conversion import convert_bert

    bert = small_bert()
    bert.config._name_or_path = "google-bert/bert-base-chinese"
    save_layout(bert, tmp_path / "bert", "safetensors")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    config["_name_or_path"] = "google-bert/bert-base-chinese"
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    convert_bert(tmp_path / "bert", tmp_path / "nezha")
    metadata, text = card_metadata(tmp_path / "nezha" / "README.md")
    assert metadata["base_model"] == "google-bert/bert-base-chinese" and "Not ready for use as is" in text
    # A model fine-tuned from it keeps naming the base model.
    model = NezhaForSequenceClassification.from_pretrained(tmp_path / "nezha", num_labels=2)
    model.save_pretrained(tmp_path / "tuned")
    metadata, _ = card_metadata(tmp_path / "tuned" / "README.md")
    assert metadata["base_model"] == "google-bert/bert-base-chinese" and metadata["pipeline_tag"] == "text-classification"


class LocalHub:
    """Stands in for `huggingface_hub.HfApi`: records what would be uploaded, touches no network."""

    def __init__(self):
        self.repos, self.commits = [], []

    def create_repo(self, repo_id, private=None, token=None, exist_ok=False, **kwargs):
        self.repos.append(repo_id)
        return SimpleNamespace(repo_id=f"someone/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        files = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations}
        self.commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return SimpleNamespace(commit_url=f"local://{repo_id}")


def test_push_to_hub_uploads_weights_config_and_card(monkeypatch):
    hub = LocalHub()
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", hub)
    model = NezhaForTokenClassification(tiny_config(vocab_size=VOCAB, num_labels=3))
    model.push_to_hub("nezha-ner", tags=["legal"], commit_message="first", remote_code=True)
    assert hub.repos == ["nezha-ner"] and len(hub.commits) == 1
    commit = hub.commits[0]
    assert commit["repo_id"] == "someone/nezha-ner" and commit["commit_message"] == "first"
    files = commit["files"]
    assert {"config.json", "model.safetensors", "README.md", "modeling_nezha.py", "relative_attention.py",
            "configuration_nezha.py"} <= set(files)
    text = files["README.md"].decode()
    metadata = yaml.safe_load(text.split("---\n")[1])
    assert metadata["tags"] == ["nezha", "legal"] and metadata["pipeline_tag"] == "token-classification"
    assert "someone/nezha-ner" in text
    assert json.loads(files["config.json"])["auto_map"]["AutoModelForTokenClassification"] == (
        "modeling_nezha.NezhaForTokenClassification"
    )


# --- remote code -------------------------------------------------------------------------------


def test_remote_code_loads_without_nezha_hf(tmp_path):
    torch.manual_seed(0)
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).eval()
    model.save_pretrained(tmp_path / "remote", remote_code=True)
    config = json.loads((tmp_path / "remote" / "config.json").read_text())
    expected_keys = {"AutoConfig"} | {auto.__name__ for auto in nezha_hf.AUTO_CLASSES}
    assert set(config["auto_map"]) == expected_keys
    input_ids = torch.randint(5, VOCAB, (2, 40))
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "logits": model(input_ids).logits}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["nezha_hf"] = None  # make `import nezha_hf` fail, as where it is not installed
        sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r})]
        import torch, transformers
        try:
            import nezha_hf
            raise SystemExit("nezha_hf is importable")
        except ImportError:
            pass
        path = {str(tmp_path / "remote")!r}
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = transformers.AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            got = model(expected["input_ids"]).logits
        print("max difference", (got - expected["logits"]).abs().max().item())
        for auto in ("AutoModel", "AutoModelForSequenceClassification", "AutoModelForQuestionAnswering",
                     "AutoModelForCausalLM"):
            getattr(transformers, auto).from_pretrained(path, trust_remote_code=True)
        generator = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        print("generates", generator.generate(expected["input_ids"][:1, :5], max_new_tokens=3,
                                               eos_token_id=3, pad_token_id=0).shape[1])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("max difference ")[1].split()[0]) < 1e-6
    assert "generates 8" in done.stdout


# --- pipelines -----------------------------------------------------------------------------------


def test_pipelines(tokenizer):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB)
    fill = pipeline("fill-mask", model=NezhaForMaskedLM(tiny_config(**config)).eval(), tokenizer=tokenizer)
    predictions = fill("原告[MASK]告", top_k=3)
    assert len(predictions) == 3 and all("token_str" in p for p in predictions)

    features = pipeline("feature-extraction", model=NezhaModel(tiny_config(**config)).eval(), tokenizer=tokenizer)
    assert torch.tensor(features("原告" * 400)).shape == (1, 802, 32)  # past 512 tokens

    classify = pipeline("text-classification", model=NezhaForSequenceClassification(
        tiny_config(**config, num_labels=2, id2label={0: "驳回", 1: "支持"}, label2id={"驳回": 0, "支持": 1})).eval(),
        tokenizer=tokenizer)
    assert classify("原告被告")[0]["label"] in ("驳回", "支持")

    tag = pipeline("token-classification", model=NezhaForTokenClassification(tiny_config(**config, num_labels=3)).eval(),
                   tokenizer=tokenizer)
    assert isinstance(tag("原告被告法院"), list)

    # transformers v5 removed "question-answering" for every model; nezha_hf registers the extractive task.
    with pytest.raises(KeyError, match="removed"):
        pipeline("question-answering", model=NezhaForQuestionAnswering(tiny_config(**config)), tokenizer=tokenizer)
    qa_model = NezhaForQuestionAnswering(tiny_config(**config)).eval()
    qa = pipeline("extractive-question-answering", model=qa_model, tokenizer=tokenizer)
    context = "原告是他，被告是你。"
    answer = qa(question="谁是原告", context=context)
    assert context[answer["start"]:answer["end"]] == answer["answer"] and 0 < answer["score"] <= 1
    # Against a direct computation: the best start/end pair inside the context, end >= start.
    encoded = tokenizer("谁是原告", context, return_tensors="pt", return_offsets_mapping=True)
    offsets = encoded.pop("offset_mapping")[0]
    with torch.no_grad():
        out = qa_model(**encoded)
    in_context = torch.tensor([s == 1 for s in encoded.sequence_ids(0)])
    best = max(((i, j) for i in range(len(offsets)) for j in range(i, min(i + 30, len(offsets)))
                if in_context[i] and in_context[j]),
               key=lambda ij: (out.start_logits[0, ij[0]] + out.end_logits[0, ij[1]]).item())
    assert (answer["start"], answer["end"]) == (int(offsets[best[0]][0]), int(offsets[best[1]][1]))


# --- Trainer -------------------------------------------------------------------------------------


def head_batch(cls, rows=4, length=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, length), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    if cls is NezhaForMultipleChoice:
        batch = {k: v[:, None].expand(-1, 2, -1).clone() for k, v in batch.items()}
        batch["input_ids"][:, 1] = torch.randint(5, VOCAB, (rows, length), generator=generator)
        batch["labels"] = torch.randint(0, 2, (rows,), generator=generator)
    elif cls in (NezhaForMaskedLM, NezhaForTokenClassification):
        labels = torch.randint(0, 3, (rows, length), generator=generator) if cls is NezhaForTokenClassification else ids.clone()
        labels[:, ::3] = -100
        batch["labels"] = labels
    elif cls is NezhaForPreTraining:
        batch["labels"] = ids.clone()
        batch["next_sentence_label"] = torch.randint(0, 2, (rows,), generator=generator)
    elif cls is NezhaForQuestionAnswering:
        batch["start_positions"] = torch.randint(0, length, (rows,), generator=generator)
        batch["end_positions"] = torch.randint(0, length, (rows,), generator=generator)
    elif cls is NezhaForUniLM:
        batch["token_type_ids"][:, 6:] = 1
        batch["labels"] = torch.where(batch["token_type_ids"] == 1, ids, -100)
    else:
        classes = 2 if cls is NezhaForNextSentencePrediction else 3
        batch["labels"] = torch.randint(0, classes, (rows,), generator=generator)
    return batch


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return len(next(iter(self.batch.values())))

    def __getitem__(self, index):
        return {key: value[index] for key, value in self.batch.items()}


HEADS = [NezhaForMaskedLM, NezhaForPreTraining, NezhaForNextSentencePrediction, NezhaForSequenceClassification,
         NezhaForMultipleChoice, NezhaForTokenClassification, NezhaForQuestionAnswering, NezhaForUniLM]


def train(cls, tmp_path, batch, **arguments):
    torch.manual_seed(0)
    model = cls(tiny_config(vocab_size=VOCAB, num_labels=2 if cls is NezhaForQuestionAnswering else 3))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", logging_steps=1,
                             use_cpu=True, disable_tqdm=True, **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(batch))
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("cls", HEADS, ids=lambda c: c.__name__)
def test_trainer_fine_tunes_every_head(cls, tmp_path):
    batch = head_batch(cls, rows=8)
    _, trainer = train(cls, tmp_path, batch, per_device_train_batch_size=4, max_steps=6, learning_rate=5e-3)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("cls", [NezhaForMaskedLM, NezhaForSequenceClassification, NezhaForUniLM],
                         ids=lambda c: c.__name__)
def test_gradient_accumulation_matches_the_larger_batch(cls, tmp_path):
    """One SGD step: 2 micro-batches of 2 with accumulation = 1 batch of 4 (weights equal after the step)."""
    batch = head_batch(cls, rows=4)
    if "labels" in batch and batch["labels"].dim() == 2:  # uneven label counts per micro-batch: the hard case
        batch["labels"][0, :8] = -100
    big, _ = train(cls, tmp_path / "a", batch, per_device_train_batch_size=4, max_steps=1, optim="sgd",
                   learning_rate=0.5, lr_scheduler_type="constant")
    small, _ = train(cls, tmp_path / "b", batch, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=1, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant")
    for (name, a), (_, b) in zip(big.named_parameters(), small.named_parameters()):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=name)


def test_trainer_gradient_checkpointing_and_bf16(tmp_path):
    batch = head_batch(NezhaForMaskedLM, rows=4)
    _, trainer = train(NezhaForMaskedLM, tmp_path / "gc", batch, per_device_train_batch_size=2, max_steps=2,
                       gradient_checkpointing=True)
    assert trainer.model.is_gradient_checkpointing
    _, trainer = train(NezhaForSequenceClassification, tmp_path / "bf16", head_batch(NezhaForSequenceClassification),
                       per_device_train_batch_size=2, max_steps=2, bf16=True)
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_fsdp_no_split_modules_name_real_layers():
    from accelerate.utils.dataclasses import get_module_class_from_name

    model = NezhaForMaskedLM(tiny_config())
    for name in model._no_split_modules:
        assert get_module_class_from_name(model, name) is not None, name


ACCELERATE_SCRIPT = """
import hashlib, os, sys, torch
sys.path.insert(0, {tests!r})
from test_ecosystem import ListDataset, head_batch, VOCAB
from conftest import tiny_config
from transformers import Trainer, TrainingArguments
from nezha_hf import NezhaForSequenceClassification

torch.manual_seed(0)
model = NezhaForSequenceClassification(tiny_config(vocab_size=VOCAB, num_labels=3))
args = TrainingArguments(output_dir={out!r}, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
                         report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
                         ddp_find_unused_parameters=False)
trainer = Trainer(model=model, args=args, train_dataset=ListDataset(head_batch(NezhaForSequenceClassification, rows=16)))
trainer.train()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
# One file per rank: two ranks printing to one pipe can interleave their lines.
os.makedirs({out!r}, exist_ok=True)
with open(f"{out}/rank{{trainer.args.process_index}}.txt", "w") as report:
    report.write(f"rank {{trainer.args.process_index}} of {{trainer.args.world_size}} weights {{digest}}")
# Shut gloo down before exit: left running, its threads can abort the interpreter at teardown.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_accelerate_two_processes_end_with_identical_weights(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out")))
    accelerate = Path(sys.executable).parent / "accelerate"
    done = subprocess.run(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", str(script)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [path.read_text() for path in sorted((tmp_path / "out").glob("rank*.txt"))]
    assert len(lines) == 2 and {line.split()[3] for line in lines} == {"2"}
    assert len({line.split()[-1] for line in lines}) == 1, lines
