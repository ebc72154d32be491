"""NezhaForUniLM's forward: prefix mask, loss, copy-tag loss, checkpoints it loads, inputs it refuses (generation:
`test_generation_nezha.py`)."""

import pytest
import reference
import torch
from helpers import (
    FIXTURES,
    PATH_CASES,
    copy_unilm,
    tiny_config,
    tiny_unilm,
    unilm_batch,
)
from transformers import AutoModelForCausalLM

from nezha_hf import NezhaForMaskedLM, NezhaForUniLM


@pytest.mark.parametrize("attn_implementation, length, path", PATH_CASES)
def test_head_logits_match_independent_reference(attn_implementation, length, path, attention_calls):
    """The head's own forward (prefix mask from token types, encoder, LM head) against the reference."""
    model = tiny_unilm()
    model.set_attn_implementation(attn_implementation)
    with torch.no_grad():
        model.cls.predictions.bias.normal_()  # so that a head that ignored its bias would differ
    target_length = 9
    batch = unilm_batch([length - target_length - 3, length - target_length - 8], target_length)
    with torch.no_grad():
        got = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"]).logits
    assert {call.ran for call in attention_calls} == {path}
    hidden = reference.nezha_forward(
        model.nezha, batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], prefix_lm=True
    )
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got[valid].double(), reference.lm_logits(model, hidden)[valid], atol=1e-5, rtol=0)


def test_source_ignores_targets_and_targets_ignore_later_targets():
    model = tiny_unilm()
    batch = unilm_batch([20], target_length=10)
    changed = batch["input_ids"].clone()
    source_end, changed_from = 22, 27  # targets occupy 22 .. 32
    changed[:, changed_from:] = torch.randint(5, 99, changed[:, changed_from:].shape)
    with torch.no_grad():
        before = model(batch["input_ids"], token_type_ids=batch["token_type_ids"]).logits
        after = model(changed, token_type_ids=batch["token_type_ids"]).logits
    torch.testing.assert_close(before[:, :changed_from], after[:, :changed_from], atol=1e-6, rtol=0)
    assert (before[:, changed_from:] - after[:, changed_from:]).abs().max() > 1e-3
    # The first source token sees the last source token (not causal inside the source).
    flipped = batch["input_ids"].clone()
    flipped[:, source_end - 2] = 5 if flipped[0, source_end - 2] != 5 else 6
    with torch.no_grad():
        third = model(flipped, token_type_ids=batch["token_type_ids"]).logits
    assert (third[:, 0] - before[:, 0]).abs().max() > 1e-4


def test_masked_lm_checkpoint_loads_into_unilm_and_auto_class(tmp_path):
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    model, info = NezhaForUniLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is NezhaForUniLM
    mlm = NezhaForMaskedLM.from_pretrained(tmp_path)
    assert torch.equal(model.cls.predictions.decoder.weight, mlm.nezha.embeddings.word_embeddings.weight)


@pytest.mark.parametrize("case", ["mlm-long", "legacy-mlm-bert-prefix"])
def test_v4_reference_checkpoint_loads_into_unilm(case):
    _, info = NezhaForUniLM.from_pretrained(FIXTURES / case, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_loss_is_next_token_cross_entropy_on_targets_only():
    model = tiny_unilm()
    batch = unilm_batch([8, 5], target_length=4)
    out = model(**batch)
    shifted_logits, shifted_labels = out.logits[:, :-1], batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(
        shifted_logits.reshape(-1, 99), shifted_labels.reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, expected)


def test_gradient_accumulation_equals_one_large_batch():
    """Two micro-batches with Trainer's num_items_in_batch give the loss and gradient of one batch."""
    model = tiny_unilm()
    full = unilm_batch([6, 9, 4, 12], target_length=5, seed=3)
    halves = [{key: value[rows] for key, value in full.items()} for rows in (slice(0, 2), slice(2, 4))]
    num_items = int((full["labels"][:, 1:] != -100).sum())

    model.zero_grad()
    full_loss = model(**full).loss
    full_loss.backward()
    full_grad = model.nezha.embeddings.word_embeddings.weight.grad.clone()

    model.zero_grad()
    accumulated = 0.0
    for half in halves:
        loss = model(**half, num_items_in_batch=torch.tensor(num_items)).loss
        loss.backward()
        accumulated += loss.item()
    torch.testing.assert_close(torch.tensor(accumulated), full_loss.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model.nezha.embeddings.word_embeddings.weight.grad, full_grad, atol=1e-6, rtol=1e-5)


def test_bad_unilm_input_is_a_clear_error():
    model = tiny_unilm()
    batch = unilm_batch([5], 3)
    with pytest.raises(ValueError, match="token_type_ids"):
        model(batch["input_ids"], labels=batch["labels"])
    out = model(batch["input_ids"][:, :7], token_type_ids=batch["token_type_ids"][:, :7], use_cache=True)
    with pytest.raises(ValueError, match="first call"):
        model(batch["input_ids"][:, 7:8], token_type_ids=torch.zeros(1, 1, dtype=torch.long),
              cache=out.cache)
    with pytest.raises(ValueError, match="causal"):
        NezhaForMaskedLM(tiny_config())(batch["input_ids"], cache=out.cache)


def test_copy_loss_is_lm_loss_plus_weighted_tag_cross_entropy():
    model = copy_unilm(copy_loss_weight=2.0)
    batch = unilm_batch([6, 9], 5)
    generator = torch.Generator().manual_seed(1)
    copy_labels = torch.randint(0, 3, batch["labels"].shape, generator=generator).masked_fill(batch["labels"] == -100, -100)
    with_copy = model(**batch, copy_labels=copy_labels, num_items_in_batch=torch.tensor(7))
    plain = model(**batch, num_items_in_batch=torch.tensor(7))
    expected_tag_loss = torch.nn.functional.cross_entropy(
        with_copy.copy_logits[:, :-1].reshape(-1, 3), copy_labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    ) / 7
    torch.testing.assert_close(with_copy.loss, plain.loss + 2.0 * expected_tag_loss)


def test_splitting_a_source_across_calls_is_still_refused_outside_generate():
    model = tiny_unilm()
    batch = unilm_batch([5], 3)
    out = model(batch["input_ids"][:, :4], token_type_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True)
    with pytest.raises(ValueError, match="first call"):
        model(batch["input_ids"][:, 4:6], token_type_ids=torch.zeros(1, 2, dtype=torch.long),
              cache=out.cache)
