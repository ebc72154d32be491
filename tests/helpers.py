"""Helpers shared by the test modules: tiny configs and tokenizers, the v4 fixture runner, attention
cases, small BERTs in every layout, and labelled batches for every head."""

import json
import re
from pathlib import Path

import pytest
import reference
import torch
import transformers
from safetensors.torch import load_file, save_file

from nezha_hf import (
    NezhaConfig,
    NezhaForMaskedLM,
    NezhaForMultipleChoice,
    NezhaForNextSentencePrediction,
    NezhaForPreTraining,
    NezhaForQuestionAnswering,
    NezhaForTokenClassification,
    NezhaForUniLM,
    nezha_head,
)
from nezha_hf import relative_attention as ra

FIXTURES = Path(__file__).parent / "fixtures" / "nezha-v4-reference"

# A tiny Chinese vocabulary: special tokens, then characters (ids 5 onwards).
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CHARACTERS = list("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你原告被判决法院")
VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)


def tiny_config(**overrides) -> NezhaConfig:
    values = dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_relative_position=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    values.update(overrides)
    return NezhaConfig(**values)


def make_tokenizer(directory: Path):
    """A `BertTokenizerFast` over `SPECIAL_TOKENS + CHARACTERS`, saved in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(SPECIAL_TOKENS + CHARACTERS) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


# Each engine with a length where it really runs (three regions only above 512 tokens, and above K), for
# tests that compare every engine with the reference and check which one ran.
PATH_CASES = [
    pytest.param(ra.Engine.GATHER.value, 40, ra.Engine.GATHER, id="gather"),
    pytest.param(ra.Engine.FUSED.value, 40, ra.Engine.FUSED, id="fused"),
    pytest.param(ra.Engine.CHUNKED.value, 40, ra.Engine.CHUNKED, id="chunked"),
    pytest.param(ra.Engine.THREE_REGIONS.value, 600, ra.Engine.THREE_REGIONS, id="three-regions"),
]


def snapshot(folder) -> dict[str, bytes]:
    """Every file below `folder` with its bytes, to check that something was left exactly as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def count_calls(monkeypatch, function) -> list:
    """Record every call of an autograd Function's `apply` (the list grows by one per call)."""
    calls = []
    original = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or original(*a))
    return calls


# --- the transformers 4.39.3 reference fixtures ---------------------------------------------------

FIXTURE_CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
FIXTURE_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "encoder_hidden_states", "encoder_attention_mask")


def run_case(name, attn_implementation, model_folder=None):
    """Load fixture `name` (or, if given, the checkpoint in `model_folder`) and compare with its outputs.

    Eager (`"eager"`) is compared on every stored output, attentions included. Any other implementation
    is run without `output_attentions` (which would switch it to eager) and compared on everything else;
    the paths that ran are returned, so callers can check the fast path really ran.
    """
    folder = FIXTURES / name
    case = json.loads((folder / "case.json").read_text())
    expected = load_file(folder / "expected.safetensors")
    auto_class = getattr(transformers, nezha_head(case["architecture"]).auto_class)
    model, info = auto_class.from_pretrained(
        model_folder or folder, output_loading_info=True, attn_implementation=attn_implementation
    )
    assert type(model).__name__ == case["architecture"]
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    model.eval()
    inputs = {k: expected[k] for k in FIXTURE_INPUTS if k in expected}
    eager = attn_implementation == "eager"
    wants_attentions = eager and any(k.startswith(("attentions.", "cross_attentions.")) for k in expected)
    with ra.recorded_attention_calls() as calls, torch.no_grad():
        outputs = model(**inputs, output_hidden_states=True, output_attentions=wants_attentions)
    compared = 0
    for key, value in expected.items():
        name, _, index = key.partition(".")
        if key in inputs or (name.endswith("attentions") and not wants_attentions):
            continue
        got = getattr(outputs, name)
        got = got[int(index)] if index else got
        torch.testing.assert_close(got, value, atol=1e-5, rtol=0, msg=f"{name}{index} differs")
        compared += 1
    assert compared >= 3
    return {call.ran for call in calls}


# --- attention cases ------------------------------------------------------------------------------


class FakeModule(torch.nn.Module):
    """Stands in for `NezhaSelfAttention` when an attention function is called directly."""


def make_case(batch, heads, length, head_size, K, mode, pad_lengths, dtype, seed):
    """Random q, k, v `[batch, heads, length, head_size]`, a `RelativeAttentionMask` and the reference's dense mask.

    `mode` is "bidirectional", "causal" or "prefix" (UniLM: random source lengths); `pad_lengths`
    gives each row's unpadded length, or None.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, head_size, generator=g, dtype=dtype) for _ in range(3))
    valid = None
    if pad_lengths is not None:
        valid = torch.arange(length)[None, :] < torch.tensor(pad_lengths)[:, None]
    source = None
    if mode == "prefix":
        source_lengths = torch.randint(1, length + 1, (batch,), generator=g)
        source = torch.arange(length)[None, :] < source_lengths[:, None]
    mask = ra.RelativeAttentionMask(key_is_valid=valid, causal=mode != "bidirectional", key_is_source=source)
    allowed = reference.allowed_mask(length, valid, mode != "bidirectional", source)
    return q, k, v, mask, allowed


def run_attention(engine, q, k, v, mask, K):
    """Ask for `engine` as the model would (eval mode) and return `[batch, heads, length, d]`."""
    table = ra.sinusoid_relative_table(K, q.shape[-1]).to(q.dtype)
    out, _ = ra.relative_attention(FakeModule().eval(), q, k, v, mask, q.shape[-1] ** -0.5, relative_table=table,
                                   requested=engine)
    return out.transpose(1, 2)


# --- small BERTs, saved as transformers would ------------------------------------------------------

SMALL_BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                  max_position_embeddings=64)


def small_bert(cls=transformers.BertForPreTraining, **overrides):
    torch.manual_seed(0)
    model = cls(transformers.BertConfig(**{**SMALL_BERT, **overrides}))
    with torch.no_grad():  # non-default values everywhere, so a mix-up cannot pass unnoticed
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    return model


def gamma_beta_name(name: str) -> str:
    """A BERT tensor name as pytorch-pretrained-bert (before transformers) saved it: LayerNorm `gamma` / `beta`."""
    return re.sub(r"LayerNorm\.weight$", "LayerNorm.gamma", re.sub(r"LayerNorm\.bias$", "LayerNorm.beta", name))


def save_layout(model, directory, layout):
    """Write `model` as Hugging Face would in `layout`: safetensors, a v4-style .bin, a pre-transformers .bin with
    LayerNorm `gamma` / `beta`, or without the prefix."""
    directory.mkdir(parents=True)
    model.config.save_pretrained(directory)
    make_tokenizer(directory)
    if layout == "safetensors":
        model.save_pretrained(directory)
        return
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if layout == "bin-with-buffers":  # older transformers also saved the position_ids buffer and tied copies
        state["bert.embeddings.position_ids"] = torch.arange(64)[None]
        torch.save(state, directory / "pytorch_model.bin")
    elif layout == "gamma-beta":  # pytorch-pretrained-bert, before transformers: LayerNorm.gamma / .beta
        torch.save({gamma_beta_name(name): tensor for name, tensor in state.items()}, directory / "pytorch_model.bin")
    elif layout == "no-prefix":
        base = {name.removeprefix("bert."): tensor for name, tensor in state.items() if name.startswith("bert.")}
        model.config.architectures = ["BertModel"]
        model.config.save_pretrained(directory)
        save_file(base, directory / "model.safetensors")


# --- labelled batches for every head -----------------------------------------------------------------


def head_batch(cls, rows=4, length=12, seed=0):
    """Inputs and labels for head `cls`, over the tiny vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, length), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    if cls is NezhaForMultipleChoice:
        batch = {k: v[:, None].expand(-1, 2, -1).clone() for k, v in batch.items()}
        batch["input_ids"][:, 1] = torch.randint(5, VOCAB, (rows, length), generator=generator)
        batch["labels"] = torch.randint(0, 2, (rows,), generator=generator)
    elif cls in (NezhaForMaskedLM, NezhaForTokenClassification):
        labels = torch.randint(0, 3, (rows, length), generator=generator) if cls is NezhaForTokenClassification else ids.clone()
        labels[:, ::3] = -100
        batch["labels"] = labels
    elif cls is NezhaForPreTraining:
        batch["labels"] = ids.clone()
        batch["next_sentence_label"] = torch.randint(0, 2, (rows,), generator=generator)
    elif cls is NezhaForQuestionAnswering:
        batch["start_positions"] = torch.randint(0, length, (rows,), generator=generator)
        batch["end_positions"] = torch.randint(0, length, (rows,), generator=generator)
    elif cls is NezhaForUniLM:
        batch["token_type_ids"][:, 6:] = 1
        batch["labels"] = torch.where(batch["token_type_ids"] == 1, ids, -100)
    else:
        classes = 2 if cls is NezhaForNextSentencePrediction else 3
        batch["labels"] = torch.randint(0, classes, (rows,), generator=generator)
    return batch


class ListDataset(torch.utils.data.Dataset):
    """A `Dataset` over the rows of a dict of tensors."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return len(next(iter(self.batch.values())))

    def __getitem__(self, index):
        return {key: value[index] for key, value in self.batch.items()}


# --- synthetic CAIL2020 judgments whose right sentences are known by construction ---------------------

MARKER = "判决"
FILLER = [c for c in CHARACTERS if c not in "判决。"]


def synthetic_judgment(rng, index, sentences=12, key=3, sentence_length=(6, 12)):
    """A judgment whose key sentences start with 判决; the summary is those sentences, in order."""
    key_positions = set(rng.sample(range(sentences), key))
    text = []
    for position in range(sentences):
        body = "".join(rng.choice(FILLER) for _ in range(rng.randint(*sentence_length)))
        text.append({"sentence": (MARKER + body if position in key_positions else body) + "。",
                     "label": int(position in key_positions)})
    summary = "".join(item["sentence"] for item in text if item["label"])
    return {"id": f"doc{index}", "summary": summary, "text": text}


def write_jsonl(path, records, extra_lines=()):
    """Records as JSON lines, then `extra_lines` verbatim (malformed ones, say)."""
    lines = [json.dumps(r, ensure_ascii=False) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- NezhaForUniLM inputs ----------------------------------------------------------------------------------

CLS, SEP, PAD = 2, 3, 0


def unilm_batch(source_lengths, target_length, vocab=99, seed=0):
    """Right-padded `[CLS] source [SEP] target [SEP]` rows with token types and labels."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for source_length in source_lengths:
        source = torch.randint(5, vocab, (source_length,), generator=generator).tolist()
        target = torch.randint(5, vocab, (target_length,), generator=generator).tolist()
        rows.append({"input_ids": [CLS, *source, SEP, *target, SEP],
                     "token_type_ids": [0] * (source_length + 2) + [1] * (target_length + 1),
                     "labels": [-100] * (source_length + 2) + [*target, SEP]})
    length = max(len(row["input_ids"]) for row in rows)
    batch = {key: [] for key in ("input_ids", "token_type_ids", "labels", "attention_mask")}
    for row in rows:
        pad = length - len(row["input_ids"])
        batch["input_ids"].append(row["input_ids"] + [PAD] * pad)
        batch["token_type_ids"].append(row["token_type_ids"] + [1] * pad)
        batch["labels"].append(row["labels"] + [-100] * pad)
        batch["attention_mask"].append([1] * len(row["input_ids"]) + [0] * pad)
    return {key: torch.tensor(value) for key, value in batch.items()}


def tiny_unilm(seed=0, **overrides):
    torch.manual_seed(seed)
    return NezhaForUniLM(tiny_config(**overrides)).eval()


def left_padded_prompts(lengths, vocab=99, seed=1):
    generator = torch.Generator().manual_seed(seed)
    prompts = [[CLS, *torch.randint(5, vocab, (n,), generator=generator).tolist(), SEP] for n in lengths]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return prompts, input_ids, attention_mask


def copy_unilm(seed=0, **overrides):
    model = tiny_unilm(seed, unilm_copy_tags=True, **overrides)
    with torch.no_grad():  # a decisive random tagger, so every tag gets used
        model.copy_head.weight.normal_(0, 1.0)
        model.copy_head.bias.copy_(torch.tensor([0.0, 0.0, 2.0]))
    return model
