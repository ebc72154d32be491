"""Data helpers for `NezhaForUniLM`: tokenise (source, target) pairs, batch them, generate text.

A training example is `[CLS] source [SEP] target [SEP]` with token types 0 on `[CLS] source [SEP]`
and 1 on `target [SEP]`, and labels equal to the ids on the target part (-100 elsewhere). When
the pair is longer than `max_length` the target is kept (cut only if it alone does not fit) and
the source is cut, from its end (`truncation="end"`) or from its middle, keeping its head and
tail (`truncation="middle"`; judgments put the parties first and the decision last).

For the SPACES copy mechanism (`NezhaConfig(unilm_copy_tags=True)`), `copy_tags` labels each
target token as generated (0), starting a copied span (1) or continuing one (2), and
`tokenize_pair(..., copy_labels=True)` / `UniLMDataCollator(..., copy_labels=True)` add them.
"""

import re
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .padding import attention_mask_for, pad_rows

TRUNCATION_MODES = ("end", "middle")
# Special tokens in a pair: [CLS] source [SEP] target [SEP].
_SPECIAL_TOKENS_IN_PAIR = 3
_SPACE_BETWEEN_CJK = re.compile(r"(?<=[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef])\s+(?=[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef])")


def _check_truncation(truncation: str) -> None:
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}.")


def cut_source(ids: list[int], budget: int, truncation: str = "end") -> list[int]:
    """Shorten source token ids to at most `budget`, from the end or from the middle."""
    _check_truncation(truncation)
    if len(ids) <= budget:
        return list(ids)
    if budget <= 0:
        return []
    if truncation == "end":
        return list(ids[:budget])
    head = (budget + 1) // 2
    return list(ids[:head]) + list(ids[len(ids) - (budget - head):])


def _ids(tokenizer, text_or_ids) -> list[int]:
    if isinstance(text_or_ids, str):
        # verbose=False: long documents are the point, not a warning.
        return tokenizer(text_or_ids, add_special_tokens=False, verbose=False)["input_ids"]
    return list(text_or_ids)


def copy_tags(source_ids: Sequence[int], target_ids: Sequence[int]) -> list[int]:
    """SPACES copy tags of the target tokens: 0 generated, 1 starts a copied span, 2 continues one.

    The target tokens of one longest common subsequence of source and target are the copied ones;
    a copied token continues a span when it follows the previous copied token in both the source
    and the target, otherwise it starts one. Among equally long subsequences the one ending latest
    in the source is taken (SPACES' backtracking).

    >>> copy_tags([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 8, 6])
    [0, 1, 2, 2, 0, 1]
    """
    source, target = np.asarray(source_ids), np.asarray(target_ids)
    # table[t, i] = length of the LCS of target[:t] and source[:i]; one vectorised row per target token.
    table = np.zeros((len(target) + 1, len(source) + 1), dtype=np.int32)
    for t in range(1, len(target) + 1):
        matched = np.where(source == target[t - 1], table[t - 1, :-1] + 1, 0)
        table[t, 1:] = np.maximum.accumulate(np.maximum(table[t - 1, 1:], matched))
    pairs, t, i = [], len(target), len(source)
    while t > 0 and i > 0:
        if source[i - 1] == target[t - 1] and table[t, i] == table[t - 1, i - 1] + 1:
            pairs.append((i - 1, t - 1))
            t, i = t - 1, i - 1
        elif table[t - 1, i] >= table[t, i - 1]:
            t -= 1
        else:
            i -= 1
    tags, previous = [0] * len(target), (-2, -2)
    for i, t in reversed(pairs):
        tags[t] = 2 if (i, t) == (previous[0] + 1, previous[1] + 1) else 1
        previous = (i, t)
    return tags


def tokenize_pair(
    tokenizer,
    source: str | Sequence[int],
    target: str | Sequence[int],
    max_length: int | None = 1024,
    max_target_length: int | None = None,
    truncation: str = "end",
    copy_labels: bool = False,
) -> dict[str, list[int]]:
    """Build one UniLM training example.

    Args:
        tokenizer: a BERT-style tokenizer (`cls_token_id`, `sep_token_id`).
        source, target: text, or token ids without special tokens.
        max_length: cap on the whole example, special tokens included (None: no cap; NEZHA has no
            length limit, memory is the only one).
        max_target_length: cap on the target tokens; by default the target is cut only when it
            leaves no room for a single source token.
        truncation: `"end"` or `"middle"`, how the source is shortened.
        copy_labels: also return `copy_labels`, the `copy_tags` of `target [SEP]` against the
            (shortened) source, -100 on the source part.

    Returns:
        `input_ids`, `token_type_ids`, `labels` (and `copy_labels`), lists of equal length.
    """
    _check_truncation(truncation)
    source_ids, target_ids = _ids(tokenizer, source), _ids(tokenizer, target)
    if max_target_length is not None:
        target_ids = target_ids[:max_target_length]
    if max_length is not None:
        if max_length < _SPECIAL_TOKENS_IN_PAIR + 2:
            raise ValueError(f"max_length={max_length} leaves no room for a source and a target token.")
        target_ids = target_ids[: max_length - _SPECIAL_TOKENS_IN_PAIR - 1]
        source_ids = cut_source(source_ids, max_length - _SPECIAL_TOKENS_IN_PAIR - len(target_ids), truncation)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    source_part = [cls, *source_ids, sep]
    target_part = [*target_ids, sep]
    example = {
        "input_ids": source_part + target_part,
        "token_type_ids": [0] * len(source_part) + [1] * len(target_part),
        "labels": [-100] * len(source_part) + target_part,
    }
    if copy_labels:
        example["copy_labels"] = [-100] * len(source_part) + copy_tags(source_ids, target_ids) + [0]
    return example


class UniLMDataCollator:
    """Batches UniLM examples for Trainer, right-padded.

    Each feature is either `{"source": ..., "target": ...}` (text or token ids; tokenised with
    `tokenize_pair` and the truncation settings given here) or an already tokenised
    `{"input_ids", "token_type_ids", "labels"}` (plus `copy_labels`). Returns tensors `input_ids`,
    `attention_mask`, `token_type_ids`, `labels` (-100 on padding), and `copy_labels` when
    `copy_labels=True` (for a model with `config.unilm_copy_tags`).

    Example:

    ```python
    collator = UniLMDataCollator(tokenizer, max_length=2048, truncation="middle")
    trainer = Trainer(model=NezhaForUniLM.from_pretrained(path), data_collator=collator,
                      train_dataset=[{"source": judgment, "target": summary}, ...], args=args)
    ```
    """

    def __init__(
        self,
        tokenizer,
        max_length: int | None = 1024,
        max_target_length: int | None = None,
        truncation: str = "end",
        pad_to_multiple_of: int | None = None,
        copy_labels: bool = False,
    ):
        _check_truncation(truncation)
        self.copy_labels = copy_labels
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_target_length = max_target_length
        self.truncation = truncation
        self.pad_to_multiple_of = pad_to_multiple_of

    def encode(self, feature: dict) -> dict[str, list[int]]:
        """One feature as `input_ids`, `token_type_ids`, `labels` (and `copy_labels`) lists."""
        if "source" in feature:
            return tokenize_pair(
                self.tokenizer, feature["source"], feature["target"], self.max_length, self.max_target_length,
                self.truncation, self.copy_labels,
            )
        needed = ["input_ids", "token_type_ids", "labels"] + (["copy_labels"] if self.copy_labels else [])
        missing = set(needed) - set(feature)
        if missing:
            raise ValueError(f"A UniLM feature needs source/target or {'/'.join(needed)}; missing {sorted(missing)}.")
        return {key: list(feature[key]) for key in needed}

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        encoded = [self.encode(feature) for feature in features]
        pad_values = {"input_ids": self.tokenizer.pad_token_id, "token_type_ids": 1, "labels": -100}
        if self.copy_labels:
            pad_values["copy_labels"] = -100
        batch = {key: pad_rows([e[key] for e in encoded], pad, self.pad_to_multiple_of) for key, pad in pad_values.items()}
        batch["attention_mask"] = attention_mask_for([e["input_ids"] for e in encoded], self.pad_to_multiple_of)
        return batch


def encode_sources(
    tokenizer, sources: Sequence[str], max_source_length: int | None = None, truncation: str = "end"
) -> dict[str, torch.Tensor]:
    """Left-padded generation inputs `[CLS] source [SEP]` (token type 0) for `NezhaForUniLM.generate`.

    `max_source_length` caps the source tokens (special tokens excluded), cut as in `tokenize_pair`.
    """
    rows = []
    for source in sources:
        ids = _ids(tokenizer, source)
        if max_source_length is not None:
            ids = cut_source(ids, max_source_length, truncation)
        rows.append([tokenizer.cls_token_id, *ids, tokenizer.sep_token_id])
    input_ids = pad_rows(rows, tokenizer.pad_token_id, side="left")
    attention_mask = attention_mask_for(rows, side="left")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}


def decode_new_tokens(tokenizer, sequences: torch.Tensor, prompt_length: int) -> list[str]:
    """The text generated after a (left-padded) prompt of `prompt_length` tokens, one string per row.

    Special tokens are dropped and the spaces a BERT tokenizer puts between Chinese characters removed.
    """
    texts = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
    return [_SPACE_BETWEEN_CJK.sub("", text).strip() for text in texts]


def generate_text(
    model,
    tokenizer,
    sources: str | Sequence[str],
    max_source_length: int | None = None,
    truncation: str = "end",
    batch_size: int = 8,
    show_progress: bool = False,
    **generate_kwargs,
) -> list[str]:
    """Generate a target for each source with a `NezhaForUniLM`; returns only the new text.

    Sources go `batch_size` at a time (`show_progress`: a progress bar over the batches).
    `generate_kwargs` go to `model.generate` (e.g. `max_new_tokens=256, num_beams=4,
    no_repeat_ngram_size=3`). `eos_token_id` defaults to `tokenizer.sep_token_id` and
    `pad_token_id` to `tokenizer.pad_token_id`.

    Text `i` is the one generated from source `i`: one sequence per source (`num_return_sequences=1`, whatever the
    model's generation config, e.g. a checkpoint's `generation_config.json`, says; asking for more here is a
    `ValueError`: call `model.generate` for several per source), and every batch must come back with one row per
    source.
    """
    if isinstance(sources, str):
        sources = [sources]
    if generate_kwargs.get("num_return_sequences", 1) != 1:
        raise ValueError(f"generate_text gives one text per source; num_return_sequences="
                         f"{generate_kwargs['num_return_sequences']} would give several (call model.generate and group "
                         "its rows by source).")
    generate_kwargs["num_return_sequences"] = 1
    generate_kwargs.setdefault("eos_token_id", tokenizer.sep_token_id)
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    texts = []
    for start in tqdm(range(0, len(sources), batch_size), desc="generating", disable=not show_progress):
        inputs = encode_sources(tokenizer, sources[start : start + batch_size], max_source_length, truncation)
        inputs = {key: value.to(model.device) for key, value in inputs.items()}
        with torch.no_grad():
            sequences = model.generate(**inputs, **generate_kwargs)
        if sequences.shape[0] != inputs["input_ids"].shape[0]:
            raise RuntimeError(f"generate returned {sequences.shape[0]} sequences for {inputs['input_ids'].shape[0]} "
                               "sources: the texts cannot be matched to their sources.")
        texts.extend(decode_new_tokens(tokenizer, sequences, inputs["input_ids"].shape[1]))
    return texts


__all__ = [
    "TRUNCATION_MODES",
    "UniLMDataCollator",
    "copy_tags",
    "cut_source",
    "decode_new_tokens",
    "encode_sources",
    "generate_text",
    "tokenize_pair",
]
