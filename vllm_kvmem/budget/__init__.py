"""The KV budget: how much KV cache each rank gets, and the table that says so.

One folder for the feature from the flags to a worker's allocation: the
pipeline-wide split (``pp_prop``, its arithmetic in ``pp_split``), the token
budget (``token_budget``, ``token_blocks``), each worker's device limit
(``device_limits``), the engine core's plan (``kv_budget``, vLLM 0.33's
builder in ``kv_builder``), the facts it keeps at run time (``runtime``) and
the startup table (``capacity_table``). The vLLM patches that call it stay in
``vllm_kvmem.patches``. Importing this package imports no vLLM: ``pp_split``
and ``token_blocks`` serve ``kvmem plan`` where vLLM is not installed.
"""
