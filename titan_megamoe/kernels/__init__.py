"""Triton kernels of the fused MoE operator (installed as ``titan_megamoe.kernels``).

Kernels know nothing of TorchTitan: they take tensors, counts and peer buffers.
"""
