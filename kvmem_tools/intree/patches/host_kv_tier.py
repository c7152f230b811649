"""[KV Connector] A host-memory tier for prefix-cache evictions.

The connector's modules are the plugin's own (``vllm_kvmem/host_tier/``, one
source): each is added under vLLM's tree with its imports renamed, vLLM's
SPDX header, and ruff run as vLLM's pre-commit runs it. Only the plugin's
start-up (its flags, the host memory check, the block count from a byte
size) stays out: in-tree the connector is configured through
``kv_connector_extra_config``. The RFC is docs/rfc-host-kv-tier.md.
"""

from pathlib import Path

import vllm_kvmem
from kvmem_tools.intree.edits import SPDX, Edit, NewFile
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "host_kv_tier"
PLUGIN = Path(vllm_kvmem.__file__).resolve().parent / "host_tier"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/host_tier_connector.py"
PACKAGE = "vllm/v1/host_kv_tier/"
#: The plugin's modules that go in, besides the connector: the whole folder.
MODULES = tuple(
    sorted(
        p.stem for p in PLUGIN.glob("*.py") if p.stem not in ("__init__", "connector")
    )
)
#: What the plugin names differently from vLLM's tree, in the order applied.
RENAMES = (
    ("vllm_kvmem.host_tier.connector", CONNECTOR[:-3].replace("/", ".")),
    ("vllm_kvmem.host_tier.", PACKAGE.replace("/", ".")),
    ("KVMemHostTierConnector", "HostTierConnector"),
    ('init_logger("vllm.kvmem.host_tier")', "init_logger(__name__)"),
    ('logging.getLogger("vllm.kvmem.copy_engine")', "logging.getLogger(__name__)"),
    ("vllm:kvmem_host_", "vllm:host_kv_tier_"),
    ('"kvmem-prefault"', '"host-kv-tier-prefault"'),
)

MESSAGE = """\
## Purpose

vLLM's prefix cache forgets a block when `BlockPool.get_new_blocks` hands it
to another request; a later request with that prefix recomputes it. This PR
adds `HostTierConnector`, a KV connector that keeps such blocks in host
memory and loads them back on a prefix hit (RFC: "A host-memory KV tier that
catches prefix-cache evictions", which compares it point by point with
`SimpleCPUOffloadConnector` eager and lazy and `OffloadingConnector`).

Like lazy offload it copies only cached blocks near the head of the free
queue, read through `bind_gpu_block_pool`. It adds: a block evicted before its
copy ran is copied before the forward pass that would overwrite it (found in a
shadow of the free queue's head: no `BlockPool` change); copied blocks keep
their place in vLLM's LRU order (no reference taken; a reallocated block makes
the compute stream, not the host, wait for its copy); copies bounded per step
both ways, with small hits loaded in the step they are admitted; vLLM's CPU
platform as well as CUDA; failed saves forgotten and failed loads recomputed.
It is `SupportsHMA` (full attention and sliding window), reports its hits as
`CacheHitSource.HOST`, and is a best-effort cache (`requires_kv_delivery` is
False).

```python
kv_transfer_config=KVTransferConfig(
    kv_connector="HostTierConnector", kv_role="kv_both",
    kv_load_failure_policy="recompute",
    kv_connector_extra_config={"num_host_blocks": 4096})
```

Other keys: `eviction_policy` (lru, fifo), `step_bytes`, `late_spill` (copy,
drop), `verify`. The connector asks for the `BLHNC` layout (a block is one
copy) through `get_required_kvcache_layout()`; where the attention backend
lacks it, vLLM keeps its own layout and the tier gathers each block's pages.

Not in this PR: flags, the host memory check at startup, KV events, Mamba and
MLA models (refused with one log line; the engine serves without the tier).

## Test Plan

- `pytest tests/v1/host_kv_tier/`, no model: the scheduler on vLLM's
  `BlockPool` (copies ahead up to the step budget; a block evicted before its
  copy is spilled with the hash it held, once; a prefix-cache reset spills
  nothing; a finished request's blocks evicted in the next pass are caught;
  host hits and the load budget), and the worker saving and loading blocks
  of a real KV cache tensor in `LBHNC` and `BLHNC`.
- `pytest tests/v1/e2e/test_host_kv_tier_engine.py`: a random-weight Llama
  with a 12-block device cache and three prompts of five blocks and a bit:
  the second and third evict every block of the first, so when the first
  comes again its prefix can only come from host memory.

## Test Result

All pass on CPU (vLLM 0.32 and 0.33 builds). In the engine test the revisit
reads its 5 full blocks (640 tokens) from host memory, in the `BLHNC` layout
with the CPU patch of this series, and its 8 greedy tokens equal the first
round's.
"""


def _module(name: str, path: str) -> NewFile:
    source = PLUGIN / f"{name}.py"
    text = source.read_text()
    renames = tuple((a, b) for a, b in RENAMES if a in text)
    return NewFile(path, source, renames, prefix=SPDX, tidy=True)


def _changes() -> list:
    tests = FILES / SLUG / "tests/v1"
    return [
        _module("connector", CONNECTOR),
        NewFile(PACKAGE + "__init__.py", FILES / SLUG / PACKAGE / "__init__.py"),
        *(_module(name, f"{PACKAGE}{name}.py") for name in MODULES),
        Edit(
            "vllm/distributed/kv_transfer/kv_connector/factory.py",
            '    "vllm.distributed.kv_transfer.kv_connector.v1.'
            'simple_cpu_offload_connector",\n'
            '    "SimpleCPUOffloadConnector",\n)\n',
            "KVConnectorFactory.register_connector(\n"
            '    "HostTierConnector",\n'
            '    "vllm.distributed.kv_transfer.kv_connector.v1.host_tier_connector",\n'
            '    "HostTierConnector",\n)\n',
        ),
        *(
            NewFile(f"tests/v1/{p}", tests / p)
            for p in (
                "host_kv_tier/test_scheduler.py",
                "host_kv_tier/test_worker.py",
                "e2e/test_host_kv_tier_engine.py",
            )
        ),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[KV Connector] Host-memory tier for evicted KV blocks",
    message=MESSAGE,
    changes={"0.32": _changes(), "0.33": _changes()},
)
