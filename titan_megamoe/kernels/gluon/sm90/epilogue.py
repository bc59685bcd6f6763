"""Epilogues: what a consumer warpgroup does with its rows of a finished tile.

The grouped GEMM's epilogues (``EPILOGUES``) take the same arguments, so the kernel calls
whichever it is given: ``(acc, acc2, out, dest, live, n0)``. ``acc`` (and ``acc2``, the
second B's product, or ``acc`` again without one) are the warpgroup's fp32 ``[64,
BLOCK_N]`` accumulators in the MMA layout; ``out`` the output; ``dest`` where each of the
warpgroup's rows starts in ``out`` (int64 element offsets, in the layout ``store_layout``
gives: ``row_starts``); rows not ``live`` belong to another expert or to no one and are not
stored; ``n0`` the tile's first column.

GEMM1's (``gate_up_rows``, ``gate_up_pair_rows``) and the backward's first GEMM's
(``swiglu_backward_rows``) read more than their accumulators and write several outputs:
each takes a record of them (``GateUpOutputs``, ``SwigluGradOutputs``). Those whose
accumulators come from two warpgroups, or whose temporaries would not fit beside them,
form their rows in column parts through shared memory, with one part's temporaries live.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

from titan_megamoe.kernels.quantize import e4m3_scale


@gluon.constexpr_function
def store_layout(block_n, warps):
    """Registers -> global memory: 16 bytes of bf16 per thread, a warp along 8 x 16 bytes of
    a row (every store is a whole 128-byte line), the warps over rows."""
    cols = min(8, block_n // 8)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [warps, 1], [1, 0])


@gluon.jit
def row_origins(rows, live, row_origin, COMBINE: gl.constexpr):
    """Where each row came from (``COMBINE``: ``row_origin[r]``, the slot ``token * k + j`` of
    rank ``origin // rows_per_rank`` the dispatch recorded), else the row itself: loaded
    before a tile's mainloop, whose MMAs hide the load."""
    if COMBINE:
        return gl.load(row_origin + rows, mask=live, other=0)
    else:
        return rows


@gluon.jit
def row_starts(origin, live, out, out_ptrs, rank, rows_per_rank, N: gl.constexpr, COMBINE: gl.constexpr):
    """Where each row's output starts, as an element offset from ``out``: row ``origin`` of
    ``out [rows, N]``; or, ``COMBINE``, row ``origin % rows_per_rank`` of rank ``origin //
    rows_per_rank``'s copy of the symmetric buffer ``out`` (``out_ptrs``: every rank's
    address of it), so each row goes straight back to the rank it came from."""
    if COMBINE:
        elem: gl.constexpr = out.dtype.element_ty.primitive_bitwidth // 8
        offset = gl.load(out_ptrs + origin // rows_per_rank, mask=live, other=0) - gl.load(out_ptrs + rank)
        # Symmetric buffers are 16-byte aligned: the hint keeps the row stores 16 bytes wide.
        offset = gl.multiple_of(offset // elem, 16 // elem)
        return offset + (origin % rows_per_rank).to(gl.int64) * N
    else:
        return origin.to(gl.int64) * N


@gluon.jit
def _store(vals, out, dest, live, n0):
    layout: gl.constexpr = dest.type.layout.parent
    BLOCK_N: gl.constexpr = vals.shape[1]
    vals = gl.convert_layout(vals, layout)
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    gl.store(out + dest[:, None] + cols[None, :], vals, mask=live[:, None])


@gluon.jit
def store_rows(acc, acc2, out, dest, live, n0):
    """``out[dest:, n0:] = acc`` in ``out``'s dtype."""
    _store(acc.to(out.dtype.element_ty), out, dest, live, n0)


@gluon.jit
def swiglu_rows(acc, acc2, out, dest, live, n0):
    """``out[dest:, n0:] = silu(acc) * acc2`` (GEMM1: ``acc`` the gate, ``acc2`` the up
    projection), formed in fp32 as the operator's reference forms it."""
    _store((acc * (1.0 / (1.0 + gl.exp(-acc))) * acc2).to(out.dtype.element_ty), out, dest, live, n0)


EPILOGUES = {"store": store_rows, "swiglu": swiglu_rows}
"""Epilogues by name (``grouped_gemm(epilogue=...)``)."""


# Triton 3.6 names the partition-wide barrier thread_barrier; later releases name it barrier.
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@aggregate
class SwigluGradOutputs:
    """What the backward's first GEMM reads beside ``d = dy W2`` and what it stores, by row
    of the receive layout: GEMM1's saved pre-activations ``preact [rows, 2I]`` (gate | up)
    and the rows' ``score``; ``dab = [da | db]`` ``[rows, 2I]``; ``h_wgrad [rows, I]``
    (``score * h``, or ``h``) for ``dW2``; ``score_parts [rows, I / BLOCK_N]``, each tile's
    ``<h, d>`` over its columns. With ``scale_k`` (128) the epilogue also takes the e4m3
    copy of ``dab`` for the dgrad GEMM (``swiglu_backward_rows``'s ``dab_q``)."""

    preact: gl.tensor
    score: gl.tensor
    dab: gl.tensor
    h_wgrad: gl.tensor
    score_parts: gl.tensor
    inter: gl.constexpr
    score_before_experts: gl.constexpr
    """The score scaled the expert input: ``dh = d`` and ``h_wgrad = h``."""
    scale_k: gl.constexpr
    """Columns per scale of ``dab_q`` (the tile's width), or 0: no e4m3 copy."""
    power_of_two: gl.constexpr
    row_align: gl.constexpr
    """Each expert's rows start on a multiple of it; its padding rows up to the next are
    stored as zeros."""

    @gluon.constexpr_function
    def __init__(self, preact, score, dab, h_wgrad, score_parts, inter, score_before_experts, scale_k, power_of_two,
                 row_align):
        self.preact = preact
        self.score = score
        self.dab = dab
        self.h_wgrad = h_wgrad
        self.score_parts = score_parts
        self.inter = gl.constexpr(inter)
        self.score_before_experts = gl.constexpr(score_before_experts)
        self.scale_k = gl.constexpr(scale_k)
        self.power_of_two = gl.constexpr(power_of_two)
        self.row_align = gl.constexpr(row_align)


SWIGLU_GRAD_PARTS = gl.constexpr(4)
"""Column parts of the backward's first GEMM's epilogue, formed one after the other."""
GATE_UP_PARTS = gl.constexpr(4)
"""Column parts of GEMM1's epilogue, formed one after the other."""


@gluon.jit
def _preact_part(rows, live, c0, outs, layout: gl.constexpr, PART_N: gl.constexpr):
    """The saved ``g`` and ``u`` of ``rows`` over intermediate columns ``c0 .. c0 + PART_N``,
    as stored (bf16). A load cannot be moved above an earlier store to memory that may be
    the same, so the caller issues it where its latency should start."""
    cols = c0 + gl.arange(0, PART_N, layout=gl.SliceLayout(0, layout))
    at = rows.to(gl.int64)[:, None] * (2 * outs.inter) + cols[None, :]
    g = gl.load(outs.preact + at, mask=live[:, None], other=0.0)
    u = gl.load(outs.preact + at + outs.inter, mask=live[:, None], other=0.0)
    return g, u


@gluon.jit
def _swiglu_backward_part(staging, j: gl.constexpr, g, u, rows, live, owned, score, n0, outs, sums):
    """The SwiGLU backward of ``rows`` over part ``j`` of the tile's columns from ``n0``
    (``d`` from ``staging``; ``g``, ``u``: its saved pre-activations, ``_preact_part``):
    stores their ``[da | db]`` and ``h_wgrad`` (zeros in the ``owned`` rows past the ``live``
    ones) and returns each row's ``<h, d>`` and largest ``|da|``, ``|db|`` as stored, over
    the parts so far (``sums`` of the parts before, or None). Formed as
    ``backward_dispatch_gemm1._swiglu_backward`` forms them."""
    layout: gl.constexpr = g.type.layout
    PART_N: gl.constexpr = g.shape[1]
    inter: gl.constexpr = outs.inter
    d = staging.slice(j * PART_N, PART_N, dim=1).load(layout)
    cols = n0 + j * PART_N + gl.arange(0, PART_N, layout=gl.SliceLayout(0, layout))
    at = rows.to(gl.int64)[:, None] * (2 * inter) + cols[None, :]
    g = g.to(gl.float32)
    u = u.to(gl.float32)
    sig = 1.0 / (1.0 + gl.exp(-g))
    silu = g * sig
    h = silu * u
    part = gl.sum(h * d, axis=1)
    if outs.score_before_experts:
        dh = d
    else:
        dh = d * score[:, None]
        h = h * score[:, None]
    keep = live[:, None]
    stored = outs.dab.dtype.element_ty
    da = gl.where(keep, dh * u * sig * (1.0 + g * (1.0 - sig)), 0.0).to(stored)
    db = gl.where(keep, dh * silu, 0.0).to(stored)
    gl.store(outs.dab + at, da, mask=owned[:, None])
    gl.store(outs.dab + at + inter, db, mask=owned[:, None])
    at_h = rows.to(gl.int64)[:, None] * inter + cols[None, :]
    gl.store(outs.h_wgrad + at_h, gl.where(keep, h, 0.0).to(stored), mask=owned[:, None])
    amax_a = gl.max(gl.abs(da.to(gl.float32)), axis=1)
    amax_b = gl.max(gl.abs(db.to(gl.float32)), axis=1)
    if sums is not None:
        part = part + sums[0]
        amax_a = gl.maximum(amax_a, sums[1])
        amax_b = gl.maximum(amax_b, sums[2])
    return part, amax_a, amax_b


@gluon.jit
def _quantize_scale_block(dab, dab_q, at, owned, multiplier, PART_N: gl.constexpr):
    """``dab_q[at + c] = dab[at + c] * multiplier`` in e4m3, per row, over one scale block
    (the ``SWIGLU_GRAD_PARTS`` parts of ``PART_N`` columns from ``at``) of the values this
    thread stored into ``dab``: read back (holding every part's ``[da | db]`` until the last
    one is formed would spill), every part's load issued before the first store."""
    gl.static_assert(SWIGLU_GRAD_PARTS == 4, "the scale block reads back in four named parts")
    v0 = gl.load(dab + at, mask=owned[:, None], other=0.0)
    v1 = gl.load(dab + at + PART_N, mask=owned[:, None], other=0.0)
    v2 = gl.load(dab + at + 2 * PART_N, mask=owned[:, None], other=0.0)
    v3 = gl.load(dab + at + 3 * PART_N, mask=owned[:, None], other=0.0)
    gl.store(dab_q + at, (v0.to(gl.float32) * multiplier[:, None]).to(gl.float8e4nv), mask=owned[:, None])
    gl.store(dab_q + at + PART_N, (v1.to(gl.float32) * multiplier[:, None]).to(gl.float8e4nv), mask=owned[:, None])
    gl.store(dab_q + at + 2 * PART_N, (v2.to(gl.float32) * multiplier[:, None]).to(gl.float8e4nv),
             mask=owned[:, None])
    gl.store(dab_q + at + 3 * PART_N, (v3.to(gl.float32) * multiplier[:, None]).to(gl.float8e4nv),
             mask=owned[:, None])


@gluon.jit
def swiglu_backward_rows(acc, staging, outs, dab_q, dab_scales, rows0, row_end, n0):
    """The backward's first GEMM's epilogue on one consumer warpgroup's 64 rows from
    ``rows0`` of a tile (``acc = dy W2`` over its ``BLOCK_N`` columns from ``n0``; rows from
    ``row_end`` on belong to the next expert or its padding): ``acc`` goes through
    ``staging`` (the warpgroup's ``[64, BLOCK_N]`` fp32 shared memory) so that each of
    ``SWIGLU_GRAD_PARTS`` column parts is formed with one part's temporaries live (its
    saved pre-activations loaded two parts ahead); with
    ``scale_k`` the tile is one scale block of ``da`` and one of ``db``, quantized once every
    part is stored into ``dab_q`` (e4m3) and ``dab_scales [rows, 2I / scale_k]``."""
    BLOCK_N: gl.constexpr = acc.shape[1]
    PART_N: gl.constexpr = BLOCK_N // SWIGLU_GRAD_PARTS
    layout: gl.constexpr = store_layout(PART_N, 4)
    inter: gl.constexpr = outs.inter
    rows = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    live = rows < row_end
    owned = rows < (row_end + outs.row_align - 1) // outs.row_align * outs.row_align
    if outs.score_before_experts:
        score = 0.0
    else:
        score = gl.load(outs.score + rows, mask=live, other=0.0)
    staging.store(acc)
    thread_barrier()
    # Each part's g and u are loaded two parts ahead (32 registers): loaded just before
    # it, each part waited for its loads alone, behind the last part's stores. The
    # compiler still moves the first use of g up to its load (docs/perf-history.md v51).
    gl.static_assert(SWIGLU_GRAD_PARTS == 4, "the pre-activations load in four named parts")
    g0, u0 = _preact_part(rows, live, n0, outs, layout=layout, PART_N=PART_N)
    g1, u1 = _preact_part(rows, live, n0 + PART_N, outs, layout=layout, PART_N=PART_N)
    sums = _swiglu_backward_part(staging, 0, g0, u0, rows, live, owned, score, n0, outs, None)
    g2, u2 = _preact_part(rows, live, n0 + 2 * PART_N, outs, layout=layout, PART_N=PART_N)
    sums = _swiglu_backward_part(staging, 1, g1, u1, rows, live, owned, score, n0, outs, sums)
    g3, u3 = _preact_part(rows, live, n0 + 3 * PART_N, outs, layout=layout, PART_N=PART_N)
    sums = _swiglu_backward_part(staging, 2, g2, u2, rows, live, owned, score, n0, outs, sums)
    part, amax_a, amax_b = _swiglu_backward_part(staging, 3, g3, u3, rows, live, owned, score, n0, outs, sums)
    gl.store(outs.score_parts + rows.to(gl.int64) * (inter // BLOCK_N) + n0 // BLOCK_N, part, mask=live)
    if outs.scale_k > 0:
        gl.static_assert(outs.scale_k == BLOCK_N, "a tile is one scale block of da and one of db")
        scale_a, multiplier_a = e4m3_scale(amax_a, outs.power_of_two)
        scale_b, multiplier_b = e4m3_scale(amax_b, outs.power_of_two)
        cols = n0 + gl.arange(0, PART_N, layout=gl.SliceLayout(0, layout))
        at = rows.to(gl.int64)[:, None] * (2 * inter) + cols[None, :]
        _quantize_scale_block(outs.dab, dab_q, at, owned, multiplier_a, PART_N=PART_N)
        _quantize_scale_block(outs.dab, dab_q, at + inter, owned, multiplier_b, PART_N=PART_N)
        at_s = dab_scales + rows.to(gl.int64) * (2 * inter // BLOCK_N) + n0 // BLOCK_N
        gl.store(at_s, scale_a, mask=owned)
        gl.store(at_s + inter // BLOCK_N, scale_b, mask=owned)
    # The next tile's accumulator overwrites the staging buffer.
    thread_barrier()


@aggregate
class GateUpOutputs:
    """What GEMM1 stores by row of the receive layout: ``h [rows, I]`` (``silu(g) * u``
    rounded to ``act_dtype``), with ``scale_k`` (128) in e4m3 (the epilogue also takes
    ``h_scales [rows, I / scale_k]``), and with ``save`` the pre-activations ``[g | u]`` of
    the rows below ``saved_rows`` (into the epilogue's ``preact [saved_rows, 2I]``)."""

    h: gl.tensor
    saved_rows: gl.tensor
    inter: gl.constexpr
    act_dtype: gl.constexpr
    scale_k: gl.constexpr
    power_of_two: gl.constexpr
    save: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, h, saved_rows, inter, act_dtype, scale_k, power_of_two, save):
        self.h = h
        self.saved_rows = saved_rows
        self.inter = gl.constexpr(inter)
        self.act_dtype = gl.constexpr(act_dtype)
        self.scale_k = gl.constexpr(scale_k)
        self.power_of_two = gl.constexpr(power_of_two)
        self.save = gl.constexpr(save)


@gluon.jit
def _gate_up_part(staging, j, rows, live, n0, outs, preact, STORE: gl.constexpr):
    """Part ``j`` (``GATE_UP_PARTS`` of the tile's columns) of ``g`` and ``u`` from the
    staging buffers, ``h = silu(g) * u`` rounded to the activation dtype; with ``STORE``
    also the saved rows' pre-activations."""
    BLOCK_N: gl.constexpr = staging.shape[2]
    PART_N: gl.constexpr = BLOCK_N // GATE_UP_PARTS
    layout: gl.constexpr = store_layout(PART_N, 4)
    g = staging.index(0).slice(j * PART_N, PART_N, dim=1).load(layout)
    u = staging.index(1).slice(j * PART_N, PART_N, dim=1).load(layout)
    cols = n0 + j * PART_N + gl.arange(0, PART_N, layout=gl.SliceLayout(0, layout))
    if STORE:
        if outs.save:
            saved = (live & (rows < outs.saved_rows))[:, None]
            at = rows.to(gl.int64)[:, None] * (2 * outs.inter) + cols[None, :]
            gl.store(preact + at, g.to(preact.dtype.element_ty), mask=saved)
            gl.store(preact + at + outs.inter, u.to(preact.dtype.element_ty), mask=saved)
    h = (g * (1.0 / (1.0 + gl.exp(-g))) * u).to(outs.act_dtype).to(gl.float32)
    return h, rows.to(gl.int64)[:, None] * outs.inter + cols[None, :]


@gluon.jit
def gate_up_rows(staging, outs, h_scales, preact, rows0, row_end, n0):
    """GEMM1's epilogue on a tile's 64 rows from ``rows0`` (those from ``row_end`` on belong
    to the next expert or to no one: not stored) and its ``BLOCK_N`` intermediate columns
    from ``n0``: ``staging [2, 64, BLOCK_N]`` fp32 holds the gate and up accumulators;
    ``h`` stored in the activation dtype, or quantized (``scale_k``: the tile is one scale
    block of each row, its scale into ``h_scales``), formed in ``GATE_UP_PARTS`` column
    parts, each with one part's temporaries live (quantized: twice, the row's scale
    known after the first pass)."""
    BLOCK_N: gl.constexpr = staging.shape[2]
    layout: gl.constexpr = store_layout(BLOCK_N // GATE_UP_PARTS, 4)
    rows = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    live = rows < row_end
    if outs.scale_k == 0:
        for j in gl.static_range(GATE_UP_PARTS):
            h, at = _gate_up_part(staging, j, rows, live, n0, outs, preact, STORE=True)
            gl.store(outs.h + at, h.to(outs.h.dtype.element_ty), mask=live[:, None])
    else:
        gl.static_assert(outs.scale_k == BLOCK_N, "a tile is one scale block of h")
        amax = gl.zeros([64], gl.float32, gl.SliceLayout(1, layout))
        for j in gl.static_range(GATE_UP_PARTS):
            h, _ = _gate_up_part(staging, j, rows, live, n0, outs, preact, STORE=True)
            amax = gl.maximum(amax, gl.max(gl.abs(h), axis=1))
        scale, multiplier = e4m3_scale(amax, outs.power_of_two)
        for j in gl.static_range(GATE_UP_PARTS):
            h, at = _gate_up_part(staging, j, rows, live, n0, outs, preact, STORE=False)
            gl.store(outs.h + at, (h * multiplier[:, None]).to(gl.float8e4nv), mask=live[:, None])
        gl.store(h_scales + rows.to(gl.int64) * (outs.inter // BLOCK_N) + n0 // BLOCK_N, scale, mask=live)


@gluon.jit
def gate_up_pair_rows(g, u, outs, preact, rows0, row_end, n0):
    """GEMM1's epilogue where one warpgroup holds both accumulators of its 64 rows (bf16:
    ``g`` the gate's, ``u`` the up projection's, in the MMA layout): the saved rows'
    pre-activations, and ``h = silu(g) * u`` rounded to the activation dtype, straight
    from registers. Rows from ``row_end`` on are not stored."""
    BLOCK_N: gl.constexpr = g.shape[1]
    layout: gl.constexpr = store_layout(BLOCK_N, 4)
    rows = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    live = rows < row_end
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    if outs.save:
        saved = (live & (rows < outs.saved_rows))[:, None]
        at = rows.to(gl.int64)[:, None] * (2 * outs.inter) + cols[None, :]
        gl.store(preact + at, gl.convert_layout(g.to(preact.dtype.element_ty), layout), mask=saved)
        gl.store(preact + at + outs.inter, gl.convert_layout(u.to(preact.dtype.element_ty), layout), mask=saved)
    h = (g * (1.0 / (1.0 + gl.exp(-g))) * u).to(outs.act_dtype).to(outs.h.dtype.element_ty)
    gl.store(outs.h + rows.to(gl.int64)[:, None] * outs.inter + cols[None, :], gl.convert_layout(h, layout),
             mask=live[:, None])
