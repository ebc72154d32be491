"""NezhaModel and heads: the v4 reference fixtures, the independent reference, cache, round trip, bad input."""

import json
import os
import pickle
import shutil

import pytest
import reference
import torch
import transformers
from helpers import (
    FIXTURE_CASES,
    FIXTURES,
    PATH_CASES,
    run_case,
    tiny_config,
)
from safetensors.torch import load_file

import nezha_hf
from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForMultipleChoice,
    NezhaForNextSentencePrediction,
    NezhaForPreTraining,
    NezhaForQuestionAnswering,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaModel,
    relative_attention,
)
from nezha_hf.relative_attention import Engine


def test_all_fixture_cases_present():
    assert len(FIXTURE_CASES) == 11, FIXTURE_CASES


RAN = {None: Engine.FUSED, Engine.CHUNKED.value: Engine.CHUNKED, "eager": Engine.GATHER}


@pytest.mark.parametrize("name", FIXTURE_CASES)
@pytest.mark.parametrize("attn_implementation", list(RAN))
def test_fixture(name, attn_implementation):
    """Every stored output at 1e-5, on the path the implementation names (fast paths without output_attentions)."""
    assert run_case(name, attn_implementation) == {RAN[attn_implementation]}


@pytest.mark.parametrize("name", FIXTURE_CASES)
def test_fixture_through_three_regions(name, monkeypatch):
    # The fixtures are shorter than the length where three regions take over: force them on real v4 checkpoints.
    # They need more tokens than K (otherwise there are no tails), so the shorter cases run the chunked path.
    monkeypatch.setattr(relative_attention, "THREE_REGIONS_MIN_LENGTH", 1)
    length = json.loads((FIXTURES / name / "case.json").read_text())["length"]
    K = json.loads((FIXTURES / name / "config.json").read_text())["max_relative_position"]
    expected = Engine.THREE_REGIONS if length > K else Engine.CHUNKED
    assert run_case(name, Engine.THREE_REGIONS.value) == {expected}


K = 8


def padded_batch(length, vocab=99):
    torch.manual_seed(length)
    input_ids = torch.randint(1, vocab, (2, length))
    token_type_ids = torch.randint(0, 2, (2, length))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, max(1, length * 3 // 4) :] = 0
    return input_ids, token_type_ids, attention_mask


@pytest.mark.parametrize("length", [1, K - 1, K, K + 1, 300, 2048])
@pytest.mark.parametrize("attn_implementation", ["eager", Engine.FUSED.value, Engine.THREE_REGIONS.value])
def test_model_matches_independent_reference(length, attn_implementation, seed):
    model = NezhaModel(tiny_config(max_relative_position=K)).eval()
    model.set_attn_implementation(attn_implementation)
    input_ids, token_type_ids, attention_mask = padded_batch(length)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    expected = reference.nezha_forward(model, input_ids, token_type_ids, attention_mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_implementation, length, path", PATH_CASES)
def test_causal_decoder_matches_reference(attn_implementation, length, path, seed, attention_calls):
    model = NezhaModel(tiny_config(is_decoder=True, max_relative_position=K)).eval()
    model.set_attn_implementation(attn_implementation)
    input_ids, token_type_ids, attention_mask = padded_batch(length)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, use_cache=False)
    assert {call.ran for call in attention_calls} == {path}
    expected = reference.nezha_forward(model, input_ids, token_type_ids, attention_mask, causal=True)
    valid = attention_mask.bool()
    torch.testing.assert_close(got.last_hidden_state[valid].double(), expected[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["eager", Engine.FUSED.value, Engine.CHUNKED.value])
@pytest.mark.parametrize("cache_keyword", ["cache", "past_key_values"])  # the keyword before transformers 5.24
def test_cached_decoding_equals_full_pass(attn_implementation, cache_keyword, seed):
    model = NezhaModel(tiny_config(is_decoder=True)).eval()
    model.set_attn_implementation(attn_implementation)
    input_ids, token_type_ids, _ = padded_batch(30)
    with torch.no_grad():
        full = model(input_ids, token_type_ids=token_type_ids, use_cache=False).last_hidden_state
        out = model(input_ids[:, :5], token_type_ids=token_type_ids[:, :5], use_cache=True)
        assert isinstance(out.cache, transformers.Cache)
        steps, cache = [out.last_hidden_state], out.cache
        for t in range(5, 30):
            out = model(input_ids[:, t : t + 1], token_type_ids=token_type_ids[:, t : t + 1],
                        **{cache_keyword: cache})
            cache = out.cache
            steps.append(out.last_hidden_state)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_round_trip_is_exact_and_keeps_v4_names(tmp_path, seed):
    model = NezhaForMaskedLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    # The names transformers 4.x NEZHA uses; no relative table in the file.
    reference_names = set(load_file(FIXTURES / "mlm-long" / "model.safetensors"))
    assert set(saved) == reference_names
    assert not any("relative" in name for name in saved)
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 99, (1, 50))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "nezha"


def test_relative_table_rebuilt_on_load(tmp_path):
    model = NezhaModel(tiny_config())
    model.save_pretrained(tmp_path)
    loaded = NezhaModel.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.relative_table.double(), reference.relative_table(8, 8), atol=1e-6, rtol=0)


class UninitialisedMemoryIsNaN:
    """`torch.empty` (and so `to_empty`) fills new memory with NaN inside this block, so that a tensor left
    uninitialised shows, rather than holding whatever the memory held (torch's deterministic mode does this)."""

    def __enter__(self):
        self.saved = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = self.saved[1]


@pytest.mark.parametrize("cls", [NezhaModel, NezhaForMaskedLM, nezha_hf.NezhaForUniLM])
def test_relative_table_rebuilt_after_to_empty(cls):
    """Issue 54 item 7: the relative table is a non-persistent buffer (in no state dict), so building on the meta
    device, `to_empty()` and `load_state_dict` (the FSDP2 way to build a large model) left it uninitialised: a
    different model, silently. Every way buffers are (re)materialised rebuilds it: `to_empty` then
    `load_state_dict`, `to_empty` then `init_weights`, and a change of dtype."""
    torch.manual_seed(0)
    config = tiny_config()
    built = cls(config).eval()
    ids = torch.randint(5, 99, (2, 40))
    with torch.no_grad():
        expected = built(ids)[0]
    table = reference.relative_table(8, 8)
    with UninitialisedMemoryIsNaN():
        for initialise in (lambda m: None, lambda m: m.init_weights()):
            with torch.device("meta"):
                model = cls(config)
            model.to_empty(device="cpu")
            initialise(model)
            model.load_state_dict(built.state_dict())
            model.eval()
            base = model if cls is NezhaModel else model.nezha
            torch.testing.assert_close(base.relative_table.double(), table, atol=1e-6, rtol=0)
            with torch.no_grad():
                torch.testing.assert_close(model(ids)[0], expected, atol=1e-6, rtol=0)
        model.to(torch.float64)
        torch.testing.assert_close(base.relative_table, table, atol=1e-6, rtol=0)


def test_legacy_bin_with_bert_prefix_and_buffers_loads():
    model, info = NezhaForMaskedLM.from_pretrained(FIXTURES / "legacy-mlm-bert-prefix", output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(input_ids=torch.tensor([[1, 2, 99]])), "vocab_size"),
        (dict(input_ids=torch.tensor([[1, -1, 3]])), "vocab_size"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), token_type_ids=torch.tensor([[0, 2, 0]])), "type_vocab_size"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), token_type_ids=torch.tensor([[0, 1]])), "token_type_ids has shape"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 1]])), "attention_mask must be"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 1, 3, 3)), "attention_mask must be"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, -1, 1]])), "only 0 and 1"),
        # an additive mask (0 for tokens, -10000 for padding) read as 0/1 masked the tokens and kept the padding
        (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0.0, 0.0, -10000.0]])), "additive"),
        (dict(input_ids=torch.tensor([1, 2, 3])), "input_ids must be"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.tensor([[0, 1, 2]])), "position_ids"),
        # transformers 4's NEZHA honoured head_mask; accepted and ignored, it gave the unmasked heads' outputs
        (dict(input_ids=torch.tensor([[1, 2, 3]]), head_mask=torch.ones(2, 4)), "head_mask"),
        (dict(), "exactly one"),
    ],
)
def test_bad_input_raises_value_error(kwargs, message):
    model = NezhaModel(tiny_config()).eval()
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


def test_heads_refuse_a_head_mask_too():
    """A head passes what it does not take on to the encoder, which refuses it."""
    model = NezhaForMaskedLM(tiny_config()).eval()
    with pytest.raises(ValueError, match="head_mask"):
        model(torch.tensor([[1, 2, 3]]), head_mask=torch.ones(2, 4))


@pytest.mark.parametrize("mask", [torch.tensor([[1, 1, 0]]), torch.tensor([[True, True, False]]),
                                  torch.tensor([[1.0, 1.0, 0.0]])], ids=["int", "bool", "float"])
def test_zero_one_masks_of_any_dtype_are_accepted(mask):
    model = NezhaModel(tiny_config()).eval()
    with torch.no_grad():
        expected = model(torch.tensor([[1, 2]])).last_hidden_state
        got = model(torch.tensor([[1, 2, 3]]), attention_mask=mask).last_hidden_state[:, :2]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_config_with_layers_the_checkpoint_lacks_is_refused(tmp_path):
    """A config saying 4 layers over a 2-layer checkpoint loaded with 2 random layers and a log line only."""
    NezhaForMaskedLM(tiny_config()).save_pretrained(tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 layers.*4|layers"):
        NezhaForMaskedLM.from_pretrained(tmp_path / "two")
    model = NezhaForMaskedLM.from_pretrained(tmp_path / "two", allow_new_layers=True)  # asked for: new layers
    assert len(model.nezha.encoder.layer) == 4
    config["num_hidden_layers"] = 1
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layers"):
        NezhaForMaskedLM.from_pretrained(tmp_path / "two")  # and layers the config would drop


def test_attention_backends_that_would_drop_relative_terms_are_refused():
    with pytest.raises(ValueError, match="relative value term"):
        NezhaModel._from_config(tiny_config(), attn_implementation="sdpa")
    model = NezhaModel(tiny_config())
    assert model.config._attn_implementation == Engine.FUSED.value
    with pytest.raises(ValueError):
        model.set_attn_implementation("flex_attention")


def test_malicious_pickle_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/ran",))

    shutil.copy(FIXTURES / "mlm-long" / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Payload()}))
    with pytest.raises(ValueError, match=str(tmp_path)):
        NezhaForMaskedLM.from_pretrained(tmp_path)
    assert not (tmp_path / "ran").exists()


def test_truncated_checkpoint_names_the_file(tmp_path):
    shutil.copy(FIXTURES / "mlm-long" / "config.json", tmp_path)
    data = (FIXTURES / "mlm-long" / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:1000])
    with pytest.raises(ValueError, match=f"{tmp_path / 'model.safetensors'}: is not a whole safetensors file"):
        NezhaForMaskedLM.from_pretrained(tmp_path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    shutil.copy(FIXTURES / "mlm-long" / "model.safetensors", tmp_path)
    config = json.loads((FIXTURES / "mlm-long" / "config.json").read_text())
    config["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"intermediate\.dense\.weight: checkpoint \(37, 32\) vs model \(40, 32\)"):
        NezhaForMaskedLM.from_pretrained(tmp_path)


def test_output_attentions_and_hidden_states_like_bert():
    model = NezhaModel(tiny_config()).eval()
    ids = torch.randint(0, 99, (2, 12))
    out = model(ids, output_attentions=True, output_hidden_states=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 4, 12, 12)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 4, 12))
    assert isinstance(model(ids, return_dict=False), tuple)


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = NezhaForMaskedLM(tiny_config())
    ids = torch.randint(0, 99, (2, 20))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model.train()
    plain = grads()
    model.activation_checkpointing_enable()
    checkpointed = grads()
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b)


HEADS = [
    (NezhaForPreTraining, lambda ids: dict(labels=ids, next_sentence_label=torch.tensor([0, 1]))),
    (NezhaForMaskedLM, lambda ids: dict(labels=ids)),
    (NezhaForNextSentencePrediction, lambda ids: dict(labels=torch.tensor([0, 1]))),
    (NezhaForSequenceClassification, lambda ids: dict(labels=torch.tensor([0, 2]))),
    (NezhaForTokenClassification, lambda ids: dict(labels=ids % 3)),
    (NezhaForQuestionAnswering, lambda ids: dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))),
]


@pytest.mark.parametrize("head,labels", HEADS, ids=lambda x: getattr(x, "__name__", ""))
def test_every_head_trains(head, labels):
    torch.manual_seed(0)
    model = head(tiny_config(num_labels=2 if head is NezhaForQuestionAnswering else 3)).train()
    ids = torch.randint(1, 99, (2, 16))
    loss = model(ids, **labels(ids)).loss
    loss.backward()
    assert torch.isfinite(loss) and model.nezha.embeddings.word_embeddings.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("num_labels,labels,problem", [
    (1, torch.tensor([0.5, -1.0]), "regression"),
    (3, torch.tensor([0, 2]), "single_label_classification"),
    (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), "multi_label_classification"),
])
def test_sequence_classification_problem_types(num_labels, labels, problem):
    model = NezhaForSequenceClassification(tiny_config(num_labels=num_labels)).eval()
    out = model(torch.randint(1, 99, (2, 10)), labels=labels)
    assert model.config.problem_type == problem
    logits = out.logits.squeeze(-1) if num_labels == 1 else out.logits
    expected = {
        "regression": lambda: torch.nn.functional.mse_loss(logits, labels),
        "single_label_classification": lambda: torch.nn.functional.cross_entropy(logits, labels),
        "multi_label_classification": lambda: torch.nn.functional.binary_cross_entropy_with_logits(logits, labels),
    }[problem]()
    torch.testing.assert_close(out.loss, expected)


def test_multiple_choice_shapes():
    model = NezhaForMultipleChoice(tiny_config()).eval()
    out = model(torch.randint(1, 99, (2, 4, 10)), labels=torch.tensor([1, 3]))
    assert out.logits.shape == (2, 4) and torch.isfinite(out.loss)


def test_auto_classes_registered():
    config = tiny_config()
    for head in nezha_hf.NEZHA_HEADS:
        if head.auto_class is not None:
            assert type(getattr(transformers, head.auto_class).from_config(config)) is head.model_class


def test_no_length_buffers_in_model():
    model = NezhaModel(tiny_config(max_position_embeddings=512))
    buffers = dict(model.named_buffers())
    assert list(buffers) == ["relative_table"] and buffers["relative_table"].shape == (17, 8)


@pytest.mark.slow
def test_16k_tokens_run_with_a_base_width_layer():
    config = tiny_config(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=1,
                         max_relative_position=64, vocab_size=200)
    model = NezhaModel(config).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 200, (1, 16384))).last_hidden_state
    assert out.shape == (1, 16384, 768) and torch.isfinite(out).all()


def test_legacy_buffers_are_dropped_with_a_log_line(caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            NezhaForMaskedLM.from_pretrained(FIXTURES / "legacy-mlm-bert-prefix")
    finally:
        hf_logging.disable_propagation()
    assert "Dropped 3 persisted buffer(s)" in caplog.text, caplog.text


def test_heads_table_lists_every_model_class():
    from nezha_hf import modeling_nezha

    classes = {
        obj for obj in vars(modeling_nezha).values()
        if isinstance(obj, type) and issubclass(obj, nezha_hf.NezhaPreTrainedModel)
        and obj not in (nezha_hf.NezhaPreTrainedModel, nezha_hf.NezhaModelWithHead)  # base classes
    }
    assert classes == {head.model_class for head in nezha_hf.NEZHA_HEADS}
    assert nezha_hf.nezha_head("NeZhaForMaskedLM").model_class is NezhaForMaskedLM  # old casing
    with pytest.raises(ValueError, match=r"not a NEZHA model class; choose from \[.*'NezhaForUniLM'"):
        nezha_hf.nezha_head("NezhaEmbeddings")


def test_attention_functions_take_the_relative_table_by_name():
    from helpers import FakeModule

    from nezha_hf.relative_attention import engine_function

    q = torch.randn(1, 2, 5, 8)
    for engine in Engine:
        with pytest.raises(TypeError, match="relative_table"):
            engine_function(engine)(FakeModule().eval(), q, q, q, None, 0.5)


# --- cross-attention (a NEZHA decoder over an encoder's states, as transformers 4.x had) ----------------------


def cross_attention_case(decoder_length=9, encoder_length=14, seed=0):
    torch.manual_seed(seed)
    model = NezhaModel(tiny_config(is_decoder=True, add_cross_attention=True, max_relative_position=4)).eval()
    ids = torch.randint(1, 99, (2, decoder_length))
    mask = torch.ones_like(ids)
    mask[1, decoder_length - 2 :] = 0
    memory = torch.randn(2, encoder_length, 32)
    memory_mask = torch.ones(2, encoder_length, dtype=torch.long)
    memory_mask[0, encoder_length - 4 :] = 0
    return model, ids, mask, memory, memory_mask


@pytest.mark.parametrize("attn_implementation", list(RAN))
@pytest.mark.parametrize("lengths", [(9, 9), (9, 14), (14, 5)])  # 4.x ran only equal lengths; the formula extends
def test_cross_attention_matches_the_independent_reference(attn_implementation, lengths):
    model, ids, mask, memory, memory_mask = cross_attention_case(*lengths)
    model.set_attn_implementation(attn_implementation or Engine.FUSED.value)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, encoder_hidden_states=memory, encoder_attention_mask=memory_mask,
                    use_cache=False).last_hidden_state
    expected = reference.nezha_forward(model, ids, attention_mask=mask, causal=True, encoder_hidden_states=memory,
                                       encoder_attention_mask=memory_mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


def test_cross_attention_cached_decoding_equals_the_full_pass():
    model, ids, _, memory, memory_mask = cross_attention_case(12, 7)
    with torch.no_grad():
        full = model(ids, encoder_hidden_states=memory, encoder_attention_mask=memory_mask, use_cache=False)
        out = model(ids[:, :4], encoder_hidden_states=memory, encoder_attention_mask=memory_mask, use_cache=True)
        assert isinstance(out.cache, transformers.EncoderDecoderCache)
        steps = [out.last_hidden_state]
        for t in range(4, 12):
            out = model(ids[:, t : t + 1], encoder_hidden_states=memory, encoder_attention_mask=memory_mask,
                        cache=out.cache)
            steps.append(out.last_hidden_state)
    torch.testing.assert_close(torch.cat(steps, 1), full.last_hidden_state, atol=1e-5, rtol=0)


def test_cross_attention_is_asked_for_or_refused():
    memory = torch.randn(1, 5, 32)
    with pytest.raises(ValueError, match="no cross-attention"):
        NezhaModel(tiny_config(is_decoder=True))(torch.tensor([[1, 2, 3]]), encoder_hidden_states=memory)
    config = tiny_config(is_decoder=True)
    config.add_cross_attention = True  # set after the config was made: the model still builds the layers
    model = NezhaModel(config)
    assert all(hasattr(layer, "crossattention") for layer in model.encoder.layer)
    model(torch.tensor([[1, 2, 3]]), encoder_hidden_states=memory)
    encoder_config = tiny_config()
    encoder_config.add_cross_attention = True
    with pytest.raises(ValueError, match="needs is_decoder"):
        NezhaModel(encoder_config)


@pytest.mark.slow
def test_encoder_decoder_model_with_nezha_on_both_sides_trains_and_generates():
    """bert2bert-style: a NEZHA encoder, a NEZHA decoder with cross-attention; it learns to copy its input."""
    torch.manual_seed(0)
    encoder = NezhaModel(tiny_config(vocab_size=20, hidden_size=64, intermediate_size=128, max_relative_position=8))
    decoder = transformers.AutoModelForCausalLM.from_config(tiny_config(
        vocab_size=20, hidden_size=64, intermediate_size=128, max_relative_position=8, is_decoder=True,
        add_cross_attention=True))
    model = transformers.EncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id, model.config.pad_token_id, model.config.eos_token_id = 2, 0, 3
    generator = torch.Generator().manual_seed(0)

    def batch(rows):
        source = torch.randint(5, 20, (rows, 6), generator=generator)
        labels = torch.cat([source, torch.full((rows, 1), 3)], 1)
        return source, labels

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(250):
        source, labels = batch(32)
        loss = model(input_ids=source, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.2 * sum(losses[:10])
    model.eval()
    source, labels = batch(8)
    settings = dict(max_new_tokens=7, do_sample=False, decoder_start_token_id=2, eos_token_id=3, pad_token_id=0)
    cached = model.generate(source, **settings)
    assert torch.equal(cached, model.generate(source, use_cache=False, **settings))
    assert (cached[:, 1:7] == source).all(1).float().mean() >= 0.75, cached


# --- bad input: a clear error, never a crash deep inside (issue: nothing silent) ------------------------------


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_an_empty_or_truncated_bin_names_the_file(tmp_path, damage):
    shutil.copy(FIXTURES / "pretraining-bin" / "config.json", tmp_path)
    data = (FIXTURES / "pretraining-bin" / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{tmp_path / 'pytorch_model.bin'}: is not a plain weights file"):
        NezhaForPreTraining.from_pretrained(tmp_path)


def test_a_missing_local_folder_is_named_not_looked_up_on_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such model folder"):
        NezhaForMaskedLM.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("shape", [(1, 0), (0, 5)])
def test_empty_input_is_a_clear_error(shape):
    with pytest.raises(ValueError, match="input is empty"):
        NezhaModel(tiny_config())(torch.zeros(shape, dtype=torch.long))


def test_a_forward_on_the_meta_device_gives_shapes():
    with torch.device("meta"):
        model = NezhaForMaskedLM(tiny_config())
    ids = torch.zeros(2, 700, dtype=torch.long, device="meta")
    logits = model(ids, attention_mask=torch.ones(2, 700, device="meta")).logits
    assert logits.shape == (2, 700, 99) and logits.device.type == "meta"


# --- what NEZHA's overrides change in transformers: each test fails once transformers changes that behaviour ---------
# (see NezhaPreTrainedModel's docstring: then the override can go)


def test_transformers_still_shards_before_it_ties_the_weights(tmp_path, monkeypatch):
    """`maybe_distribute_model` ties the MLM decoder to the word embeddings before sharding, because transformers
    still calls it before it ties them."""
    from transformers import PreTrainedModel
    from transformers.distributed import DistributedConfig

    NezhaForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    tied_when_distributing = []

    def spy(cls, model, distributed_config, mesh_manager):
        tied_when_distributing.append(model.cls.predictions.decoder.weight is model.get_input_embeddings().weight)
        return model

    monkeypatch.setattr(NezhaForMaskedLM, "maybe_distribute_model", classmethod(spy))
    model = NezhaForMaskedLM.from_pretrained(tmp_path, distributed_config=DistributedConfig())
    assert tied_when_distributing == [False]
    assert model.cls.predictions.decoder.weight is model.get_input_embeddings().weight
    assert PreTrainedModel.maybe_distribute_model  # the hook NEZHA overrides still exists


def test_transformers_still_defaults_to_another_attention_and_accepts_paged_ones():
    """`get_correct_attn_implementation` picks NEZHA's fused engine by default and refuses every other registered
    attention, because transformers' own picks eager (no sdpa here) and accepts paged eager, which would drop the
    relative terms."""
    from transformers import PreTrainedModel

    model = NezhaModel(tiny_config())
    assert PreTrainedModel.get_correct_attn_implementation(model, None) == "eager"
    assert PreTrainedModel.get_correct_attn_implementation(model, "paged|eager") == "paged|eager"
    assert model.get_correct_attn_implementation(None) == "nezha_fused"
    with pytest.raises(ValueError, match="relative value term"):
        model.get_correct_attn_implementation("paged|eager")


def test_transformers_still_reports_mismatched_tensors_only_in_its_log(tmp_path):
    """`from_pretrained` names each tensor that does not fit the config in its error, because transformers' error
    still only points to the report it logged."""
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=37)
    transformers.BertModel(config).save_pretrained(tmp_path)
    config.vocab_size = 60
    with pytest.raises(RuntimeError) as raised:
        transformers.BertModel.from_pretrained(tmp_path, config=config)
    assert "word_embeddings" not in str(raised.value)
