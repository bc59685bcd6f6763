"""Epilogues: what a consumer warpgroup does with its rows of a finished tile.

Every epilogue takes the same arguments, so the kernel calls whichever it is given:
``(acc, acc2, out, dest, live, n0)``. ``acc`` (and ``acc2``, the second B's product, or
``acc`` again without one) are the warpgroup's fp32 ``[64, BLOCK_N]`` accumulators in the
MMA layout; ``out`` the output; ``dest`` where each of the warpgroup's rows starts in
``out`` (int64 element offsets, in the layout ``store_layout`` gives: ``row_starts``);
rows not ``live`` belong to another expert or to no one and are not stored; ``n0`` the
tile's first column.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
