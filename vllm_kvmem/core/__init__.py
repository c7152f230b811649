"""The vLLM-free core: arithmetic and data structures over ints and tensors.

Nothing under this package imports vLLM, so it can be unit-tested in
milliseconds and reused by the offline planner.
"""
