"""Padding token-id rows into one batch tensor: the one helper every collator here uses."""

from collections.abc import Sequence

import torch


def pad_rows(
    rows: Sequence[Sequence[int]], value: int, pad_to_multiple_of: int | None = None, side: str = "right"
) -> torch.Tensor:
    """Rows of integers of different lengths as one `[len(rows), width]` long tensor.

    `width` is the longest row, rounded up to a multiple of `pad_to_multiple_of` if given; the
    rest of each row is `value`, after the row (`side="right"`) or before it (`side="left"`, for
    generation prompts).
    """
    if side not in ("left", "right"):
        raise ValueError(f'side must be "left" or "right", got {side!r}.')
    width = max((len(row) for row in rows), default=0)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    padded = torch.full((len(rows), width), value, dtype=torch.long)
    for index, row in enumerate(rows):
        if len(row):
            columns = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
            padded[index, columns] = torch.as_tensor(list(row), dtype=torch.long)
    return padded


def attention_mask_for(rows: Sequence[Sequence[int]], pad_to_multiple_of: int | None = None, side: str = "right"):
    """The 0/1 attention mask of `pad_rows(rows, ...)`: 1 on the rows' own entries, 0 on padding."""
    return pad_rows([[1] * len(row) for row in rows], 0, pad_to_multiple_of, side)
