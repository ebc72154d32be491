"""nezha_hf.unilm: pair tokenisation, truncation, the collator, copy tags, and generate_text."""

import pytest
import torch
from helpers import CHARACTERS, SPECIAL_TOKENS, tiny_config
from transformers import TextStreamer

from nezha_hf import NezhaForUniLM
from nezha_hf.unilm import (
    UniLMDataCollator,
    copy_tags,
    cut_source,
    encode_sources,
    generate_text,
    tokenize_pair,
)

CLS, SEP, PAD = 2, 3, 0


def test_streaming_and_generate_text(tokenizer):
    model = NezhaForUniLM(tiny_config(vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS))).eval()

    class Collect(TextStreamer):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.pieces = []

        def on_finalized_text(self, text, stream_end=False):
            self.pieces.append(text)

    streamer = Collect(tokenizer)
    inputs = encode_sources(tokenizer, ["原告被告"])
    sequences = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, streamer=streamer,
                               eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id)
    streamed = "".join(streamer.pieces).replace(" ", "")
    texts = generate_text(model, tokenizer, ["原告被告", "法院判决了原告"], max_new_tokens=6, min_new_tokens=6)
    assert texts[0] == streamed == tokenizer.decode(sequences[0, 6:], skip_special_tokens=True).replace(" ", "")
    assert len(texts) == 2 and all(texts)


def test_cut_source_end_and_middle():
    ids = list(range(10))
    assert cut_source(ids, 4, "end") == [0, 1, 2, 3]
    assert cut_source(ids, 5, "middle") == [0, 1, 2, 8, 9]
    assert cut_source(ids, 20, "middle") == ids
    with pytest.raises(ValueError, match="truncation"):
        cut_source(ids, 4, "start")


def test_tokenize_pair_keeps_the_target(tokenizer):
    example = tokenize_pair(tokenizer, "原告" * 20, "判决", max_length=12, truncation="middle")
    tokens = tokenizer.convert_ids_to_tokens(example["input_ids"])
    # 7 source tokens fit: the first 4 and the last 3.
    assert tokens == ["[CLS]", "原", "告", "原", "告", "告", "原", "告", "[SEP]", "判", "决", "[SEP]"]
    assert example["token_type_ids"] == [0] * 9 + [1] * 3
    assert example["labels"][:9] == [-100] * 9 and example["labels"][9:] == example["input_ids"][9:]
    long_target = tokenize_pair(tokenizer, "原告", "判" * 30, max_length=10)
    assert len(long_target["input_ids"]) == 10 and long_target["token_type_ids"].count(0) == 3


def test_collator_pads_and_masks(tokenizer):
    collator = UniLMDataCollator(tokenizer, max_length=32, pad_to_multiple_of=8)
    batch = collator([{"source": "原告被告", "target": "判决"}, {"source": "法院", "target": "原告的"}])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(1).tolist() == [9, 8]
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    with pytest.raises(ValueError, match="missing"):
        collator([{"input_ids": [1, 2]}])


def lcs_length(a, b):
    """Plain dynamic programming, the textbook recurrence."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def is_subsequence(needle, haystack):
    remaining = iter(haystack)
    return all(token in remaining for token in needle)


def test_copy_tags_hand_example_and_properties():
    assert copy_tags([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 8, 6]) == [0, 1, 2, 2, 0, 1]
    assert copy_tags([7, 8], [8, 7, 8]) == [0, 1, 2]
    assert copy_tags([1, 2], [1, 9, 2]) == [1, 0, 1]  # adjacent in the source, not in the target: two spans
    assert copy_tags([], [1, 2]) == [0, 0] and copy_tags([1], []) == []
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        source = torch.randint(0, 6, (int(torch.randint(0, 15, (1,), generator=generator)),), generator=generator).tolist()
        target = torch.randint(0, 6, (int(torch.randint(0, 15, (1,), generator=generator)),), generator=generator).tolist()
        tags = copy_tags(source, target)
        copied = [token for token, tag in zip(target, tags) if tag]
        assert len(copied) == lcs_length(source, target)
        assert is_subsequence(copied, source)
        assert not tags or tags[0] != 2  # a span starts with 1
        assert all(tags[t - 1] != 0 for t in range(1, len(tags)) if tags[t] == 2)  # 2 continues a copied token
        spans, current = [], []
        for token, tag in zip(target, tags):
            if tag != 2 and current:
                spans.append(current)
                current = []
            if tag:
                current.append(token)
        spans += [current] if current else []
        for span in spans:  # a span is a contiguous piece of the source
            assert any(source[i : i + len(span)] == span for i in range(len(source))), (source, target, tags)


def test_tokenize_pair_and_collator_add_copy_labels(tokenizer):
    example = tokenize_pair(tokenizer, "原告起诉被告", "被告起诉", copy_labels=True)
    source_part = 1 + 6 + 1
    assert example["copy_labels"][:source_part] == [-100] * source_part
    assert example["copy_labels"][source_part:] == copy_tags(
        tokenizer("原告起诉被告", add_special_tokens=False)["input_ids"],
        tokenizer("被告起诉", add_special_tokens=False)["input_ids"]) + [0]
    batch = UniLMDataCollator(tokenizer, copy_labels=True)([{"source": "原告", "target": "原告"},
                                                           {"source": "原告起诉被告", "target": "被告"}])
    assert batch["copy_labels"].tolist()[0] == [-100] * 4 + [1, 2, 0] + [-100] * 4
    assert ((batch["copy_labels"] == -100) == (batch["labels"] == -100)).all()
