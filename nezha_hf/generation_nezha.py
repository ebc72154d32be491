"""Generation with `NezhaForUniLM`: the UniLM source through every decoding mode, and SPACES copy decoding.

As Whisper keeps its generation in `generation_whisper.py`, NEZHA keeps it here: `NezhaUniLMGenerationMixin`
is what `NezhaForUniLM` generates with, `CopySpanLogitsProcessor` the copy constraint it adds.

How the source travels. The prompt is the source (token type 0 unless the caller says otherwise) and every
generated token is a target (type 1). transformers extends `token_type_ids` by repeating the last value
(in the decoding loop and in assisted decoding's candidates), which would make generated tokens source
tokens. `generate` therefore puts the prompt's length into the generation kwargs as `source_length` (an
assistant model's own `generate` receives it with the other kwargs), and `prepare_inputs_for_generation`,
the one place every decoding mode passes, gives the model the types that follow from it:

- while the cache does not hold the whole source yet (the first call, or a re-run after assisted decoding
  cropped its cache into the source): `token_type_ids` with 1 from `source_length` on, and `source_length`
  itself when a cache is there, so that the model accepts source tokens after it;
- once the cache holds the source: no `token_type_ids` at all. The model then treats the new tokens as
  targets, so a decoding step takes nothing a generic exported decoding loop cannot give it.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import (
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
)
from transformers.utils.deprecation import deprecate_kwarg

from .relative_attention import tracing, values_known

COPY_TAGS = ("generated", "copy-start", "copy-continue")
# transformers' default length when a call gives none: this many new tokens.
DEFAULT_NEW_TOKENS = 20


def cache_length(cache: Cache | None) -> int | torch.Tensor:
    """Tokens already in the cache (0 without one). A static cache reports a tensor: eager code gets an int,
    traced code a copy of the tensor (its value changes from one decoding step to the next). A copy, because the
    cache reports its own counter, which each layer's `update` then advances in place: read after layer 0's
    update, the exported step would place its queries one token too far."""
    length = cache.get_seq_length() if cache is not None else 0
    if not isinstance(length, torch.Tensor):
        return length
    return int(length) if values_known(length) else length.clone()


def check_cache_fits(cache: Cache, key: torch.Tensor, layer_idx: int, num_layers: int) -> None:
    """A `ValueError` naming what does not match when `cache` (the self-attention cache a layer is about to extend)
    was made by another model or for another batch: the number of layers it holds (`num_layers` in this model), or
    the batch size, heads or head size of its keys at `layer_idx` against this layer's new `key` (`[batch, heads,
    length, head_size]`). Shapes only; nothing is checked while tracing (compile, export), where shapes are the
    trace's."""
    if tracing() or not cache.layers:  # a cache transformers builds layer by layer, on first use
        return
    if layer_idx == 0 and len(cache.layers) != num_layers:
        raise ValueError(f"The cache holds {len(cache.layers)} layers but this model has {num_layers}: it was made "
                         "for another model. Pass a cache this model returned, or one built from its config (or none).")
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    cached = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    if not isinstance(cached, torch.Tensor) or cached.dim() != 4 or not cached.numel():
        return
    names = {0: "batch size", 1: "heads", 3: "head size"}
    differ = [f"{name} {cached.shape[dim]} (this call: {key.shape[dim]})" for dim, name in names.items()
              if cached.shape[dim] != key.shape[dim]]
    if differ:
        raise ValueError(f"The cache's keys at layer {layer_idx} do not fit this model and input: "
                         f"{', '.join(differ)}. It was made by another model or for another batch; pass a cache this "
                         "model returned for these inputs (or none).")


class CopySpanLogitsProcessor(LogitsProcessor):
    """SPACES copy decoding: a token tagged as copied must continue an n-gram of its source.

    `NezhaForUniLM.generate` adds it when the model has a copy head; a forward hook hands it the
    copy-tag logits of each step (`read_copy_logits`). For every row, with `n` the length of the
    current copied span (0 outside one): the tag is the arg-max of the copy logits (2 is not
    allowed when `n = 0`); tag 0 leaves the scores alone and ends the span; tag 1 starts a span
    (`n = 1`) and keeps only tokens of the source; tag 2 extends it (`n + 1`) and keeps only the
    tokens that follow the span's last `n` tokens somewhere in the source. If the span cannot be
    continued, it restarts as a new span (`n = 1`), as SPACES did; if another processor (e.g.
    `no_repeat_ngram_size`) has banned every source token, the row decodes freely. Scores of the
    kept tokens are renormalised among themselves (log-softmax). The span length is kept per
    generated prefix, so beam search and sampling with several sequences are handled.

    Args:
        sources: the token ids a copy may come from, one list per batch row before expansion.
        prompt_length: length of the (padded) prompt; what follows it is the generated target.
        prompts: the prompt rows (`for_prompt` gives them): each decoding row must start with its source's prompt
            (generate keeps a source's rows together), so a row is never constrained by another source.
    """

    def __init__(self, sources: list[list[int]], prompt_length: int, prompts: torch.Tensor | None = None):
        if any(not source for source in sources):
            raise ValueError("Copy decoding needs a non-empty source in every row.")
        self.sources = [list(source) for source in sources]
        self.prompt_length = prompt_length
        self.prompts = prompts
        self.copy_logits = None
        self._span_length = {}
        self._continuations = {}

    @classmethod
    def for_prompt(cls, prompt: torch.Tensor, attention_mask: torch.Tensor | None, special_tokens) -> "CopySpanLogitsProcessor":
        """The processor for a (left-padded) prompt of token ids: each row's copy source is its attended tokens
        except `special_tokens` (padding, `bos_token_id`, `eos_token_id`)."""
        attended = torch.ones_like(prompt, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        sources = [[token for token, keep in zip(row.tolist(), keep_row.tolist()) if keep and token not in special_tokens]
                   for row, keep_row in zip(prompt, attended)]
        return cls(sources, prompt.shape[1], prompt)

    def read_copy_logits(self, module, args, output) -> None:
        """Forward hook: keep the copy-tag logits of the last position."""
        self.copy_logits = output.copy_logits[:, -1].float()

    def _candidates(self, source_index: int, span: tuple) -> list[int] | None:
        """Tokens that follow `span` somewhere in the source (every source token for an empty span)."""
        key = (source_index, len(span))
        if key not in self._continuations:
            source, n = self.sources[source_index], len(span)
            table = {}
            for start in range(len(source) - n):
                table.setdefault(tuple(source[start : start + n]), set()).add(source[start + n])
            self._continuations[key] = {prefix: sorted(tokens) for prefix, tokens in table.items()}
        return self._continuations[key].get(span)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.copy_logits is None or self.copy_logits.shape[0] != input_ids.shape[0]:
            raise RuntimeError("CopySpanLogitsProcessor got no copy logits for this step: use NezhaForUniLM.generate.")
        rows_per_source = input_ids.shape[0] // len(self.sources)
        expected = None if self.prompts is None else self.prompts.to(input_ids.device).repeat_interleave(
            rows_per_source, 0)
        if input_ids.shape[0] % len(self.sources) or (
                expected is not None and not torch.equal(input_ids[:, : self.prompt_length], expected)):
            raise RuntimeError(f"CopySpanLogitsProcessor: the {input_ids.shape[0]} decoding rows do not start with "
                               f"the prompts of its {len(self.sources)} sources, each source's rows together: a row "
                               "would be constrained by another source's n-grams.")
        constrained = torch.full_like(scores, float("-inf"))
        for row in range(input_ids.shape[0]):
            source_index = row // rows_per_source
            target = tuple(input_ids[row, self.prompt_length :].tolist())
            span = self._span_length.get((source_index, target[:-1]), 0) if target else 0
            tag_scores = self.copy_logits[row].clone()
            if span == 0:
                tag_scores[2] = float("-inf")
            tag = int(tag_scores.argmax())
            span = tag if tag < 2 else span + 1
            options = [(span, target[len(target) - span + 1 :])] if span > 1 else []
            options += [(1, ())] if span > 0 else []
            for option_span, prefix in options:
                candidates = self._candidates(source_index, prefix)
                kept = None if candidates is None else scores[row, torch.tensor(candidates, device=scores.device)]
                if kept is not None and bool((kept > float("-inf")).any()):
                    # Renormalised over the candidates (as SPACES did): beam search then ranks a copied
                    # token by its probability given that the token is copied, not below every free one.
                    constrained[row, candidates] = kept.log_softmax(-1)
                    span = option_span
                    break
            else:
                span = 0
                constrained[row] = scores[row]
            self._span_length[(source_index, target)] = span
        return constrained


class NezhaUniLMGenerationMixin(GenerationMixin):
    """`GenerationMixin` for `NezhaForUniLM`: the prompt as the UniLM source, SPACES copy decoding, no length cap."""

    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")
    def generate(self, inputs: torch.Tensor | None = None, *args, copy_constraint: bool | None = None, **kwargs):
        """`GenerationMixin.generate`, with the prompt as the UniLM source.

        Without `token_type_ids` every prompt token is source (type 0); generated tokens get type 1. No length
        cap applies: `config.max_position_embeddings` is only kept for transformers 4.x, and without
        `max_length` / `max_new_tokens` anywhere the default is 20 new tokens, as in transformers. Takes every
        argument of transformers' `generate` (greedy, beam search, sampling, assisted decoding, streamers),
        plus:

        Args:
            copy_constraint: with a copy head (`config.unilm_copy_tags`), keep copied spans on source n-grams
                (`CopySpanLogitsProcessor`); default True when the model has a copy head. The copy source is
                every attended prompt token except padding, `bos_token_id` and `eos_token_id`.
            source_length: where the source ends in the sequence (default: the prompt's length, or the
                length of the `cache` passed in); an assistant model receives it from the main
                model's `generate`.
        """
        self._check_special_ids(kwargs)
        prompt = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if kwargs.get("token_type_ids") is None and prompt is not None:
            kwargs["token_type_ids"] = torch.zeros(prompt.shape[:2], dtype=torch.long, device=prompt.device)
        if kwargs.get("source_length") is None and prompt is not None and not self.config.is_decoder:
            # Tokens after a non-empty cache are targets, like the ones generated after the prompt.
            cached = cache_length(kwargs.get("cache"))
            kwargs["source_length"] = min(prompt.shape[1], cached) if isinstance(cached, int) and cached else prompt.shape[1]
        if not self._length_given(kwargs):
            kwargs["max_new_tokens"] = DEFAULT_NEW_TOKENS
        if copy_constraint is None:
            copy_constraint = self.copy_head is not None
        hook = None
        if copy_constraint:
            processor = self._copy_processor(prompt, kwargs)
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])
            hook = self.register_forward_hook(processor.read_copy_logits)
        try:
            return super().generate(inputs, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()

    def _check_special_ids(self, kwargs: dict) -> None:
        """A `ValueError` for a padding, start or end id that cannot mean anything, whether the call or a generation
        config (a checkpoint's `generation_config.json`) gives it: one at or above the vocabulary size (an end id
        the model can never produce would let every summary run to the length limit without a word), or one that
        is not an integer. A negative id is accepted, as transformers accepts it: it matches no token (transformers'
        own generation checks set `eos_token_id=-1` to run every sequence to its full length)."""
        configs = [c for c in (kwargs.get("generation_config"), self.generation_config) if c is not None]
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = kwargs.get(name, next((getattr(c, name) for c in configs if getattr(c, name, None) is not None),
                                          None))
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
                value = value.tolist()
            for token in value if isinstance(value, list) else [value]:
                if token is None:
                    continue
                if not isinstance(token, int) or isinstance(token, bool):
                    raise ValueError(f"{name} {value!r} is not a token id: give an integer (or a list of them) "
                                     "(given to generate, or in the model's generation_config.json).")
                if token >= self.config.vocab_size:
                    raise ValueError(f"{name} {value} lies outside the vocabulary: ids are below "
                                     f"{self.config.vocab_size} (a negative id matches no token, as in transformers) "
                                     "(given to generate, or in the model's generation_config.json).")

    def _length_given(self, kwargs: dict) -> bool:
        """Whether the call or a generation config sets a length. Without one, transformers would cap the
        default at `config.max_position_embeddings` (512 in v4 configs), which NEZHA does not have."""
        configs = [kwargs.get("generation_config"), self.generation_config]
        return any(kwargs.get(name) is not None or any(getattr(c, name, None) is not None for c in configs if c)
                   for name in ("max_length", "max_new_tokens"))

    def _copy_processor(self, prompt: torch.Tensor | None, kwargs: dict) -> CopySpanLogitsProcessor:
        if self.copy_head is None:
            raise ValueError("copy_constraint=True needs a copy head: set config.unilm_copy_tags=True and train it.")
        if prompt is None or prompt.dtype != torch.long:
            raise ValueError("Copy decoding needs the prompt as input_ids (not inputs_embeds).")
        generation_config = kwargs.get("generation_config") or self.generation_config
        special = set()
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = kwargs.get(name, getattr(generation_config, name, None))
            special.update(value if isinstance(value, list) else [] if value is None else [value])
        return CopySpanLogitsProcessor.for_prompt(prompt, kwargs.get("attention_mask"), special)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def prepare_inputs_for_generation(self, input_ids, cache=None, inputs_embeds=None,
                                      source_length: int | None = None, **kwargs):
        """transformers' inputs for one forward of `generate`, with the token types of the UniLM sequence (see the
        module docstring): positions before `source_length` keep the prompt's types, later ones are targets."""
        inputs = super().prepare_inputs_for_generation(
            input_ids, cache=cache, inputs_embeds=inputs_embeds, **kwargs
        )
        types = inputs.get("token_type_ids")
        if source_length is None or types is None:
            return inputs
        past = cache_length(cache)
        if isinstance(past, int) and past >= source_length:
            del inputs["token_type_ids"]  # only targets from here on: the model's default after a cache
            return inputs
        position = past + torch.arange(types.shape[1], device=types.device)
        inputs["token_type_ids"] = torch.where(position >= source_length, torch.ones_like(types), types)
        if not (isinstance(past, int) and past == 0):
            inputs["source_length"] = source_length  # source tokens re-run after a cropped cache
        return inputs

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache, **kwargs):
        """For static caches: the 2D padding mask (`forward` builds the prefix mask from it), padded to the
        cache's size, so that its shape is the same at every step and a compiled forward compiles once."""
        if attention_mask is None or cache is None:
            return attention_mask
        cache_size = cache.get_mask_sizes(inputs_embeds.shape[1], 0)[0]
        return nn.functional.pad(attention_mask, (0, cache_size - attention_mask.shape[1]))


__all__ = ["COPY_TAGS", "CopySpanLogitsProcessor", "NezhaUniLMGenerationMixin", "cache_length"]
