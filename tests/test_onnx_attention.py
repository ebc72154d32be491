"""The exported attention (`nezha_hf.onnx_attention`): the ONNX graph run by onnxruntime against the independent
O(L^2 d) reference (tests/reference.py), with padding, causal and UniLM prefix masks, a KV cache's offset, lengths
that are not a whole number of chunks and K small and large against the length; and what an exported model holds."""

import numpy as np
import pytest
import torch
from helpers import make_case, tiny_config

import reference
from nezha_hf import NezhaForSequenceClassification, NezhaModel

onnxruntime = pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")
ir = pytest.importorskip("onnx_ir")
onnx_attention = pytest.importorskip("nezha_hf.onnx_attention")

TYPES = {torch.float32: ir.DataType.FLOAT, torch.float64: ir.DataType.DOUBLE}


def attention_session(dtype, heads, head_size, K, causal, padded, source, options=None):
    """An onnxruntime session of `relative_attention_graph` alone: inputs q, k, v `[batch, heads, n, d]`, the mask's
    flags and the cache offset; the table is the reference's, a constant of the graph."""
    from onnx_ir.tape import Tape

    tape = Tape()
    nodes = onnx_attention._Nodes(lambda op_type, inputs, attributes: tape.op(op_type, list(inputs), attributes or None))

    def graph_input(name, kind, shape):
        return ir.Value(name=name, type=ir.TensorType(kind), shape=ir.Shape(shape))

    q, k, v = (graph_input(name, TYPES[dtype], ["batch", heads, f"{name}_length", head_size]) for name in "qkv")
    flags = {name: graph_input(name, ir.DataType.BOOL, ["batch", "k_length"])
             for name, wanted in (("valid", padded), ("source", source)) if wanted}
    offset = graph_input("offset", ir.DataType.INT64, [])
    table = nodes.Constant(value=ir.tensor(reference.relative_table(K, head_size, dtype).numpy()))
    table.shape = ir.Shape([2 * K + 1, head_size])
    output = onnx_attention.relative_attention_graph(nodes, q, k, v, table, flags.get("valid"), causal,
                                                     flags.get("source"), offset, head_size**-0.5)
    output.name = "output"
    graph = ir.Graph([q, k, v, *flags.values(), offset], [output], nodes=tape.nodes, opset_imports={"": 18})
    for number, node in enumerate(ir.traversal.RecursiveGraphIterator(graph)):
        for value in node.outputs:
            if value is not output:
                value.name = f"value_{number}_{value.name}"  # the loop's body names its own; the graph, here
    model = ir.Model(graph, ir_version=10)
    return onnxruntime.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options,
                                        providers=["CPUExecutionProvider"])


def run_graph(q, k, v, mask, K, options=None):
    """The graph's output `[batch, heads, queries, d]` (as the reference's) and its session."""
    session = attention_session(q.dtype, q.shape[1], q.shape[-1], K, mask.causal, mask.key_is_valid is not None,
                                mask.key_is_source is not None, options)
    feeds = {"q": q, "k": k, "v": v, "valid": mask.key_is_valid, "source": mask.key_is_source,
             "offset": torch.tensor(mask.query_offset)}
    names = {i.name for i in session.get_inputs()}
    output = session.run(None, {name: value.numpy() for name, value in feeds.items() if name in names})[0]
    return torch.from_numpy(output).transpose(1, 2), session


def ops_run(session) -> set[str]:
    """The op types whose kernels a profiled session (`enable_profiling`) ran, subgraphs' included."""
    import json
    import os

    path = session.end_profiling()
    try:
        with open(path) as file:
            events = json.load(file)
    finally:
        os.remove(path)
    return {event["args"]["op_name"] for event in events
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time")}


def profiled(tmp_path):
    options = onnxruntime.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    return options


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 query rows, so that short inputs run several chunks (and a last one with padded rows)."""
    monkeypatch.setattr(onnx_attention, "MAX_CHUNK_ROWS", 16)


CASES = [  # batch, heads, length, head size, K, mode, unpadded lengths
    (1, 2, 1, 4, 3, "bidirectional", None),
    (2, 3, 7, 8, 2, "bidirectional", [7, 4]),
    (3, 2, 41, 8, 9, "bidirectional", [41, 0, 30]),  # a row of padding alone: 0 for every query
    (2, 2, 67, 4, 30, "bidirectional", [67, 50]),  # K large against the chunks: the middle is the whole row
    (2, 2, 10, 8, 64, "bidirectional", [10, 3]),  # K larger than the length
    (2, 2, 53, 8, 3, "causal", [53, 40]),
    (3, 2, 50, 8, 5, "prefix", [50, 33, 12]),  # UniLM: source keys seen by every query
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("batch,heads,length,head_size,K,mode,pad_lengths", CASES)
def test_exported_attention_equals_the_reference(batch, heads, length, head_size, K, mode, pad_lengths, dtype,
                                                 small_chunks):
    q, k, v, mask, allowed = make_case(batch, heads, length, head_size, K, mode, pad_lengths, dtype, seed=length)
    expected, _ = reference.attention(q, k, v, K, allowed)
    atol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(run_graph(q, k, v, mask, K)[0], expected, atol=atol, rtol=0)


@pytest.mark.parametrize("length,chunks", [(16, 1), (128, 1), (129, 2), (300, 3), (600, 5)])
def test_one_chunk_or_many_at_the_default_sizes(length, chunks, tmp_path):
    """The default chunking (the graph computes rows from the call's sizes: up to 128 rows, 300 tokens in 3 chunks
    of 100, 600 in 5 of 120), K = 64 and a padded row; one chunk runs without the scan (its `If` branch), more run
    the scan: the profile says which ran."""
    q, k, v, mask, allowed = make_case(2, 2, length, 16, 64, "bidirectional", [length, length // 3], torch.float32,
                                       seed=length)
    expected, _ = reference.attention(q, k, v, 64, allowed)
    output, session = run_graph(q, k, v, mask, 64, profiled(tmp_path))
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    assert ("Scan" in ops_run(session)) == (chunks > 1), (length, chunks)


@pytest.mark.parametrize("queries,offset", [(1, 39), (3, 37), (20, 20)])
def test_queries_after_a_cache(queries, offset, small_chunks, tmp_path):
    """Decoding: queries at positions offset.. against every key (a cache of `offset` keys and the new ones), causal
    with padding and source keys (UniLM's generator), and with a static cache's unfilled slots as padding."""
    K, keys = 6, offset + queries + 5  # 5 slots of a static cache not yet filled
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(2, 2, queries, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, keys, 8, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.arange(keys)[None, :] < offset + queries
    valid = valid & ~((torch.arange(keys) < 4) & torch.tensor([[False], [True]]))  # the second row left-padded
    source = torch.arange(keys)[None, :] < torch.tensor([[9], [15]])
    from nezha_hf.attention_ops import RelativeAttentionMask

    mask = RelativeAttentionMask(key_is_valid=valid, causal=True, key_is_source=source, query_offset=offset)
    allowed = reference.allowed_mask(queries, valid, True, source, query_offset=offset, key_length=keys)
    expected, _ = reference.attention(q, k, v, K, allowed, query_offset=offset)
    output, session = run_graph(q, k, v, mask, K, profiled(tmp_path))
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=0)
    # A decoding step (one chunk of 16 rows at most) runs without the scan, its far keys shifted in the chunk.
    assert ("Scan" in ops_run(session)) == (queries > 16), queries


@pytest.mark.parametrize("K", [64, 32, 5])
def test_chunk_rows_keep_a_chunk_within_its_scores(K):
    """A chunk's scores stay within CHUNK_SCORES (memory linear in the length), in whole groups of 16 rows (of 2K
    where that is less), spread evenly, and never more than 2K rows (the split's condition); evaluated by onnxruntime
    as the graph computes them."""
    from onnx_ir.tape import Tape

    tape = Tape()
    nodes = onnx_attention._Nodes(lambda op_type, inputs, attributes: tape.op(op_type, list(inputs), attributes or None))
    sizes = [ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
             for name in ("batch_heads", "queries", "keys")]
    chunks, rows = onnx_attention.chunk_rows(nodes, *sizes, K)
    chunks.name, rows.name = "chunks", "rows"
    graph = ir.Graph(sizes, [chunks, rows], nodes=tape.nodes, opset_imports={"": 18})
    session = onnxruntime.InferenceSession(ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString())
    for batch_heads, length in [(12, 1), (12, 100), (12, 130), (12, 2048), (12, 16384), (96, 16384), (12, 1 << 21)]:
        count, size = (int(x) for x in session.run(None, {"batch_heads": np.array(batch_heads),
                                                          "queries": np.array(length), "keys": np.array(length)}))
        assert count * size >= length > (count - 1) * size and size <= onnx_attention.MAX_CHUNK_ROWS, (length, size)
        biggest = max(min(onnx_attention.MIN_CHUNK_ROWS, 2 * K), onnx_attention.CHUNK_SCORES // (batch_heads * length))
        assert size <= min(biggest, onnx_attention.MAX_CHUNK_ROWS, 2 * K), (batch_heads, length, size)


def exported_ops(path, into_scans=True):
    """The op types of the file's graph and its subgraphs (a `Scan`'s body only `into_scans`)."""
    import onnx

    def ops(graph):
        for node in graph.node:
            yield node.op_type
            for attribute in node.attribute:
                if attribute.g.node and (into_scans or node.op_type != "Scan"):
                    yield from ops(attribute.g)

    return set(ops(onnx.load(str(path)).graph))


def test_an_exported_model_holds_the_chunked_graph(tmp_path):
    """The export writes the attention as the chunks' Scan behind an If (one chunk runs without it): no scatter but
    the chunk's band correction inside the scan (not the gather decomposition's ScatterElements over L x L), and
    onnxruntime gives PyTorch's outputs at one chunk and at lengths that are not a whole number of chunks."""
    from nezha_hf.export import export_onnx

    torch.manual_seed(0)
    model = NezhaForSequenceClassification(tiny_config(num_labels=2)).eval()
    export_onnx(model, tmp_path / "model.onnx")
    ops = exported_ops(tmp_path / "model.onnx")
    assert {"Scan", "If", "ScatterElements"} <= ops and not ops & {"ScatterND", "Loop"}, sorted(ops)
    assert "ScatterElements" not in exported_ops(tmp_path / "model.onnx", into_scans=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    for length in (1, 131, 517):
        ids = torch.randint(1, 99, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[1, length // 2 + 1:] = 0
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).logits
        got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                 "token_type_ids": np.zeros_like(ids.numpy())})[0]
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0, err_msg=str(length))


def test_attention_dropout_is_refused_with_a_message():
    """A model exported in training mode with attention dropout would carry no dropout in the graph: refused, saying
    what to do."""
    import nezha_hf.export  # noqa: F401  (registers the exported attention)

    model = NezhaModel(tiny_config(attention_probs_dropout_prob=0.1, attn_implementation="nezha_chunked")).train()
    ids = torch.randint(1, 99, (1, 9))
    with pytest.raises(Exception) as error:
        torch.onnx.export(model, (ids,), dynamo=True)
    messages = []
    cause = error.value
    while cause is not None:
        messages.append(str(cause))
        cause = cause.__cause__
    assert any("eval mode" in message for message in messages), messages[-1][:500]
