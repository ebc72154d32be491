"""PEFT on NEZHA from PEFT's documented calls alone: `import nezha_hf` gives PEFT NEZHA's default target modules
(`nezha_hf/peft_targets.py`) without importing PEFT, so `LoraConfig(task_type=...)` needs no `target_modules`."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, head_batch, tiny_config

from nezha_hf import (
    NEZHA_HEADS,
    NezhaForPreTraining,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaForUniLM,
)

peft = pytest.importorskip("peft", reason="PEFT is not installed (`pip install -e '.[dev]'` brings it)")
from peft import (  # noqa: E402  (after the skip above)
    AdaLoraConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    PeftModel,
    VeraConfig,
    get_peft_model,
)
from peft.tuners.lora import LoraLayer  # noqa: E402
from peft.tuners.tuners_utils import BaseTuner  # noqa: E402
from peft.utils import constants  # noqa: E402

from nezha_hf.peft_targets import is_target_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYERS = tiny_config().num_hidden_layers
# LoRA's default for BERT-shaped models, written out: what the tables must give NEZHA.
QUERY_AND_VALUE = {f"encoder.layer.{i}.attention.self.{name}" for i in range(LAYERS) for name in ("query", "value")}


def target_tables() -> dict[str, dict]:
    return {name: table for name, table in vars(constants).items() if is_target_table(name, table)}


def wrapped(names) -> set[str]:
    """The encoder's module names among `names`, without the prefix of the head and PEFT's wrapper."""
    return {name[name.index("encoder.layer."):] for name in names if "encoder.layer." in name}


def test_every_table_with_a_bert_row_has_bert_s_row_for_nezha_and_nezha_has_those_modules():
    tables = {name: table for name, table in target_tables().items() if "bert" in table}
    assert "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING" in tables
    assert "TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING" in tables
    module_names = [name for name, _ in NezhaForPreTraining(tiny_config()).named_modules()]
    for name, table in tables.items():
        assert table.get("nezha") == table["bert"], name
        rows = [table["nezha"]] if isinstance(table["nezha"], str) else table["nezha"]
        for row in rows:  # matched as PEFT matches a name: the whole name or its last dotted parts
            assert any(module == row or module.endswith("." + row) for module in module_names), (name, row)


def test_every_peft_method_reads_the_tables_that_have_the_nezha_row():
    """Where PEFT reads the defaults: each tuner's `target_module_mapping` (and IA3's module-level tables) must be
    the filled dicts, not copies made before they were filled."""
    tuners = [cls for module in list(sys.modules.values()) if getattr(module, "__name__", "").startswith("peft.")
              for cls in vars(module).values() if isinstance(cls, type) and issubclass(cls, BaseTuner)]
    mappings = [cls.target_module_mapping for cls in tuners
                if isinstance(getattr(cls, "target_module_mapping", None), dict)]
    assert len(mappings) >= 10
    for mapping in mappings:
        assert "bert" not in mapping or "nezha" in mapping
    ia3 = sys.modules["peft.tuners.ia3.model"]  # reads its two tables by their module-level names
    for table in ("TARGET", "FEEDFORWARD"):
        mapping = getattr(ia3, f"TRANSFORMERS_MODELS_TO_IA3_{table}_MODULES_MAPPING")
        assert mapping["nezha"] == mapping["bert"]


@pytest.mark.parametrize("head", NEZHA_HEADS, ids=lambda head: head.model_class.__name__)
def test_lora_without_target_modules_wraps_query_and_value_on_every_head(head):
    model = get_peft_model(head.model_class(tiny_config(vocab_size=VOCAB)), LoraConfig())
    lora = {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert wrapped(lora) == QUERY_AND_VALUE


@pytest.mark.parametrize("config", [IA3Config(task_type="SEQ_CLS"), LoHaConfig(task_type="SEQ_CLS"),
                                    LoKrConfig(task_type="SEQ_CLS"), VeraConfig(task_type="SEQ_CLS"),
                                    AdaLoraConfig(task_type="SEQ_CLS", total_step=10)],
                         ids=lambda config: type(config).__name__)
def test_other_methods_take_their_bert_defaults_on_nezha(config):
    model = get_peft_model(NezhaForSequenceClassification(tiny_config(vocab_size=VOCAB)), config)
    row = target_tables()[f"TRANSFORMERS_MODELS_TO_{config.peft_type.value}_TARGET_MODULES_MAPPING"]["nezha"]
    assert set(model.peft_config["default"].target_modules) == set(row)
    targeted = set(model.base_model.targeted_module_names)
    assert targeted and wrapped(targeted) == {module for module in wrapped(name for name, _ in model.named_modules())
                                              if any(module.endswith("." + name) for name in row)}
    assert len(wrapped(targeted)) == len(targeted)  # nothing outside the encoder's layers


def train_steps(model, batch, steps=3):
    """A few AdamW steps on `batch`; the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize("task_type, cls", [("SEQ_CLS", NezhaForSequenceClassification),
                                            ("TOKEN_CLS", NezhaForTokenClassification),
                                            ("CAUSAL_LM", NezhaForUniLM)])
def test_lora_from_the_task_type_alone_trains_saves_reloads_and_merges(tmp_path, task_type, cls):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB, num_labels=3)
    cls(config).save_pretrained(tmp_path / "base")
    model = get_peft_model(cls.from_pretrained(tmp_path / "base"), LoraConfig(task_type=task_type))
    lora = {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert wrapped(lora) == QUERY_AND_VALUE
    head = {"SEQ_CLS": "classifier.", "TOKEN_CLS": "classifier."}.get(task_type)  # trained whole (modules_to_save)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or (head and head in name) for name in trainable), trainable

    batch = head_batch(cls)
    base_weights = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapter = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    losses = train_steps(model, batch)
    assert losses[-1] < losses[0], losses
    for name, p in model.named_parameters():
        if name in adapter:
            assert not torch.equal(p, adapter[name]), f"{name} did not train"
        elif name in base_weights:
            assert torch.equal(p, base_weights[name]), f"{name} of the base model changed"
    trained = logits(model, batch)

    model.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapter alone
    reloaded = PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert set(reloaded.peft_config["default"].target_modules) == {"query", "value"}
    torch.testing.assert_close(logits(reloaded, batch), trained, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert type(merged) is cls and not any(isinstance(m, LoraLayer) for m in merged.modules())
    torch.testing.assert_close(logits(merged, batch), trained, rtol=1e-5, atol=1e-5)
    if cls is NezhaForUniLM:  # generation through the adapter, and from the merged model, writes the same tokens
        prompt = {"input_ids": torch.tensor([[2, 7, 9, 11, 3]]), "token_type_ids": torch.zeros(1, 5, dtype=torch.long)}
        unmerged = PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
        settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(unmerged.generate(**prompt, **settings), merged.generate(**prompt, **settings))


IMPORT_ORDER = """
import sys
{first}
import nezha_hf
loaded = sorted(name for name in sys.modules if name == "peft" or name.startswith("peft."))
print("peft modules after import nezha_hf:", len(loaded))
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraModel
model = get_peft_model(nezha_hf.NezhaForSequenceClassification(nezha_hf.NezhaConfig(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)),
    LoraConfig(task_type="SEQ_CLS"))
print("defaults:", sorted(LoraModel.target_module_mapping["nezha"]))
print("targeted:", len(model.base_model.targeted_module_names))
"""


@pytest.mark.parametrize("first", ["", pytest.param("import peft", marks=pytest.mark.slow)],
                         ids=["nezha_hf-first", "peft-first"])
def test_import_order_does_not_matter_and_import_nezha_hf_imports_no_peft(first):
    done = subprocess.run([sys.executable, "-c", IMPORT_ORDER.format(first=first)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    if not first:  # nezha_hf alone leaves PEFT (and its every tuner) unimported
        assert "peft modules after import nezha_hf: 0" in lines
    assert "defaults: ['query', 'value']" in lines and f"targeted: {2 * LAYERS}" in lines


RELOADED = """
import importlib, sys
import nezha_hf
import nezha_hf.peft_targets
for _ in range(2):  # what IPython's %autoreload does after an edit, twice
    importlib.reload(nezha_hf.peft_targets)
    importlib.reload(nezha_hf)
finders = [f for f in sys.meta_path if type(f).__name__ == "FillTablesOnImport"]
print("finders:", len(finders))
import json  # any import goes through every finder
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraModel
model = get_peft_model(nezha_hf.NezhaForSequenceClassification(nezha_hf.NezhaConfig(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)),
    LoraConfig(task_type="SEQ_CLS"))
print("defaults:", sorted(LoraModel.target_module_mapping["nezha"]))
"""


def test_reloading_the_modules_keeps_one_import_hook():
    """Issue 54 item 12: `importlib.reload(nezha_hf.peft_targets)` then `importlib.reload(nezha_hf)` (IPython's
    %autoreload) put a second finder on `sys.meta_path`, and the two called each other: RecursionError on the next
    import. The hook installs once however often its modules are reloaded."""
    done = subprocess.run([sys.executable, "-c", RELOADED], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finders: 1" in done.stdout.splitlines() and "defaults: ['query', 'value']" in done.stdout.splitlines()
# --- every checkpoint the project writes has a pooler (issue 57) -------------------------------------------------

ADAPTER_ROUND_TRIP = """
import sys, torch
import nezha_hf
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification
base, adapter, step = sys.argv[1], sys.argv[2], sys.argv[3]
inputs = dict(input_ids=torch.tensor([[2, 10, 11, 12, 13, 3], [2, 14, 15, 16, 3, 0]]),
              attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]))
torch.manual_seed(int(step == "reload"))   # another seed in the fresh process: nothing may depend on it
model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=2)
if step == "train":
    model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(**inputs, labels=torch.tensor([0, 1])).loss.backward()
        optimizer.step(); optimizer.zero_grad()
    model.save_pretrained(adapter)
else:
    model = PeftModel.from_pretrained(model, adapter)
with torch.no_grad():
    torch.save(model.eval()(**inputs).logits, f"{adapter}/logits-{step}.pt")
"""


@pytest.mark.slow
def test_a_lora_adapter_on_a_pretrain_output_reloads_onto_a_fresh_base_in_a_fresh_process_with_equal_logits(tmp_path):
    """`pretrain` writes the pooler (a classifier reads it) with the model: without it the pooler was drawn anew at
    every load, outside the adapter, and the reloaded classifier's logits were 0.07-0.09 off."""
    from test_pretraining import pretraining_start, run

    from helpers import make_tokenizer

    start, corpus = pretraining_start(tmp_path, make_tokenizer(tmp_path / "tokenizer"))
    run(start, corpus, tmp_path / "adapted")
    adapter = tmp_path / "adapter"
    for step in ("train", "reload"):
        done = subprocess.run([sys.executable, "-c", ADAPTER_ROUND_TRIP, str(tmp_path / "adapted"), str(adapter), step],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    trained, reloaded = (torch.load(adapter / f"logits-{step}.pt") for step in ("train", "reload"))
    torch.testing.assert_close(reloaded, trained, rtol=0, atol=1e-6)
