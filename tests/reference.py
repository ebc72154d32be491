"""Independent NEZHA reference for the tests: the plain O(L^2 d) formula, written from the paper.

Nothing here imports nezha_hf. It materialises the full `L x L x d` relative tensor, which is the
obvious, slow, memory-hungry way, so it is only used on small inputs.
"""

import math

import torch


def relative_table(max_relative_position: int, head_size: int, dtype=torch.float64) -> torch.Tensor:
    """T[p, 2m] = sin(p / 10000^(2m/d)), T[p, 2m+1] = cos(p / 10000^(2m/d)), p = 0 .. 2K."""
    table = torch.empty(2 * max_relative_position + 1, head_size, dtype=torch.float64)
    for p in range(2 * max_relative_position + 1):
        for m in range(head_size // 2):
            angle = p / (10000 ** (2 * m / head_size))
            table[p, 2 * m] = math.sin(angle)
            table[p, 2 * m + 1] = math.cos(angle)
    return table.to(dtype)


def allowed_mask(length, key_valid=None, causal=False, key_is_source=None, query_offset=0, key_length=None):
    """[batch or 1, 1, Lq, Lk] bool, the rules written out directly on query positions i and key positions j:

    with `causal`, key j is visible from query i when j <= i or j is a source key; and a padded key never is.
    """
    key_length = key_length or length
    i = torch.arange(length)[:, None] + query_offset  # [Lq, 1]
    j = torch.arange(key_length)[None, :]  # [1, Lk]
    allowed = torch.ones(1, 1, length, key_length, dtype=torch.bool)
    if causal:
        visible = j <= i
        if key_is_source is not None:
            visible = visible | key_is_source[:, None, None, :]
        allowed = allowed & visible
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    return allowed


def attention(q, k, v, max_relative_position, allowed=None, query_offset=0, table=None, keep=None, dropout=0.0):
    """softmax_j((q_i.k_j + q_i.a_ij)/sqrt(d)) (v_j + a_ij) with a_ij = T[clip(j - i, -K, K) + K].

    Rows with every key masked give zeros; NaN and inf in the inputs propagate as the formula makes them.
    With a `keep` mask (`[..., Lq, Lk]`, 0 or 1), dropout as in
    transformers 4.x: the probabilities times keep / (1 - dropout), into both value terms.
    """
    K, d = max_relative_position, q.shape[-1]
    table = relative_table(K, d, q.dtype) if table is None else table
    i = torch.arange(q.shape[-2])[:, None] + query_offset
    j = torch.arange(k.shape[-2])[None, :]
    a = table[(j - i).clamp(-K, K) + K]  # [Lq, Lk, d]
    scores = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, a)) / math.sqrt(d)
    sees_something = True
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
        # A row that sees no key gives 0 (and passes no gradient), as transformers 5's BERT does by default.
        sees_something = allowed.any(-1, keepdim=True)
        scores = scores.masked_fill(~sees_something, 0.0)
    probs = torch.softmax(scores, -1) * sees_something
    weights = probs if keep is None else probs * keep / (1 - dropout)
    return weights @ v + torch.einsum("bhij,ijd->bhid", weights, a), probs


def nezha_forward(model, input_ids, token_type_ids=None, attention_mask=None, causal=False, prefix_lm=False,
                  encoder_hidden_states=None, encoder_attention_mask=None):
    """Last hidden state of a NEZHA encoder from its weights alone, in float64.

    `prefix_lm`: the UniLM mask, in which tokens of type 0 are visible to every query and tokens
    of type 1 only to themselves and later tokens. With `encoder_hidden_states`, each layer then
    attends to them (cross-attention), decoder position i and encoder position j being j - i apart.

    `model` is used only as a bag of weights (`state_dict`) and for its config numbers.
    """
    config = model.config
    sd = {k.removeprefix("nezha."): v.double() for k, v in model.state_dict().items()}
    H, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    eps = config.layer_norm_eps

    def ln(x, name):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    x = sd["embeddings.word_embeddings.weight"][input_ids] + sd["embeddings.token_type_embeddings.weight"][token_type_ids]
    x = ln(x, "embeddings.LayerNorm")
    B, L = input_ids.shape
    key_valid = attention_mask.bool() if attention_mask is not None else torch.ones(B, L, dtype=torch.bool)
    allowed = key_valid[:, None, None, :].expand(B, 1, L, L)
    if causal or prefix_lm:
        visible = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
        if prefix_lm:
            visible = visible | (token_type_ids == 0)[:, None, None, :]
        allowed = allowed & visible
    table = relative_table(config.max_relative_position, d)
    for n in range(config.num_hidden_layers):
        p = f"encoder.layer.{n}."

        def heads(t):
            return t.view(B, L, H, d).transpose(1, 2)

        q, k, v = (heads(lin(x, p + f"attention.self.{w}")) for w in ("query", "key", "value"))
        ctx, _ = attention(q, k, v, config.max_relative_position, allowed, table=table)
        ctx = ctx.transpose(1, 2).reshape(B, L, H * d)
        x = ln(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        if encoder_hidden_states is not None:
            memory = encoder_hidden_states.double()
            E = memory.shape[1]
            q = heads(lin(x, p + "crossattention.self.query"))
            k, v = (lin(memory, p + f"crossattention.self.{w}").view(B, E, H, d).transpose(1, 2) for w in ("key", "value"))
            seen = torch.ones(B, 1, L, E, dtype=torch.bool)
            if encoder_attention_mask is not None:
                seen = seen & encoder_attention_mask.bool()[:, None, None, :]
            ctx, _ = attention(q, k, v, config.max_relative_position, seen, table=table)
            ctx = ctx.transpose(1, 2).reshape(B, L, H * d)
            x = ln(lin(ctx, p + "crossattention.output.dense") + x, p + "crossattention.output.LayerNorm")
        hidden = torch.nn.functional.gelu(lin(x, p + "intermediate.dense"))
        x = ln(lin(hidden, p + "output.dense") + x, p + "output.LayerNorm")
    return x


def lm_logits(model, hidden):
    """Masked-LM logits from a last hidden state: dense, GELU, LayerNorm, then the word embeddings
    (tied, as in BERT) plus the output bias `cls.predictions.bias`. Float64."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    p = "cls.predictions."
    x = hidden.double() @ sd[p + "transform.dense.weight"].T + sd[p + "transform.dense.bias"]
    x = torch.nn.functional.gelu(x)
    x = torch.nn.functional.layer_norm(
        x, x.shape[-1:], sd[p + "transform.LayerNorm.weight"], sd[p + "transform.LayerNorm.bias"], model.config.layer_norm_eps
    )
    return x @ sd["nezha.embeddings.word_embeddings.weight"].T + sd[p + "bias"]
