"""Every head under Trainer: fine-tuning, gradient accumulation, bf16, checkpointing, FSDP names, accelerate."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, ListDataset, head_batch, tiny_config
from transformers import Trainer, TrainingArguments

from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForMultipleChoice,
    NezhaForNextSentencePrediction,
    NezhaForPreTraining,
    NezhaForQuestionAnswering,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaForUniLM,
)
from nezha_hf.relative_attention import Engine

HEADS = [NezhaForMaskedLM, NezhaForPreTraining, NezhaForNextSentencePrediction, NezhaForSequenceClassification,
         NezhaForMultipleChoice, NezhaForTokenClassification, NezhaForQuestionAnswering, NezhaForUniLM]


def train(cls, tmp_path, batch, dropout=0.0, **arguments):
    torch.manual_seed(0)
    model = cls(tiny_config(vocab_size=VOCAB, num_labels=2 if cls is NezhaForQuestionAnswering else 3,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))
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


@pytest.mark.parametrize("cls", [NezhaForMaskedLM, NezhaForUniLM], ids=lambda c: c.__name__)
def test_gradient_accumulation_with_dropout_keeps_the_loss_scale(cls, tmp_path, attention_calls):
    """With the dropout every released config has (0.1), training runs the kernel with dropout, and accumulating
    2 micro-batches logs the loss of one batch of 4, not twice it (the bug of a loss not normalised by
    `num_items_in_batch`). Not exact: the micro-batches draw other dropout masks than the one batch does."""
    batch = head_batch(cls, rows=4)
    batch["labels"][0, :8] = -100  # uneven label counts per micro-batch
    losses = []
    for name, arguments in (("big", dict(per_device_train_batch_size=4)),
                            ("small", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2))):
        _, trainer = train(cls, tmp_path / name, batch, dropout=0.1, max_steps=1, optim="sgd", learning_rate=0.5,
                           lr_scheduler_type="constant", **arguments)
        losses.append(next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry))
    assert abs(losses[1] / losses[0] - 1) < 0.2, losses
    assert any(call.ran is Engine.FUSED and call.dropout for call in attention_calls)


def test_trainer_gradient_checkpointing_and_bf16(tmp_path):
    batch = head_batch(NezhaForMaskedLM, rows=4)
    _, trainer = train(NezhaForMaskedLM, tmp_path / "gc", batch, per_device_train_batch_size=2, max_steps=2,
                       activation_checkpointing=True)
    assert trainer.model.is_activation_checkpointing
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
from helpers import ListDataset, head_batch, VOCAB
from helpers import tiny_config
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
