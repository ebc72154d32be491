"""Continued masked-LM pretraining: whole-word masking, packing, a run that lowers the loss and resumes."""

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import CHARACTERS, snapshot
from transformers import AutoTokenizer

from nezha_hf import NezhaConfig, NezhaForMaskedLM
from nezha_hf.pretraining import WholeWordMaskCollator, pack_documents


def chinese_corpus(directory, documents=40):
    """Generated Chinese text with structure to learn: each document repeats a few phrases."""
    rng = random.Random(0)
    phrases = ["".join(rng.choice(CHARACTERS) for _ in range(rng.randint(2, 4))) for _ in range(12)]
    directory.mkdir(parents=True)
    blocks = ["".join(rng.choice(phrases) for _ in range(rng.randint(20, 60))) for _ in range(documents)]
    (directory / "corpus.txt").write_text("\n\n".join(blocks), encoding="utf-8")
    (directory / "more.jsonl").write_text(
        json.dumps({"text": blocks[0]}, ensure_ascii=False) + "\n{broken json\n" + json.dumps({"id": 3}) + "\n",
        encoding="utf-8",
    )
    return directory


def test_whole_word_masking_masks_every_token_of_a_word(tokenizer):
    examples = pack_documents(tokenizer, ["原告被告法院判决了" * 30], max_length=64, show_progress=False)
    assert all(len(e["input_ids"]) <= 64 for e in examples) and len(examples) == 5
    assert examples[0]["input_ids"][0] == tokenizer.cls_token_id and examples[0]["input_ids"][-1] == tokenizer.sep_token_id
    torch.manual_seed(0)
    batch = WholeWordMaskCollator(tokenizer)(examples)
    masked = batch["labels"] != -100
    word_ids = torch.tensor([e["word_ids"] + [-1] * (64 - len(e["word_ids"])) for e in examples])
    for row in range(len(examples)):
        for word in word_ids[row][masked[row]].unique():
            assert masked[row][word_ids[row] == word].all()  # whole words only
        fraction = masked[row].sum() / (word_ids[row] >= 0).sum()
        assert 0.1 <= fraction <= 0.3
    assert not masked[:, 0].any()  # never [CLS]


@pytest.mark.slow
def test_pretrain_lowers_the_loss_and_resumes(tmp_path, tokenizer):
    start, corpus = pretraining_start(tmp_path, tokenizer)
    texts = (corpus / "corpus.txt").read_text(encoding="utf-8").split("\n\n")
    held_out = pack_documents(tokenizer, texts[:4], max_length=128, show_progress=False)

    def loss_of(path):
        model = NezhaForMaskedLM.from_pretrained(path).eval()
        torch.manual_seed(1)
        with torch.no_grad():
            return model(**WholeWordMaskCollator(tokenizer)(held_out)).loss.item()

    done = subprocess.run(
        [sys.executable, "-m", "nezha_hf", "pretrain", str(start), str(corpus), "--output", str(tmp_path / "out"),
         "--max-length", "128", "--max-steps", "60", "--batch-size", "8", "--learning-rate", "2e-3",
         "--save-steps", "30"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "more.jsonl:2" in done.stderr and "more.jsonl:3" in done.stderr  # bad lines named, run went on
    assert loss_of(tmp_path / "out") < 0.9 * loss_of(start)
    assert (tmp_path / "out.checkpoints" / "checkpoint-60").is_dir()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == len(tokenizer)
    # Training turns the cache off; the saved model keeps its own setting, so a generator built on it decodes with one.
    assert json.loads((tmp_path / "out" / "config.json").read_text()).get("use_cache", True) is True
    # Rerun with more steps (replacing the finished model): continues from checkpoint-60 instead of starting over.
    checkpoint = tmp_path / "out.checkpoints" / "checkpoint-60"
    saved = snapshot(checkpoint)
    again = subprocess.run(
        [sys.executable, "-m", "nezha_hf", "pretrain", str(start), str(corpus), "--output", str(tmp_path / "out"),
         "--max-length", "128", "--max-steps", "70", "--batch-size", "8", "--save-steps", "30", "--learning-rate",
         "2e-3", "--overwrite"],
        capture_output=True, text=True, timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Resuming from {checkpoint}" in again.stderr
    assert snapshot(checkpoint) == saved
    before = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    after = json.loads((tmp_path / "out.checkpoints" / "checkpoint-70" / "trainer_state.json").read_text())
    # The first 60 steps' logs (learning rates of the first run's schedule) are carried over, not re-run.
    assert after["global_step"] == 70 and after["log_history"][: len(before)] == before and before


# --- resuming after a run died while saving (issue: resumable training) --------------------------------------


def pretraining_start(tmp_path, tokenizer):
    corpus = chinese_corpus(tmp_path / "corpus")
    torch.manual_seed(0)
    start = tmp_path / "start"
    NezhaForMaskedLM(NezhaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_relative_position=16)).save_pretrained(start)
    tokenizer.save_pretrained(start)
    return start, corpus


def run(start, corpus, output):
    from nezha_hf.pretraining import continue_pretraining

    return continue_pretraining(start, [corpus], output, max_length=64, max_steps=30, save_steps=10, logging_steps=5,
                                per_device_train_batch_size=4, learning_rate=2e-3, show_progress=False, overwrite=True)


def weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("damage", ["killed while saving trainer_state.json", "truncated weights"])
@pytest.mark.slow
def test_resume_skips_an_incomplete_checkpoint_and_reaches_the_uninterrupted_weights(tmp_path, tokenizer, damage,
                                                                                     monkeypatch, caplog):
    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    start, corpus = pretraining_start(tmp_path, tokenizer)
    run(start, corpus, tmp_path / "uninterrupted")
    interrupted = tmp_path / "interrupted"
    run(start, corpus, interrupted)
    checkpoints = tmp_path / "interrupted.checkpoints"
    newest = checkpoints / "checkpoint-30"
    if damage.startswith("killed"):
        (newest / "trainer_state.json").unlink()
    else:
        data = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
    earlier = snapshot(checkpoints / "checkpoint-20")
    steps = []
    original = Trainer.training_step
    monkeypatch.setattr(Trainer, "training_step", lambda *a, **k: steps.append(1) or original(*a, **k))
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            run(start, corpus, interrupted)
    finally:
        hf_logging.disable_propagation()
    assert f"Skipping the checkpoint {newest}" in caplog.text
    assert len(steps) == 10  # only the steps after checkpoint-20
    assert snapshot(checkpoints / "checkpoint-20") == earlier
    expected, got = weights(tmp_path / "uninterrupted"), weights(interrupted)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


def test_pretraining_refuses_to_write_into_its_sources(tmp_path, tokenizer):
    start, corpus = pretraining_start(tmp_path, tokenizer)
    before = snapshot(start)
    from nezha_hf.pretraining import continue_pretraining

    for output in (start, start / "out", corpus):
        with pytest.raises(ValueError, match="never written"):
            continue_pretraining(start, [corpus], output, max_steps=1)
    assert snapshot(start) == before


def test_a_file_with_a_line_that_is_not_utf8_is_left_out_whole_and_the_rest_is_read(tmp_path):
    """Such a line was skipped and the rest of its file pretrained on as if whole (issue 46)."""
    from nezha_hf.documents import read_documents

    (tmp_path / "corpus.jsonl").write_bytes(b'{"text": "\xe5\x8e\x9f\xe5\x91\x8a"}\n{"text": "bad \xff\xfe"}\n{"text": "ok"}\n')
    (tmp_path / "notes.txt").write_bytes("原告\n".encode() + b"\xc3\x28 broken\n" + "被告\n".encode())
    (tmp_path / "more.txt").write_bytes("法院\n判决\n".encode())
    problems = []
    documents = list(read_documents([tmp_path], txt_split="lines", problems=problems))
    assert [d.text for d in documents] == ["法院", "判决"]
    assert [(p.path.endswith(name), p.line) for p, name in zip(problems, ("corpus.jsonl", "notes.txt"))] == [
        (True, None), (True, None)]
    assert all("not UTF-8" in p.message and "line 2" in p.message for p in problems)
