"""nki_kernels package."""
