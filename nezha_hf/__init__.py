"""NEZHA for transformers v5.

`import nezha_hf` registers NEZHA with the transformers Auto classes (every head in
`NEZHA_HEADS` that has one), so `AutoModelForMaskedLM.from_pretrained(path)` loads a NEZHA
checkpoint of any published layout, and gives PEFT NEZHA's default target modules (`nezha_hf.peft_targets`), so
`LoraConfig(task_type="SEQ_CLS")` needs no `target_modules`.
"""

import transformers

from . import hub, modeling_nezha, peft_targets
from .configuration_nezha import NezhaConfig
from .modeling_nezha import *  # noqa: F403  (the classes and the heads table; see modeling_nezha.__all__)
from .pipelines import register_pipelines
from .relative_attention import Engine, RelativeAttentionMask, recorded_attention_calls
from .version import package_version

__version__ = package_version()  # written once, in pyproject.toml

transformers.AutoConfig.register("nezha", NezhaConfig, exist_ok=True)
for _head in modeling_nezha.NEZHA_HEADS:
    if _head.auto_class is not None:
        getattr(transformers, _head.auto_class).register(NezhaConfig, _head.model_class, exist_ok=True)
register_pipelines()  # "extractive-question-answering", which transformers v5 removed
peft_targets.register()  # without importing PEFT
modeling_nezha.NezhaPreTrainedModel.hub_integration = hub  # model cards, remote code and uploads

__all__ = [
    "Engine",
    "NezhaConfig",
    "RelativeAttentionMask",
    "recorded_attention_calls",
    *modeling_nezha.__all__,
]
