"""Tell the host KV tier about a cached block before vLLM evicts it."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def _maybe_evict_cached_block(self, block):
        if block.block_hash is not None:
            from vllm_kvmem.host_tier import notify_evicted

            notify_evicted(block)
        return original(self, block)

    return _maybe_evict_cached_block


PATCH = Patch(
    name="block_pool_evict",
    target="vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block",
    make_replacement=_make,
    signature=("self", "block"),
    processes=("engine core",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="The host tier keeps exactly the blocks the device prefix cache evicts, "
    "at the moment a freed cached block is handed to another request; vLLM's "
    "connector API has no eviction callback (KV events carry hashes, not the "
    "block id the copy needs), and upstream offloading stores every block as it "
    "is computed instead.",
    how="Before vLLM drops the block's hashes, calls the host tier's listener "
    "(set only when `--kv-host-cache-bytes` is on) with the block. A block "
    "already copied ahead of eviction moves nothing; any other is queued for a "
    "device-to-host copy that the workers run before the step's forward pass "
    "(or dropped with `--kv-host-cache-late-spill drop`). A no-op attribute "
    "check when the tier is off.",
    upstream="None; would be an eviction hook on BlockPool for KV connectors.",
    remove_when="vLLM gives connectors an eviction callback with block ids.",
    idle="Calls vLLM's method; the eviction is passed to no one (no host tier "
    "listens).",
)
