"""vllm-kvmem's development tools, kept out of the runtime package (and its
wheel): the in-tree series generator (``python -m kvmem_tools.intree``) and the
reader of a vLLM tree's sources that it and the tests share."""
