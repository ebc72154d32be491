"""Continued masked-LM pretraining: whole-word masking, packing, a run that lowers the loss and resumes."""

import json
import random
import subprocess
import sys

import torch
from helpers import CHARACTERS
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


def test_pretrain_lowers_the_loss_and_resumes(tmp_path, tokenizer):
    corpus = chinese_corpus(tmp_path / "corpus")
    torch.manual_seed(0)
    start = tmp_path / "start"
    NezhaForMaskedLM(NezhaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_relative_position=16)).save_pretrained(start)
    tokenizer.save_pretrained(start)
    texts = (corpus / "corpus.txt").read_text(encoding="utf-8").split("\n\n")
    held_out = pack_documents(tokenizer, texts[:4], max_length=128, show_progress=False)

    def loss_of(path):
        model = NezhaForMaskedLM.from_pretrained(path).eval()
        torch.manual_seed(1)
        with torch.no_grad():
            return model(**WholeWordMaskCollator(tokenizer)(held_out)).loss.item()

    done = subprocess.run(
        [sys.executable, "-m", "nezha_hf.cli", "pretrain", str(start), str(corpus), "--output", str(tmp_path / "out"),
         "--max-length", "128", "--max-steps", "60", "--batch-size", "8", "--learning-rate", "2e-3",
         "--save-steps", "30"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "more.jsonl:2" in done.stderr and "more.jsonl:3" in done.stderr  # bad lines named, run went on
    assert loss_of(tmp_path / "out") < 0.9 * loss_of(start)
    assert (tmp_path / "out" / "checkpoint-60").is_dir()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == len(tokenizer)
    # Rerun with more steps: continues from checkpoint-60 instead of starting over.
    again = subprocess.run(
        [sys.executable, "-m", "nezha_hf.cli", "pretrain", str(start), str(corpus), "--output", str(tmp_path / "out"),
         "--max-length", "128", "--max-steps", "70", "--batch-size", "8", "--save-steps", "30"],
        capture_output=True, text=True, timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    state = json.loads((tmp_path / "out" / "checkpoint-70" / "trainer_state.json").read_text())
    assert state["global_step"] == 70 and len(state["log_history"]) >= 1
