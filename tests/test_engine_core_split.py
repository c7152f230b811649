"""The engine-core half of the split, on vLLM's real planner and real configs.

These call the patched ``get_kv_cache_configs`` exactly as the engine core
does, with real ``VllmConfig`` objects and real vLLM KV specs, for worker
layouts that would need more processes than this 2-core machine can run
(tensor x pipeline parallel) or devices it does not have (a GPU whose free
memory is smaller than a share: the per-worker limits are given directly,
standing in for what a GPU worker would report).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import vllm.v1.attention.backends.utils as attn_utils
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import human_readable_int
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.kv_cache_interface import FullAttentionSpec

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")


BIG = 1 << 40


def _config(model, pp=2, tp=1, budget=64 << 20, max_len=512, flag=True, tokens=None):
    cfg = EngineArgs(
        model=str(model),
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=None if tokens else budget,
        max_model_len=max_len,
        enable_pp_prop_kv_cache=flag,
        kv_cache_tokens=tokens,
    ).create_engine_config()
    from vllm.v1.core.single_type_kv_cache_manager import (
        register_all_kvcache_specs,
    )

    register_all_kvcache_specs(cfg)
    return cfg


def _specs(cfg, layers_per_stage, tp=1, heads=None):
    """Per-worker spec dicts, rank order = stage-major, TP-minor (as vLLM)."""
    bs = cfg.cache_config.block_size
    out, first = [], 0
    for stage, n in enumerate(layers_per_stage):
        h = heads[stage] if heads else 2
        stage_specs = {
            f"model.layers.{first + i}.self_attn.attn": FullAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=64, dtype=torch.bfloat16
            )
            for i in range(n)
        }
        first += n
        out += [dict(stage_specs) for _ in range(tp)]
    attn_utils.resolve_kv_cache_layout(
        cfg, [["LBHNC"]] * len(out), [s for d in out for s in d.values()]
    )
    return out


def _alloc(c):
    return max(t.size for t in c.kv_cache_tensors)


def test_tp2_x_pp2_split_per_shard(model_8l):
    cfg = _config(model_8l, tp=2)
    specs = _specs(cfg, [6, 2], tp=2)
    configs = ku.get_kv_cache_configs(cfg, specs, [BIG] * 4)
    assert len({c.num_blocks for c in configs}) == 1
    assert _alloc(configs[0]) == _alloc(configs[1])  # same stage, same share
    assert _alloc(configs[2]) == _alloc(configs[3])
    per_shard = _alloc(configs[0]) + _alloc(configs[2])
    assert per_shard <= 64 << 20
    assert _alloc(configs[0]) == 3 * _alloc(configs[2])


def test_share_follows_bytes_not_layer_count(model_8l):
    # Same layer count per stage, 4x the KV heads on stage 1: its share must
    # be 4x, where a layer-count split would give 50/50.
    cfg = _config(model_8l)
    specs = _specs(cfg, [4, 4], heads=[2, 8])
    configs = ku.get_kv_cache_configs(cfg, specs, [BIG, BIG])
    assert configs[0].num_blocks == configs[1].num_blocks
    assert _alloc(configs[1]) == 4 * _alloc(configs[0])
    total = _alloc(configs[0]) + _alloc(configs[1])
    bpb = total // configs[0].num_blocks
    assert (64 << 20) - bpb < total <= 64 << 20  # within one block of T


def test_without_flag_vllm_plans_alone(model_8l):
    cfg = _config(model_8l, flag=False)
    specs = _specs(cfg, [6, 2])
    configs = ku.get_kv_cache_configs(cfg, specs, [64 << 20] * 2)
    original = ku.get_kv_cache_configs.__kvmem_original__
    cfg2 = _config(model_8l, flag=False)
    expected = original(cfg2, _specs(cfg2, [6, 2]), [64 << 20] * 2)
    assert [(c.num_blocks, _alloc(c)) for c in configs] == [
        (c.num_blocks, _alloc(c)) for c in expected
    ]


@pytest.mark.parametrize("tp", [1, 2])
def test_share_above_device_limit_names_rank_share_limit_and_a_budget(model_8l, tp):
    cfg = _config(model_8l, budget=1 << 30, tp=tp)
    specs = _specs(cfg, [6, 2], tp=tp)
    limits = [BIG] * (2 * tp)
    limits[tp - 1] = 300 << 20  # the last TP rank of stage 0 would get 768 MiB
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, specs, limits)
    msg = str(e.value)
    assert f"rank {tp - 1} (pipeline stage 0)" in msg
    assert "768.00 MiB" in msg and "300.00 MiB" in msg
    suggested = human_readable_int(
        msg.split("--kv-cache-memory-bytes ")[-1].split("`")[0]
    )
    assert suggested >= 300 << 20  # a tight suggestion, not one TP times too small
    ok = _config(model_8l, budget=suggested, tp=tp)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2], tp=tp), limits)
    assert _alloc(configs[tp - 1]) <= 300 << 20
    too_much = _config(model_8l, budget=suggested + (2 << 20), tp=tp)
    with pytest.raises(ValueError, match="more than its device can hold"):
        ku.get_kv_cache_configs(too_much, _specs(too_much, [6, 2], tp=tp), limits)


@pytest.mark.parametrize("tp", [1, 2])
def test_share_too_small_for_one_sequence_names_a_budget_that_works(model_8l, tp):
    cfg = _config(model_8l, budget=2 << 20, max_len=1024, tp=tp)
    specs = _specs(cfg, [6, 2], tp=tp)
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, specs, [BIG] * (2 * tp))
    msg = str(e.value)
    assert "rank 0 (pipeline stage 0)" in msg and "1,024-token sequence" in msg
    suggested = msg.split("--kv-cache-memory-bytes ")[-1].split("`")[0]
    budget = human_readable_int(suggested)
    ok = _config(model_8l, budget=budget, max_len=1024, tp=tp)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2], tp=tp), [BIG] * (2 * tp))
    assert len({c.num_blocks for c in configs}) == 1
    # ... and the suggestion is tight: one MiB less no longer holds a sequence.
    less = _config(model_8l, budget=budget - (1 << 20), max_len=1024, tp=tp)
    with pytest.raises(ValueError, match="1,024-token sequence"):
        ku.get_kv_cache_configs(less, _specs(less, [6, 2], tp=tp), [BIG] * (2 * tp))


def test_num_gpu_blocks_override_still_wins(model_8l):
    cfg = _config(model_8l)
    cfg.cache_config.num_gpu_blocks_override = 7
    configs = ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), [64 << 20] * 2)
    assert [c.num_blocks for c in configs] == [7, 7]


def _capacity(cfg, config):
    return ku.get_kv_cache_capacity(cfg, config)[0]


@pytest.mark.parametrize("tokens", [5000, 16384, 100_001])
def test_token_budget_gives_every_rank_exactly_the_blocks_needed(model_8l, tokens):
    cfg = _config(model_8l, tp=2, tokens=tokens)
    specs = _specs(cfg, [6, 2], tp=2, heads=[2, 4])
    configs = ku.get_kv_cache_configs(cfg, specs, [BIG] * 4)
    blocks = {c.num_blocks for c in configs}
    assert len(blocks) == 1
    n = blocks.pop()
    assert _capacity(cfg, configs[0]) >= tokens
    bs = cfg.cache_config.block_size
    assert (n - 1) * bs < tokens  # one block fewer would not hold them
    # Bytes follow each stage's own bytes per block (6 layers x 2 heads vs
    # 2 layers x 4 heads): 12 : 8.
    assert _alloc(configs[0]) * 8 == _alloc(configs[2]) * 12


def test_token_budget_larger_than_a_device_names_rank_and_tokens_that_fit(model_8l):
    cfg = _config(model_8l, tokens=200_000)
    limits = [BIG, 10 << 20]
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), limits)
    msg = str(e.value)
    assert "--kv-cache-tokens 200,000: rank 1 needs" in msg
    assert "10.00 MiB free" in msg
    fit = int(msg.split("Use --kv-cache-tokens ")[-1].split(" ")[0].replace(",", ""))
    ok = _config(model_8l, tokens=fit)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2]), limits)
    assert _alloc(configs[1]) <= 10 << 20
    assert _capacity(ok, configs[1]) >= fit


@pytest.mark.parametrize("tokens", [100, 512])
def test_token_budget_below_one_sequence_is_refused(model_8l, tokens):
    cfg = _config(model_8l, tokens=tokens, max_len=512)
    with pytest.raises(ValueError, match=f"--kv-cache-tokens {tokens} cannot hold"):
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), [BIG, BIG])
    # ... and the suggested minimum is accepted.
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), [BIG, BIG])
    least = int(
        str(e.value).split("Use --kv-cache-tokens ")[1].split()[0].replace(",", "")
    )
    ok = _config(model_8l, tokens=least, max_len=512)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2]), [BIG, BIG])
    assert configs[0].num_blocks == 5  # 4 blocks of 128 tokens + the null block


def test_startup_report_lists_every_rank(model_8l):
    import logging

    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("vllm.kvmem.kv_budget")
    h = H()
    log.addHandler(h)
    try:
        cfg = _config(model_8l, tp=2, flag=False)
        configs = ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2], tp=2), [BIG] * 4)
    finally:
        log.removeHandler(h)
    (report,) = [r for r in records if r.startswith("KV cache per rank")]
    rows = report.splitlines()[2:]
    assert len(rows) == 4
    for rank, (row, c) in enumerate(zip(rows, configs)):
        rank_s, stage, layers, _gib, blocks, tokens, conc = row.split()
        assert int(rank_s) == rank and int(stage) == rank // 2
        assert int(layers) == (6 if rank < 2 else 2)
        assert int(blocks.replace(",", "")) == c.num_blocks
        assert int(tokens.replace(",", "")) == _capacity(cfg, c)


@pytest.mark.parametrize("flag", ["pp-prop", "tokens"])
def test_refusal_names_each_component_of_the_device_limit(model_8l, flag):
    """The workers' components (here as the executor patch stores them; a GPU
    worker would measure them) appear in the refusal, and the suggestion fits
    the limit after every component is taken off."""
    from vllm_kvmem.device_limits import RUNTIME_KEY, DeviceLimit

    def config(budget=None, tokens=None):
        cfg = _config(model_8l, budget=budget or (1 << 30), tokens=tokens)
        tight = DeviceLimit(free=900 << 20, cuda_graphs=300 << 20, staging=256 << 20)
        runtime = cfg.additional_config.setdefault(RUNTIME_KEY, {})
        runtime["device_limits"] = [asdict(tight), asdict(DeviceLimit(free=BIG))]
        limits = [tight.kv_bytes, BIG]  # 344 MiB on rank 0
        return cfg, limits

    cfg, limits = config(tokens=2_000_000) if flag == "tokens" else config()
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), limits)
    msg = str(e.value)
    assert (
        "900.00 MiB free after loading the model, less 300.00 MiB for vLLM's CUDA "
        "graph estimate, less 256.00 MiB for the host KV tier's staging buffer: "
        "344.00 MiB" in msg
    )
    if flag == "tokens":
        fit = int(msg.split("Use --kv-cache-tokens ")[1].split()[0].replace(",", ""))
        ok, limits = config(tokens=fit)
    else:
        fit = msg.split("Use `--kv-cache-memory-bytes ")[1].split("`")[0]
        ok, limits = config(budget=human_readable_int(fit))
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2]), limits)
    assert _alloc(configs[0]) <= 344 << 20
