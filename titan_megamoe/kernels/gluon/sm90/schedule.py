"""Persistent tile schedule over the experts' row blocks (who computes what, in what order).

The rows are laid out as ``kernels.layout`` lays out a receive buffer: local expert ``e``'s
``local_rows[e]`` rows start at row ``local_base[e]``, and its tiles at virtual row
``block_base[e]``, a multiple of ``BLOCK_M`` in a space where each expert's rows are padded
to whole blocks; ``num_blocks`` (device memory) counts the virtual blocks (int32 or int64). A tile is one
virtual block times ``BLOCK_N`` output columns; tile ``t`` is block ``t // N_TILES``,
column block ``t % N_TILES``, so neighbouring programs share a block of A (and an
expert's B) in L2. Program ``p`` of ``P`` takes tiles ``p, p + P, ...``: every partition
of a program derives the same sequence, so they need not exchange tile numbers.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate


@aggregate
class ExpertTiles:
    """The receive layout the tiles cover (device pointers, and the local experts)."""

    block_base: gl.tensor
    local_base: gl.tensor
    local_rows: gl.tensor
    local_experts: gl.tensor
    num_blocks: gl.tensor

    @gluon.constexpr_function
    def __init__(self, block_base, local_base, local_rows, local_experts, num_blocks):
        self.block_base = block_base
        self.local_base = local_base
        self.local_rows = local_rows
        self.local_experts = local_experts
        self.num_blocks = num_blocks

    @gluon.jit
    def count(self, spec):
        """Tiles of the call: the layout's virtual blocks (read on the device) times the
        tiles of rows per block and the column blocks."""
        return gl.load(self.num_blocks).to(gl.int32) * spec.tiles_per_block * (spec.n // spec.block_n)

    @gluon.jit
    def tile(self, t, spec, WARPS: gl.constexpr):
        """``(expert, row0, row_end, n0)`` of tile ``t``: its local expert, its first row,
        the end of the expert's rows (rows from there on belong to the next expert or to
        no one: computed, never stored) and its first output column. ``WARPS``: the
        calling partition's warps (the layout of the search over the experts' block
        starts)."""
        n_tiles: gl.constexpr = spec.n // spec.block_n
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        lane = gl.arange(0, spec.local_pad, layout=lanes)
        virtual_row = (t // n_tiles) * spec.block_m
        starts = gl.load(self.block_base + lane, mask=lane < self.local_experts, other=2147483647)
        # The last expert starting at or before the block (one without rows starts where the next does).
        expert = gl.sum((starts <= virtual_row).to(gl.int32), axis=0) - 1
        base = gl.load(self.local_base + expert)
        row0 = base + virtual_row - gl.load(self.block_base + expert)
        return expert, row0, base + gl.load(self.local_rows + expert), (t % n_tiles) * spec.block_n

    @gluon.jit
    def saved_end(self, saved_rows, spec, SAVED_M: gl.constexpr, WARPS: gl.constexpr):
        """The virtual row where the ``SAVED_M``-row tiles whose rows all lie below row
        ``saved_rows`` end: every block of the experts that end by then, the tiles of the
        next expert wholly below it, none after (a prefix, as experts follow one another in
        both spaces). ``kernels.layout.saved_tile_rows`` computes the same for ``tl``."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        lane = gl.arange(0, spec.local_pad, layout=lanes)
        mine = lane < self.local_experts
        base = gl.load(self.local_base + lane, mask=mine, other=0)
        count = gl.load(self.local_rows + lane, mask=mine, other=0)
        whole = base + count <= saved_rows
        span = gl.where(whole, (count + spec.block_m - 1) // spec.block_m * spec.block_m,
                        gl.maximum(saved_rows - base, 0) // SAVED_M * SAVED_M)
        ends = gl.load(self.block_base + lane, mask=mine, other=0) + span
        return gl.max(gl.where(mine & (span > 0), ends, 0), axis=0)

    @gluon.jit
    def count_below(self, virtual_end, spec):
        """Tiles of the blocks that start below virtual row ``virtual_end``."""
        return (virtual_end + spec.block_m - 1) // spec.block_m * (spec.n // spec.block_n)


@aggregate
class TokenBlockTiles:
    """Tiles of a GEMM grouped along K (the weight gradients): expert ``e`` contracts the
    token blocks ``block_start[e] .. block_start[e + 1]`` of two token-major operands, each
    ``BLOCK_K`` tokens, into its own ``[M, N]`` output. Tile ``t`` is expert ``t //
    (M_TILES * N_TILES)``, then row block, then column block fastest: neighbouring programs
    share the expert's A rows and its token range in L2."""

    block_start: gl.tensor
    experts: gl.tensor

    @gluon.constexpr_function
    def __init__(self, block_start, experts):
        self.block_start = block_start
        self.experts = experts

    @gluon.jit
    def count(self, spec):
        return self.experts * ((spec.m // spec.block_m) * (spec.n // spec.block_n))

    @gluon.jit
    def tile(self, t, spec):
        """``(expert, m0, n0, first, blocks)``: the tile's expert, first output row and column,
        and the expert's first token block and number of them (0: the tile is zeros)."""
        n_tiles: gl.constexpr = spec.n // spec.block_n
        per_expert: gl.constexpr = (spec.m // spec.block_m) * n_tiles
        expert = t // per_expert
        within = t % per_expert
        first = gl.load(self.block_start + expert)
        return (expert, (within // n_tiles) * spec.block_m, (within % n_tiles) * spec.block_n, first,
                gl.load(self.block_start + expert + 1) - first)
