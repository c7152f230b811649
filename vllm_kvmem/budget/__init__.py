"""The KV budget: how much KV cache each rank gets, and the table that says so.

One folder for the feature from the flags to a worker's allocation: the
flags' checks (``pp_prop`` for the pipeline-wide split, ``token_budget`` for
``--kv-cache-tokens``), each worker's device limit (``device_limits``), the
engine core's one plan and the hooks that call it (``kv_budget``; vLLM 0.33's
builder in ``kv_builder``), the facts it keeps at run time (``runtime``) and
the startup table (``capacity_table``). The vLLM patches that call it stay in
``vllm_kvmem.patches``; its arithmetic over ints is ``core.kv_arith``, which
``kvmem plan`` shares where vLLM is not installed.
"""
