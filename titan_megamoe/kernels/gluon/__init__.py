"""Kernels written in Gluon (``triton.experimental.gluon``), one package per architecture.

Gluon exposes what ``tl.dot`` hides on Hopper: asynchronous warpgroup MMAs waited on with
a number left in flight, TMA copies into shared-memory rings guarded by mbarriers, and
warp-specialized partitions with their own register budgets. Gluon kernels do not run
under the Triton interpreter: the CPU tests compile them for their target and check
their resources; their numerics are GPU tests.
"""
