"""A KV connector that moves nothing, for the benchmarks' ``noop`` arms.

It is the tests' example connector (``tests/contiguous_example.py``, so the
process needs the repository root on its path) asking for no layout: with
it, vLLM does its per-step work for a connector (metadata built, handed to
the workers and answered) and nothing else, so that an arm with it separates
vLLM's plumbing from what the host tier itself costs.
"""

NOOP_TRANSFER_CONFIG = {
    "kv_connector": "ContiguousLayoutExampleConnector",
    "kv_connector_module_path": "tests.contiguous_example",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"kv_cache_layout": None},
}
