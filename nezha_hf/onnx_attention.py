"""NEZHA attention as an ONNX graph that onnxruntime runs well: queries in chunks (an ONNX `Scan`), linear memory.

ONNX has no NEZHA attention, and the decomposition every engine's op has (`attention_ops.gather_attention`) holds
`L x L` scores per head, an `int64` index of the scores' size and a scatter for the value term: in onnxruntime that
was slower than BERT from 512 tokens on and did not fit a long judgment in memory. The exporters take this graph
instead (`register_onnx_attention`), for every engine's op. A chunk holds `C <= 2K` query rows at positions
`[p, p + C)`; its split `s = p + K` is within `K` of every row, so a key at distance `-K` or less from a row lies
before the split and one at `K` or more from it:

- every key before the split is taken shifted by the table's row 0, `k_j + T[0]` and `v_j + T[0]`, every key from it
  on by row `2K` (the shifted keys and values are made once per call, and the chunk gathers its own from them in
  one pass), so the relative terms of every key outside a row's band ride in the matrix products;
- the band, the `2K - 1` keys at distances `1 - K .. K - 1` of each row, is corrected: its key term `q T^T` less the
  row 0 or `2K` the product gave it, added into the scores in place (`ScatterElements`, `2K - 1` numbers a row), and
  its value term, the band's probabilities gathered along its diagonals times the table's rows, less their masses
  before and from the split times rows 0 and `2K`.

Each chunk's scores are one `Softmax` over whole rows, and the padding mask rides in the matrix products as one
more column (a column of ones on the queries, the additive mask on the keys): the score passes are BERT's (product,
softmax, product); the score scale is folded into the queries. A causal mask (a decoder, UniLM's prefix mask) is
added to each chunk's scores. The scan carries nothing between chunks but their outputs; a chunk's rows are chosen
so that a call's scores stay within `CHUNK_SCORES` numbers (`chunk_rows`, computed in the graph from the call's
sizes): memory grows linearly with the length. When one chunk holds every query (a short input, a decoding step),
an `If` runs the chunk's body without the scan: its keys unshifted and its key term gathered for every key (an index
of the one chunk's scores' size, cheaper there than the band's scatter), its values as the scan's.

A row that sees no key gives 0, as every engine does. docs/serving.md has what this costs against BERT in
onnxruntime (`benchmarks/serving.py`).
"""

import itertools
from typing import Optional

import numpy as np
import onnx_ir as ir
from onnxscript import BOOL, INT64
from onnxscript.function_libs.torch_lib.tensor_typing import TFloat
from onnxscript.onnx_opset import opset18

from .attention_ops import max_relative_position

# Scores of one chunk across batch and heads (float32: 64 MB), and the bounds on its rows, as the chunked engine.
CHUNK_SCORES = 1 << 24
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 16, 128
# The additive mask of a key a query does not see: far below any score, and twice it (padding and a causal mask
# added) still a float32 number, so a row never becomes NaN; exp of it is 0.
MASKED = -1.0e30

_names = itertools.count()


class _Nodes:
    """Writes ONNX nodes through `emit(op_type, inputs, attributes) -> value`: `nodes.MatMul(a, b)`,
    `nodes.Softmax(x, axis=-1)`; `nodes.ints(...)` and `nodes.number(x, like)` make constants."""

    def __init__(self, emit):
        self._emit = emit

    def __getattr__(self, op_type):
        return lambda *inputs, **attributes: self._emit(op_type, inputs, attributes)

    def ints(self, *values, scalar=False):
        array = np.array(values[0] if scalar else values, dtype=np.int64)
        return self._emit("Constant", (), {"value": ir.tensor(array)})

    def number(self, value, like):
        """A scalar of `like`'s float type."""
        return self._emit("CastLike", (self._emit("Constant", (), {"value": ir.tensor(np.array(value, np.float64))}),
                                       like), {})


def _subgraph(build, inputs=()):
    """A loop's body or a branch: the `ir.Graph` of the values `build(nodes)` returns, its nodes written by a
    `_Nodes` of its own (outer values it uses are read from the enclosing graph), its values named apart."""
    from onnx_ir.tape import Tape

    tape = Tape()
    outputs = build(_Nodes(lambda op_type, inputs, attributes: tape.op(op_type, list(inputs), attributes or None)))
    name = f"nezha_attention_{next(_names)}"
    for number, node in enumerate(tape.nodes):
        for value in node.outputs:
            value.name = f"{name}_{number}"
    return ir.Graph(list(inputs), outputs, nodes=tape.nodes, name=name)


def chunk_rows(g: _Nodes, batch_heads, queries, keys, K: int):
    """Rows per chunk, in the graph: the most that keep a chunk's `batch * heads * rows * keys` scores within
    `CHUNK_SCORES`, between `MIN_CHUNK_ROWS` and `MAX_CHUNK_ROWS` in whole groups of `MIN_CHUNK_ROWS`, at most the
    queries, and never more than `2K` (the chunk's split needs every row within `K` of it: `relative_attention_graph`;
    groups are smaller where `2K` is under `MIN_CHUNK_ROWS`); then spread evenly over the chunks that takes (so the
    last chunk is not mostly padding). Returns `(chunks, rows)`, int64 scalars."""
    fit = g.Div(g.ints(CHUNK_SCORES, scalar=True), g.Mul(batch_heads, keys))
    most = min(MAX_CHUNK_ROWS, 2 * K)
    group = min(MIN_CHUNK_ROWS, most)
    groups = g.Max(g.Div(g.Min(fit, g.ints(most, scalar=True)), g.ints(group, scalar=True)), g.ints(1, scalar=True))
    rows = g.Min(g.Mul(groups, g.ints(group, scalar=True)), queries)
    chunks = g.Div(g.Sub(g.Add(queries, rows), g.ints(1, scalar=True)), rows)
    return chunks, g.Div(g.Sub(g.Add(queries, chunks), g.ints(1, scalar=True)), chunks)


def relative_attention_graph(g: _Nodes, query, key, value, table, key_is_valid, causal: bool, key_is_source,
                             query_offset, scaling: float):
    """NEZHA attention in ONNX nodes written by `g` (the exporter's): query `[batch, heads, queries, d]`, key and
    value `[batch, heads, keys, d]`, the `(2K + 1) x d` table, the mask's parts as `attention_ops.RelativeAttentionMask`
    holds them (`key_is_valid` / `key_is_source` `[batch, keys]` bool or None, `query_offset` an int64 scalar).
    Returns the output `[batch, queries, heads, d]`."""
    K = max_relative_position(table)
    axis = {n: g.ints(n) for n in range(4)}
    shape = g.Shape(query)
    # Sizes read by `Shape`'s own slicing: onnxruntime merges a Shape + Slice into that, and cannot rename a value the
    # branches and the scan read (it says so on every session's start).
    batch_heads = g.Shape(query, start=0, end=2)
    queries = g.Squeeze(g.Shape(query, start=2, end=3), axis[0])
    keys = g.Squeeze(g.Shape(key, start=2, end=3), axis[0])
    first_position = g.Cast(query_offset, to=ir.DataType.INT64)

    def row(index):  # the table's row `index`, `[d]`
        return g.Squeeze(g.Slice(table, g.ints(index), g.ints(index + 1), axis[0]), axis[0])

    left_row, right_row = row(0), row(2 * K)
    band_rows = g.Slice(table, g.ints(1), g.ints(2 * K), axis[0])
    scaled = g.Mul(query, g.number(scaling, query))
    query_table = g.MatMul(scaled, g.Transpose(table, perm=[1, 0]))  # [batch, heads, queries, 2K + 1]
    if key_is_valid is not None:  # the padding mask as one more dimension: [q, 1] . [k, mask]
        mask = g.Unsqueeze(g.Where(key_is_valid, g.number(0.0, query), g.number(MASKED, query)), g.ints(1, 3))
        key = g.Concat(key, g.Expand(mask, g.Concat(batch_heads, g.Shape(mask, start=2), axis=0)), axis=-1)
        scaled = g.Pad(scaled, g.ints(0, 0, 0, 0, 0, 0, 0, 1), g.number(1.0, query))
        left_key, right_key = (g.Pad(row, g.ints(0, 1)) for row in (left_row, right_row))
    else:
        left_key, right_key = left_row, right_row
    # The shifts of keys and values before a chunk's split (0: by T[0]) and from it on (1: by T[2K]).
    unshifted, shifts = {"key": key, "value": value}, {"key": (left_key, right_key), "value": (left_row, right_row)}

    def attend(b, chunk_query, chunk_table, start, rows, stacked=None):
        """The chunk of `rows` (at most 2K) queries from `start` (its rows of `scaled` and `query_table`), in nodes
        written by `b`: its output `[batch, rows, heads, d]`. `stacked[kind]` holds the keys or values twice along the
        keys' axis, shifted by `T[0]` and by `T[2K]` once for every chunk, and the chunk gathers its own from them;
        without it, the chunk shifts its own."""
        bz, bone = b.ints(0, scalar=True), b.ints(1, scalar=True)
        first = b.Add(first_position, start)  # position of the chunk's first query
        # Every row of the chunk is within K of the split: a key at distance -K or less is before it, K or more from it.
        split = b.Max(b.Min(b.Add(first, b.ints(K, scalar=True)), keys), bz)
        key_position = b.Range(bz, keys, bone)
        if stacked is not None:
            stacked_key = b.Add(key_position, b.Mul(b.Cast(b.GreaterOrEqual(key_position, split), to=ir.DataType.INT64),
                                                    keys))

        def in_order(kind):  # the chunk's keys or values, shifted as seen from the split, [batch, heads, keys, d]
            if stacked is not None:
                return b.Gather(stacked[kind], stacked_key, axis=2)
            ends = [b.Unsqueeze(x, b.ints(0)) for x in (bz, split, keys)]
            return b.Concat(*(b.Add(b.Slice(unshifted[kind], ends[side], ends[side + 1], b.ints(2)), shifts[kind][side])
                              for side in (0, 1)), axis=2)

        # The band: each row's keys at distances 1 - K .. K - 1, [rows, 2K - 1], and which of them lie before the split.
        query_position = b.Unsqueeze(b.Add(first, b.Range(bz, rows, bone)), b.ints(1))  # [rows, 1]
        band_key = b.Add(query_position, b.Range(b.ints(1 - K, scalar=True), b.ints(K, scalar=True), bone))
        in_keys = b.CastLike(b.And(b.GreaterOrEqual(band_key, bz), b.Less(band_key, keys)), chunk_query)
        before = b.Less(band_key, split)
        band_column = b.Expand(b.Clip(band_key, bz, b.Max(b.Sub(keys, bone), bz)),
                               b.Concat(batch_heads, b.Shape(band_key), axis=0))
        if stacked is not None:
            # Scores of every key in one product, the band's key term corrected in place (the product gave it T[0] or
            # T[2K]): a scatter of 2K - 1 numbers a row, where the whole row's index would outweigh the scores.
            scores = b.MatMul(chunk_query, b.Transpose(in_order("key"), perm=[0, 1, 3, 2]))
            # (Gathered, by indices computed from the chunk: the exporter folds constant ones into initializers, and
            # onnxruntime's transformer optimizer drops an initializer that only a scan's body reads.)
            table_row = lambda index: b.GatherElements(chunk_table, b.Expand(index, b.Shape(band_column)), axis=3)
            correction = b.Sub(table_row(b.Add(b.Sub(band_key, query_position), b.ints(K, scalar=True))),
                               table_row(b.Where(before, bz, b.ints(2 * K, scalar=True))))
            scores = b.ScatterElements(scores, band_column, b.Mul(correction, in_keys), axis=3, reduction="add")
        else:
            # One chunk: its key term gathered for every key (an index of the scores' size, which one chunk affords).
            distance = b.Sub(b.Unsqueeze(key_position, bz), query_position)  # [rows, keys]
            table_row = b.Add(b.Clip(distance, b.ints(-K, scalar=True), b.ints(K, scalar=True)), b.ints(K, scalar=True))
            scores = b.Add(b.MatMul(chunk_query, b.Transpose(unshifted["key"], perm=[0, 1, 3, 2])),
                           b.GatherElements(chunk_table, b.Expand(table_row, b.Concat(batch_heads, b.Shape(table_row),
                                                                                      axis=0)), axis=3))
        if causal:
            scores = b.Add(scores, _causal_mask(b, query_position, key_position, keys, key_is_source, scores))
        probabilities = b.Softmax(scores, axis=-1)
        # The band's value term likewise: its probabilities times the table's rows, less what the product gave them.
        band = b.Mul(b.GatherElements(probabilities, band_column, axis=3), in_keys)
        masses = [b.ReduceSum(b.Mul(band, b.CastLike(side, band)), b.ints(-1), keepdims=1)
                  for side in (before, b.Not(before))]
        output = b.Add(b.MatMul(probabilities, in_order("value")), b.MatMul(band, band_rows))
        output = b.Sub(output, b.Add(b.Mul(masses[0], left_row), b.Mul(masses[1], right_row)))
        return b.Transpose(output, perm=[0, 2, 1, 3])

    chunks, rows = chunk_rows(g, g.ReduceProd(batch_heads, keepdims=0), queries, keys, K)

    def in_chunks(b):
        """The scan over chunks of `rows` queries: the queries padded to whole chunks, the keys shifted once."""
        stacked = {kind: b.Concat(*(b.Add(tensor, shift) for shift in shifts[kind]), axis=2)
                   for kind, tensor in unshifted.items()}
        padded_rows = b.Sub(b.Mul(chunks, rows), queries)
        row_padding = b.Concat(b.ints(0, 0, 0, 0, 0, 0), b.Unsqueeze(padded_rows, b.ints(0)), b.ints(0), axis=0)
        padded_query, padded_table = b.Pad(scaled, row_padding), b.Pad(query_table, row_padding)
        start = ir.Value(name=f"nezha_chunk_{next(_names)}", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))

        def body(c):  # the chunk whose first row is `start` -> its output [batch, rows, heads, d]
            rows_of = lambda x: c.Slice(x, c.Unsqueeze(start, c.ints(0)), c.Unsqueeze(c.Add(start, rows), c.ints(0)),
                                        c.ints(2))
            return [attend(c, rows_of(padded_query), rows_of(padded_table), start, rows, stacked)]

        starts = b.Range(b.ints(0, scalar=True), b.Mul(chunks, rows), rows)
        outputs = b.Scan(starts, body=_subgraph(body, [start]), num_scan_inputs=1)  # [chunks, batch, rows, heads, d]
        output = b.Reshape(b.Transpose(outputs, perm=[1, 0, 2, 3, 4]),
                           b.Concat(b.Slice(shape, b.ints(0), b.ints(1)), b.ints(-1),
                                    b.Slice(shape, b.ints(1), b.ints(2)), b.Slice(shape, b.ints(3), b.ints(4)), axis=0))
        return [b.Slice(output, b.ints(0), b.Unsqueeze(queries, b.ints(0)), b.ints(1))]

    # One chunk (a short input, a decoding step): its body without the scan, its padding and the shifts of all keys.
    output = g.If(g.Equal(chunks, g.ints(1, scalar=True)),
                  then_branch=_subgraph(lambda b: [attend(b, scaled, query_table, b.ints(0, scalar=True), queries)]),
                  else_branch=_subgraph(in_chunks))
    seen = _sees_something(g, key_is_valid, causal, key_is_source, first_position, queries, keys)
    return output if seen is None else g.Mul(output, g.CastLike(seen, output))


def _causal_mask(b: _Nodes, query_position, key_position, keys, key_is_source, like):
    """The additive causal mask of a chunk, `[1 or batch, 1, rows, keys]` for the keys at `key_position`: a query sees
    the keys at or before it, and the source keys (`attention_ops.visible_keys`)."""
    allowed = b.LessOrEqual(key_position, query_position)  # [rows, keys]
    if key_is_source is not None:
        allowed = b.Or(allowed, b.Unsqueeze(b.Gather(key_is_source, key_position, axis=1), b.ints(1, 2)))
    return b.Where(allowed, b.number(0.0, like), b.number(MASKED, like))


def _sees_something(g: _Nodes, key_is_valid, causal, key_is_source, first_position, queries, keys):
    """`[batch, queries, 1, 1]` bool, False for a query that sees no key (`attention_ops.sees_nothing`), or None when
    every query sees one."""
    if key_is_valid is None:
        return None
    key_position = g.Range(g.ints(0, scalar=True), keys, g.ints(1, scalar=True))
    first_valid = g.ReduceMin(g.Where(key_is_valid, key_position, keys), g.ints(1), keepdims=1)  # [batch, 1]
    if causal:
        position = g.Add(first_position, g.Range(g.ints(0, scalar=True), queries, g.ints(1, scalar=True)))
        seen = g.LessOrEqual(first_valid, position)  # [batch, queries]
        if key_is_source is not None:
            valid_source = g.Cast(g.And(key_is_valid, key_is_source), to=ir.DataType.INT64)
            seen = g.Or(seen, g.Cast(g.ReduceMax(valid_source, g.ints(1), keepdims=1), to=ir.DataType.BOOL))
    else:
        seen = g.Less(first_valid, keys)
    return g.Unsqueeze(seen, g.ints(2, 3))


# Typed as the exporters read a translation's signature (in this module's names): tensors are inputs, numbers and
# flags attributes.
def exported_attention(query: TFloat, key: TFloat, value: TFloat, table: TFloat, key_is_valid: Optional[BOOL] = None,
                       causal: bool = False, key_is_source: Optional[BOOL] = None, query_offset: INT64 = None,
                       scaling: float = 1.0, dropout: float = 0.0, seed: Optional[INT64] = None):
    """The exporters' translation of every engine's forward op (`attention_ops.engine_op`): `relative_attention_graph`,
    as `[output]` (the op's other outputs serve its backward, which an exported graph lacks)."""
    if dropout:
        raise ValueError("NEZHA attention is exported for inference: put the model in eval mode (model.eval()) before "
                         "exporting it (attention dropout is on).")
    nodes = _Nodes(lambda op_type, inputs, attributes: getattr(opset18, op_type)(*inputs, **attributes))
    return [relative_attention_graph(nodes, query, key, value, table, key_is_valid, causal, key_is_source,
                                     query_offset, scaling)]


def register_onnx_attention() -> None:
    """Make the ONNX exporters built on `torch.onnx.export(..., dynamo=True)` (PyTorch's, transformers'
    `OnnxExporter` and `export_for_generation`) write every NEZHA engine's op as `relative_attention_graph` rather
    than its `L x L` decomposition. `nezha_hf.export` calls it; call it before exporting a NEZHA model with
    transformers' exporters yourself. Registers in onnxscript's table of PyTorch-op translations, which every
    export reads (once per process; needs `pip install "nezha_hf[onnx]"`)."""
    import torch
    from onnxscript.function_libs.torch_lib.registration import default_registry, torch_op

    from .attention_ops import Engine

    for engine in Engine:
        name = f"nezha_hf::{engine.op_name}_forward"
        if hasattr(torch.ops.nezha_hf, f"{engine.op_name}_forward") and name not in default_registry:
            torch_op(name, trace_only=True)(exported_attention)
