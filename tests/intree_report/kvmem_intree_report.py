"""A pytest plugin that records what the in-tree series' engine tests did,
so that ``tests/test_intree_engines.py`` can compare runs while the tests
themselves carry no hook of this project.

``tests/test_intree_engines.py`` runs each engine test in its own pytest
process with this folder on ``PYTHONPATH`` and ``PYTEST_PLUGINS`` naming this
module. Before the tests run it loads vLLM's general plugins as ``vllm serve``
does (vllm-kvmem's engine arguments exist on unmodified vLLM only once it is
loaded; the in-tree runs set ``VLLM_PLUGINS=""``, so nothing loads there). It
wraps ``LLM.generate``: after each call it asks every worker for its KV cache
figures and keeps them with the greedy token ids. At each test's end it
writes them to ``<test name>.json`` in the folder ``KVMEM_INTREE_REPORT``
names. Nothing here imports vllm_kvmem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_RECORD: dict[str, Any] = {}


def rank_figures(worker: Any) -> dict[str, Any]:
    """One worker's KV cache: layers, blocks, page and KV bytes, capacity.
    Runs in the worker (module-level, so the workers import it by name)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    cfg = worker.model_runner.kv_cache_config
    tokens, _ = get_kv_cache_capacity(worker.vllm_config, cfg)
    return {
        "rank": worker.rank,
        "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
        "num_blocks": cfg.num_blocks,
        "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
        "kv_bytes": sum(t.size for t in cfg.kv_cache_tensors),
        "tokens": tokens,
    }


def pytest_configure(config: Any) -> None:
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    generate = LLM.generate

    def recording_generate(self: LLM, *args: Any, **kwargs: Any) -> Any:
        outputs = generate(self, *args, **kwargs)
        ranks = self.collective_rpc(rank_figures)
        _RECORD["ranks"] = sorted(ranks, key=lambda r: r["rank"])
        _RECORD["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        return outputs

    LLM.generate = recording_generate


def pytest_runtest_teardown(item: Any) -> None:
    folder = os.environ.get("KVMEM_INTREE_REPORT")
    if folder and _RECORD:
        path = Path(folder) / f"{item.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_RECORD, indent=1))
    _RECORD.clear()
