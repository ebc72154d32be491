"""Generation with NezhaForUniLM (`generation_nezha`): cached and uncached, every decoding mode, token types, the
SPACES copy constraint, no length cap, and toy tasks it must learn."""

import json

import pytest
import torch
from helpers import (
    CLS,
    PAD,
    SEP,
    copy_unilm,
    left_padded_prompts,
    tiny_config,
    tiny_unilm,
    unilm_batch,
)

from nezha_hf import NezhaForUniLM
from nezha_hf.unilm import copy_tags


def generate_scores(model, input_ids, attention_mask, use_cache, **kwargs):
    out = model.generate(
        input_ids, attention_mask=attention_mask, use_cache=use_cache, max_new_tokens=8, eos_token_id=SEP,
        pad_token_id=PAD, return_dict_in_generate=True, output_logits=True, **kwargs,
    )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("decoding", [dict(do_sample=False), dict(num_beams=3, do_sample=False, length_penalty=0.8)])
def test_cached_generation_equals_uncached_left_padded(decoding):
    model = tiny_unilm()
    _, input_ids, attention_mask = left_padded_prompts([7, 12, 3])
    cached, cached_logits = generate_scores(model, input_ids, attention_mask, True, **decoding)
    uncached, uncached_logits = generate_scores(model, input_ids, attention_mask, False, **decoding)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(cached_logits, uncached_logits, atol=1e-5, rtol=0)


def test_left_padded_batch_equals_one_prompt_at_a_time():
    model = tiny_unilm()
    prompts, input_ids, attention_mask = left_padded_prompts([7, 12, 3])
    batched, batched_logits = generate_scores(model, input_ids, attention_mask, True, do_sample=False)
    width = input_ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone, alone_logits = generate_scores(model, torch.tensor([prompt]), None, True, do_sample=False)
        new = alone[0, len(prompt):]
        assert torch.equal(batched[row, width : width + len(new)], new)
        steps = alone_logits.shape[1]
        torch.testing.assert_close(batched_logits[row, :steps], alone_logits[0], atol=1e-5, rtol=0)


def test_static_cache_equals_dynamic_cache():
    model = tiny_unilm()
    _, input_ids, attention_mask = left_padded_prompts([6, 9])
    dynamic, dynamic_logits = generate_scores(model, input_ids, attention_mask, True, do_sample=False)
    static, static_logits = generate_scores(
        model, input_ids, attention_mask, True, do_sample=False, cache_implementation="static"
    )
    assert torch.equal(dynamic, static)
    torch.testing.assert_close(dynamic_logits, static_logits, atol=1e-5, rtol=0)


def test_generated_tokens_get_token_type_one():
    model = tiny_unilm()
    _, input_ids, attention_mask = left_padded_prompts([5, 8])
    seen, passed = [], []  # the types each step embeds, and the types generate() passed to forward
    embedding_hook = model.nezha.embeddings.token_type_embeddings.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].clone())
    )
    forward_hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: passed.append(kwargs.get("token_type_ids")), with_kwargs=True
    )
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, eos_token_id=SEP, pad_token_id=PAD,
                   min_new_tokens=4)
    embedding_hook.remove()
    forward_hook.remove()
    assert torch.equal(seen[0], torch.zeros_like(input_ids))
    assert len(seen) == 4 and all(bool((step == 1).all()) for step in seen[1:])
    # Decoding steps take no token types (targets are the default after a cache): nothing per step an exported
    # decoding loop would have to supply.
    assert passed[0] is not None and passed[1:] == [None] * 3


def test_beam_search_options_and_sampling():
    model = tiny_unilm()
    _, input_ids, attention_mask = left_padded_prompts([6, 10])
    beams = model.generate(
        input_ids, attention_mask=attention_mask, num_beams=4, no_repeat_ngram_size=2, min_new_tokens=6,
        max_new_tokens=10, eos_token_id=SEP, pad_token_id=PAD, length_penalty=1.5,
    )
    width = input_ids.shape[1]
    for row in beams[:, width:].tolist():
        row = [token for token in row if token != PAD]
        assert len(row) >= 6
        bigrams = list(zip(row, row[1:]))
        assert len(bigrams) == len(set(bigrams)), row
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        sampled.append(model.generate(
            input_ids, attention_mask=attention_mask, do_sample=True, top_k=20, top_p=0.9, temperature=0.7,
            repetition_penalty=1.3, max_new_tokens=8, eos_token_id=SEP, pad_token_id=PAD, use_cache=use_cache,
        ))
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.slow
def test_long_source_generation_with_cache_matches_uncached():
    """A 4,096-token source (three-region prefill) and cached decoding; same tokens without the cache."""
    model = tiny_unilm(max_relative_position=64)
    _, input_ids, attention_mask = left_padded_prompts([4094])
    cached, cached_logits = generate_scores(model, input_ids, attention_mask, True, do_sample=False)
    uncached, uncached_logits = generate_scores(model, input_ids, attention_mask, False, do_sample=False)
    assert input_ids.shape[1] == 4096
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(cached_logits, uncached_logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_small_model_learns_to_copy_the_source():
    """Trained on copying 5-token sources, greedy generation reproduces held-out sources."""
    torch.manual_seed(0)
    vocab = 20
    model = NezhaForUniLM(tiny_config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      max_relative_position=16))
    generator = torch.Generator().manual_seed(0)

    def examples(count):
        sources = torch.randint(5, vocab, (count, 5), generator=generator)
        return [{"input_ids": [CLS, *s, SEP, *s, SEP], "token_type_ids": [0] * 7 + [1] * 6,
                 "labels": [-100] * 7 + [*s, SEP]} for s in sources.tolist()]

    def collate(rows):
        return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(300):
        loss = model(**collate(examples(32))).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.1 * sum(losses[:10]) / 10
    model.eval()
    held_out = torch.randint(5, vocab, (8, 5), generator=generator)
    prompts = torch.cat([torch.full((8, 1), CLS), held_out, torch.full((8, 1), SEP)], 1)
    generated = model.generate(prompts, max_new_tokens=6, eos_token_id=SEP, pad_token_id=PAD, do_sample=False)
    correct = (generated[:, 7:12] == held_out).all(1).float().mean().item()
    assert correct >= 0.75, generated


def test_generation_is_not_capped_at_max_position_embeddings(tmp_path, caplog):
    """v4 configs say max_position_embeddings=512; transformers would stop a 600-token prompt at once (and warn
    past 512 tokens). The value still goes back into config.json, where transformers 4.x reads it."""
    from transformers.utils import logging as hf_logging

    model = tiny_unilm(max_position_embeddings=512)
    _, input_ids, _ = left_padded_prompts([598])
    hf_logging.enable_propagation()
    try:
        out = model.generate(input_ids, eos_token_id=SEP, pad_token_id=PAD, min_new_tokens=20)
    finally:
        hf_logging.disable_propagation()
    assert out.shape[1] == 600 + 20  # transformers' default of 20 new tokens
    assert not [r for r in caplog.records if "maximum length" in r.getMessage()]
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == 512


def reference_copy_decode(model, source, max_new_tokens):
    """SPACES greedy copy decoding, one full forward per step (no cache)."""
    sequence, span, tags_used = [CLS, *source, SEP], 0, []
    for _ in range(max_new_tokens):
        types = [0] * (len(source) + 2) + [1] * (len(sequence) - len(source) - 2)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([sequence]), token_type_ids=torch.tensor([types]))
        scores, tag_scores = out.logits[0, -1], out.copy_logits[0, -1].clone()
        if span == 0:
            tag_scores[2] = float("-inf")
        tag = int(tag_scores.argmax())
        tags_used.append(tag)
        span = tag if tag < 2 else span + 1
        target = sequence[len(source) + 2 :]
        allowed = None
        if span > 1:
            prefix = target[len(target) - span + 1 :]
            allowed = {source[i + len(prefix)] for i in range(len(source) - len(prefix)) if source[i : i + len(prefix)] == prefix}
            if not allowed:
                span = 1
        if span == 1:
            allowed = set(source)
        if allowed is not None:
            scores = torch.where(torch.isin(torch.arange(len(scores)), torch.tensor(sorted(allowed))), scores, float("-inf"))
        sequence.append(int(scores.argmax()))
        if sequence[-1] == SEP:
            break
    return sequence[len(source) + 2 :], tags_used


def test_copy_decoding_matches_the_spaces_reference_loop():
    model = copy_unilm()
    prompts, input_ids, attention_mask = left_padded_prompts([9, 14], vocab=30)
    generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, eos_token_id=SEP,
                               pad_token_id=PAD, do_sample=False)
    all_tags = set()
    for row, prompt in enumerate(prompts):
        expected, tags = reference_copy_decode(model, prompt[1:-1], 12)
        all_tags.update(tags)
        got = generated[row, input_ids.shape[1] :].tolist()
        assert got[: len(expected)] == expected
    assert all_tags == {0, 1, 2}  # the comparison exercised generation, span starts and continuations
    free = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, eos_token_id=SEP,
                          pad_token_id=PAD, do_sample=False, copy_constraint=False)
    assert not torch.equal(free, generated)


@pytest.mark.parametrize("decoding", [dict(do_sample=False), dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)])
def test_copied_spans_continue_source_ngrams(decoding):
    """A tagger that always copies: each generated token follows its predecessor in the source."""
    model = tiny_unilm(0, unilm_copy_tags=True)
    with torch.no_grad():
        model.copy_head.weight.zero_()
        model.copy_head.bias.copy_(torch.tensor([0.0, 5.0, 10.0]))  # start a span, then always continue
    sources = [list(range(10, 40)), list(range(40, 60))]  # distinct tokens: every continuation is unique
    input_ids = torch.tensor([[CLS, *sources[0], SEP], [PAD] * 10 + [CLS, *sources[1], SEP]])  # left-padded
    attention_mask = (input_ids != PAD).long()
    torch.manual_seed(0)
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, eos_token_id=SEP,
                         pad_token_id=PAD, **decoding)
    rows_per_source = out.shape[0] // 2
    for row, generated in enumerate(out[:, input_ids.shape[1] :].tolist()):
        source = sources[row // rows_per_source]
        assert all(token in source for token in generated)
        for before, after in zip(generated, generated[1:]):
            # continue the source, or restart after its last token (nothing follows it)
            assert after == before + 1 or before == source[-1], generated


def test_copy_constraint_gives_way_to_no_repeat_ngram():
    """When no_repeat_ngram_size bans every source token, the row decodes freely instead of breaking."""
    model = tiny_unilm(0, unilm_copy_tags=True)
    with torch.no_grad():
        model.copy_head.weight.zero_()
        model.copy_head.bias.copy_(torch.tensor([0.0, 5.0, 10.0]))
    input_ids = torch.tensor([[CLS, 10, 11, 12, SEP]])
    for decoding in (dict(do_sample=False), dict(num_beams=2)):
        out = model.generate(input_ids, max_new_tokens=12, min_new_tokens=12, eos_token_id=SEP, pad_token_id=PAD,
                             no_repeat_ngram_size=2, **decoding)[0, 5:].tolist()
        assert len(out) == 12
        bigrams = list(zip(out, out[1:]))
        assert len(bigrams) == len(set(bigrams))  # only 3x3 bigrams of source tokens exist: some are free


def test_copy_head_errors_are_clear():
    plain = tiny_unilm()
    batch = unilm_batch([4], 3)
    with pytest.raises(ValueError, match="unilm_copy_tags"):
        plain(**batch, copy_labels=batch["labels"])
    with pytest.raises(ValueError, match="copy head"):
        plain.generate(batch["input_ids"][:, :6], copy_constraint=True, max_new_tokens=2)
    with pytest.raises(Exception, match="copy_loss_weight"):  # huggingface_hub wraps the ValueError
        tiny_config(unilm_copy_tags=True, copy_loss_weight=-1)
    model = copy_unilm()
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(inputs_embeds=torch.randn(1, 5, model.config.hidden_size), max_new_tokens=2)


@pytest.mark.slow
def test_copy_head_learns_tags_jointly_and_constrained_decoding_copies():
    """Target = source tokens 2..4, then a fixed token: copy tags 1 2 2 0 0."""
    torch.manual_seed(0)
    vocab, marker = 24, 4
    model = NezhaForUniLM(tiny_config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      max_relative_position=16, unilm_copy_tags=True))
    generator = torch.Generator().manual_seed(0)

    def examples(count):
        rows = []
        for source in torch.randint(5, vocab, (count, 6), generator=generator).tolist():
            target = [*source[1:4], marker]
            rows.append({"input_ids": [CLS, *source, SEP, *target, SEP], "token_type_ids": [0] * 8 + [1] * 5,
                         "labels": [-100] * 8 + [*target, SEP], "copy_labels": [-100] * 8 + copy_tags(source, target) + [0]})
        return rows

    def collate(rows):
        return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(700):  # every seed tried (0 to 5) then copies at least 3 of 4 held-out spans
        loss = model(**collate(examples(32))).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    held_out = collate(examples(64))
    with torch.no_grad():
        predicted = model(**held_out).copy_logits[:, :-1].argmax(-1)
    wanted = held_out["copy_labels"][:, 1:]
    assert (predicted == wanted)[wanted != -100].float().mean() > 0.9
    generated = model.generate(held_out["input_ids"][:, :8], max_new_tokens=5, eos_token_id=SEP, pad_token_id=PAD)
    correct = (generated[:, 8:11] == held_out["input_ids"][:, 2:5]).all(1).float().mean()
    assert correct >= 0.75, generated


# --- every generate mode gives plain greedy's tokens (issue: token types in each mode) ----------------------


def greedy_setup(prompt_lengths=(9,), seed=3):
    model = tiny_unilm(seed)
    _, input_ids, attention_mask = left_padded_prompts(list(prompt_lengths), seed=seed)
    settings = dict(max_new_tokens=10, min_new_tokens=10, eos_token_id=SEP, pad_token_id=PAD, do_sample=False)
    plain = model.generate(input_ids, attention_mask=attention_mask, use_cache=False, **settings)
    return model, input_ids, attention_mask, settings, plain


@pytest.mark.parametrize("assistant_layers", [None, 1, 2])  # None: the model assists itself
def test_assisted_decoding_gives_greedy_tokens(assistant_layers):
    model, input_ids, _, settings, plain = greedy_setup()
    assistant = model if assistant_layers is None else tiny_unilm(7, num_hidden_layers=assistant_layers)
    assert torch.equal(model.generate(input_ids, assistant_model=assistant, **settings), plain)


def test_prompt_lookup_decoding_gives_greedy_tokens():
    model, input_ids, _, settings, plain = greedy_setup()
    # A prompt that repeats what greedy decoding produces, so that lookup proposes (long) candidates.
    generated = plain[:, input_ids.shape[1]:]
    prompt = torch.cat([input_ids[:, :-1], generated, generated, input_ids[:, -1:]], 1)
    reference = model.generate(prompt, use_cache=False, **settings)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=4, **settings), reference)


@pytest.mark.parametrize("cache_keyword", ["cache", "past_key_values"])
def test_generation_continues_from_a_cache(cache_keyword):
    """The source in one forward call, then generate() with that cache and the source plus the first new token.
    `past_key_values` is the keyword before transformers 5.24: code written for it keeps working."""
    from transformers import DynamicCache

    model, input_ids, _, settings, plain = greedy_setup()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, token_type_ids=torch.zeros_like(input_ids), **{cache_keyword: cache}, use_cache=True)
    assert cache.get_seq_length() == input_ids.shape[1]
    start = input_ids.shape[1] + 1
    continued = model.generate(plain[:, :start], **{cache_keyword: cache}, **{**settings, "max_new_tokens": 9,
                                                                             "min_new_tokens": 9})
    assert torch.equal(continued, plain)


def test_generation_from_inputs_embeds_and_continuing_from_them():
    model, input_ids, attention_mask, settings, plain = greedy_setup((9, 5))
    embeds = model.get_input_embeddings()(input_ids)
    out = model.generate(inputs_embeds=embeds, attention_mask=attention_mask, return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, plain[:, input_ids.shape[1]:])  # with inputs_embeds only new tokens return
    # Continue: the embeddings of everything so far, the cache of the first call, five more tokens.
    first = model.generate(inputs_embeds=embeds, attention_mask=attention_mask, return_dict_in_generate=True,
                           **{**settings, "max_new_tokens": 5, "min_new_tokens": 5})
    so_far = torch.cat([input_ids, first.sequences], 1)
    mask = torch.cat([attention_mask, torch.ones_like(first.sequences)], 1)
    more = model.generate(inputs_embeds=model.get_input_embeddings()(so_far), attention_mask=mask,
                          cache=first.cache, **{**settings, "max_new_tokens": 5, "min_new_tokens": 5})
    assert torch.equal(torch.cat([first.sequences, more], 1), plain[:, input_ids.shape[1]:])


def test_static_cache_and_beam_search_give_their_uncached_tokens():
    model, input_ids, attention_mask, settings, plain = greedy_setup((9, 5))
    static = model.generate(input_ids, attention_mask=attention_mask, cache_implementation="static", **settings)
    assert torch.equal(static, plain)
    beams = {**settings, "num_beams": 3, "do_sample": False}
    assert torch.equal(model.generate(input_ids, attention_mask=attention_mask, **beams),
                       model.generate(input_ids, attention_mask=attention_mask, use_cache=False, **beams))




# --- the generation contract (what transformers' GenerationTesterMixin checks of a decoder) --------------------


@pytest.mark.parametrize("decoding", [dict(do_sample=False), dict(num_beams=2, do_sample=False),
                                      dict(do_sample=True, num_return_sequences=2)], ids=["greedy", "beams", "sample"])
def test_return_dict_in_generate_has_outputs_of_the_right_shapes(decoding):
    model = tiny_unilm()
    _, input_ids, attention_mask = left_padded_prompts([6, 9])
    batch, prompt, new = input_ids.shape[0], input_ids.shape[1], 5
    rows = batch * decoding.get("num_beams", decoding.get("num_return_sequences", 1))
    torch.manual_seed(0)
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new, min_new_tokens=new,
                         eos_token_id=SEP, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, output_hidden_states=True, output_attentions=True, **decoding)
    config = model.config
    assert out.sequences.shape == (batch * decoding.get("num_return_sequences", 1), prompt + new)
    assert len(out.scores) == len(out.logits) == new
    assert all(s.shape == (rows, config.vocab_size) for s in (*out.scores, *out.logits))
    hidden, attentions = out.hidden_states, out.attentions
    assert len(hidden) == len(attentions) == new
    for step, (states, probs) in enumerate(zip(hidden, attentions)):
        queries = prompt if step == 0 else 1
        assert len(states) == config.num_hidden_layers + 1 and len(probs) == config.num_hidden_layers
        assert all(s.shape == (rows, queries, config.hidden_size) for s in states)
        assert all(p.shape == (rows, config.num_attention_heads, queries, prompt + step) for p in probs)
    from transformers import DynamicCache

    assert isinstance(out.cache, DynamicCache)
    assert out.cache.get_seq_length() == prompt + new - 1


def test_stopping_criteria_end_generation(tokenizer):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= prompt + 3, dtype=torch.bool)

    model = tiny_unilm(vocab_size=len(tokenizer))
    input_ids = tokenizer(["原告起诉被告"], return_tensors="pt")["input_ids"]
    prompt = input_ids.shape[1]
    out = model.generate(input_ids, max_new_tokens=20, eos_token_id=SEP, pad_token_id=PAD,
                         stopping_criteria=StoppingCriteriaList([AfterThree()]))
    assert out.shape[1] == prompt + 3


@pytest.mark.slow
def test_compiled_static_cache_gives_the_uncompiled_tokens():
    from transformers import CompileConfig

    model, input_ids, attention_mask, settings, plain = greedy_setup((9, 5))
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told otherwise
    compiled_forwards = []
    original = model.get_compiled_call
    model.get_compiled_call = lambda *a: compiled_forwards.append(1) or original(*a)
    compiled = model.generate(input_ids, attention_mask=attention_mask, cache_implementation="static",
                              compile_config=config, **settings)
    assert compiled_forwards and torch.equal(compiled, plain)


# --- negative special ids: "matches no token", as transformers reads them (issue 56) -----------------------------
# transformers' generation checks set eos_token_id / pad_token_id to -1 so that every sequence runs to its length;
# generate refused them as "outside the vocabulary", and six of those checks failed on that alone.

NEVER = dict(eos_token_id=-1, pad_token_id=-1, do_sample=False, max_new_tokens=6)


def never_ending_setup(prompt_lengths=(9,)):
    """A model, left-padded prompts, and its uncached greedy tokens with end and padding ids of -1."""
    model = tiny_unilm(3)
    _, input_ids, attention_mask = left_padded_prompts(list(prompt_lengths), seed=3)
    plain = model.generate(input_ids, attention_mask=attention_mask, use_cache=False, **NEVER)
    assert plain.shape[1] == input_ids.shape[1] + NEVER["max_new_tokens"]
    return model, input_ids, attention_mask, plain


@pytest.mark.parametrize("assistant_layers", [None, 1])  # None: the model assists itself
def test_assisted_decoding_with_negative_special_ids_gives_greedy_tokens(assistant_layers):
    model, input_ids, _, plain = never_ending_setup()
    assistant = model if assistant_layers is None else tiny_unilm(7, num_hidden_layers=assistant_layers)
    assert torch.equal(model.generate(input_ids, assistant_model=assistant, **NEVER), plain)


def test_assisted_sampling_with_negative_special_ids_runs_to_its_length():
    model, input_ids, _, plain = never_ending_setup()
    torch.manual_seed(0)
    sampled = model.generate(input_ids, assistant_model=tiny_unilm(7, num_hidden_layers=1),
                             **{**NEVER, "do_sample": True, "top_k": 5})
    assert sampled.shape == plain.shape and torch.equal(sampled[:, : input_ids.shape[1]], input_ids)
    assert bool(((sampled >= 0) & (sampled < model.config.vocab_size)).all())


def test_prompt_lookup_with_negative_special_ids_gives_greedy_tokens():
    model, input_ids, _, plain = never_ending_setup()
    assert torch.equal(model.generate(input_ids, prompt_lookup_num_tokens=3, **NEVER), plain)


def test_continuing_from_a_cache_with_negative_special_ids():
    from transformers import DynamicCache

    model, input_ids, _, plain = never_ending_setup()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, token_type_ids=torch.zeros_like(input_ids), cache=cache, use_cache=True)
    start = input_ids.shape[1] + 1
    continued = model.generate(plain[:, :start], cache=cache, **{**NEVER, "max_new_tokens": NEVER["max_new_tokens"] - 1})
    assert torch.equal(continued, plain)


def test_continuing_from_inputs_embeds_with_negative_special_ids():
    model, input_ids, attention_mask, plain = never_ending_setup((9, 5))
    embed = model.get_input_embeddings()
    first = model.generate(inputs_embeds=embed(input_ids), attention_mask=attention_mask, return_dict_in_generate=True,
                           **{**NEVER, "max_new_tokens": 3})
    so_far = torch.cat([input_ids, first.sequences], 1)
    mask = torch.cat([attention_mask, torch.ones_like(first.sequences)], 1)
    more = model.generate(inputs_embeds=embed(so_far), attention_mask=mask, cache=first.cache,
                          **{**NEVER, "max_new_tokens": 3})
    assert torch.equal(torch.cat([first.sequences, more], 1), plain[:, input_ids.shape[1]:])


def test_static_cache_fed_inputs_embeds_with_negative_special_ids():
    model, input_ids, attention_mask, plain = never_ending_setup((9, 5))
    out = model.generate(inputs_embeds=model.get_input_embeddings()(input_ids), attention_mask=attention_mask,
                         cache_implementation="static", **NEVER)
    assert torch.equal(out, plain[:, input_ids.shape[1]:])


def test_negative_special_ids_in_the_model_and_generation_configs(tmp_path):
    """A config or generation_config.json with -1 for the padding and end ids loads and generates to the length (the
    padding id gives the embedding no padding row: -1 is not the vocabulary's last row)."""
    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config(pad_token_id=-1, eos_token_id=-1)).eval()
    assert model.nezha.embeddings.word_embeddings.padding_idx is None
    model.save_pretrained(tmp_path / "m", model_card=False)
    settings = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert settings["eos_token_id"] == -1 and settings["pad_token_id"] == -1
    loaded = NezhaForUniLM.from_pretrained(tmp_path / "m").eval()
    _, input_ids, _ = left_padded_prompts([7])
    assert loaded.generate(input_ids, max_new_tokens=5).shape[1] == input_ids.shape[1] + 5
def test_copy_processor_ties_each_row_to_its_own_prompt():
    """Issue 54's kind "generated outputs matched to inputs by position": the copy constraint took row `r`'s source
    to be `r // rows_per_source`. Rows that do not carry their source's prompt (reordered, or a count that is not
    a multiple of the sources) are an error, not another source's n-grams."""
    from nezha_hf.generation_nezha import CopySpanLogitsProcessor

    prompt = torch.tensor([[CLS, 10, 11, SEP], [CLS, 40, 41, SEP]])
    processor = CopySpanLogitsProcessor.for_prompt(prompt, None, {CLS, SEP, PAD})
    scores = torch.zeros(4, 60)
    processor.copy_logits = torch.tensor([[0.0, 5.0, 0.0]]).repeat(4, 1)
    beams = prompt.repeat_interleave(2, 0)  # how generate expands rows: each source's together
    assert processor(beams, scores).shape == (4, 60)
    with pytest.raises(RuntimeError, match="prompt"):
        processor(prompt.repeat(2, 1), scores)  # the same rows, interleaved: 0, 1, 0, 1
    processor.copy_logits = processor.copy_logits[:3]
    with pytest.raises(RuntimeError, match="prompt"):
        processor(beams[:3], scores[:3])
