"""Epilogues: what a consumer warpgroup does with its rows of a finished tile.

Every epilogue takes the same arguments, so the kernel calls whichever it is given:
``(acc, acc2, out, rows, row_end, n0, N)``. ``acc`` (and ``acc2``, the second B's
product, or ``acc`` again without one) are the warpgroup's fp32 ``[rows, BLOCK_N]``
accumulators in the MMA layout; ``out`` the output ``[total rows, N]``; ``rows`` the
warpgroup's row indices (int64, in the layout ``store_layout`` gives); rows at or past
``row_end`` belong to another expert and are not stored; ``n0`` the tile's first column.
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
def _store(vals, out, rows, row_end, n0, N: gl.constexpr):
    layout: gl.constexpr = rows.type.layout.parent
    BLOCK_N: gl.constexpr = vals.shape[1]
    vals = gl.convert_layout(vals, layout)
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    gl.store(out + rows[:, None] * N + cols[None, :], vals, mask=(rows < row_end)[:, None])


@gluon.jit
def store_rows(acc, acc2, out, rows, row_end, n0, N: gl.constexpr):
    """``out[rows, n0:] = acc`` in ``out``'s dtype."""
    _store(acc.to(out.dtype.element_ty), out, rows, row_end, n0, N)


@gluon.jit
def swiglu_rows(acc, acc2, out, rows, row_end, n0, N: gl.constexpr):
    """``out[rows, n0:] = silu(acc) * acc2`` (GEMM1: ``acc`` the gate, ``acc2`` the up
    projection), formed in fp32 as the operator's reference forms it."""
    _store((acc * (1.0 / (1.0 + gl.exp(-acc))) * acc2).to(out.dtype.element_ty), out, rows, row_end, n0, N)


EPILOGUES = {"store": store_rows, "swiglu": swiglu_rows}
"""Epilogues by name (``grouped_gemm(epilogue=...)``)."""
