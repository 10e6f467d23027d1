"""Tensor-parallel twins: one rank's slice of each subkernel's math, in PyTorch (see nki_kernels/README.md)."""
