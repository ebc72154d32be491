"""Pipelines with NEZHA models, and the extractive QA task transformers v5 removed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, tiny_config
from transformers import pipeline

from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForQuestionAnswering,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaModel,
)


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


def test_an_empty_context_is_a_clear_error(tokenizer):
    qa = pipeline("extractive-question-answering", model=NezhaForQuestionAnswering(tiny_config(vocab_size=VOCAB)).eval(),
                  tokenizer=tokenizer)
    with pytest.raises(ValueError, match="context is empty"):
        qa(question="谁是原告", context="")


MEMORY_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import VOCAB, make_tokenizer, tiny_config
from pathlib import Path
from transformers import pipeline
from nezha_hf import NezhaForQuestionAnswering
def resident(field):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(field)) / 1024
torch.manual_seed(0)
model = NezhaForQuestionAnswering(tiny_config(vocab_size=VOCAB, hidden_size=256, num_attention_heads=4,
                                              intermediate_size=512, max_relative_position=64)).eval()
tokenizer = make_tokenizer(Path({work!r}))
context = "原告被告法院判决" * 2500  # 20,000 characters, one token each
qa = pipeline("extractive-question-answering", model=model, tokenizer=tokenizer)
qa(question="谁", context=context[:100])  # warm up: thread pools, the kernel
inputs = tokenizer("谁是原告", context, return_tensors="pt")
open('/proc/self/clear_refs', 'w').write('5')
before = resident('VmRSS')
with torch.no_grad():
    {call}
print(resident('VmHWM') - before)
"""


@pytest.mark.slow
def test_the_qa_pipeline_finds_the_best_span_in_linear_memory(tmp_path):
    """20,000 tokens: the pipeline's peak memory stays within 1.2x a bare forward's (a start x end table was 1.6 GB)."""
    def peak(call):
        script = MEMORY_SCRIPT.format(tests=str(Path(__file__).parent), work=str(tmp_path / "tok"), call=call)
        # Blocks of 1 MB or more mapped and unmapped on their own, so the figure is the call's memory, not how
        # malloc's heap happened to fragment (which moves the peak by tens of MB from run to run).
        environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                              env=environment)
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.split()[-1])

    forward = peak("model(**inputs)")
    answered = peak("qa(question='谁是原告', context=context)")
    print(f"peak memory at 20,000 tokens: forward {forward:.0f} MB, pipeline {answered:.0f} MB")
    assert answered <= 1.2 * forward, (answered, forward)


def test_the_best_span_is_the_best_valid_pair(tokenizer):
    """Against all pairs by brute force, with answers capped at 3 tokens so that the cap matters."""
    torch.manual_seed(3)
    model = NezhaForQuestionAnswering(tiny_config(vocab_size=VOCAB)).eval()
    qa = pipeline("extractive-question-answering", model=model, tokenizer=tokenizer)
    context = "原告是他被告是你法院判决原告胜诉被告败诉"
    answer = qa(question="谁是原告", context=context, max_answer_length=3)
    encoded = tokenizer("谁是原告", context, return_tensors="pt", return_offsets_mapping=True)
    offsets = encoded.pop("offset_mapping")[0]
    with torch.no_grad():
        out = model(**encoded)
    inside = [s == 1 for s in encoded.sequence_ids(0)]
    start, end = (logits[0].masked_fill(~torch.tensor(inside), -torch.inf).log_softmax(-1)
                  for logits in (out.start_logits, out.end_logits))
    best = max(((i, j) for i in range(len(inside)) for j in range(i, min(i + 3, len(inside))) if inside[i] and inside[j]),
               key=lambda ij: (start[ij[0]] + end[ij[1]]).item())
    assert (answer["start"], answer["end"]) == (int(offsets[best[0]][0]), int(offsets[best[1]][1]))
    assert answer["score"] == pytest.approx((start[best[0]] + end[best[1]]).exp().item(), rel=1e-5)
