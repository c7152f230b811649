"""The contract of the in-tree offload series (issue 38): vLLM's own
SimpleCPUOffloadConnector in lazy mode, with the series applied and no
plugin, serves at least the host hit rate of the plugin's host tier on the
same CPU workload, with greedy output equal to no offload; without the late
spills PR it falls short. On vLLM 0.32 and 0.33.

The CPU build cannot run SimpleCPUOffloadConnector as vLLM ships it (CUDA
streams, pinning, batched memcpy): both vLLM trees get
``kvmem_tools.intree.cpu_scaffolding``, a synchronous copy path that stands in
for the GPU this machine lacks. It is test scaffolding, not a PR.

Workload: a 12-block device cache (11 usable), at most 2 requests at once,
prompts of 3 blocks and a bit. Round 1 sends prompts 0-3 in one batch: when
0 and 1 finish, 2 and 3 take their blocks in the next scheduling pass, before
lazy offload's walk (at the end of that pass) reaches them; round 2 sends 4
other prompts, which evict the rest; round 3 sends prompts 0-3 again, whose
prefixes can then only come from host memory.

Per release, three processes (an engine start is ~2 s, a process ~10 s): the
series' vLLM with no plugin (no offload, then lazy offload), the release's
vLLM without the series (lazy offload), both with the scaffolding, and the
release's vLLM with the plugin's connector. Run as a script, this file is
that process's driver: it imports only vLLM.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BLOCK_SIZE = 32  # the CPU attention backend's smallest
DEVICE_BLOCKS = 12
PROMPT_TOKENS = 3 * BLOCK_SIZE + 5
HOST_BYTES = 16 << 20
LAZY = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": HOST_BYTES, "lazy_offload": True},
}
PLUGIN = {
    "kv_connector": "KVMemHostTierConnector",
    "kv_connector_module_path": "vllm_kvmem.host_tier.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"num_host_blocks": 64},
}


def run_arms(model: str, arms: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Each arm's engine (``kv_transfer_config`` or None) on the workload, one
    after the other in this process: cached tokens and greedy tokens of
    each round."""
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    hf = AutoConfig.from_pretrained(model)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    # float32 K and V of every layer
    block_bytes = 2 * BLOCK_SIZE * hf.num_key_value_heads * head * 4
    block_bytes *= hf.num_hidden_layers

    def tokens(p: int) -> list[int]:
        return [(p * 131 + i * 7 + 11) % 1000 for i in range(PROMPT_TOKENS)]

    prompts = [TokensPrompt(prompt_token_ids=tokens(p)) for p in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    for name, connector in arms.items():
        llm = LLM(
            model=model,
            dtype="float32",
            block_size=BLOCK_SIZE,
            max_model_len=4 * BLOCK_SIZE,
            max_num_seqs=2,
            enforce_eager=True,
            kv_cache_memory_bytes=DEVICE_BLOCKS * block_bytes,
            kv_transfer_config=KVTransferConfig(**connector) if connector else None,
        )
        rounds = [
            llm.generate(batch, params, use_tqdm=False)
            for batch in (prompts[:4], prompts[4:], prompts[:4])
        ]
        out[name] = {
            "cached": [[o.num_cached_tokens for o in r] for r in rounds],
            "tokens": [[list(o.outputs[0].token_ids) for o in r] for r in rounds],
        }
        del llm
        gc.collect()
    return out


def _run(python: str, model: Path, arms: dict, env: dict, cwd: Path) -> dict:
    done = subprocess.run(
        [python, __file__, str(model), json.dumps(arms)],
        env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=420,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("ARMS=")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-4000:]
    return json.loads(lines[-1].removeprefix("ARMS="))


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def arms(request, tmp_path_factory, model_8l) -> dict[str, Any]:
    """Every arm's results on one release."""
    from kvmem_tools.intree import cpu_scaffolding
    from kvmem_tools.intree import series as intree
    from tests.helpers import ROOT, engine_env, no_plugin_shim, site_033

    if request.param == "0.32":
        python, src = sys.executable, intree.installed_vllm_root()
    else:
        python, src = request.getfixturevalue("vllm033_python"), site_033()
    tmp = tmp_path_factory.mktemp(f"offload{request.param.replace('.', '')}")
    _version, files = intree.write_series(tmp / "series", src)
    shim = no_plugin_shim(tmp / "shim")
    results: dict[str, Any] = {}
    for tree, patches, arms_here in (
        ("series", files, {"none": None, "lazy": LAZY}),
        ("release", [], {"lazy_without_late_spills": LAZY}),
    ):
        copy = intree.copy_tree(src, tmp / tree)
        intree.apply_series(copy, patches)
        cpu_scaffolding.apply(copy)
        env = engine_env(PYTHONPATH=f"{copy}{os.pathsep}{shim}", VLLM_PLUGINS="")
        results.update(_run(python, model_8l, arms_here, env, copy))
    env = engine_env(PYTHONPATH=str(ROOT))
    results.update(_run(python, model_8l, {"plugin": PLUGIN}, env, ROOT))
    return results


def _host_hit_rate(arm: dict[str, Any]) -> float:
    """Round 3's cached tokens over the tokens of its prompts' full blocks (what
    a prefix cache can hold): all from host memory (round 2 evicted every block
    of prompts 0-3; the no-offload arm shows it)."""
    return sum(arm["cached"][2]) / (4 * (PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE)


@pytest.mark.engine
def test_lazy_offload_with_the_series_matches_the_plugin_tier(arms):
    none, lazy, plugin = arms["none"], arms["lazy"], arms["plugin"]
    assert none["cached"][2] == [0, 0, 0, 0]  # nothing left on the device
    assert lazy["tokens"] == none["tokens"] == plugin["tokens"]
    assert _host_hit_rate(lazy) >= _host_hit_rate(plugin) > 0
    assert lazy["cached"][2] == [3 * BLOCK_SIZE] * 4  # every full block


@pytest.mark.engine
def test_without_late_spills_lazy_offload_falls_short(arms):
    without = arms["lazy_without_late_spills"]
    assert without["tokens"] == arms["none"]["tokens"]
    # Prompts 0 and 1 finished together and 2 and 3 took their blocks before
    # the walk reached them, and so did round 2 with 2 and 3's: only one of
    # each pair reached host memory. The RFC's figure: 50% against 100%.
    assert _host_hit_rate(without) == 0.5
    assert _host_hit_rate(arms["lazy"]) == 1.0


if __name__ == "__main__":
    print("ARMS=" + json.dumps(run_arms(sys.argv[1], json.loads(sys.argv[2]))))
