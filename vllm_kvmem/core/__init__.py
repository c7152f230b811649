"""What several features share, vLLM-free: byte sizes, the one text table,
fixed pseudo-random numbers and percentiles.

Nothing under this package imports vLLM, so ``kvmem plan``, the demo and the
benchmarks use it where vLLM is not installed.
"""
