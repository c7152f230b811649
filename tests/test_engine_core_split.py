"""The engine-core half of the split, on vLLM's real planner and real configs.

These call the patched ``get_kv_cache_configs`` exactly as the engine core
does, with real ``VllmConfig`` objects and real vLLM KV specs, for worker
layouts that would need more processes than this 2-core machine can run
(tensor x pipeline parallel) or devices it does not have (a GPU whose free
memory is smaller than a share: the per-worker limits are given directly,
standing in for what a GPU worker would report).
"""

from __future__ import annotations

import pytest
from vllm.v1.core import kv_cache_utils as ku

from tests.helpers import captured_log, messages
from tests.helpers import planner_config as _config
from tests.helpers import worker_specs as _specs

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")


BIG = 1 << 40
MiB = 1 << 20
# model_8l on CPU: 128-token blocks of 64 KiB per layer, so a 6/2 split holds
# 384 KiB of each block on stage 0 and 128 KiB on stage 1 (3/4 and 1/4).


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
    # Stage 0 gets 3/4 of 1 GiB; the largest budget whose 3/4 fits 300 MiB is
    # 400 MiB (a tight suggestion, not one TP times too small).
    assert str(e.value) == (
        f"--enable-pp-prop-kv-cache: rank {tp - 1} (pipeline stage 0) gets "
        "768.00 MiB of the 1,024.00 MiB --kv-cache-memory-bytes budget, more than "
        "its device can hold (300.00 MiB free after loading the model). Use "
        "`--kv-cache-memory-bytes 400M` or less, or move layers off this stage "
        "with VLLM_PP_LAYER_PARTITION."
    )
    suggested = 400 * MiB
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
    # 1,024 tokens are 8 blocks, plus vLLM's null block: 9 blocks of 384 KiB
    # (3.38 MiB) on stage 0, and 9 x 512 KiB = 4.5 MiB pipeline-wide, so 5M.
    assert str(e.value) == (
        "--enable-pp-prop-kv-cache: rank 0 (pipeline stage 0) gets 1.50 MiB "
        "(4 blocks) of the 2.00 MiB --kv-cache-memory-bytes budget, less than the "
        "3.38 MiB (9 blocks, with vLLM's null block) one 1,024-token sequence "
        "needs there. Use `--kv-cache-memory-bytes 5M` or more, or lower "
        "--max-model-len."
    )
    budget = 5 * MiB
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
    # All but the null block hold them; one block fewer would not.
    assert (n - 2) * bs < tokens <= (n - 1) * bs
    # Bytes follow each stage's own bytes per block (6 layers x 2 heads vs
    # 2 layers x 4 heads): 12 : 8.
    assert _alloc(configs[0]) * 8 == _alloc(configs[2]) * 12


def test_token_budget_larger_than_a_device_names_rank_and_tokens_that_fit(model_8l):
    cfg = _config(model_8l, tokens=200_000)
    limits = [BIG, 10 << 20]
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), limits)
    # 200,000 tokens are 1,563 blocks of 128 KiB on stage 1, and the null
    # block; its 10 MiB hold 80 blocks, 79 usable: 10,112 tokens.
    assert str(e.value) == (
        "--kv-cache-tokens 200,000: rank 1 needs 1,564 blocks = 195.50 MiB of KV "
        "cache, more than its device can hold (10.00 MiB free after loading the "
        "model). Use --kv-cache-tokens 10,112 or less."
    )
    fit = 10_112
    ok = _config(model_8l, tokens=fit)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2]), limits)
    assert _alloc(configs[1]) <= 10 << 20
    assert _capacity(ok, configs[1]) >= fit


@pytest.mark.parametrize("tokens", [100, 384])
def test_token_budget_below_one_sequence_is_refused(model_8l, tokens):
    cfg = _config(model_8l, tokens=tokens, max_len=512)
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), [BIG, BIG])
    # 512 tokens are 4 blocks, plus vLLM's null block: 5 blocks, which any
    # budget above 3 blocks' 384 tokens buys.
    assert str(e.value) == (
        f"--kv-cache-tokens {tokens} cannot hold one 512-token sequence "
        "(max_model_len) next to vLLM's null block: that needs 5 blocks. Use "
        "--kv-cache-tokens 385 or more, or lower --max-model-len."
    )
    # ... and the suggested minimum is accepted.
    ok = _config(model_8l, tokens=385, max_len=512)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2]), [BIG, BIG])
    assert configs[0].num_blocks == 5  # 4 blocks of 128 tokens + the null block


def test_startup_report_lists_every_rank(model_8l):
    with captured_log("vllm.kvmem.capacity_table") as records:
        cfg = _config(model_8l, tp=2, flag=False)
        configs = ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2], tp=2), [BIG] * 4)
    (report,) = [m for m in messages(records) if m.startswith("KV cache per rank")]
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
    from vllm_kvmem.budget.runtime import BudgetRuntime, DeviceLimit

    def config(budget=None, tokens=None):
        cfg = _config(model_8l, budget=budget or (1 << 30), tokens=tokens)
        tight = DeviceLimit(
            free=1306 << 20,
            cuda_graphs=300 << 20,
            staging=512 << 20,
            headroom=150 << 20,
        )
        BudgetRuntime(device_limits=[tight, DeviceLimit(free=BIG)]).store(cfg)
        limits = [tight.kv_bytes, BIG]  # 344 MiB on rank 0
        return cfg, limits

    cfg, limits = config(tokens=2_000_000) if flag == "tokens" else config()
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, _specs(cfg, [6, 2]), limits)
    limit = (
        "(1,306.00 MiB free after loading the model, less 300.00 MiB for vLLM's "
        "CUDA graph estimate, less 512.00 MiB for the host KV tier's staging "
        "buffers, less 150.00 MiB for headroom: 344.00 MiB)"
    )
    # 344 MiB hold 917 blocks of 384 KiB (916 usable: 117,248 tokens) on
    # stage 0, which
    # gets 3/4 of a budget: 458 MiB at most.
    if flag == "tokens":
        assert str(e.value) == (
            "--kv-cache-tokens 2,000,000: rank 0 needs 15,626 blocks = 5,859.75 MiB "
            f"of KV cache, more than its device can hold {limit}. Use "
            "--kv-cache-tokens 117,248 or less."
        )
        ok, limits = config(tokens=117_248)
    else:
        assert str(e.value) == (
            "--enable-pp-prop-kv-cache: rank 0 (pipeline stage 0) gets 768.00 MiB of "
            "the 1,024.00 MiB --kv-cache-memory-bytes budget, more than its device "
            f"can hold {limit}. Use `--kv-cache-memory-bytes 458M` or less, or move "
            "layers off this stage with VLLM_PP_LAYER_PARTITION."
        )
        ok, limits = config(budget=458 * MiB)
    configs = ku.get_kv_cache_configs(ok, _specs(ok, [6, 2]), limits)
    assert _alloc(configs[0]) <= 344 << 20


def test_a_stage_without_kv_layers_is_refused_by_name(model_8l):
    """A stage that holds no attention layer has no bytes per block to split
    by: refused naming the stage and rank, not ignored."""
    cfg = _config(model_8l, budget=64 << 20)
    specs = _specs(cfg, [8, 0])
    with pytest.raises(ValueError) as e:
        ku.get_kv_cache_configs(cfg, specs, [BIG, BIG])
    assert str(e.value).startswith(
        "--enable-pp-prop-kv-cache: pipeline stage 1 (rank 1) holds no KV cache "
        "layers, so the --kv-cache-memory-bytes budget cannot be split"
    ), str(e.value)
