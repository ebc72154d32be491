"""An engine's eager calls go straight to its functions (`attention_ops.engine_op`), past the dispatcher, with the
results, gradients and refusals of its registered ops; anything that must see the ops (a dispatch mode, tracing)
still does."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nezha_hf import chunked_attention, fused_attention, three_regions
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask, flatten, sinusoid_relative_table

ENGINES = {"chunked": chunked_attention.chunked_attention, "three_regions": three_regions.three_regions_attention,
           "fused": fused_attention.fused_attention}


def engine(name):
    if name == "fused" and fused_attention.fused_kernel() is None:
        pytest.fail("the fused kernel did not build here (the CI machine builds it)")
    return ENGINES[name]


def case(dropout=0.0):
    """A batch of 2 with padding and a causal mask (tensors among the problem's fields), 12 tokens."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 3, 12, 8, generator=generator) for _ in range(3))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False
    problem = AttentionProblem(RelativeAttentionMask(valid, True), 8**-0.5, dropout,
                               torch.tensor(3) if dropout else None)
    return query, key, value, sinusoid_relative_table(4, 8), problem


def through_registered_op(attend, query, key, value, table, problem):
    return attend.forward_op(query, key, value, table, *flatten(problem))[0]


def output_and_gradients(call, attend, query, key, value, table, problem):
    inputs = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    output = call(attend, *inputs, table, problem)
    grad_output = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
    return output, torch.autograd.grad(output, inputs, grad_output)


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_an_eager_call_skips_the_dispatcher_with_the_registered_ops_results(name, dropout):
    attend = engine(name)
    arguments = case(dropout)
    direct, direct_grads = output_and_gradients(lambda attend, *a: attend(*a), attend, *arguments)
    registered, registered_grads = output_and_gradients(through_registered_op, attend, *arguments)
    assert type(direct.grad_fn).__name__ == "DirectAttentionBackward", type(direct.grad_fn)
    assert type(registered.grad_fn).__name__ != "DirectAttentionBackward"
    assert torch.equal(direct, registered)
    for got, expected in zip(direct_grads, registered_grads):
        assert torch.equal(got, expected)
    with torch.no_grad():
        assert torch.equal(attend(*arguments), direct)


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ENGINES)
def test_a_dispatch_mode_sees_the_registered_ops(name):
    attend = engine(name)
    query, key, value, table, problem = case()
    query.requires_grad_()
    with OpNames() as seen:
        attend(query, key, value, table, problem).sum().backward()
    op = attend.forward_op.name().split("::")[1].removesuffix("_forward")
    assert f"nezha_hf.{op}_forward.default" in seen.names and f"nezha_hf.{op}_backward.default" in seen.names


@pytest.mark.parametrize("name", ENGINES)
def test_a_second_derivative_is_refused_on_the_direct_route(name):
    attend = engine(name)
    query, key, value, table, problem = case()
    query.requires_grad_()
    (grad,) = torch.autograd.grad(attend(query, key, value, table, problem).pow(2).sum(), query, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        grad.sum().backward()


@pytest.mark.parametrize("name", ENGINES)
def test_a_profile_names_the_ops_on_the_direct_route(name):
    """Profiles (the GPU check's, a user's) find an engine's time under its ops' names on either route."""
    attend = engine(name)
    query, key, value, table, problem = case()
    query.requires_grad_()
    with torch.profiler.profile() as profile:
        attend(query, key, value, table, problem).sum().backward()
    names = {event.name for event in profile.events()}
    assert {attend.forward_op.name(), attend.backward_op.name()} <= names, sorted(names)
