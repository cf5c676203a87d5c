"""The size of llama.cpp's compute buffer, by replaying what llama.cpp does when it creates a context.

llama.cpp sizes a context's compute buffer once, when the context is created
(``llama_context::sched_reserve`` in src/llama-context.cpp): it builds the graph of its worst-case
micro-batch, ``n_tokens = min(n_ctx, n_ubatch)`` tokens, every one an output, attending over the whole
KV cache, and lets ggml's graph allocator (ggml/src/ggml-alloc.c, ``ggml_gallocr_reserve_n``) lay the
graph's tensors out in one buffer, reusing the memory of a tensor once its last consumer has run. The
buffer is the highest offset that layout reaches. A smaller graph reserved afterwards (the token
generation graph, n_seq_max tokens) only keeps it.

So this module does the same: :func:`llama_graph` builds the node list of llama.cpp's graph for a
llama-like decoder (``llm_build_llama``/``llm_build_qwen2`` and ``llm_graph_context::build_attn`` in
src/llama-graph.cpp: the inputs, per layer the attention and the SwiGLU feed-forward, the output
head), with the shapes the model's metadata gives, and :func:`peak_bytes` replays
``ggml_gallocr_alloc_graph_impl`` over it: inputs first, every node after its sources, a node written
in place over a source of the same layout that has no other consumer, a tensor freed when its last
consumer has run, a best-fit free list whose last block grows the buffer. Nothing is fitted: on tiny
models of five shapes and the default pair the replay reproduces the size llama.cpp logs ("CPU
compute buffer size") to the 0.01 MiB it prints, across flash attention on and off, f16/f32/q8_0
caches, contexts of 256 to 40,192 cells, micro-batches of 16 to 512 tokens and 4 to 64 sequences
(tests/test_memory.py; ``python benchmarks/memory_estimate.py --sweep``: 888 configurations).
Architectures with operations of their own (extra norms, MoE experts, sliding windows) are sized as
their llama-like core, which leaves out those operations' few activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALIGNMENT = 32  # the CPU buffer type's alignment (ggml-backend.cpp TENSOR_ALIGNMENT)
TYPE_BYTES = {"f32": 4, "f16": 2, "i32": 4, "i64": 8}
# ggml-alloc.c ggml_op_can_inplace, those of this graph: the ops that may overwrite a source of the same layout
IN_PLACE = frozenset({"ADD", "MUL", "SCALE", "ROPE", "RMS_NORM", "SOFT_MAX", "UNARY"})
VIEW = "VIEW"


@dataclass(frozen=True)
class GraphShape:
    """What a llama-like graph's tensors depend on, from a GGUF file's metadata."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_ff: tuple[int, ...]  # per layer
    n_vocab: int  # rows of the output matrix (the logits of one token)
    biases: frozenset[str] = frozenset()  # of "q", "k", "v", "o": the attention projections with a bias


class Tensor:
    """A tensor of the graph: its bytes, sources, the tensor it views (a view owns no memory) and
    its layout (two tensors of one layout may share memory in place)."""

    __slots__ = ("op", "size", "src", "view_of", "layout", "external", "input", "output")

    def __init__(self, op: str, size: int, src: Sequence[Tensor] = (), view_of: Tensor | None = None,
                 layout: tuple = (), external: bool = False, input: bool = False, output: bool = False) -> None:
        self.op, self.size, self.src, self.view_of, self.layout = op, size, tuple(src), view_of, layout
        self.external, self.input, self.output = external, input, output


class Graph:
    """A graph under construction: its leafs (inputs and weights) and nodes, in llama.cpp's order."""

    def __init__(self) -> None:
        self.leafs: list[Tensor] = []
        self.nodes: list[Tensor] = []
        self.weight = Tensor("NONE", 0, external=True)  # every weight and the KV cache: memory of their own

    def input(self, dtype: str, *ne: int) -> Tensor:
        t = Tensor("NONE", TYPE_BYTES[dtype] * math.prod(ne), layout=(dtype, ne), input=True)
        self.leafs.append(t)
        return t

    def op(self, op: str, dtype: str, ne: tuple[int, ...], *src: Tensor, output: bool = False) -> Tensor:
        t = Tensor(op, TYPE_BYTES[dtype] * math.prod(ne), src, layout=(dtype, ne), output=output)
        self.nodes.append(t)
        return t

    def view(self, src: Tensor, *extra: Tensor) -> Tensor:
        """A reshape, permute or view of `src` (or of the KV cache, `self.weight`): no memory."""
        root = src.view_of or src
        t = Tensor(VIEW, src.size, (src, *extra), view_of=root, layout=("view",), external=root.external)
        self.nodes.append(t)
        return t

    def cast(self, src: Tensor, dtype: str, ne: tuple[int, ...]) -> Tensor:
        """ggml_cast: a CPY node that is its own second source (ggml.c ggml_cpy_impl)."""
        t = self.op("CPY", dtype, ne, src)
        t.src = (src, t)
        return t


def rotation_block(head_dim: int) -> int:
    """The Walsh-Hadamard block a quantized K cache is rotated with (llama-kv-cache.cpp attn_rot_k:
    the largest power of two up to head_dim that divides it, 0 where 64 does not divide head_dim)."""
    if head_dim <= 0 or head_dim % 64:
        return 0
    block = 64
    while head_dim % (block * 2) == 0:
        block *= 2
    return block


def _rotate(g: Graph, x: Tensor, rot: Tensor | None, n: int) -> Tensor:
    """llama_mul_mat_hadamard: x reshaped to blocks, multiplied by the rotation, reshaped back."""
    if rot is None:
        return x
    return g.view(g.op("MUL_MAT", "f32", (n,), rot, g.view(x)))


def _projection(g: Graph, s: GraphShape, name: str, cur: Tensor, rows: int, t: int) -> Tensor:
    x = g.op("MUL_MAT", "f32", (rows, t), g.weight, cur)
    return g.op("ADD", "f32", (rows, t), x, g.weight) if name in s.biases else x


def _attention(g: Graph, s: GraphShape, il: int, cur: Tensor, inputs: dict, t: int, n_kv: int, fa: bool,
               cache_f32: bool) -> Tensor:
    """build_attn with a unified KV cache: Q, K and V, the cache writes, attention, the output
    projection (the order of llm_build_llama's nodes)."""
    hkv, dk, dv, h = s.n_head_kv[il], s.head_dim_k, s.head_dim_v, s.n_head
    q = g.op("ROPE", "f32", (dk, h, t), g.view(_projection(g, s, "q", cur, dk * h, t)), inputs["pos"])
    q = _rotate(g, q, inputs.get("k_rot"), dk * h * t)
    v = g.view(_projection(g, s, "v", cur, dv * hkv, t))
    v = _rotate(g, v, inputs.get("v_rot"), dv * hkv * t)
    k = g.op("ROPE", "f32", (dk, hkv, t), g.view(_projection(g, s, "k", cur, dk * hkv, t)), inputs["pos"])
    k = _rotate(g, k, inputs.get("k_rot"), dk * hkv * t)
    g.view(g.weight, g.view(k), inputs["k_idxs"])  # set_rows into the K cache
    if fa:
        g.view(g.weight, g.view(v), inputs["v_idxs"])
    else:  # the V cache is transposed: one row index per value
        g.view(g.weight, g.view(g.view(v)), inputs["v_idxs"], g.view(g.weight))
    if fa:
        q_view = g.view(g.view(q))
        k_view, v_view = g.view(g.view(g.weight)), g.view(g.view(g.weight))
        if cache_f32:  # the CPU's flash attention reads an F16 cache: llama-graph.cpp casts an F32 one
            k_view = g.cast(k_view, "f16", (dk, n_kv, hkv))
            v_view = g.cast(v_view, "f16", (dv, n_kv, hkv))
        out = g.op("FLASH_ATTN_EXT", "f32", (dv, h, t), q_view, k_view, v_view, inputs["mask"])
        out = g.view(out)
    else:
        v_view = g.view(g.view(g.weight))
        k_view = g.view(g.view(g.weight))
        q_view = g.view(g.view(q))
        kq = g.op("MUL_MAT", "f32", (n_kv, t, h), k_view, q_view)
        kq = g.op("SOFT_MAX", "f32", (n_kv, t, h), kq, inputs["mask"])
        out = g.op("CONT", "f32", (dv * h, t), g.view(g.op("MUL_MAT", "f32", (dv, t, h), v_view, kq)))
    out = _rotate(g, g.view(out), inputs.get("v_rot"), dv * h * t)
    return _projection(g, s, "o", out, s.n_embd, t)


def _layer(g: Graph, s: GraphShape, il: int, inp: Tensor, inputs: dict, t: int, n_out: int, n_kv: int,
           fa: bool, cache_f32: bool) -> Tensor:
    """One decoder layer: attention, residual, SwiGLU feed-forward, residual; the last layer keeps only
    the output rows (ggml_get_rows over out_ids) before its feed-forward."""
    e = s.n_embd
    cur = g.op("MUL", "f32", (e, t), g.op("RMS_NORM", "f32", (e, t), inp), g.weight)
    cur = _attention(g, s, il, cur, inputs, t, n_kv, fa, cache_f32)
    if il == s.n_layer - 1:
        t = n_out
        cur = g.op("GET_ROWS", "f32", (e, t), cur, inputs["out_ids"])
        inp = g.op("GET_ROWS", "f32", (e, t), inp, inputs["out_ids"])
    ffn_inp = g.op("ADD", "f32", (e, t), cur, inp)
    cur = g.op("MUL", "f32", (e, t), g.op("RMS_NORM", "f32", (e, t), ffn_inp), g.weight)
    f = s.n_ff[il]
    gate = g.op("MUL_MAT", "f32", (f, t), g.weight, cur)
    up = g.op("MUL_MAT", "f32", (f, t), g.weight, cur)
    cur = g.op("MUL_MAT", "f32", (e, t), g.weight, g.op("SWIGLU", "f32", (f, t), gate, up))
    return g.op("ADD", "f32", (e, t), cur, ffn_inp)


def llama_graph(s: GraphShape, n_tokens: int, n_outputs: int, n_kv: int, flash_attn: bool, cache_type: str) -> Graph:
    """llama.cpp's graph of one micro-batch of n_tokens tokens (n_outputs of them outputs) over a KV
    cache of n_kv cells, for a llama-like model."""
    g, t = Graph(), n_tokens
    inputs = {"tokens": g.input("i32", t)}
    g.input("f32", s.n_embd, t)  # inp_embd: the embeddings input, in every graph since llama.cpp PR 18550
    inputs["pos"] = g.input("i32", t)
    quantized = cache_type not in ("f16", "f32")
    if quantized and rotation_block(s.head_dim_k):
        block = rotation_block(s.head_dim_k)
        inputs["k_rot"] = g.input("f32", block, block)
    if quantized and rotation_block(s.head_dim_v):
        inputs["v_rot"] = g.input("f32", 64, 64)
    inputs["k_idxs"] = g.input("i64", t)
    inputs["v_idxs"] = g.input("i64", t if flash_attn else t * max(s.n_head_kv) * s.head_dim_v)
    inputs["mask"] = g.input("f16" if flash_attn else "f32", n_kv, t)
    inputs["out_ids"] = g.input("i32", n_outputs)
    cur = g.op("GET_ROWS", "f32", (s.n_embd, t), g.weight, inputs["tokens"])
    for il in range(s.n_layer):
        cur = _layer(g, s, il, cur, inputs, t, n_outputs, n_kv, flash_attn, cache_type == "f32")
    cur = g.op("MUL", "f32", (s.n_embd, n_outputs), g.op("RMS_NORM", "f32", (s.n_embd, n_outputs), cur), g.weight,
               output=True)
    g.op("MUL_MAT", "f32", (s.n_vocab, n_outputs), g.weight, cur, output=True)
    return g


class FreeList:
    """ggml-alloc.c's ggml_dyn_tallocr for one chunk: free blocks sorted by offset, the last one
    endless; best fit among the others, else the end; `peak` is the buffer the layout needs."""

    def __init__(self) -> None:
        self.blocks: list[list[int]] = [[0, 1 << 62]]
        self.peak = 0

    def alloc(self, size: int) -> int:
        size = -(-size // ALIGNMENT) * ALIGNMENT
        fits = [i for i, (_, free) in enumerate(self.blocks[:-1]) if free >= size]
        best = min(fits, key=lambda i: self.blocks[i][1], default=len(self.blocks) - 1)
        if len(fits) > 1:  # ties go to the last block of the smallest size, as the C loop's <=
            smallest = self.blocks[best][1]
            best = max(i for i in fits if self.blocks[i][1] == smallest)
        block = self.blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.blocks[best]
        self.peak = max(self.peak, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        size = -(-size // ALIGNMENT) * ALIGNMENT
        blocks = self.blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:  # after this block: grow it, and join the next one
                block[1] += size
                if i + 1 < len(blocks) and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks.pop(i + 1)[1]
                return
            if offset + size == block[0]:  # before this block: grow it backwards, join the previous
                block[0], block[1] = offset, block[1] + size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += blocks.pop(i)[1]
                return
        at = next((i for i, block in enumerate(blocks) if block[0] > offset), len(blocks))
        blocks.insert(at, [offset, size])


def peak_bytes(g: Graph) -> int:
    """The buffer ggml's graph allocator needs for `g` (ggml_gallocr_alloc_graph_impl, replayed)."""
    heap = FreeList()
    children: dict[int, int] = {}
    views: dict[int, int] = {}
    where: dict[int, int] = {}  # id of an owned, allocated tensor -> its offset

    def allocate(t: Tensor) -> None:
        if t.external or t.view_of is not None or id(t) in where or t.op == "NONE" and not t.input:
            return
        if t.op in IN_PLACE:
            for p in t.src:
                if (id(p) in where and not p.output and p.layout == t.layout
                        and children.get(id(p), 0) == 1 and views.get(id(p), 0) == 0):
                    where[id(t)] = where.pop(id(p))  # written over its source
                    return
        where[id(t)] = heap.alloc(t.size)

    def release(t: Tensor) -> None:
        if not t.output and id(t) in where:
            heap.free(where.pop(id(t)), t.size)

    for leaf in g.leafs:
        allocate(leaf)
    for node in g.nodes:
        if node.view_of is not None:
            views[id(node.view_of)] = views.get(id(node.view_of), 0) + 1
        for p in node.src:
            children[id(p)] = children.get(id(p), 0) + 1
    for node in g.nodes:
        for p in node.src:  # a source freed already is allocated again (a cast, its own source, is)
            allocate(p)
        allocate(node)
        for p in node.src:
            children[id(p)] -= 1
            if children[id(p)] or views.get(id(p), 0):
                continue
            if p.view_of is not None:
                views[id(p.view_of)] -= 1
                if not views[id(p.view_of)] and not children.get(id(p.view_of), 0):
                    release(p.view_of)
            else:
                release(p)
    return heap.peak


def compute_bytes(s: GraphShape, n_ctx: int, n_ubatch: int, n_seq_max: int, flash_attn: bool,
                  cache_type: str) -> int:
    """The CPU compute buffer of a context of n_ctx cells (already padded), n_ubatch tokens a
    micro-batch and n_seq_max sequences: the larger of the prompt and the generation graphs'
    (llama_context::sched_reserve reserves both; the buffer only grows)."""
    n_outputs = min(n_ctx, n_ubatch)
    n_tokens = -(-n_outputs // n_seq_max) * n_seq_max  # graph_reserve: whole tokens per sequence (outputs kept)
    prompt = llama_graph(s, n_tokens, n_outputs, n_ctx, flash_attn, cache_type)
    generation = llama_graph(s, n_seq_max, n_seq_max, n_ctx, flash_attn, cache_type)
    return max(peak_bytes(prompt), peak_bytes(generation))
