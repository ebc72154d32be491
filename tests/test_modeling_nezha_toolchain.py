"""NEZHA in the PyTorch toolchain: torch.compile, torch.export, torch.jit.trace and ONNX, each against eager mode on
padded batches at lengths where every engine really runs."""

import warnings

import pytest
import torch
from helpers import tiny_config
from transformers import CompileConfig

from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForSequenceClassification,
    NezhaForUniLM,
    NezhaModel,
)
from nezha_hf import relative_attention as ra

HEADS = [NezhaModel, NezhaForMaskedLM, NezhaForSequenceClassification]
# Compiling takes long on 2 cores: one head at one length in the default run, the rest marked slow (CI runs them).
COMPILED = [pytest.param(cls, length, marks=[] if (cls, length) == (NezhaForMaskedLM, 600) else [pytest.mark.slow],
                         id=f"{cls.__name__}-{length}")
            for cls in HEADS for length in (16, 600, 3000)]


def padded_batch(length, rows=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.randint(0, 2, ids.shape, generator=generator)}


def main_output(out):
    return out["logits"] if "logits" in out else out["last_hidden_state"]


def build(cls, implementation=None, **overrides):
    torch.manual_seed(0)
    return cls._from_config(tiny_config(num_labels=3, **overrides), attn_implementation=implementation).eval()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_default_attention_compiles_without_graph_breaks():
    model = build(NezhaForMaskedLM, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    for training in (False, True):
        model.train(training)
        explanation = torch._dynamo.explain(model)(**padded_batch(40))
        assert explanation.graph_break_count == 0, [reason.reason for reason in explanation.break_reasons]


@pytest.mark.parametrize("cls, length", COMPILED)
@pytest.mark.slow
def test_compiled_forward_and_backward_match_eager(cls, length):
    model = build(cls, classifier_dropout=0.0)
    batch = padded_batch(length)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        expected = main_output(model(**batch))
        torch.testing.assert_close(main_output(compiled(**batch)), expected, atol=1e-5, rtol=0)
    model.train()  # every dropout is 0 here, so the gradients must agree too
    main_output(compiled(**batch)).pow(2).mean().backward()
    compiled_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    main_output(model(**batch)).pow(2).mean().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(compiled_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", [ra.Engine.CHUNKED.value, ra.Engine.THREE_REGIONS.value])
def test_other_implementations_compile_under_bf16_autocast(implementation):
    """Three regions above 512 tokens, and bf16 autocast, used to crash inductor; traced they run the chunked op."""
    model = build(NezhaForMaskedLM, implementation)
    batch = padded_batch(600)
    with torch.no_grad():
        expected = model(**batch).logits
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(**batch).logits, expected, atol=1e-5, rtol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(compiled(**batch).logits.float(), expected, atol=3e-2, rtol=0)


@pytest.mark.slow
def test_compiled_static_cache_generation_equals_plain_greedy():
    model = build(NezhaForUniLM)
    ids = torch.randint(5, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 2
    ids[1, :4] = 0  # left padding
    mask = (torch.arange(12) >= torch.tensor([[0], [4]])).long()
    settings = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, eos_token_id=3, pad_token_id=0,
                    do_sample=False)
    plain = model.generate(ids, use_cache=False, **settings)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles generation on accelerators only by default
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **settings)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs, "generate() did not compile the forward"
    assert torch.equal(compiled, plain)


@pytest.mark.parametrize("implementation", [None, "eager"])
@pytest.mark.parametrize("cls", HEADS, ids=lambda c: c.__name__)
@pytest.mark.slow
def test_exported_program_with_dynamic_batch_and_length(cls, implementation):
    model = build(cls, implementation)
    example = padded_batch(40, rows=2)
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=2)
    program = torch.export.export(model, (), example, dynamic_shapes={name: {0: batch, 1: length} for name in example})
    for size in (16, 600, 3000):
        inputs = padded_batch(size, rows=3, seed=size)
        with torch.no_grad():
            expected = main_output(model(**inputs))
        torch.testing.assert_close(main_output(program.module()(**inputs)), expected, atol=1e-5, rtol=0)
    # Padding is honoured: the padded row's real tokens equal the same tokens run alone.
    inputs = padded_batch(600, rows=3, seed=2)
    alone = {name: value[1:2, :300] for name, value in inputs.items()}
    with torch.no_grad():
        short = main_output(model(**alone))
    got = main_output(program.module()(**inputs))[1:2]
    torch.testing.assert_close(got[:, :300] if got.dim() > 2 else got, short, atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", [None, ra.Engine.CHUNKED.value, "eager"])
def test_jit_trace_made_unpadded_honours_padding(implementation):
    """Traced with an all-ones mask, the trace used to keep the 'nothing padded' branch and ignore the mask."""
    model = build(NezhaForMaskedLM, implementation)
    example = padded_batch(40)
    example["attention_mask"] = torch.ones_like(example["attention_mask"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, tuple(example.values()), strict=False)
    inputs = padded_batch(70, seed=3)
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(traced(*inputs.values())["logits"], expected, atol=1e-5, rtol=0)
