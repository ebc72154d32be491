"""NEZHA for transformers v5.

`import nezha_hf` registers NEZHA with the transformers Auto classes, so
`AutoModelForMaskedLM.from_pretrained(path)` loads a NEZHA checkpoint of any published layout.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForNextSentencePrediction,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_nezha import NezhaConfig
from .modeling_nezha import (
    FAST_ATTENTION,
    PYTORCH_ATTENTION,
    NezhaForMaskedLM,
    NezhaForMultipleChoice,
    NezhaForNextSentencePrediction,
    NezhaForPreTraining,
    NezhaForQuestionAnswering,
    NezhaForSentenceExtraction,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaForUniLM,
    NezhaModel,
    NezhaPreTrainedModel,
)
from .pipelines import register_pipelines
from .relative_attention import RelativeAttentionMask

__version__ = "0.1.0"

# Each Auto class and the NEZHA class it builds; also used to write a complete `auto_map`.
AUTO_CLASSES = {
    AutoModel: NezhaModel,
    AutoModelForPreTraining: NezhaForPreTraining,
    AutoModelForMaskedLM: NezhaForMaskedLM,
    AutoModelForNextSentencePrediction: NezhaForNextSentencePrediction,
    AutoModelForSequenceClassification: NezhaForSequenceClassification,
    AutoModelForMultipleChoice: NezhaForMultipleChoice,
    AutoModelForTokenClassification: NezhaForTokenClassification,
    AutoModelForQuestionAnswering: NezhaForQuestionAnswering,
    AutoModelForCausalLM: NezhaForUniLM,
}

AutoConfig.register("nezha", NezhaConfig, exist_ok=True)
for _auto_class, _model_class in AUTO_CLASSES.items():
    _auto_class.register(NezhaConfig, _model_class, exist_ok=True)
register_pipelines()  # "extractive-question-answering", which transformers v5 removed

__all__ = [
    "AUTO_CLASSES",
    "FAST_ATTENTION",
    "PYTORCH_ATTENTION",
    "NezhaConfig",
    "NezhaForMaskedLM",
    "NezhaForMultipleChoice",
    "NezhaForNextSentencePrediction",
    "NezhaForPreTraining",
    "NezhaForQuestionAnswering",
    "NezhaForSentenceExtraction",
    "NezhaForSequenceClassification",
    "NezhaForTokenClassification",
    "NezhaForUniLM",
    "NezhaModel",
    "NezhaPreTrainedModel",
    "RelativeAttentionMask",
]
