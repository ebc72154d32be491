"""What a fresh process of tests/test_compile_engine_op.py runs: `compiled_engine_worker.py ORDER`.

ORDER is `nezha-first` (`import nezha_hf`, then Inductor: what a user's script does) or `inductor-first`. The
process then compiles with Inductor, forward and backward, a tiny NezhaModel and each CPU engine's op called
directly, and prints one JSON line per case: the `nezha_hf` ops the generated code calls (`ops`), or the error
(`error`). Code that computes the attention with `L x L` scores (the ops' decomposition) calls no `nezha_hf` op.
"""

import json
import re
import sys

import torch

if sys.argv[1] == "inductor-first":
    import torch._inductor.compile_fx  # noqa: F401  (what `torch.compile` loads on its first call)

import nezha_hf  # noqa: E402
from nezha_hf import NezhaConfig, NezhaModel, chunked_attention, fused_attention, three_regions  # noqa: E402
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask, sinusoid_relative_table  # noqa: E402

if sys.argv[1] == "nezha-first":
    import torch._inductor.compile_fx  # noqa: F401,E402


def ops_in_compiled_code(forward, *inputs) -> dict:
    """The `nezha_hf` ops called by the code Inductor generates for `forward(*inputs)` and its backward."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True)

    def step(*inputs):
        compiled(*inputs).pow(2).mean().backward()

    try:
        _, code = run_and_get_code(step, *inputs)
    except Exception as error:  # reported to the test, which prints it
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    return {"ops": sorted(set(re.findall(r"nezha_hf\.(\w+)", "\n".join(code))))}


def model_case() -> dict:
    config = NezhaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=37, max_relative_position=8)
    torch.manual_seed(0)
    model = NezhaModel(config)
    ids = torch.randint(1, 99, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    with nezha_hf.recorded_attention_calls() as calls:
        model(input_ids=ids, attention_mask=mask)  # loads the fused kernel, as a first eager call does

    def forward(ids, mask):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    return {"engine": calls[0].ran.op_name, **ops_in_compiled_code(forward, ids, mask)}


def op_case(attention) -> dict:
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 24, 8, generator=generator, requires_grad=True) for _ in range(3))
    table = sinusoid_relative_table(4, 8)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, 20:] = False

    def forward(query, key, value):
        return attention(query, key, value, table, AttentionProblem(RelativeAttentionMask(valid), 8 ** -0.5))

    return ops_in_compiled_code(forward, query, key, value)


cases = {"model": model_case}
if fused_attention.fused_kernel() is not None:
    cases["fused"] = lambda: op_case(fused_attention.fused_attention)
cases["chunked"] = lambda: op_case(chunked_attention.chunked_attention)
if three_regions.AVAILABLE:
    cases["three_regions"] = lambda: op_case(three_regions.three_regions_attention)
for name, case in cases.items():
    print(json.dumps({"case": name, **case()}), flush=True)
