"""The ring of shared-memory stages between the load partition and the consumers (where
the operands live, and the protocol that hands them over).

``step`` counts K steps over all of a program's tiles, identically in every partition;
stage ``s = step % STAGES`` holds step ``step`` in its ``(step // STAGES)``-th use, and
each use flips the parity of the stage's two mbarriers:

    load:      wait empty[s] at parity ^ 1 (a fresh barrier counts as released),
               expect ready[s] <- the stage's bytes, TMA A, B (, B2) -> stage s
    consumer:  wait ready[s] at parity, issue its MMAs on the stage (asynchronous),
               wait until only this step's MMAs are in flight, release stage s - 1
               (the last step of a tile: wait for every MMA, release stage s)

``empty[s]`` expects one arrival per consumer warpgroup. An mbarrier arrive is issued once
per partition; every warp of a consumer warpgroup has passed the MMA wait before it (a
wgmma completes for the whole warpgroup), so the stage is no longer read.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.core import _aggregate as aggregate


@aggregate
class StageRing:
    """``STAGES`` stages of A ``[BLOCK_M, BLOCK_K]`` and B (and B2) tiles, with their
    ``ready`` (filled) and ``empty`` (released) mbarriers."""

    a: gl.shared_memory_descriptor
    b: gl.shared_memory_descriptor
    b2: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, a, b, b2, ready, empty):
        self.a = a
        self.b = b
        self.b2 = b2
        self.ready = ready
        self.empty = empty

    @gluon.jit
    def allocate(a_desc, b_desc, b2_desc, spec):
        """The ring for these operands' tiles (B2 aliases B without a second B), barriers
        initialised."""
        a = gl.allocate_shared_memory(a_desc.dtype, [spec.stages] + a_desc.block_type.shape, a_desc.layout)
        b = gl.allocate_shared_memory(b_desc.dtype, [spec.stages] + b_desc.block_type.shape, b_desc.layout)
        if spec.two_b:
            b2 = gl.allocate_shared_memory(b2_desc.dtype, [spec.stages] + b2_desc.block_type.shape,
                                           b2_desc.layout)
        else:
            b2 = b
        ready = gl.allocate_shared_memory(gl.int64, [spec.stages, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [spec.stages, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(spec.stages):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=spec.mma_warpgroups)
        return StageRing(a, b, b2, ready, empty)

    @gluon.jit
    def fill(self, step, spec):
        """Load side: wait until stage ``step`` is released; return the stage and its
        ``ready`` barrier, which the caller's TMA copies complete."""
        s = step % spec.stages
        mbarrier.wait(self.empty.index(s), ((step // spec.stages) & 1) ^ 1)
        return s, self.ready.index(s)

    @gluon.jit
    def acquire(self, step, spec, WARPGROUP: gl.constexpr):
        """Consumer side: wait until stage ``step`` is filled; return its A rows of
        consumer ``WARPGROUP`` (64 of them) and its B and B2 as ``[BLOCK_K, BLOCK_N]``
        operands; with ``spec.split_b``, all of its A rows and the warpgroup's own B
        (returned as both)."""
        s = step % spec.stages
        mbarrier.wait(self.ready.index(s), (step // spec.stages) & 1)
        if spec.split_b:
            a = self.a.index(s)
            b = (self.b if WARPGROUP == 0 else self.b2).index(s)
            b2 = b
        else:
            a = self.a.index(s).slice(WARPGROUP * 64, 64, dim=0)
            b = self.b.index(s)
            b2 = self.b2.index(s)
        if spec.b_k_major:
            b = b.permute((1, 0))
            b2 = b2.permute((1, 0))
        return a, b, b2

    @gluon.jit
    def release(self, step, spec):
        """Consumer side: this warpgroup no longer reads stage ``step``."""
        mbarrier.arrive(self.empty.index(step % spec.stages))

    @gluon.jit
    def release_previous(self, step, spec, pred):
        """Consumer side, where ``pred``: this warpgroup no longer reads the stage of the step
        before ``step``."""
        mbarrier.arrive(self.empty.index((step + spec.stages - 1) % spec.stages), pred=pred)


@gluon.jit
def allocate_barriers(COUNT: gl.constexpr):
    """``COUNT`` mbarriers in shared memory, each expecting one arrival: the hand-overs
    between consumer warpgroups (GEMM1's accumulator)."""
    barriers = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(COUNT):
        mbarrier.init(barriers.index(i), count=1)
    return barriers
