"""Hopper (SM90) grouped GEMM core in Gluon: ``out[rows of expert e] = A[rows] B[e]^T``.

One persistent kernel, three kinds of partition, each in its own module:

- ``schedule``: which tiles a program computes, in which order. Tiles are the experts'
  ``BLOCK_M``-row blocks of the receive layout (``kernels.layout``) times ``BLOCK_N``
  output columns; every partition of a program walks the same sequence.
- ``load``: one warp with a small register budget issues TMA copies of each K step's A
  tile and B tile(s) into a ring of ``STAGES`` shared-memory stages.
- ``mma``: ``MMA_WARPGROUPS`` consumer warpgroups, each the MMAs of its 64 rows of a tile,
  issued asynchronously with one K step left in flight; blockwise fp8 promotes each
  128-deep K block's partial product into the accumulator while the next block's MMA
  runs. Then each runs the tile's epilogue on its rows.
- ``epilogue``: what a consumer does with a finished tile (``EPILOGUES``): store the rows,
  or SwiGLU of two accumulators into ``h``; the backward's first GEMM has its own
  (``swiglu_backward_rows``), which reads more than the accumulator.

Synchronisation protocol (per program; ``s`` = step % STAGES, phase = (step // STAGES) & 1,
``step`` counting K steps over all of the program's tiles, identically in every partition):

    load:      wait empty[s] at phase ^ 1   (a fresh barrier counts as released)
               expect ready[s] <- the stage's bytes; TMA A, B (, B2) -> stage s, arrive ready[s]
    consumer:  wait ready[s] at phase; issue the MMAs on stage s (asynchronous)
               wait until only this step's MMAs are in flight, then arrive empty[s - 1]
               (one arrival per consumer warpgroup: empty[] expects MMA_WARPGROUPS)
               after a tile's last step: wait for every MMA, arrive empty[s], epilogue

An mbarrier arrive is issued once per partition; every warp of a consumer warpgroup has
passed the MMA wait before it (the wait is warpgroup-wide), so the stage is free.
``grouped_gemm`` is the kernel and its host launcher. ``token_grouped_gemm`` runs the same
partitions on a schedule grouped along K (``schedule.TokenBlockTiles``: the weight
gradients, each expert contracting its own token blocks), with the same protocol.
``gate_up_gemm`` (GEMM1) and ``swiglu_grad_gemm`` (the backward's first GEMM) read rows the
dispatch may still be bringing: their load warp waits for them (``arrivals``: before a
tile's first copy, every chunk its rows come from at the call's epoch, as ``kernels.sync``
specifies). GEMM1's two consumer warpgroups multiply the same rows by W1 and W3 and hand
the up projection over through shared memory (``mma.gate_up_mma_partition``); the
backward's runs the SwiGLU backward as its epilogue (``epilogue.swiglu_backward_rows``).
"""
