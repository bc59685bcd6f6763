"""Tile sizes of the fused kernels: the one table to tune, keyed by (architecture, format
name). Free of Triton, so the host can decide where the kernels run without importing it.
"""

import os
from dataclasses import dataclass
from typing import NamedTuple

from titan_megamoe.precision import Format

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels run under the Triton interpreter (CPU tests)."""


ROWS_GEMM_KERNELS = ("tl", "gluon")
"""Implementations of the rows GEMMs (GEMM2, dgrad: ``TileConfig.gemm2_kernel``) and of the
quantized weight gradients (``TileConfig.wgrad_kernel``), of GEMM1 (``gemm1_kernel``) and of
the backward's first kernel's saved tiles (``grad1_kernel``)."""


class RowsGemmTiles(NamedTuple):
    """One rows GEMM's row of the table (GEMM2's or dgrad's)."""

    kernel: str
    m: int
    n: int
    k: int
    warps: int
    stages: int


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    """Rows per GEMM tile block and per dispatch chunk: the tile scheduler hands out each
    local expert's rows in whole blocks (``layout``)."""
    gemm1_m: int
    """Rows per GEMM1 tile, dividing ``block_m``: a quantized tile keeps a partial product
    beside each accumulator, and fewer rows keep both in registers."""
    gemm1_n: int
    """Intermediate columns per GEMM1 tile (two accumulators: gate and up)."""
    gemm1_k: int
    gemm1_warps: int
    gemm1_stages: int
    gemm2_n: int
    """Hidden columns per GEMM2 tile."""
    gemm2_k: int
    gemm2_warps: int
    gemm2_stages: int
    grad1_m: int
    """Backward, first kernel: rows per tile, dividing ``block_m``."""
    grad1_n: int
    """Backward, first kernel: intermediate columns per tile (three accumulators: gate, up
    and ``dy W2``)."""
    grad1_saved_n: int
    """The same when GEMM1 was saved (one accumulator: ``dy W2``)."""
    grad1_k: int
    grad1_warps: int
    grad1_stages: int
    grad1_saved_stages: int
    """The same when GEMM1 was saved: without GEMM1's operands a pipeline stage is smaller."""
    dgrad_n: int
    """Backward, second kernel: hidden columns per ``[da | db] [W1 | W3]`` tile."""
    dgrad_k: int
    dgrad_warps: int
    dgrad_stages: int
    copy_rows: int
    """Rows a dispatching program moves per step."""
    copy_cols: int
    """Columns per step (a multiple of the format's row scale block). A copy is bound by
    the latency of its loads: a step's bytes are what one program keeps in flight."""
    reduce_tokens: int
    """Most tokens per combine-reduction block; a call with fewer blocks than programs
    halves it (down to ``REDUCE_MIN_TOKENS``) so that every program gets a block."""
    reduce_cols: int
    reduce_warps: int
    """The combine reduction runs one program per SM it is given (it spins on
    COMBINE_READY): wide programs keep enough loads in flight."""
    transpose_block: int
    """Square tile of the backward's weight transposes."""
    wgrad_m: int = 128
    wgrad_n: int = 128
    wgrad_k: int = 128
    """Tokens per K step; divides the format's token block (promoted scales) or is a
    multiple of it (a scaled MMA)."""
    wgrad_warps: int = 8
    wgrad_stages: int = 3
    """Tiles of the quantized weight-gradient GEMM (bf16 runs torch's grouped GEMM)."""
    wgrad_kernel: str = "tl"
    """What runs the quantized weight gradients: ``"tl"`` (``kernels.wgrad.wgrad_kernel``,
    the tiles above) or ``"gluon"``, Hopper's core grouped along the tokens
    (``kernels.gluon.sm90.token_grouped_gemm``, blockwise e4m3 only: 128 x 128 tiles of two
    consumer warpgroups, one token block per K step, ``wgrad_stages`` stages; ``wgrad_m``,
    ``wgrad_n`` and ``wgrad_k`` must say so, ``wgrad_warps`` unused). Where a layer's
    dimensions are not multiples of 128 the ``tl`` kernel runs, and the log says so."""
    token_major_row_bytes: int = 128
    """Bytes of each row a token-major copy program reads (one token block by this over
    the operand's element size columns: 64 of bf16, 128 of e4m3); the columns must divide
    the row scale block of an operand that arrives quantized, or hold whole ones."""
    token_major_warps: int = 4
    """Warps of a token-major copy program."""
    mx_dequantized_weights: int = 0
    """Scaled-MMA formats (mxfp8) only. 1: the weights are quantized and dequantized to
    bf16 once per call, and the GEMMs scale only their A operand (``tl.dot_scaled`` with a
    bf16 B: same values); where the MMA has no MX form (Hopper) this spares converting a
    weight tile per K step. 0: the weights stay e4m3 with their scales."""
    mx_upcast: int = 0
    """Scaled-MMA formats (mxfp8) only. 1: the mainloop multiplies each e4m3 tile by its
    scales into bf16 itself and runs a bf16 dot (for GPUs without an MX MMA); 0: it hands
    tiles and scales to ``tl.dot_scaled`` (native MX MMA, or Triton's emulation)."""
    row_align: int = 32
    """Each local expert's rows start on a multiple of this many rows of the receive
    buffer (a power of two dividing ``block_m``; its rows padded to it, not to a block:
    ``layout``). The weight-gradient copies of ``mx_wgrad_dequantized`` take whole token
    blocks of it. Every row of one architecture must agree (one receive layout)."""
    mx_in_bf16: int = 0
    """Scaled-MMA formats (mxfp8) only. 1: the forward and data-gradient GEMMs take MX
    operands held in bf16 (``Format.in_bf16``: the same values), so they run the bf16
    kernels unchanged: rows are rounded to MX where they are made (at their source, and
    ``h`` and ``[da | db]`` in the epilogues that write them), the weights once per call,
    and the rows cross the link in bf16 (twice the bytes of e4m3 and scales). For GPUs
    without an MX MMA; excludes ``mx_upcast`` and ``mx_dequantized_weights``."""
    mx_wgrad_dequantized: int = 0
    """MX weight gradients only. 1: their operands are copied in the receive layout,
    quantized along the tokens and dequantized into the activation dtype (the same values:
    power-of-two scales), and torch's grouped GEMM multiplies them (for GPUs without an MX
    MMA; ``row_align`` must be a multiple of the token block); 0: token-major e4m3 copies
    and ``wgrad_kernel``'s scaled mainloop."""
    gemm2_m: int = 128
    """Rows per GEMM2 tile, dividing ``block_m``: half a block in half the warps takes half
    the registers and shared memory, so two programs can share an SM and one's epilogue
    (the scattered stores to the combine buffers) overlaps the other's MMAs."""
    dgrad_m: int = 128
    """The same for the dgrad GEMM."""
    gemm2_kernel: str = "tl"
    """What runs GEMM2 and its combine stores: ``"tl"`` (``rows_gemm_combine_kernel``) or
    ``"gluon"``, Hopper's warp-specialized core (``kernels.gluon.sm90``), on ``gemm2_m`` /
    64 consumer warpgroups (``gemm2_m`` = ``block_m``: a tile is a block), ``gemm2_n`` x
    ``gemm2_k`` tiles in ``gemm2_stages`` stages (``gemm2_warps`` unused). The core takes
    bf16 operands or blockwise e4m3; other operands run ``"tl"``, and the log says so."""
    dgrad_kernel: str = "tl"
    """The same for the dgrad GEMM; ``"gluon"`` reads ``[W1 | W3]`` transposed
    (``w13_as_stored_rows`` = 0)."""
    grad1_saved_parts: int = 1
    """1 or 2: where GEMM1 was saved, the backward's first kernel runs its SwiGLU backward
    over each half of a tile's ``grad1_saved_n`` columns in turn (2), so that one half's
    temporaries, not the whole tile's, sit in registers beside the ``dy W2`` accumulator
    (a half must hold whole scale blocks)."""
    gemm1_kernel: str = "tl"
    """What runs GEMM1: ``"tl"`` (``dispatch_gemm1_kernel``, which also dispatches the rows)
    or ``"gluon"``, Hopper's core (``kernels.gluon.sm90.gate_up_gemm``: ``gemm1_n`` (128)
    columns, ``gemm1_k`` deep, ``gemm1_stages`` stages; bf16 tiles of 128 rows, blockwise
    e4m3 ones of 64 with the two consumer warpgroups on the gate and the up projection),
    on the SMs that ``dispatch_gemm1_kernel``'s communication programs leave, on a stream
    beside them, waiting for the rows they dispatch. The core takes bf16 or blockwise e4m3
    operands in blocks of whole tiles; others run ``"tl"``, and the log says so."""
    grad1_kernel: str = "tl"
    """What runs the backward's first kernel's tiles where GEMM1 was saved: ``"tl"``
    (``dispatch_grad_gemm1_kernel``, which also dispatches the rows) or ``"gluon"``,
    Hopper's core (``kernels.gluon.sm90.swiglu_grad_gemm``: 128 x ``grad1_saved_n`` (128)
    tiles of two consumer warpgroups, ``grad1_k`` deep, ``grad1_saved_stages`` stages),
    on the SMs that ``dispatch_grad_gemm1_kernel``'s communication programs leave, as
    GEMM1's. The core takes bf16 or blockwise e4m3 operands; other operands, and GEMM1
    recomputed, run ``"tl"``, and the log says so."""
    gemm1_claim_ahead: int = 0
    """1: each GEMM1 program claims its next tile from the tile counter before its
    mainloop, which then hides the atomic's round trip; 0: after the tile's stores (the
    backward's first kernel always claims ahead)."""
    w2_as_stored: int = 0
    """Unquantized backward formats only. 1: ``dy W2`` reads W2 as stored (``[H, I]`` per
    expert, an N-major B operand) instead of a transposed copy made on every call; 0: the
    copy (quantized formats always: Hopper's fp8 MMA takes K-major operands, MX held in
    bf16 is rounded as it is transposed)."""
    w13_as_stored_rows: int = 0
    """Unquantized backward formats only. The dgrad GEMM reads W1 and W3 as stored (``[I, H]``
    per expert each, one N-major B split along K: each K step reads the one its rows lie
    in) in calls that bring fewer than this many rows per local expert on average (tokens x
    top-k / local experts), instead of a transposed ``[H, 2I]`` copy made on every call: the
    copy is a fixed cost per call, the N-major operand one per row (0: always the copy; also
    where ``dgrad_k`` does not divide I, or W1 and W3 are not a multiple of 16 bytes apart)."""

    def __post_init__(self):
        for name in ("gemm1_m", "grad1_m", "gemm2_m", "dgrad_m"):
            rows = getattr(self, name)
            if rows < 1 or self.block_m % rows:
                raise ValueError(f"{name} = {rows} must divide block_m = {self.block_m}")
        if self.row_align < 1 or self.row_align & (self.row_align - 1) or self.block_m % self.row_align:
            raise ValueError(f"row_align = {self.row_align} must be a power of two dividing block_m = {self.block_m}")
        if self.grad1_saved_parts not in (1, 2):
            raise ValueError(f"grad1_saved_parts = {self.grad1_saved_parts} must be 1 or 2")
        for name in ("mx_dequantized_weights", "mx_upcast", "mx_in_bf16",
                     "mx_wgrad_dequantized", "w2_as_stored", "gemm1_claim_ahead"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"{name} = {getattr(self, name)} must be 0 or 1")
        if self.w13_as_stored_rows < 0:
            raise ValueError(f"w13_as_stored_rows = {self.w13_as_stored_rows} must be >= 0")
        for name in ("gemm2", "dgrad"):
            kernel, rows = getattr(self, f"{name}_kernel"), getattr(self, f"{name}_m")
            if kernel not in ROWS_GEMM_KERNELS:
                raise ValueError(f"{name}_kernel = {kernel!r}; known: {', '.join(ROWS_GEMM_KERNELS)}")
            if kernel == "gluon" and rows != self.block_m:
                raise ValueError(f"{name}_kernel = 'gluon' tiles whole blocks: {name}_m = {rows} must be block_m = "
                                 f"{self.block_m}")
            if kernel == "gluon" and (self.mx_upcast or self.mx_dequantized_weights):
                raise ValueError(f"{name}_kernel = 'gluon' multiplies bf16 or blockwise e4m3 operands; mx_upcast and "
                                 "mx_dequantized_weights must be 0 with it")
        if self.wgrad_kernel not in ROWS_GEMM_KERNELS:
            raise ValueError(f"wgrad_kernel = {self.wgrad_kernel!r}; known: {', '.join(ROWS_GEMM_KERNELS)}")
        if self.wgrad_kernel == "gluon" and (self.wgrad_m, self.wgrad_n, self.wgrad_k) != (128, 128, 128):
            raise ValueError(f"wgrad_kernel = 'gluon' takes 128 x 128 tiles, one 128-token block per K step: wgrad_m, "
                             f"wgrad_n, wgrad_k = {self.wgrad_m}, {self.wgrad_n}, {self.wgrad_k} must be 128")
        if self.gemm1_kernel not in ROWS_GEMM_KERNELS:
            raise ValueError(f"gemm1_kernel = {self.gemm1_kernel!r}; known: {', '.join(ROWS_GEMM_KERNELS)}")
        if self.gemm1_kernel == "gluon" and (self.gemm1_n != 128 or self.block_m % 64):
            raise ValueError(f"gemm1_kernel = 'gluon' takes tiles of 64 rows by 128 columns: gemm1_n = "
                             f"{self.gemm1_n} must be 128 and block_m = {self.block_m} a multiple of 64")
        if self.grad1_kernel not in ROWS_GEMM_KERNELS:
            raise ValueError(f"grad1_kernel = {self.grad1_kernel!r}; known: {', '.join(ROWS_GEMM_KERNELS)}")
        if self.grad1_kernel == "gluon" and (self.grad1_saved_n != 128 or self.grad1_m % 64):
            raise ValueError(f"grad1_kernel = 'gluon' takes tiles 128 columns wide, and leaves the rows past the saved "
                             f"ones to tl tiles of whole warpgroups: grad1_saved_n = {self.grad1_saved_n} must be "
                             f"128 and grad1_m = {self.grad1_m} a multiple of 64")
        if self.dgrad_kernel == "gluon" and self.w13_as_stored_rows:
            raise ValueError("dgrad_kernel = 'gluon' reads [W1 | W3] transposed: w13_as_stored_rows must be 0")
        if self.mx_in_bf16 and (self.mx_upcast or self.mx_dequantized_weights):
            raise ValueError("mx_in_bf16 = 1 runs bf16 GEMMs on operands held in bf16; mx_upcast and "
                             "mx_dequantized_weights (ways to scale e4m3 operands) must be 0 with it")

    @property
    def gemm2(self) -> RowsGemmTiles:
        return RowsGemmTiles(self.gemm2_kernel, self.gemm2_m, self.gemm2_n, self.gemm2_k, self.gemm2_warps,
                             self.gemm2_stages)

    @property
    def dgrad(self) -> RowsGemmTiles:
        return RowsGemmTiles(self.dgrad_kernel, self.dgrad_m, self.dgrad_n, self.dgrad_k, self.dgrad_warps,
                             self.dgrad_stages)

    def operand_format(self, fmt: Format) -> Format:
        """The format the kernels of this row hold ``fmt``'s GEMM operands in: ``fmt``, or
        its bf16 form for MX with ``mx_in_bf16``."""
        return fmt.in_bf16() if self.mx_in_bf16 and fmt.scaled_mma else fmt


EVERY_CALL = 1 << 31
"""``w13_as_stored_rows`` above any call's rows per local expert."""

TILE_CONFIGS: dict[tuple[str, str], TileConfig] = {
    # H100/H200 (measured on H200, docs/perf.md): GEMM1 128x(2x128)x64 in 4 stages,
    # GEMM2 128x256x64 in 3 stages, 8 warps each; backward 128x(3x64)x64 in 4 stages and
    # 128x256x64 (dgrad, as GEMM2) in 3, 8 warps. dy W2 reads W2 as stored: its transpose
    # cost more than the N-major operand (30B-A3B 16k fwd+bwd 10.07 -> 9.89 ms, 235B-A22B
    # 34.12 -> 33.39, v21). Where GEMM1 was saved, the backward's first kernel runs
    # 128x128 with its epilogue in two halves: one 128-wide epilogue spilled (1.2 KB at
    # 235B-A22B), 64-wide tiles read 1.5x the operand bytes per FLOP (first kernel 2.21 ->
    # 1.77 ms at 30B-A3B 16k against 64 wide, 6.60 -> 5.52 at 235B-A22B against one
    # 128-wide part; v22). dgrad reads W1 and W3 as stored in every call: with its
    # combine stores 16 bytes wide again the N-major operand costs the GEMM nothing
    # measurable, and the transposes it spares took 0.46 ms (30B-A3B) and 1.82 ms
    # (235B-A22B) per call at 16k tokens (v24; v23's 1.5x slower GEMM was those stores).
    # GEMM2 and dgrad take their tiles one after another: with the rows' destinations
    # loaded before the mainloop, a tile loop flattened into the K loop spilled (3.8x
    # slower); unflattened it is 5% faster than the flattened loop was without them (v29).
    # GEMM2 runs on the Gluon core, 128x256x64 in 4 stages: 0.71 ms against the tl
    # kernel's 1.10 at 30B-A3B 16k (v39). dgrad stays tl: the core reads no B split along
    # K, and a transposed [W1 | W3] costs more than its GEMM would gain (v24). Where GEMM1
    # was saved the backward's first kernel runs on the core, beside its dispatch: 8.56 ms
    # per call against 8.80 at 30B-A3B 16k (one H100, v45). GEMM1 stays tl: on the core
    # (128-row tiles, each warpgroup both weights) it ran no faster (8.63 against 8.80 at
    # 30B-A3B, 29.67 against 29.53 ms at 235B-A22B with both on the core).
    ("sm90", "native"): TileConfig(
        block_m=128, w2_as_stored=1, w13_as_stored_rows=EVERY_CALL, grad1_saved_parts=2,
        gemm1_m=128, gemm1_n=128, gemm1_k=64, gemm1_warps=8, gemm1_stages=4,
        gemm2_kernel="gluon", gemm2_n=256, gemm2_k=64, gemm2_warps=8, gemm2_stages=4,
        grad1_kernel="gluon", grad1_m=128, grad1_n=64, grad1_saved_n=128, grad1_k=64, grad1_warps=8,
        grad1_stages=4, grad1_saved_stages=4,
        dgrad_n=256, dgrad_k=64, dgrad_warps=8, dgrad_stages=3,
        copy_rows=16, copy_cols=512, reduce_tokens=64, reduce_cols=512, reduce_warps=16, transpose_block=64,
    ),
    # Blockwise fp8 on H100/H200: one 128-deep scale block per K step. Each scaled
    # accumulator has a partial product beside it (promoted once per block). GEMM1 and
    # the backward's first kernel store h and [da | db] in 1x128 blocks, so their tiles
    # are 128 columns wide; GEMM1 128 rows tall in 3 stages (small spills, 9% faster than
    # 64 rows), the backward's first kernel 64 (128 rows are 35% slower). GEMM2 and dgrad
    # 128x128 as in the plain blockwise-fp8 grouped GEMM measured at 613-835 TFLOP/s
    # (docs/perf-history.md, v9); 64x128 tiles of 4 warps, two programs per SM (one's stores
    # beside the other's MMAs) were 7% faster at 30B-A3B and 7% slower at 235B-A22B
    # (v29). The backward's first kernel runs 2 stages where it recomputes
    # GEMM1 (3 take 240 KB of shared memory when fp8_bwd recomputes it in bf16) and 4
    # where GEMM1 was saved. Token-major copies read 128 bytes of each row in 2 warps,
    # neighbouring programs the same rows (9-12% faster than 64 columns of any operand in
    # 4 warps, v36; 128 columns of fp32 in 4 warps were 34% slower, v16). Weight gradients on
    # the Gluon core grouped along the tokens, 128x128 in 5 stages: 1.88 ms against
    # wgrad_kernel's 2.75 (64x128 tiles, two programs per SM) at 30B-A3B 16k, 0.77 against
    # 1.29 at 4k (v43).
    # Dispatch copies of 16 whole e4m3 rows (2,048 columns) per step: a copy waits on its
    # loads, and wider steps keep more bytes in flight (GEMM1 kernel 8% faster, v17).
    # GEMM1 claims its next tile before the mainloop: 6-7% faster here (bf16's GEMM1 ran
    # 2-5% slower with it, at the same registers, v30). GEMM2 and dgrad run on the Gluon
    # core, 128x128x128 in 5 stages, the promotion under the next block's MMA: together
    # 1.38 ms against the tl kernel's 2.50 at 30B-A3B 16k, 4.74 against 7.13 at 235B-A22B
    # (v39). Where GEMM1 was saved the backward's first kernel runs on the core beside its
    # dispatch: 9.59 ms per call against 9.76 at 30B-A3B 16k (one H100, v45). GEMM1 stays
    # tl: the core's 64-row tiles split between the gate and the up projection ran at
    # 438-455 TFLOP/s against the tl kernel's 626-754 (v45).
    ("sm90", "fp8_block"): TileConfig(
        block_m=128, gemm1_claim_ahead=1,
        gemm1_m=128, gemm1_n=128, gemm1_k=128, gemm1_warps=8, gemm1_stages=3,
        gemm2_kernel="gluon", gemm2_n=128, gemm2_k=128, gemm2_warps=8, gemm2_stages=5,
        grad1_kernel="gluon", grad1_m=64, grad1_n=128, grad1_saved_n=128, grad1_k=128, grad1_warps=8,
        grad1_stages=2, grad1_saved_stages=4,
        dgrad_kernel="gluon", dgrad_n=128, dgrad_k=128, dgrad_warps=8, dgrad_stages=5,
        copy_rows=16, copy_cols=2048, reduce_tokens=64, reduce_cols=512, reduce_warps=16, transpose_block=64,
        wgrad_kernel="gluon", wgrad_m=128, wgrad_n=128, wgrad_k=128, wgrad_stages=5, token_major_warps=2,
    ),
    # MXFP8 on H100/H200: Hopper has no MX MMA. MX values are exact in bf16, so the
    # operands are held in bf16 rounded to MX (mx_in_bf16) and every GEMM runs the bf16
    # kernels with the bf16 row's tiles; scaling e4m3 tiles into bf16 in the mainloop
    # (mx_upcast, weights dequantized once per call) ran the GEMMs at half the bf16
    # kernels' rate (docs/perf-history.md v15, v20). The backward's first kernel as bf16's where
    # GEMM1 was saved, 128 wide with its epilogue in halves (at 128 in one part, rounding
    # [da | db] spilled: 64 wide was faster, v20; halves 2.42 -> 1.88 ms, v22). The
    # weight gradients run torch's bf16 grouped GEMM on copies quantized along the tokens
    # and dequantized (v19). GEMM2 on the Gluon core, as bf16's (v39).
    ("sm90", "mxfp8"): TileConfig(
        block_m=128, mx_in_bf16=1, mx_wgrad_dequantized=1, grad1_saved_parts=2,
        gemm1_m=128, gemm1_n=128, gemm1_k=64, gemm1_warps=8, gemm1_stages=4,
        gemm2_kernel="gluon", gemm2_n=256, gemm2_k=64, gemm2_warps=8, gemm2_stages=4,
        grad1_m=128, grad1_n=64, grad1_saved_n=128, grad1_k=64, grad1_warps=8, grad1_stages=4,
        grad1_saved_stages=4,
        dgrad_n=256, dgrad_k=64, dgrad_warps=8, dgrad_stages=3,
        copy_rows=16, copy_cols=512, reduce_tokens=64, reduce_cols=512, reduce_warps=16, transpose_block=64,
    ),
    # MXFP8 on B200 (SM100): native MX MMA (block-scaled tcgen05) with the accumulators in
    # tensor memory; K steps of 128 (four scale blocks). Compiled for sm_100a, never run:
    # no Blackwell GPU was at hand (docs/perf-history.md v14).
    ("sm100", "mxfp8"): TileConfig(
        block_m=128,
        gemm1_m=128, gemm1_n=128, gemm1_k=128, gemm1_warps=8, gemm1_stages=3,
        gemm2_n=256, gemm2_k=128, gemm2_warps=8, gemm2_stages=3,
        grad1_m=128, grad1_n=64, grad1_saved_n=128, grad1_k=128, grad1_warps=8, grad1_stages=3,
        grad1_saved_stages=3,
        dgrad_n=256, dgrad_k=128, dgrad_warps=8, dgrad_stages=3,
        copy_rows=16, copy_cols=512, reduce_tokens=64, reduce_cols=512, reduce_warps=16, transpose_block=64,
        wgrad_m=128, wgrad_n=128, wgrad_k=128, wgrad_warps=8, wgrad_stages=3,
    ),
    # Small tiles for the Triton interpreter (CPU tests); the fp8 row's GEMM1, GEMM2,
    # dgrad and backward-first-kernel tiles are half a block tall (the path where a tile
    # splits a block). The quantized rows' GEMM2, dgrad and weight-gradient tiles are as
    # wide as the interpreter runs fastest while the tests' 256-wide experts still take
    # two tiles across. Experts start on multiples of 4 rows: tiles start inside them and
    # reach into the next expert's rows.
    # dgrad reads W1 and W3 as stored below 10 rows per expert: the fused checks' 37-token
    # calls take the copy, the others read them as stored.
    ("interpret", "native"): TileConfig(
        block_m=16, row_align=4, w2_as_stored=1, w13_as_stored_rows=10, grad1_saved_parts=2,
        gemm1_m=16, gemm1_n=16, gemm1_k=16, gemm1_warps=4, gemm1_stages=1,
        gemm2_m=16, gemm2_n=16, gemm2_k=16, gemm2_warps=4, gemm2_stages=1,
        grad1_m=16, grad1_n=16, grad1_saved_n=32, grad1_k=16, grad1_warps=4, grad1_stages=1,
        grad1_saved_stages=1,
        dgrad_m=16, dgrad_n=16, dgrad_k=16, dgrad_warps=4, dgrad_stages=1,
        copy_rows=4, copy_cols=16, reduce_tokens=4, reduce_cols=16, reduce_warps=4, transpose_block=16,
    ),
    ("interpret", "fp8_block"): TileConfig(
        block_m=16, row_align=4, gemm1_claim_ahead=1,
        gemm1_m=8, gemm1_n=128, gemm1_k=32, gemm1_warps=4, gemm1_stages=1,
        gemm2_m=8, gemm2_n=128, gemm2_k=32, gemm2_warps=4, gemm2_stages=1,
        grad1_m=8, grad1_n=128, grad1_saved_n=128, grad1_k=32, grad1_warps=4, grad1_stages=1,
        grad1_saved_stages=1,
        dgrad_m=8, dgrad_n=128, dgrad_k=32, dgrad_warps=4, dgrad_stages=1,
        copy_rows=4, copy_cols=128, reduce_tokens=4, reduce_cols=16, reduce_warps=4, transpose_block=64,
        wgrad_m=128, wgrad_n=128, wgrad_k=32, wgrad_warps=4, token_major_row_bytes=512,
    ),
    # mxfp8's K steps span one or two scale blocks (the scaled MMA takes whole ones); the
    # weight gradients' two, so each expert's tokens are padded to 64; token-major copies
    # read four scale blocks of the arriving rows per program; transposes of whole scale
    # blocks (weights in bf16 are rounded as they are transposed).
    ("interpret", "mxfp8"): TileConfig(
        block_m=16, row_align=4,
        gemm1_m=16, gemm1_n=128, gemm1_k=64, gemm1_warps=4, gemm1_stages=1,
        gemm2_m=16, gemm2_n=128, gemm2_k=64, gemm2_warps=4, gemm2_stages=1,
        grad1_m=16, grad1_n=128, grad1_saved_n=128, grad1_k=64, grad1_warps=4, grad1_stages=1,
        grad1_saved_stages=1,
        dgrad_m=16, dgrad_n=128, dgrad_k=32, dgrad_warps=4, dgrad_stages=1,
        copy_rows=4, copy_cols=128, reduce_tokens=4, reduce_cols=16, reduce_warps=4, transpose_block=64,
        wgrad_m=128, wgrad_n=128, wgrad_k=64, wgrad_warps=4, token_major_row_bytes=512,
    ),
}
"""Rows by ``(architecture, format name)``: architectures as ``arch_of`` names them,
format names as ``titan_megamoe.precision`` does."""

GLUON_ARCHS = ("sm90",)
"""Architectures the Gluon core (``*_kernel = "gluon"``) is written for."""


def check_table(table: dict[tuple[str, str], TileConfig]) -> None:
    """Raise where a row names an implementation its architecture cannot run."""
    for (arch, fmt_name), row in table.items():
        for phase, kernel in (("a rows GEMM", row.gemm2.kernel), ("a rows GEMM", row.dgrad.kernel),
                              ("the weight gradients", row.wgrad_kernel),
                              ("the backward's first kernel", row.grad1_kernel),
                              ("GEMM1", row.gemm1_kernel)):
            if kernel == "gluon" and arch not in GLUON_ARCHS:
                raise ValueError(f"tile row ({arch}, {fmt_name}) runs {phase} on the Gluon core, which is written "
                                 f"for {', '.join(GLUON_ARCHS)} only")


check_table(TILE_CONFIGS)

ARCH_BY_CAPABILITY = {(9, 0): "sm90", (10, 0): "sm100"}
"""CUDA compute capability -> architecture of the table."""


def arch_of(capability: tuple[int, int] | None) -> str | None:
    """The table's architecture for a GPU of compute ``capability`` (None: no GPU):
    ``"interpret"`` whenever kernels run under the Triton interpreter, else ``"sm90"`` for
    Hopper (9, 0) and ``"sm100"`` for Blackwell B200 (10, 0); None where the table has no
    architecture for it."""
    if INTERPRET:
        return "interpret"
    return ARCH_BY_CAPABILITY.get(capability)


def tile_config(arch: str, fmt_name: str) -> TileConfig:
    """The row for ``arch`` (``arch_of``) and GEMM operand format ``fmt_name``; raises
    naming the rows there are."""
    if (arch, fmt_name) not in TILE_CONFIGS:
        rows = ", ".join(f"({a}, {f})" for a, f in TILE_CONFIGS)
        raise ValueError(f"no tile config for architecture {arch!r} and format {fmt_name!r}; rows: {rows}")
    return TILE_CONFIGS[arch, fmt_name]
