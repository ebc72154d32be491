"""A NEZHA folder whose tokenizer says `model_max_length: 512` (as transformers 4.x-era checkpoints do) is one
warning when loaded, naming `nezha-hf convert nezha`, whose copy a pipeline reads whole."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import CHARACTERS, VOCAB, make_tokenizer, tiny_config
from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline

from nezha_hf import NezhaForTokenClassification

TOKENS = 1_290
# A text of TOKENS characters, each one token of the tiny vocabulary.
TEXT = "".join(CHARACTERS[i % len(CHARACTERS)] for i in range(TOKENS))
LABELS = {0: "O", 1: "B-PARTY", 2: "I-PARTY"}


def nezha_folder(folder: Path, model_max_length) -> Path:
    """A tiny token classifier and its tokenizer, whose config says `model_max_length` (or nothing, for None)."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    NezhaForTokenClassification(config).save_pretrained(folder)
    make_tokenizer(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config.pop("model_max_length", None)
    if model_max_length is not None:
        tokenizer_config["model_max_length"] = model_max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return folder


def cap_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "model_max_length" in r.getMessage()]


def tag_everything(folder):
    """The token-classification pipeline of `folder`, keeping "O" tags too: one entry per token it read."""
    return pipeline("token-classification", model=str(folder), ignore_labels=[])


def test_a_folder_whose_tokenizer_says_512_warns_once_and_is_cut_at_512(tmp_path, caplog):
    folder = nezha_folder(tmp_path / "nezha-v4", 512)
    with caplog.at_level("WARNING"):
        AutoModelForTokenClassification.from_pretrained(folder)
        NezhaForTokenClassification.from_pretrained(str(folder) + os.sep)  # the same folder, spelled otherwise
        tagged = tag_everything(folder)(TEXT)
    [message] = cap_warnings(caplog)
    assert f"nezha-hf convert nezha {folder.resolve()} NEW_FOLDER" in message and "model_max_length=512" in message
    assert len(tagged) == 510  # what the warning is about: [CLS] + 510 tokens + [SEP]


@pytest.mark.parametrize("model_max_length", [None, 1_000_000, int(1e30)],
                         ids=["no-cap", "converted", "transformers-default"])
def test_a_folder_with_no_cap_or_a_large_one_warns_nothing(tmp_path, caplog, model_max_length):
    folder = nezha_folder(tmp_path / "nezha", model_max_length)
    with caplog.at_level("WARNING"):
        AutoModelForTokenClassification.from_pretrained(folder)
    assert cap_warnings(caplog) == []


def test_after_convert_nezha_a_pipeline_tags_every_one_of_1290_tokens(tmp_path, caplog, run_cli):
    folder = nezha_folder(tmp_path / "nezha-v4", 512)
    assert run_cli("convert", "nezha", folder, tmp_path / "nezha-long").returncode == 0
    with caplog.at_level("WARNING"):
        tagged = tag_everything(tmp_path / "nezha-long")(TEXT)
    assert cap_warnings(caplog) == []
    # Against the model run directly on the whole text, untruncated.
    model = NezhaForTokenClassification.from_pretrained(folder).eval()
    inputs = AutoTokenizer.from_pretrained(folder)(TEXT, truncation=False, return_tensors="pt")
    assert inputs["input_ids"].shape[1] == TOKENS + 2
    with torch.no_grad():
        expected = model(**inputs).logits[0, 1:-1].argmax(-1)
    assert [entity["index"] for entity in tagged] == list(range(1, TOKENS + 1))
    assert [entity["entity"] for entity in tagged] == [LABELS[int(i)] for i in expected]
    assert "".join(entity["word"] for entity in tagged) == TEXT


def test_a_snapshot_in_the_hub_cache_warns_as_a_folder_does_without_the_network(tmp_path, caplog, run_cli):
    """A Hub id already in the cache: its snapshot's tokenizer is read from disk, never fetched."""
    saved = nezha_folder(tmp_path / "saved", 512)
    repo = tmp_path / "cache" / "models--someone--nezha-ner"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for file in saved.iterdir():  # links into blobs/, as the Hub cache keeps them
        file.rename(repo / "blobs" / file.name)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / file.name)
    with caplog.at_level("WARNING"):
        # local_files_only: conftest.py sets HF_HUB_OFFLINE after huggingface_hub has read it, and each refused
        # connection costs half a minute of retries; the Auto class's look for a PEFT adapter ignores it (transformers
        # 5.24), so the class itself.
        NezhaForTokenClassification.from_pretrained("someone/nezha-ner", cache_dir=tmp_path / "cache",
                                                    local_files_only=True)
    [message] = cap_warnings(caplog)
    assert f"nezha-hf convert nezha {snapshot} NEW_FOLDER" in message
    assert run_cli("convert", "nezha", snapshot, tmp_path / "nezha-long").returncode == 0  # the step, as named
    assert AutoTokenizer.from_pretrained(tmp_path / "nezha-long").model_max_length > TOKENS


def test_an_unreadable_tokenizer_config_does_not_stop_the_model_loading(tmp_path, caplog):
    """Loading the tokenizer reports a damaged config; loading the model is not this check's to fail."""
    folder = nezha_folder(tmp_path / "nezha", 512)
    (folder / "tokenizer_config.json").write_bytes(b"\xff\xfe not json")
    with caplog.at_level("WARNING"):
        assert isinstance(AutoModelForTokenClassification.from_pretrained(folder), NezhaForTokenClassification)
    assert cap_warnings(caplog) == []


def test_a_deeply_nested_tokenizer_config_does_not_stop_the_model_loading(tmp_path, caplog):
    """Issue 54: 10 KB of brackets in `tokenizer_config.json` raised `RecursionError` through the cap check, which is
    documented to return None for a file it cannot read, so the model could not load."""
    from nezha_hf.tokenizer_cap import tokenizer_cap

    folder = nezha_folder(tmp_path / "nezha", 512)
    (folder / "tokenizer_config.json").write_text("[" * 10_000 + "]" * 10_000)
    assert tokenizer_cap(str(folder / "tokenizer_config.json")) is None
    with caplog.at_level("WARNING"):
        assert isinstance(AutoModelForTokenClassification.from_pretrained(folder), NezhaForTokenClassification)
    assert cap_warnings(caplog) == []
