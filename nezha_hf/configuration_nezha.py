"""NEZHA model configuration."""

import dataclasses
import functools
import math
import re

import transformers
from huggingface_hub import EvalResult
from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import HFValidationError, StrictDataclassError
from huggingface_hub.utils import validate_repo_id
from packaging.version import Version
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import logging

from .json_files import JSON_OBJECT, read_json

logger = logging.get_logger(__name__)

# The oldest transformers this code runs on (it names the KV cache `cache`, as 5.24 does); pyproject.toml's floor,
# which a test keeps equal. Remote code installs nothing, so an older transformers is refused here, in words,
# rather than with a TypeError in the first forward.
MINIMUM_TRANSFORMERS = "5.24"
if Version(transformers.__version__) < Version(MINIMUM_TRANSFORMERS):
    raise ImportError(f"NEZHA needs transformers>={MINIMUM_TRANSFORMERS}; this is {transformers.__version__}: "
                      f"pip install -U 'transformers>={MINIMUM_TRANSFORMERS}'")


# The longest relative distance `K` a config may ask for. The published checkpoints use 64 (Chinese) and 127
# (English); distances beyond the longest input carry nothing, and every engine holds `[.., length, 2K + 1]` terms per
# call, so a `K` in the millions (10^9 in a downloaded config.json) would only exhaust memory before the first token.
MAX_RELATIVE_POSITION = 16_384
# The largest sizes a config may ask for, read from a file before anything of the model (meta tensors included) is
# built: 20,000 layers in a downloaded config.json took 50 s and 1.8 GB before anything else could refuse them. Each is
# several times the largest encoder published (XLM-RoBERTa XXL: 48 layers of 4,096, 16,384 wide, 250,002 tokens;
# BERT, NEZHA: 2 token types), and so is the product (`parameter_count`, 10.7 * 10^9 for XLM-R XXL).
MAX_SIZES = {"num_hidden_layers": 512, "hidden_size": 65_536, "intermediate_size": 262_144,
             "num_attention_heads": 1_024, "vocab_size": 4_194_304, "type_vocab_size": 1_024}
MAX_PARAMETERS = 10**11
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it LayerNorm's epsilon fades to 0

# The model-card templates (`model_cards/<kind>.md`) a config's `nezha_card["kind"]` may name, and the other
# `nezha_card` settings with the JSON types they may have. `nezha_card` comes from a checkpoint's config.json, so it
# is data from whoever published the checkpoint: anything else in it is dropped where the config is read.
CARD_KINDS = ("converted", "continued-pretraining", "classifier", "summarizer")
# Config keys that tell transformers to fetch and run code (`trust_remote_code`), and the form nezha_hf's own
# `auto_map` takes (`hub.export_remote_code`; transformers prefixes `repo--` when it loads one from the Hub).
LOADER_CODE_KEYS = ("auto_map", "custom_pipelines")
OWN_AUTO_MAP = re.compile(r"([\w.-]+/[\w.-]+--)?(configuration_nezha\.NezhaConfig|modeling_nezha\.Nezha\w+)")
CARD_TEXT_SETTINGS = ("model_name", "repo_id", "license", "base_model", "pipeline_tag", "task_description",
                      "training_summary", "evaluation_summary", "extra")
CARD_LIST_SETTINGS = ("language", "datasets", "tags")  # lists of strings (a single string too, but for tags)
# The card's usage code and metadata take `repo_id` and `base_model` as Hub ids and `pipeline_tag` as one of these
# tasks (NEZHA's heads' and the other text tasks of the Hub): names from a fixed alphabet or set, never free text.
CARD_PIPELINE_TAGS = ("feature-extraction", "fill-mask", "text-classification", "token-classification",
                      "question-answering", "multiple-choice", "summarization", "text-generation", "sentence-similarity",
                      "zero-shot-classification", "text-ranking", "table-question-answering", "text2text-generation")
CARD_ID_SETTINGS = ("repo_id", "base_model")


def card_setting_problem(name: str, value) -> str | None:
    """Why `value` cannot be the model-card setting `name` (`repo_id` and `base_model` a Hub repo id `name` or
    `owner/name`, `pipeline_tag` one of `CARD_PIPELINE_TAGS`), or None. The other settings have no rule here."""
    if name in CARD_ID_SETTINGS:
        try:
            validate_repo_id(value)
        except HFValidationError:
            return f"{name} {value!r} is not a Hub repo id (`name` or `owner/name`, letters, digits, '-', '_', '.')"
    elif name == "pipeline_tag" and value not in CARD_PIPELINE_TAGS:
        return f"pipeline_tag {value!r} is not one of {', '.join(CARD_PIPELINE_TAGS)}"
    return None


def checked_card_settings(card) -> dict:
    """The usable part of a config's `nezha_card` (model-card settings, see `nezha_hf.hub.build_model_card`): a kind
    from `CARD_KINDS`, texts that are strings, `language` / `datasets` (a string or a list of strings), `tags` (a list
    of strings) and `eval_results` entries that are `huggingface_hub.EvalResult` fields. Anything else is dropped with
    one warning naming it, never used as a path or a template."""
    if card is None:
        return {}
    if not isinstance(card, dict):
        logger.warning(f"Ignoring nezha_card: it is a {type(card).__name__}, not a dict of model-card settings.")
        return {}
    kept, dropped = {}, []
    for name, value in card.items():
        if name == "kind":
            usable = value in CARD_KINDS
        elif name in CARD_TEXT_SETTINGS:
            usable = isinstance(value, str) and card_setting_problem(name, value) is None
        elif name in CARD_LIST_SETTINGS:
            usable = (isinstance(value, str) and name != "tags") or (
                isinstance(value, list) and all(isinstance(v, str) for v in value))
        elif name == "eval_results":
            usable = isinstance(value, list) and all(map(_is_eval_result, value))
        else:
            usable = False
        if usable:
            kept[name] = value
        else:
            dropped.append(f"{name}={value!r}"[:80])
    if dropped:
        logger.warning(
            f"Ignoring nezha_card settings that are not model-card settings of nezha_hf: {', '.join(dropped)} (a card "
            f"kind is one of {', '.join(CARD_KINDS)}).")
    return kept


def _drop_loader_code(settings: dict) -> None:
    """Remove `LOADER_CODE_KEYS` from config `settings`, with one warning when they name code other than nezha_hf's
    own (`save_pretrained(remote_code=True)` writes that again)."""
    foreign = []
    for key in LOADER_CODE_KEYS:
        value = settings.pop(key, None)
        own = key == "auto_map" and isinstance(value, dict) and all(
            isinstance(name, str) and OWN_AUTO_MAP.fullmatch(name) for name in value.values())
        if value is not None and not own:
            foreign.append(f"{key}={value!r}"[:120])
    if foreign:
        logger.warning(f"Ignoring {', '.join(foreign)} in the config: it names code for transformers to fetch and run, "
                       "and nezha_hf runs its own (save_pretrained(remote_code=True) writes nezha_hf's own auto_map).")


def _is_eval_result(item) -> bool:
    """Whether `item` (from a config file) builds a `huggingface_hub.EvalResult` with text where it needs text."""
    if not isinstance(item, dict):
        return False
    try:
        EvalResult(**item)
    except (TypeError, ValueError):
        return False
    return all(isinstance(item.get(name), str) for name in ("task_type", "dataset_type", "dataset_name", "metric_type"))


@strict(accept_kwargs=True)
class NezhaConfig(PreTrainedConfig):
    r"""
    Configuration of a NEZHA model (Huawei's Chinese BERT with relative positions).

    It reads every published NEZHA `config.json`: the transformers v4 ones, the older releases whose
    `architectures` say `NeZhaForMaskedLM` and that carry leftover ALBERT fields (`embedding_size`,
    `num_hidden_groups`, ...). Unknown fields are kept as attributes, not rejected.

    Args:
        vocab_size: size of the token vocabulary (21128 for the Chinese checkpoints).
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act,
        hidden_dropout_prob, attention_probs_dropout_prob, type_vocab_size, initializer_range,
        layer_norm_eps, classifier_dropout: as in `BertConfig`.
        max_relative_position: `K`, the distance beyond which relative positions are clipped
            (64 for the Chinese checkpoints), at most `MAX_RELATIVE_POSITION`. The relative table has `2K + 1` rows.
        max_position_embeddings: read from and written back to `config.json` unchanged, because
            transformers 4.x sized its position buffers with it; NEZHA here has no absolute positions,
            so it limits nothing. It is kept as `v4_max_position_embeddings`, not under its own name,
            so that nothing in transformers (`generate()`'s default length, its length warnings)
            takes it for a limit.
        is_decoder: causal self-attention (a left-to-right language model).
        add_cross_attention: give each layer of a decoder (`is_decoder=True`) a cross-attention over an
            encoder's `encoder_hidden_states`, as transformers 4.x NEZHA had (`EncoderDecoderModel`).
        use_cache: return a key/value cache when `is_decoder` is set.
        tie_word_embeddings: tie the masked-LM decoder to the word embeddings (as every NEZHA
            checkpoint does).
        unilm_copy_tags: give `NezhaForUniLM` the SPACES copy mechanism: a head that tags every
            next target token 0 (generated), 1 (starts a span copied from the source) or 2
            (continues that span), trained jointly with `copy_labels`; `generate()` then keeps a
            copied span on an n-gram of the source.
        copy_loss_weight: weight of the copy-tag loss added to the language-model loss (SPACES
            used 2).
        nezha_card (optional): model-card settings for `save_pretrained` / `push_to_hub` (see
            `nezha_hf.hub.build_model_card`); read as data: a card kind outside `CARD_KINDS` and settings of the
            wrong type are dropped with a warning (`checked_card_settings`).

    Example:

    ```python
    >>> from nezha_hf import NezhaConfig, NezhaModel
    >>> config = NezhaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    >>> model = NezhaModel(config)
    ```
    """

    model_type = "nezha"
    # How transformers' DistributedConfig shards NEZHA (`from_pretrained(..., distributed_config=...)`): every encoder
    # layer its own FSDP2 unit; tensor parallel over the heads (query/key/value column-wise, the attention output
    # row-wise) and the feed-forward (in column-wise, out row-wise), the relative table replicated (a buffer).
    base_model_fsdp_plan = {"encoder.layer.*": "free_full_weight"}
    base_model_tp_plan = {
        "embeddings.word_embeddings": "embedding_rowwise",
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    }

    vocab_size: int = 21128
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_relative_position: int = 64
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    classifier_dropout: float | int | None = 0.1
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 3
    use_cache: bool = True
    is_decoder: bool = False
    add_cross_attention: bool = False
    tie_word_embeddings: bool = True
    unilm_copy_tags: bool = False
    copy_loss_weight: float | int = 2.0

    @classmethod
    def _dict_from_json_file(cls, json_file):
        # transformers' reader, bounded (`json_files.read_json`): 10 KB of brackets would exhaust its recursion.
        return cls._decode_special_floats(read_json(json_file, JSON_OBJECT))

    def __post_init__(self, **kwargs):
        self.v4_max_position_embeddings = kwargs.pop("max_position_embeddings", None)
        if "nezha_card" in kwargs:
            kwargs["nezha_card"] = checked_card_settings(kwargs["nezha_card"])
        if __name__.startswith("nezha_hf."):
            # nezha_hf is installed and runs its own code: code a checkpoint names is never kept, so that no save
            # (save_pretrained, push_to_hub, a conversion, an export) hands it on. A remote-code copy of this file
            # (loaded with trust_remote_code) keeps its `auto_map`, which transformers needs to find its classes.
            _drop_loader_code(kwargs)
        # Old releases spell the classes `NeZha*`; the classes here are `Nezha*`.
        if self.architectures:
            self.architectures = [name.replace("NeZha", "Nezha") for name in self.architectures]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Reject values the model cannot honour, with the field name in the message."""
        super().validate_architecture()
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "type_vocab_size", "max_relative_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        for name, bound in MAX_SIZES.items():
            if getattr(self, name) > bound:
                raise ValueError(f"{name} must be at most {bound:,} (no encoder has more), got {getattr(self, name):,}.")
        if self.parameter_count() > MAX_PARAMETERS:
            raise ValueError(f"These sizes make {self.parameter_count():,} parameters, more than the {MAX_PARAMETERS:,} "
                             "a config may ask for (the largest encoder published has 10.7 * 10^9).")
        if self.max_relative_position > MAX_RELATIVE_POSITION:
            raise ValueError(f"max_relative_position must be at most {MAX_RELATIVE_POSITION:,} (the published "
                             f"checkpoints use 64 and 127), got {self.max_relative_position:,}.")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, list) else [value]:
                # A negative id matches no token (transformers' meaning); only one past the vocabulary is refused.
                if token is not None and token >= self.vocab_size:
                    default = " (its default: pass another, or None)" if value == _DEFAULT_IDS[name] else ""
                    raise ValueError(f"{name} must lie below vocab_size={self.vocab_size} (or be negative: no token), "
                                     f"got {value}{default}.")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"{name} must be a probability in [0, 1), got {value}.")
        if not FLOAT32_TINY <= self.layer_norm_eps < math.inf:
            raise ValueError(f"layer_norm_eps must be finite and at least {FLOAT32_TINY:.3g} (0, or a value float32 "
                             f"rounds towards 0, divides by zero on constant inputs), got {self.layer_norm_eps}.")
        if not 0 <= self.initializer_range < math.inf:
            raise ValueError(f"initializer_range must be finite and non-negative, got {self.initializer_range}.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if (self.hidden_size // self.num_attention_heads) % 2 != 0:
            raise ValueError(
                f"The head size hidden_size / num_attention_heads = {self.hidden_size // self.num_attention_heads} "
                "must be even: the sinusoidal relative-position table interleaves sin and cos."
            )
        if not 0 <= self.copy_loss_weight < math.inf:
            raise ValueError(f"copy_loss_weight must be finite and non-negative, got {self.copy_loss_weight}.")
        if isinstance(self.hidden_act, str) and self.hidden_act not in ACT2FN:
            raise ValueError(f"Unknown hidden_act {self.hidden_act!r}; known: {sorted(ACT2FN)}.")

    def parameter_count(self) -> int:
        """The parameters of a model of this config, to the leading terms (embeddings and layers; heads add less than
        a layer), computed from the sizes before anything is built."""
        hidden, inner = self.hidden_size, self.intermediate_size
        layer = 4 * hidden * hidden + 2 * hidden * inner + (4 * hidden * hidden if self.add_cross_attention else 0)
        return (self.vocab_size + self.type_vocab_size) * hidden + self.num_hidden_layers * layer

    def to_dict(self) -> dict:
        """The config as a dict, with `max_position_embeddings` under its transformers 4.x name."""
        output = super().to_dict()
        legacy = output.pop("v4_max_position_embeddings", None)
        if legacy is not None:
            output["max_position_embeddings"] = legacy
        return output

    def validate_output_attentions(self):
        # The fast attention path falls back to the eager one when attentions are requested,
        # so unlike the base class we accept output_attentions with any implementation.
        return


# What a config that does not set them has, for the message that names one outside a small vocabulary.
_DEFAULT_IDS = {field.name: field.default for field in dataclasses.fields(NezhaConfig)
                if field.name in ("pad_token_id", "bos_token_id", "eos_token_id")}


class NezhaConfigError(ValueError):
    """A `NezhaConfig` value the model cannot honour (the message names the field)."""


def _value_errors(init):
    """`huggingface_hub`'s strict dataclasses wrap validation errors in their own (non-`ValueError`) type:
    unwrap them, so that a bad value is a `ValueError` as everywhere else in transformers."""

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except StrictDataclassError as error:
            raise NezhaConfigError(f"Invalid NezhaConfig: {error.__cause__ or error}") from error

    return checked_init


NezhaConfig.__init__ = _value_errors(NezhaConfig.__init__)


__all__ = ["CARD_KINDS", "CARD_PIPELINE_TAGS", "LOADER_CODE_KEYS", "MAX_PARAMETERS", "MAX_RELATIVE_POSITION", "MAX_SIZES",
           "NezhaConfig", "NezhaConfigError", "card_setting_problem", "checked_card_settings"]
