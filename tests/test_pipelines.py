"""Pipelines with NEZHA models, and the extractive QA task transformers v5 removed."""

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
