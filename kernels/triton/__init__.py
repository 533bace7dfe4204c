"""Triton kernels of fusedlm (the `triton` backend), one module per op."""
