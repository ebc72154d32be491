"""NEZHA attention as an ONNX graph that onnxruntime runs well: queries in chunks (an ONNX `Scan`), linear memory.

ONNX has no NEZHA attention, and the decomposition every engine's op has (`attention_ops.gather_attention`) holds
`L x L` scores per head, an `int64` index of the scores' size and a scatter for the value term: in onnxruntime that
was slower than BERT from 512 tokens on and did not fit a long judgment in memory. The exporters take this graph
instead (`register_onnx_attention`), for every engine's op. For the call's query chunk of `C` rows at positions
`[p, p + C)` the keys fall in three ranges, as in the chunked engine:

- the far left `j < p - K + 1`, where every row of the chunk reads the table's row 0: there the relative terms are
  a shift of the keys and values, `q . (k_j + T[0])` and `v_j + T[0]` (`k + T[0]` and `v + T[0]` are made once per
  call), so they ride in the matrix products;
- the far right `j >= p + C - 1 + K` (row `2K`), the same with `T[2K]`;
- the middle, `C + 2K - 2` keys at most: there the key term is gathered from `q T^T` (`C x (2K + 1)` numbers per
  row, `GatherElements` with an index of the middle's size), and the value term is the band's probabilities
  gathered along its diagonals and the two near tails' masses, times the table.

Each chunk's scores are one `Softmax` over whole rows, and the padding mask rides in the matrix products as one
more column (a column of ones on the queries, the additive mask on the keys): the score passes are BERT's (product,
softmax, product) plus one `Concat` of the three ranges' products; the score scale is folded into the queries. A
causal mask (a decoder, UniLM's prefix mask) is added to each chunk's scores. The scan carries nothing between
chunks but their outputs; a chunk's rows are chosen so that a call's scores stay within `CHUNK_SCORES` numbers
(`chunk_rows`, computed in the graph from the call's sizes): memory grows linearly with the length. When one chunk
holds every query (a short input, a decoding step), an `If` runs the chunk's body without the scan.

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


def chunk_rows(g: _Nodes, batch_heads, queries, keys):
    """Rows per chunk, in the graph: the most that keep a chunk's `batch * heads * rows * keys` scores within
    `CHUNK_SCORES`, between `MIN_CHUNK_ROWS` and `MAX_CHUNK_ROWS` in whole groups of `MIN_CHUNK_ROWS`, at most the
    queries; then spread evenly over the chunks that takes (so the last chunk is not mostly padding).
    Returns `(chunks, rows)`, int64 scalars."""
    fit = g.Div(g.ints(CHUNK_SCORES, scalar=True), g.Mul(batch_heads, keys))
    groups = g.Max(g.Div(g.Min(fit, g.ints(MAX_CHUNK_ROWS, scalar=True)), g.ints(MIN_CHUNK_ROWS, scalar=True)),
                   g.ints(1, scalar=True))
    rows = g.Min(g.Mul(groups, g.ints(MIN_CHUNK_ROWS, scalar=True)), queries)
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
    # Keys and values of the far left (0), the middle (1) and the far right (2), the far ones shifted by their row.
    unshifted, shifts = {"key": key, "value": value}, {"key": (left_key, right_key), "value": (left_row, right_row)}

    def shifted(b, tensor, kind, side):
        return tensor if side == 1 else b.Add(tensor, shifts[kind][side // 2])

    def attend(b, chunk_query, chunk_table, start, rows, whole_sides=None):
        """The chunk of `rows` queries from `start` (its rows of `scaled` and `query_table`), in nodes written by `b`:
        its output `[batch, rows, heads, d]`. `whole_sides[kind][side]` are the keys and values shifted once for
        every chunk; without them, the chunk shifts its own far keys."""
        bz, bone = b.ints(0, scalar=True), b.ints(1, scalar=True)
        bax = {n: b.ints(n) for n in (0, 1, 2, 3)}
        first = b.Add(first_position, start)  # position of the chunk's first query
        left_end = b.Max(b.Min(b.Add(first, b.ints(1 - K, scalar=True)), keys), bz)
        right_start = b.Max(b.Min(b.Add(first, b.Add(rows, b.ints(K - 1, scalar=True))), keys), left_end)
        bounds = [b.Unsqueeze(x, bax[0]) for x in (bz, left_end, right_start, keys)]

        def keys_in(kind, side):
            if whole_sides is not None:
                return b.Slice(whole_sides[kind][side], bounds[side], bounds[side + 1], bax[2])
            return shifted(b, b.Slice(unshifted[kind], bounds[side], bounds[side + 1], bax[2]), kind, side)

        # Middle entries: distance j - i and its table row, [rows, middle].
        width = b.Sub(right_start, left_end)
        query_position = b.Unsqueeze(b.Add(first, b.Range(bz, rows, bone)), bax[1])  # [rows, 1]
        distance = b.Sub(b.Add(left_end, b.Range(bz, width, bone)), query_position)
        every_head = lambda index: b.Expand(index, b.Concat(batch_heads, b.Shape(index), axis=0))
        table_row = b.Add(b.Clip(distance, b.ints(-K, scalar=True), b.ints(K, scalar=True)), b.ints(K, scalar=True))
        # Scores in the order middle, far left, far right (a softmax does not mind the order; the values follow it).
        far_keys = b.Concat(keys_in("key", 0), keys_in("key", 2), axis=2)
        middle_scores = b.MatMul(chunk_query, b.Transpose(keys_in("key", 1), perm=[0, 1, 3, 2]))
        middle_scores = b.Add(middle_scores, b.GatherElements(chunk_table, every_head(table_row), axis=3))
        scores = b.Concat(middle_scores, b.MatMul(chunk_query, b.Transpose(far_keys, perm=[0, 1, 3, 2])), axis=3)
        if causal:
            key_position = b.Concat(*(b.Range(*ends, bone) for ends in ((left_end, right_start), (bz, left_end),
                                                                         (right_start, keys))), axis=0)
            scores = b.Add(scores, _causal_mask(b, query_position, key_position, keys, key_is_source, scores))
        probabilities = b.Softmax(scores, axis=-1)
        values = b.Concat(*(keys_in("value", side) for side in (1, 0, 2)), axis=2)
        output = b.MatMul(probabilities, values)
        # The middle's value term: the band's 2K - 1 diagonals and the near tails' masses.
        middle = b.Slice(probabilities, b.ints(0), b.Unsqueeze(width, bax[0]), bax[3])
        band_key = b.Add(query_position, b.Range(b.ints(1 - K, scalar=True), b.ints(K, scalar=True), bone))
        in_middle = b.And(b.GreaterOrEqual(band_key, left_end), b.Less(band_key, right_start))
        band_column = b.Clip(b.Sub(band_key, left_end), bz, b.Max(b.Sub(width, bone), bz))
        band = b.Mul(b.GatherElements(middle, every_head(band_column), axis=3), b.CastLike(in_middle, middle))
        near = [b.ReduceSum(b.Mul(middle, b.CastLike(tail, middle)), b.ints(-1), keepdims=1)
                for tail in (b.LessOrEqual(distance, b.ints(-K, scalar=True)),
                             b.GreaterOrEqual(distance, b.ints(K, scalar=True)))]
        output = b.Add(b.Add(output, b.MatMul(band, band_rows)),
                       b.Add(b.Mul(near[0], left_row), b.Mul(near[1], right_row)))
        return b.Transpose(output, perm=[0, 2, 1, 3])

    chunks, rows = chunk_rows(g, g.ReduceProd(batch_heads, keepdims=0), queries, keys)

    def in_chunks(b):
        """The scan over chunks of `rows` queries: the queries padded to whole chunks, the far keys shifted once."""
        whole_sides = {kind: [shifted(b, tensor, kind, side) for side in range(3)] for kind, tensor in unshifted.items()}
        padded_rows = b.Sub(b.Mul(chunks, rows), queries)
        row_padding = b.Concat(b.ints(0, 0, 0, 0, 0, 0), b.Unsqueeze(padded_rows, b.ints(0)), b.ints(0), axis=0)
        padded_query, padded_table = b.Pad(scaled, row_padding), b.Pad(query_table, row_padding)
        start = ir.Value(name=f"nezha_chunk_{next(_names)}", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))

        def body(c):  # the chunk whose first row is `start` -> its output [batch, rows, heads, d]
            rows_of = lambda x: c.Slice(x, c.Unsqueeze(start, c.ints(0)), c.Unsqueeze(c.Add(start, rows), c.ints(0)),
                                        c.ints(2))
            return [attend(c, rows_of(padded_query), rows_of(padded_table), start, rows, whole_sides)]

        starts = b.Range(b.ints(0, scalar=True), b.Mul(chunks, rows), rows)
        stacked = b.Scan(starts, body=_subgraph(body, [start]), num_scan_inputs=1)  # [chunks, batch, rows, heads, d]
        output = b.Reshape(b.Transpose(stacked, perm=[1, 0, 2, 3, 4]),
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
