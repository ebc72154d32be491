"""PyTorch NEZHA for transformers v5: BERT with fixed sinusoidal relative positions instead of absolute ones.

Parameter names are those of transformers 4.x (`nezha.encoder.layer.N.attention.self.query.weight`,
`cls.predictions.*`), so v4 checkpoints load unchanged and transformers 4.x reads what we save.
The relative-position maths is in `relative_attention.py`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import (
    ALL_ATTENTION_FUNCTIONS,
    AttentionInterface,
    PreTrainedModel,
)
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_nezha import NezhaConfig
from .generation_nezha import COPY_TAGS, NezhaUniLMGenerationMixin, cache_length, check_cache_fits
from .loading_nezha import CheckpointShapeError, NezhaLoadingMixin
from .relative_attention import (
    Engine,
    RelativeAttentionMask,
    engine_function,
    prepare_attention,
    sinusoid_relative_table,
    tracing,
    values_known,
)

logger = logging.get_logger(__name__)

for _engine in Engine:
    if _engine is not Engine.GATHER:  # transformers' "eager" is each model's own default function
        AttentionInterface.register(_engine.value, engine_function(_engine))
_gather_attention = engine_function(Engine.GATHER)


def padding_flags(mask: torch.Tensor, name: str) -> torch.Tensor:
    """A 0/1 padding mask (bool, integer or float) as bool; any other value is a `ValueError` (checked in eager
    mode: -1 would count as attend, and an additive 0 / -10000 mask would be read inverted)."""
    if mask.dtype != torch.bool and values_known(mask) and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        values = mask.unique()[:6].tolist()
        kind = " (an additive mask: 0 for tokens, a large negative number for padding)" if mask.min() < 0 else ""
        raise ValueError(
            f"{name} must hold only 0 and 1 (1 = attend, 0 = padding), got values {values}{kind}. Pass the 2-D "
            f"0/1 padding mask; for other masks build a nezha_hf.RelativeAttentionMask (NEZHA takes no 4-D or "
            "additive masks: its attention never forms an L x L matrix)."
        )
    return mask.bool()


class NezhaEmbeddings(nn.Module):
    """Word and token-type embeddings, LayerNorm, dropout. No absolute positions."""

    def __init__(self, config):
        super().__init__()
        # A negative pad id means "no padding token" (transformers' meaning), not a row counted from the end.
        padding_idx = config.pad_token_id if config.pad_token_id is not None and config.pad_token_id >= 0 else None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=padding_idx)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros(inputs_embeds.shape[:-1], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))


class NezhaSelfAttention(nn.Module):
    """Multi-head attention with NEZHA's relative key and value terms; with `is_cross_attention`, the keys
    and values come from `encoder_hidden_states` (a decoder's cross-attention, as in transformers 4.x)."""

    def __init__(self, config, layer_idx=None, is_cross_attention=False):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size**-0.5

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.is_cross_attention = is_cross_attention
        self.layer_idx = layer_idx

    def forward(
        self,
        hidden_states: torch.Tensor,
        relative_table: torch.Tensor,
        attention_mask: RelativeAttentionMask | None = None,
        cache: Cache | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `hidden_states` (`[batch, length, hidden]`) with NEZHA's relative terms.

        `relative_table` is the model's `(2K + 1) x head_size` sinusoid table (`NezhaModel.relative_table`).
        Cross-attention attends to `encoder_hidden_states`, whose keys and values an `EncoderDecoderCache`
        keeps after the first call.
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query_layer = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.is_cross_attention:
            key_layer, value_layer = self._encoder_keys_and_values(encoder_hidden_states, cache)
        else:
            key_layer = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
            value_layer = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
            if cache is not None:
                self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
                check_cache_fits(self_cache, key_layer, self.layer_idx, self.config.num_hidden_layers)
                key_layer, value_layer = self_cache.update(key_layer, value_layer, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, _gather_attention
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_layer,
            key_layer,
            value_layer,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout.p,
            scaling=self.scaling,
            relative_table=relative_table,
            **kwargs,
        )
        return attn_output.reshape(*input_shape, -1).contiguous(), attn_weights

    def _encoder_keys_and_values(self, encoder_hidden_states, cache):
        """The encoder's keys and values: computed once, then read from the cross-attention cache."""
        if isinstance(cache, EncoderDecoderCache) and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return layer.keys, layer.values
        shape = (*encoder_hidden_states.shape[:-1], -1, self.attention_head_size)
        key_layer = self.key(encoder_hidden_states).view(shape).transpose(1, 2)
        value_layer = self.value(encoder_hidden_states).view(shape).transpose(1, 2)
        if isinstance(cache, EncoderDecoderCache):
            key_layer, value_layer = cache.cross_attention_cache.update(key_layer, value_layer, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return key_layer, value_layer


class NezhaResidualOutput(nn.Module):
    """A sublayer's output: projection to the hidden size, dropout, the residual added, LayerNorm (after attention,
    `input_size` the hidden size; after the feed-forward layer, the intermediate size)."""

    def __init__(self, config, input_size: int):
        super().__init__()
        self.dense = nn.Linear(input_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


def _activation(config) -> Callable:
    """`config.hidden_act`: a name in transformers' `ACT2FN`, or a function."""
    return ACT2FN[config.hidden_act] if isinstance(config.hidden_act, str) else config.hidden_act


class NezhaAttention(nn.Module):
    def __init__(self, config, layer_idx=None, is_cross_attention=False):
        super().__init__()
        self.self = NezhaSelfAttention(config, layer_idx=layer_idx, is_cross_attention=is_cross_attention)
        self.output = NezhaResidualOutput(config, config.hidden_size)

    def forward(self, hidden_states, relative_table: torch.Tensor, attention_mask=None, cache=None, **kwargs):
        attention_output, attn_weights = self.self(
            hidden_states, relative_table, attention_mask, cache, **kwargs
        )
        return self.output(attention_output, hidden_states), attn_weights


class NezhaIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = _activation(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class NezhaLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.attention = NezhaAttention(config, layer_idx=layer_idx)
        if config.add_cross_attention:
            if not config.is_decoder:
                raise ValueError("add_cross_attention=True needs is_decoder=True: cross-attention belongs to a decoder.")
            self.crossattention = NezhaAttention(config, layer_idx=layer_idx, is_cross_attention=True)
        self.intermediate = NezhaIntermediate(config)
        self.output = NezhaResidualOutput(config, config.intermediate_size)

    def forward(
        self, hidden_states, relative_table: torch.Tensor, attention_mask=None, cache=None,
        encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: RelativeAttentionMask | None = None,
        **kwargs,
    ) -> torch.Tensor:
        attention_output, _ = self.attention(
            hidden_states, relative_table, attention_mask, cache=cache, **kwargs
        )
        if encoder_hidden_states is not None:
            attention_output, _ = self.crossattention(
                attention_output, relative_table, encoder_attention_mask, cache=cache,
                encoder_hidden_states=encoder_hidden_states, **kwargs,
            )
        return self.output(self.intermediate(attention_output), attention_output)


class NezhaEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([NezhaLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])

    def forward(
        self, hidden_states, relative_table: torch.Tensor, attention_mask=None, cache=None, use_cache=None,
        encoder_hidden_states=None, encoder_attention_mask=None, **kwargs,
    ):
        for layer_module in self.layer:
            hidden_states = layer_module(
                hidden_states, relative_table, attention_mask, cache=cache,
                encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask, **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states, cache=cache if use_cache else None
        )


# The pooler's weights in a checkpoint. Every checkpoint nezha_hf writes keeps one, heads without a pooler (masked LM)
# included, so that a classifier built on it reads the same pooler at every load (a pooler drawn at load is in no PEFT
# adapter either).
POOLER_WEIGHT = r"(^|\.)pooler\.dense\.(weight|bias)$"


class NezhaPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The first token ([CLS]) stands for the sequence.
        return self.activation(self.dense(hidden_states[:, 0]))


class NezhaPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class NezhaLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = NezhaPredictionHeadTransform(config)
        # The decoder weight is tied to the word embeddings; the bias is output-only.
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden_states))


class NezhaOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = NezhaLMPredictionHead(config)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return self.predictions(sequence_output)


class NezhaOnlyNSPHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, pooled_output: torch.Tensor) -> torch.Tensor:
        return self.seq_relationship(pooled_output)


class NezhaPreTrainingHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = NezhaLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class NezhaPreTrainedModel(NezhaLoadingMixin, PreTrainedModel):
    """Weight initialisation, checkpoint-loading rules (`loading_nezha.NezhaLoadingMixin`) and attention selection
    shared by every NEZHA class.

    `attn_implementation` is one of the engines of `relative_attention.Engine` (default `"nezha_fused"`); the
    table in docs/attention.md says what each is and where it runs. `"sdpa"`, flash, flex and
    every other registered attention cannot express NEZHA's relative value term and are refused.

    Besides `_init_weights`, it overrides what NEZHA needs and transformers offers no hook for; each override says
    which behaviour of transformers it changes, and tests/test_modeling_nezha.py ("transformers still ...") fails if
    transformers changes that behaviour, so that the override can go.
    """

    config: NezhaConfig
    base_model_prefix = "nezha"
    supports_gradient_checkpointing = True
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    # Every implementation is compile-friendly (the kernels are opaque torch.library ops): generate() may
    # compile the forward with a static cache.
    _can_compile_fullgraph = True
    _no_split_modules = ["NezhaEmbeddings", "NezhaLayer"]
    _can_record_outputs = {
        "hidden_states": NezhaLayer,
        "attentions": OutputRecorder(NezhaSelfAttention, index=1, layer_name="attention.self"),
        "cross_attentions": OutputRecorder(NezhaSelfAttention, index=1, layer_name="crossattention.self"),
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, NezhaLMPredictionHead):
            init.zeros_(module.bias)
        elif isinstance(module, NezhaModel):
            # Non-persistent: rebuilt here on every load, never read from a checkpoint.
            init.copy_(module.relative_table, module.build_relative_table())

    @property
    def head_info(self) -> "NezhaHead":
        """This model's row of `NEZHA_HEADS` (also for a subclass a wrapper made of it, such as FSDP's)."""
        rows = {head.model_class: head for head in NEZHA_HEADS}
        return next(rows[cls] for cls in type(self).__mro__ if cls in rows)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """Changes: transformers defaults to sdpa, else eager, and accepts every registered attention (paged ones
        included, which would drop the relative terms); NEZHA defaults to its fused engine, accepts its own engines
        only, and builds the kernel when a model that uses it is made on the CPU."""
        # While the model is being built it has no parameters yet: it is built on the default device.
        parameter = next(self.parameters(), None)
        device = parameter.device if parameter is not None else torch.get_default_device()
        return prepare_attention(requested_attention, device)

@dataclass
class NezhaForPreTrainingOutput(ModelOutput):
    """Output of `NezhaForPreTraining`: masked-LM and next-sentence logits, and their summed loss."""

    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    seq_relationship_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor] | None = None
    attentions: tuple[torch.Tensor] | None = None


# Inputs of transformers' BERT (or of NEZHA in transformers 4) that this model does not take: passed, they are an
# error, as ignoring them would return outputs that do not do what the caller asked.
REFUSED_INPUTS = {
    "position_ids": "NEZHA has no absolute positions (its positions are relative, inside attention)",
    "head_mask": "transformers 5 removed head masks, and NEZHA's attention engines do not take one; to silence a head, "
                 "zero its columns of the attention output projection (`attention.output.dense.weight`)",
}


class NezhaModel(NezhaPreTrainedModel):
    """The bare NEZHA encoder (or, with `config.is_decoder`, a causal decoder with a KV cache).

    Inputs of any length are accepted; the only limit is memory. `attention_mask` is a `[batch,
    key_length]` 0/1 tensor (key_length includes the cache), or a `RelativeAttentionMask` for
    special masks such as the UniLM prefix mask.

    Example:

    ```python
    >>> import torch
    >>> from nezha_hf import NezhaConfig, NezhaModel
    >>> model = NezhaModel(NezhaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))
    >>> model(torch.randint(0, 100, (1, 3000))).last_hidden_state.shape
    torch.Size([1, 3000, 64])
    ```
    """

    def __init__(self, config: NezhaConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = NezhaEmbeddings(config)
        self.encoder = NezhaEncoder(config)
        self.pooler = NezhaPooler(config) if add_pooling_layer else None
        # What a checkpoint may hold beyond this model, read without a report: pretraining heads (`cls.*`) where the
        # model has none, and the pooler where it has none (every checkpoint nezha_hf writes keeps one).
        self._keys_to_ignore_on_load_unexpected = [*self._keys_to_ignore_on_load_unexpected, r"^cls\.",
                                                   *([] if add_pooling_layer else [POOLER_WEIGHT])]
        # One (2K+1) x head_size table for the whole model.
        self.register_buffer("relative_table", self.build_relative_table(), persistent=False)
        self.post_init()

    def build_relative_table(self) -> torch.Tensor:
        """The sinusoid relative-position table for this config."""
        head_size = self.config.hidden_size // self.config.num_attention_heads
        return sinusoid_relative_table(self.config.max_relative_position, head_size)

    def _apply(self, fn, recurse=True):
        """Changes: `nn.Module._apply` (behind `to`, `to_empty`, `half`, ...) carries buffers over through `fn`, and
        `to_empty` leaves them uninitialised; the relative table is in no state dict, so the FSDP2 way to build a
        model (meta device, `to_empty`, `load_state_dict`) kept garbage in it. It is rebuilt after every such move
        (`_init_weights` rebuilds it when transformers loads a checkpoint)."""
        super()._apply(fn, recurse)
        if self.relative_table.device.type != "meta":
            with torch.no_grad():
                self.relative_table.copy_(self.build_relative_table())
        return self

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # the name before transformers 5.24
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | RelativeAttentionMask | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        source_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        r"""
        input_ids: `[batch, length]` token ids (or pass `inputs_embeds`).
        attention_mask: `[batch, past + length]` with 1 for tokens to attend to, 0 for padding (or a
            `RelativeAttentionMask`, used as it is).
        token_type_ids: `[batch, length]` segment ids in `[0, type_vocab_size)`.
        cache: a transformers `Cache` (decoders only); created when `use_cache` and `is_decoder`
            (an `EncoderDecoderCache` with `encoder_hidden_states`).
        encoder_hidden_states: `[batch, encoder_length, hidden]` for the cross-attention of a decoder made
            with `add_cross_attention=True`. As in transformers 4.x, decoder position i and encoder position
            j are `j - i` apart for the relative terms.
        encoder_attention_mask: `[batch, encoder_length]` 0/1 padding mask of `encoder_hidden_states`.
        source_mask: `[batch, length]` bool, True on the UniLM source tokens among the new ones: the prefix mask
            (source tokens see the whole source, the others see the source and what precedes them), as
            `NezhaForUniLM` uses it. None: causal if `config.is_decoder`, else bidirectional.
        """
        self._check_inputs(input_ids, inputs_embeds, token_type_ids, kwargs)
        if encoder_hidden_states is not None and not self.config.add_cross_attention:
            raise ValueError(
                "encoder_hidden_states were passed, but this model has no cross-attention: build the decoder with "
                "NezhaConfig(is_decoder=True, add_cross_attention=True)."
            )
        embedding_output = self.embeddings(input_ids, token_type_ids, inputs_embeds)
        batch_size, length = embedding_output.shape[:2]
        if isinstance(attention_mask, RelativeAttentionMask):
            mask = attention_mask
        else:
            mask = self.build_attention_mask(attention_mask, batch_size, length, cache, source_mask)
        # A cache only makes sense when no query sees a later key: decoders and the UniLM prefix mask.
        if cache is not None and not mask.causal:
            raise ValueError(
                "A cache needs a causal mask (config.is_decoder, or NezhaForUniLM's prefix mask): in a "
                "bidirectional encoder earlier tokens would have to see the new ones."
            )
        use_cache = bool(use_cache) and mask.causal
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
            if encoder_hidden_states is not None:
                cache = EncoderDecoderCache(cache, DynamicCache(config=self.config))
        encoder_mask = None
        if encoder_hidden_states is not None:
            encoder_mask = self.build_encoder_attention_mask(encoder_attention_mask, encoder_hidden_states, mask)

        encoder_outputs = self.encoder(
            embedding_output,
            self.relative_table,
            attention_mask=mask,
            cache=cache,
            use_cache=use_cache,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_mask,
            **kwargs,
        )
        sequence_output = encoder_outputs.last_hidden_state
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output,
            pooler_output=self.pooler(sequence_output) if self.pooler is not None else None,
            cache=encoder_outputs.cache,
        )

    def _check_inputs(self, input_ids, inputs_embeds, token_type_ids, kwargs):
        """Bad input gets a ValueError here instead of an index error (or a silent wrong answer) later.

        Checks of the values (ids in range) need the data, so they run in eager mode only; under
        `torch.compile`, `torch.export` and `torch.jit.trace`, and on the meta device, the shapes are
        still checked.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        for name, reason in REFUSED_INPUTS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} must not be passed: {reason}.")
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        if len(shape) != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(shape)}.")
        if not tracing() and 0 in shape:
            raise ValueError(f"The input is empty (shape {tuple(shape)}): give at least one row of at least one token.")
        if token_type_ids is not None and token_type_ids.shape != shape:
            raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)} but input_ids has {tuple(shape)}.")
        if not values_known(input_ids if input_ids is not None else inputs_embeds):
            return
        if input_ids is not None and input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, vocab_size={self.config.vocab_size}); got values from "
                f"{int(input_ids.min())} to {int(input_ids.max())}. Is the tokenizer the model's own?"
            )
        if token_type_ids is not None and token_type_ids.numel() and (
            token_type_ids.min() < 0 or token_type_ids.max() >= self.config.type_vocab_size
        ):
            raise ValueError(
                f"token_type_ids must lie in [0, type_vocab_size={self.config.type_vocab_size}); got values "
                f"from {int(token_type_ids.min())} to {int(token_type_ids.max())}."
            )

    def build_attention_mask(
        self,
        attention_mask: torch.Tensor | None,
        batch_size: int,
        length: int,
        cache: Cache | None = None,
        source_mask: torch.Tensor | None = None,
    ) -> RelativeAttentionMask:
        """Turn a 0/1 padding mask into the `RelativeAttentionMask` the attention functions take.

        Args:
            attention_mask: `[batch, past + length]` 0/1 (a static cache: `[batch, past + length]` or
                `[batch, cache size]`), or None: nothing is padded.
            batch_size, length: shape of the new tokens.
            cache: the cache the new tokens extend, if any.
            source_mask: `[batch, length]` bool, True on UniLM source tokens: gives the prefix mask
                (source tokens see the whole source, others see the source and what precedes them).
                None gives a causal mask if `config.is_decoder`, else a bidirectional one.

        In eager mode a mask of all ones is dropped (the faster unmasked kernels run); while tracing
        (compile, export, jit) the mask is always kept, so a trace made with an unpadded example
        still honours padding later.
        """
        past_length = cache_length(cache)
        # A pre-allocated (static) cache has more key slots than are filled.
        key_length = cache.get_mask_sizes(length, 0)[0] if cache is not None else length
        if isinstance(past_length, int) and past_length + length > key_length:
            raise ValueError(f"The cache has room for {key_length} tokens: it holds {past_length} and this call adds "
                             f"{length}. Build it with a larger max_cache_len.")
        device = self.relative_table.device
        key_position = torch.arange(key_length, device=device)
        partly_filled = not isinstance(past_length, int) or past_length + length != key_length

        key_is_valid = None
        if attention_mask is not None:
            widths = (key_length,) if not isinstance(past_length, int) else (key_length, past_length + length)
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] not in widths:
                raise ValueError(
                    f"attention_mask must be [batch, past + length] = [{batch_size}, {past_length} + {length}] of "
                    f"0/1, got shape {tuple(attention_mask.shape)}."
                )
            key_is_valid = nn.functional.pad(padding_flags(attention_mask, "attention_mask"),
                                             (0, key_length - attention_mask.shape[1]), value=False)
            if values_known(key_is_valid) and not partly_filled and bool(key_is_valid.all()):
                key_is_valid = None
        if partly_filled:
            filled = (key_position < past_length + length).expand(batch_size, key_length)
            key_is_valid = filled if key_is_valid is None else key_is_valid & filled
        key_is_source = None
        if source_mask is not None:
            # Cached keys are all visible to the new queries anyway, so marking them non-source is exact.
            new_key = (key_position >= past_length) & (key_position < past_length + length)
            index = (key_position - past_length).clamp(0, max(length - 1, 0)).expand(batch_size, key_length)
            key_is_source = source_mask.bool().gather(1, index) & new_key
        return RelativeAttentionMask(
            key_is_valid=key_is_valid,
            causal=self.config.is_decoder or source_mask is not None,
            key_is_source=key_is_source,
            query_offset=past_length,
        )


    def build_encoder_attention_mask(
        self, encoder_attention_mask: torch.Tensor | None, encoder_hidden_states: torch.Tensor,
        self_mask: RelativeAttentionMask,
    ) -> RelativeAttentionMask:
        """The cross-attention mask: every decoder query sees every encoder key that is not padding; the queries
        sit at the decoder positions (after the cache) for the relative terms."""
        batch_size, encoder_length = encoder_hidden_states.shape[:2]
        key_is_valid = None
        if encoder_attention_mask is not None:
            if encoder_attention_mask.shape != (batch_size, encoder_length):
                raise ValueError(
                    f"encoder_attention_mask must be [batch, encoder_length] = [{batch_size}, {encoder_length}], got "
                    f"shape {tuple(encoder_attention_mask.shape)}."
                )
            key_is_valid = padding_flags(encoder_attention_mask, "encoder_attention_mask")
            if values_known(key_is_valid) and bool(key_is_valid.all()):
                key_is_valid = None
        return RelativeAttentionMask(key_is_valid=key_is_valid, query_offset=self_mask.query_offset)


class _LMHeadTying:
    """Output-embedding accessors shared by the heads whose decoder is tied to the word embeddings."""

    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "nezha.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
    # Tensor parallel: the decoder's vocabulary rows split as the word embeddings' are (`embedding_rowwise`), the
    # logits gathered. Its bias is the head's `bias` (tied), split the same way.
    _tp_plan = {"cls.predictions.decoder": "colwise_gather_output", "cls.predictions.bias": "colwise"}

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias


class NezhaModelWithHead(NezhaPreTrainedModel):
    """A NEZHA encoder (`self.nezha`) with one head on it: what the task models share.

    Each head writes its own `forward` around `encode`, with its own signature and output type: Trainer finds a
    model's label columns by the names in its forward's signature, and sentence-transformers its output fields by the
    forward's return annotation.
    """

    uses_pooler = False  # whether the head reads the pooled [CLS] state
    # Losses are batch means unless a head normalises by Trainer's `num_items_in_batch` (and says True): without
    # this, Trainer would not divide them by the gradient-accumulation steps.
    accepts_loss_kwargs = False

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.nezha = NezhaModel(config, add_pooling_layer=self.uses_pooler)

    def add_classifier(self, num_outputs: int):
        """Adds BERT's classification layer: `dropout` (`config.classifier_dropout`, else the hidden dropout) and
        `classifier`, a linear layer from the hidden size to `num_outputs`."""
        rate = self.config.classifier_dropout
        self.dropout = nn.Dropout(rate if rate is not None else self.config.hidden_dropout_prob)
        self.classifier = nn.Linear(self.config.hidden_size, num_outputs)

    def encode(self, input_ids, attention_mask, token_type_ids, inputs_embeds,
               **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """The encoder's output for BERT's inputs."""
        return self.nezha(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                          inputs_embeds=inputs_embeds, return_dict=True, **kwargs)


class NezhaForPreTraining(_LMHeadTying, NezhaModelWithHead):
    """NEZHA with the pretraining heads: masked LM (`labels`) and next-sentence prediction (`next_sentence_label`).

    The loss is the sum of the two mean losses; under gradient accumulation Trainer averages the
    micro-batches (`accepts_loss_kwargs = False`).
    """

    uses_pooler = True

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.cls = NezhaPreTrainingHeads(config)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                next_sentence_label=None, **kwargs: Unpack[TransformersKwargs]) -> NezhaForPreTrainingOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        prediction_scores, seq_relationship_score = self.cls(outputs.last_hidden_state, outputs.pooler_output)
        total_loss = None
        if labels is not None and next_sentence_label is not None:
            loss_fct = CrossEntropyLoss()
            total_loss = loss_fct(prediction_scores.view(-1, self.config.vocab_size), labels.view(-1)) + loss_fct(
                seq_relationship_score.view(-1, 2), next_sentence_label.view(-1)
            )
        return NezhaForPreTrainingOutput(
            loss=total_loss, prediction_logits=prediction_scores, seq_relationship_logits=seq_relationship_score,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


class NezhaForMaskedLM(_LMHeadTying, NezhaModelWithHead):
    """NEZHA with the masked-language-modelling head (decoder tied to the word embeddings).

    `labels` use -100 for positions without a target. The loss is normalised by Trainer's
    `num_items_in_batch`, so gradient accumulation matches one large batch.

    Example:

    ```python
    >>> import nezha_hf  # registers NEZHA with the Auto classes
    >>> from transformers import AutoModelForMaskedLM
    >>> model = AutoModelForMaskedLM.from_pretrained("path/to/nezha-cn-base")  # doctest: +SKIP
    ```
    """

    accepts_loss_kwargs = True

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        if config.is_decoder:
            logger.warning("NezhaForMaskedLM wants bidirectional attention: set config.is_decoder=False.")
        self.cls = NezhaOnlyMLMHead(config)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs: Unpack[TransformersKwargs]) -> MaskedLMOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        prediction_scores = self.cls(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(prediction_scores, labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(
            loss=loss, logits=prediction_scores, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@dataclass
class NezhaUniLMOutput(CausalLMOutputWithCrossAttentions):
    """Output of `NezhaForUniLM`; `copy_logits` (`[batch, length, 3]`) only with `config.unilm_copy_tags`.

    `copy_logits[:, t]` scores the copy tag of the token at `t + 1`, as `logits[:, t]` scores its id.
    """

    copy_logits: torch.Tensor | None = None


class NezhaForUniLM(_LMHeadTying, NezhaPreTrainedModel, NezhaUniLMGenerationMixin):
    """NEZHA as a UniLM sequence-to-sequence model: one encoder with a prefix mask, and `generate()`.

    Inputs are `[CLS] source [SEP] target [SEP]` with `token_type_ids` 0 on the source part and 1
    on the target part. Source tokens see the whole source; target tokens see the source and the
    targets before them. The weights are exactly those of `NezhaForMaskedLM`, so an MLM checkpoint
    (or a converted BERT) loads directly.

    Training: pass `labels` equal to `input_ids` with -100 on the source and padding; the loss is
    next-token cross-entropy over the target, normalised by Trainer's `num_items_in_batch` under
    gradient accumulation. `nezha_hf.unilm` has the tokenisation helper and the data collator.

    Generation: `model.generate(input_ids, attention_mask=...)` treats the prompt as the source
    (token type 0 unless `token_type_ids` says otherwise) and gives every generated token type 1.
    Left-pad batches. With the KV cache each new token costs O(length). Generation stops at
    `generation_config.eos_token_id`; for a BERT vocabulary that is `tokenizer.sep_token_id`
    (`nezha_hf.unilm.generate_text` sets it, and returns only the new text).

    Copy mechanism (SPACES), with `config.unilm_copy_tags=True`: a linear head predicts, from each
    position, the copy tag of the next token (0 generated, 1 starts a span copied from the source,
    2 continues it). Train it with `copy_labels` (`nezha_hf.unilm.copy_tags` derives them from the
    longest common subsequence of source and target; -100 elsewhere): the loss becomes
    `lm_loss + config.copy_loss_weight * copy_loss`. `generate()` then applies
    `generation_nezha.CopySpanLogitsProcessor` (turn it off with `copy_constraint=False`).

    With `config.is_decoder=True` it is instead a plain left-to-right language model (a causal mask,
    token type 0 unless given), which is what `AutoModelForCausalLM` and `EncoderDecoderModel` build
    for a NEZHA decoder; add `add_cross_attention=True` to attend to an encoder's
    `encoder_hidden_states` (bert2bert-style summarisation, as transformers 4.x allowed).

    Example:

    ```python
    >>> import torch
    >>> from nezha_hf import NezhaConfig, NezhaForUniLM
    >>> model = NezhaForUniLM(NezhaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
    ...                                   num_attention_heads=4, intermediate_size=128))
    >>> source = torch.tensor([[2, 10, 11, 12, 3]])
    >>> model.generate(source, max_new_tokens=4, eos_token_id=3, pad_token_id=0).shape[1] <= 9
    True
    ```
    """

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.nezha = NezhaModel(config, add_pooling_layer=False)
        self.cls = NezhaOnlyMLMHead(config)
        self.copy_head = nn.Linear(config.hidden_size, len(COPY_TAGS)) if config.unilm_copy_tags else None
        self.loss_type = "ForCausalLM"
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        copy_labels: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        source_length: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> NezhaUniLMOutput:
        r"""
        token_type_ids: 0 on the source (`[CLS] source [SEP]`), 1 on the target. Default: all source
            when there is no cache, all target when continuing from a cache (a decoder, `is_decoder=True`:
            all 0).
        labels: `input_ids` with -100 on the source and padding; shifted inside the loss.
        copy_labels: copy tag (0, 1, 2) of every target token, -100 where `labels` is -100; shifted
            like `labels`. Needs `config.unilm_copy_tags`.
        logits_to_keep: compute logits for the last this many positions only (0 = all).
        encoder_hidden_states, encoder_attention_mask: an encoder's output and padding mask, for a decoder
            with cross-attention (see `NezhaModel.forward`).
        source_length: how many leading positions of the whole sequence are source, when the cache holds
            part of it and source tokens come again after it (what `generate` passes when assisted decoding
            cropped its cache into the source; the cache must then hold tokens computed with the whole
            source). Without it, source tokens after a cache are refused: cached tokens could not see them.
        """
        if copy_labels is not None and self.copy_head is None:
            raise ValueError("copy_labels given, but this model has no copy head: set config.unilm_copy_tags=True.")
        batch_size, length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        past_length = cache_length(cache)
        source_mask = None
        if not self.config.is_decoder:  # a decoder is a plain causal language model: no source
            if token_type_ids is None:
                if labels is not None:
                    raise ValueError("Training NezhaForUniLM needs token_type_ids: 0 on [CLS] source [SEP], 1 on the target.")
                device = self.nezha.relative_table.device
                token_type_ids = torch.zeros((batch_size, length), dtype=torch.long, device=device) + (past_length > 0)
            elif values_known(token_type_ids) and past_length:
                position = past_length + torch.arange(length, device=token_type_ids.device)
                if ((token_type_ids == 0) & (position >= (source_length or 0))).any():
                    raise ValueError(
                        "Source tokens (token type 0) must all be in the first call: source tokens already in the "
                        "cache could not see them. Pass the whole source at once, then continue with token type 1."
                    )
            source_mask = token_type_ids == 0
        outputs = self.nezha(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
            cache=cache,
            use_cache=use_cache if use_cache is not None else self.config.use_cache,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            source_mask=source_mask,
            return_dict=True,
            **kwargs,
        )
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = outputs.last_hidden_state[:, slice_indices, :]
        logits = self.cls(hidden)
        copy_logits = self.copy_head(hidden) if self.copy_head is not None else None
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        if copy_labels is not None:
            # Same targets as the LM loss, so Trainer's num_items_in_batch normalises both.
            copy_loss = self.loss_function(copy_logits, copy_labels, vocab_size=len(COPY_TAGS), **kwargs)
            loss = copy_loss * self.config.copy_loss_weight + (loss if loss is not None else 0)
        return NezhaUniLMOutput(
            loss=loss,
            logits=logits,
            copy_logits=copy_logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class NezhaForNextSentencePrediction(NezhaModelWithHead):
    """NEZHA with the next-sentence-prediction head (`labels`: 0 = B continues A, 1 = random)."""

    uses_pooler = True

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.cls = NezhaOnlyNSPHead(config)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs: Unpack[TransformersKwargs]) -> NextSentencePredictorOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        logits = self.cls(outputs.pooler_output)
        loss = CrossEntropyLoss()(logits.view(-1, 2), labels.view(-1)) if labels is not None else None
        return NextSentencePredictorOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NezhaForSequenceClassification(NezhaModelWithHead):
    """NEZHA with a linear head on the pooled [CLS] output.

    As in BERT: `num_labels == 1` is regression (MSE); integer labels are single-label
    classification (cross-entropy); float multi-hot labels are multi-label (BCE). Set
    `config.problem_type` to force one. Losses are batch means (`accepts_loss_kwargs = False`).
    """

    uses_pooler = True

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.add_classifier(config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs: Unpack[TransformersKwargs]) -> SequenceClassifierOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                loss = MSELoss()(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype)) if self.num_labels == 1 \
                    else MSELoss()(logits, labels)
            elif self.config.problem_type == "single_label_classification":
                loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = BCEWithLogitsLoss()(logits, labels.to(logits.dtype))
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NezhaForMultipleChoice(NezhaModelWithHead):
    """NEZHA for multiple choice: inputs are `[batch, num_choices, length]`, `labels` the right choice."""

    uses_pooler = True

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.add_classifier(1)
        self.post_init()

    def encode(self, *inputs, **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """Every choice encoded as a sequence of its own: `[batch * num_choices, length]`."""
        return super().encode(*(None if x is None else x.reshape(-1, *x.shape[2:]) for x in inputs), **kwargs)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs: Unpack[TransformersKwargs]) -> MultipleChoiceModelOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        logits = self.classifier(self.dropout(outputs.pooler_output)).view(-1, num_choices)
        loss = CrossEntropyLoss()(logits, labels) if labels is not None else None
        return MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NezhaForTokenClassification(NezhaModelWithHead):
    """NEZHA with a linear head on every token (NER and tagging); `labels` use -100 to skip a token.

    The loss is normalised by Trainer's `num_items_in_batch` under gradient accumulation.
    """

    accepts_loss_kwargs = True

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.add_classifier(config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs: Unpack[TransformersKwargs]) -> TokenClassifierOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = self.loss_function(logits, labels, self.config, **kwargs) if labels is not None else None
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NezhaForQuestionAnswering(NezhaModelWithHead):
    """NEZHA for extractive QA: start and end logits per token; positions outside the input are ignored.

    The output layer always has two units (start, end), as in every v4 checkpoint; `config.num_labels`
    is for the classification heads and does not change it.
    """

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None,
                **kwargs: Unpack[TransformersKwargs]) -> QuestionAnsweringModelOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).split(1, dim=-1)
        start_logits, end_logits = start_logits.squeeze(-1).contiguous(), end_logits.squeeze(-1).contiguous()
        total_loss = None
        if start_positions is not None and end_positions is not None:
            ignored_index = start_logits.size(1)
            loss_fct = CrossEntropyLoss(ignore_index=ignored_index)
            start_loss = loss_fct(start_logits, start_positions.view(-1).clamp(0, ignored_index))
            end_loss = loss_fct(end_logits, end_positions.view(-1).clamp(0, ignored_index))
            total_loss = (start_loss + end_loss) / 2
        return QuestionAnsweringModelOutput(
            loss=total_loss, start_logits=start_logits, end_logits=end_logits, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


@dataclass
class NezhaSentenceExtractionOutput(ModelOutput):
    """Output of `NezhaForSentenceExtraction`: one logit per sentence (`[batch, max_sentences]`) and the loss."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor] | None = None
    attentions: tuple[torch.Tensor] | None = None


def sentence_means(token_scores: torch.Tensor, sentence_ids: torch.Tensor, num_sentences: int):
    """Each sentence's mean token score, `[batch, num_sentences]` (the dtype's minimum for a sentence with no
    token), and its token count. A sentence's logit is the classifier of its mean state, which (the classifier
    being linear) is the mean of its tokens' scores: so an export can stop at the token scores."""
    in_sentence = sentence_ids >= 0
    index = sentence_ids.clamp(min=0)
    weights = in_sentence.to(token_scores.dtype)
    sums = token_scores.new_zeros(token_scores.shape[0], num_sentences).scatter_add(1, index, token_scores * weights)
    counts = token_scores.new_zeros(token_scores.shape[0], num_sentences).scatter_add(1, index, weights)
    means = (sums / counts.clamp(min=1)).masked_fill(counts == 0, torch.finfo(token_scores.dtype).min)
    return means, counts


class NezhaForSentenceExtraction(NezhaModelWithHead):
    """Scores every sentence of a whole document for extractive summarisation.

    The document is encoded in one pass (thousands of tokens: every sentence is judged in the
    context of the entire judgment), each sentence is the mean of its tokens' final states, and a
    linear layer gives its logit (sigmoid = probability of being extracted); computed as the mean of
    the tokens' linear scores (`sentence_means`), the same number.

    Inputs: `input_ids` etc. as usual, plus `sentence_ids` `[batch, length]`: the index of the
    sentence each token belongs to (0, 1, ...), -1 for `[CLS]`, `[SEP]` and padding. `labels`
    `[batch, max_sentences]` are 1 / 0, or -100 for sentences that do not exist. The loss is the
    mean binary cross-entropy over existing sentences (`accepts_loss_kwargs = False`).
    `nezha_hf.summarization` builds these inputs from judgments.
    """

    def __init__(self, config: NezhaConfig):
        super().__init__(config)
        self.add_classifier(1)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None,
                sentence_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> NezhaSentenceExtractionOutput:
        if sentence_ids is None:
            raise ValueError("NezhaForSentenceExtraction needs sentence_ids: the sentence index of every token (-1 for none).")
        outputs = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds, **kwargs)
        token_scores = self.classifier(self.dropout(outputs.last_hidden_state)).squeeze(-1)
        if labels is not None:
            num_sentences = labels.shape[1]
            if values_known(sentence_ids) and int(sentence_ids.max()) >= num_sentences:
                raise ValueError(f"sentence_ids go up to {int(sentence_ids.max())}, but labels cover {num_sentences} sentences.")
        else:  # as many sentences as the highest index says (at least one); a data-dependent size under export
            num_sentences = sentence_ids.max().clamp(min=0).item() + 1
            torch._check(num_sentences >= 1)
        logits, counts = sentence_means(token_scores, sentence_ids, num_sentences)
        loss = None
        if labels is not None:
            labels = labels.to(logits.dtype)
            valid = (labels != -100) & (counts > 0)
            loss = BCEWithLogitsLoss()(logits[valid], labels[valid])
        return NezhaSentenceExtractionOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@dataclass(frozen=True)
class NezhaHead:
    """One NEZHA class and what the rest of the package needs to know about it.

    Attributes:
        model_class: the class.
        auto_class: the transformers Auto class that builds it (its name), or None.
        bert_classes: BERT classes whose checkpoints `nezha-hf convert` turns into this class.
        pipeline_tag: the Hub task its model card declares.
        card_template: the file in `model_cards/` (without `.md`) its model card is written from.
    """

    model_class: type
    auto_class: str | None
    bert_classes: tuple[str, ...]
    pipeline_tag: str
    card_template: str


# Every NEZHA class a checkpoint can be: registration, conversion, model cards and remote code read this table.
NEZHA_HEADS = (
    NezhaHead(NezhaModel, "AutoModel", ("BertModel",), "feature-extraction", "classifier"),
    NezhaHead(NezhaForPreTraining, "AutoModelForPreTraining", ("BertForPreTraining",), "fill-mask", "continued-pretraining"),
    NezhaHead(NezhaForMaskedLM, "AutoModelForMaskedLM", ("BertForMaskedLM",), "fill-mask", "continued-pretraining"),
    NezhaHead(NezhaForNextSentencePrediction, "AutoModelForNextSentencePrediction", ("BertForNextSentencePrediction",),
              "text-classification", "classifier"),
    NezhaHead(NezhaForSequenceClassification, "AutoModelForSequenceClassification", ("BertForSequenceClassification",),
              "text-classification", "classifier"),
    NezhaHead(NezhaForMultipleChoice, "AutoModelForMultipleChoice", ("BertForMultipleChoice",), "multiple-choice",
              "classifier"),
    NezhaHead(NezhaForTokenClassification, "AutoModelForTokenClassification", ("BertForTokenClassification",),
              "token-classification", "classifier"),
    NezhaHead(NezhaForQuestionAnswering, "AutoModelForQuestionAnswering", ("BertForQuestionAnswering",),
              "question-answering", "classifier"),
    NezhaHead(NezhaForUniLM, "AutoModelForCausalLM", ("BertLMHeadModel",), "summarization", "summarizer"),
    NezhaHead(NezhaForSentenceExtraction, None, (), "summarization", "summarizer"),
)


def nezha_head(name: str) -> NezhaHead:
    """The row of `NEZHA_HEADS` for a class name (old `NeZha` casing accepted); a `ValueError` lists the valid ones."""
    name = name.replace("NeZha", "Nezha")
    for head in NEZHA_HEADS:
        if head.model_class.__name__ == name:
            return head
    raise ValueError(
        f"{name!r} is not a NEZHA model class; choose from {[head.model_class.__name__ for head in NEZHA_HEADS]}."
    )


__all__ = [
    "NEZHA_HEADS",
    "CheckpointShapeError",
    "NezhaForMaskedLM",
    "NezhaForMultipleChoice",
    "NezhaForNextSentencePrediction",
    "NezhaForPreTraining",
    "NezhaForQuestionAnswering",
    "NezhaForSentenceExtraction",
    "NezhaForSequenceClassification",
    "NezhaForTokenClassification",
    "NezhaForUniLM",
    "NezhaHead",
    "NezhaModel",
    "NezhaModelWithHead",
    "NezhaPreTrainedModel",
    "nezha_head",
]
