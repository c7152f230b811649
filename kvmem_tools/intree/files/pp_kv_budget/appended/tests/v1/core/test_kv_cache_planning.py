def _pp_config(budget: int, pp: int = 2, tp: int = 1) -> VllmConfig:
    return VllmConfig(
        cache_config=CacheConfig(
            kv_cache_memory_bytes=budget, enable_pp_prop_kv_cache=True
        ),
        parallel_config=ParallelConfig(
            pipeline_parallel_size=pp, tensor_parallel_size=tp
        ),
    )


def _pp_specs(stages: list[int]) -> list[dict]:
    """One spec dict a worker, holding its stage's layer."""
    spec = new_kv_cache_spec(dtype=torch.bfloat16)
    return [{f"layers.{stage}": spec} for stage in stages]


@pytest.mark.parametrize(
    "bytes_per_block,tp",
    [
        ([6 * 64 * 1024, 2 * 64 * 1024], 1),  # 6 and 2 layers
        ([4 * 32 * 1024, 4 * 128 * 1024], 1),  # 2 and 8 KV heads
        ([6 * 64 * 1024] * 2 + [2 * 64 * 1024] * 2, 2),  # TP 2 x PP 2
    ],
)
def test_pp_prop_kv_cache_shares_follow_bytes_per_block(bytes_per_block, tp):
    budget = 64 << 20
    stages = [w // tp for w in range(len(bytes_per_block))]
    memory = kv_cache_planning._split_kv_budget_across_pp_stages(
        _pp_config(budget, tp=tp),
        _pp_specs(stages),
        bytes_per_block,
        [budget] * len(bytes_per_block),
    )
    blocks = {m // b for m, b in zip(memory, bytes_per_block)}
    assert len(blocks) == 1  # the same block count on every stage
    assert all(m % b == 0 for m, b in zip(memory, bytes_per_block))
    per_shard = sum(memory[::tp])
    assert budget - sum(bytes_per_block[::tp]) < per_shard <= budget
    assert memory[0] * bytes_per_block[-1] == memory[-1] * bytes_per_block[0]


def test_pp_prop_kv_cache_stage_without_kv_cache_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline stage\(s\) \[1\] hold no KV"):
        kv_cache_planning._split_kv_budget_across_pp_stages(
            _pp_config(64 << 20), _pp_specs([0, 1]), [64 * 1024, 0], [64 << 20] * 2
        )


def test_pp_prop_kv_cache_workers_out_of_stage_order_are_refused():
    # TP 2 x PP 2 with the ranks tensor-parallel-major.
    with pytest.raises(RuntimeError, match="stage-major .* worker 1 does not hold"):
        kv_cache_planning._split_kv_budget_across_pp_stages(
            _pp_config(64 << 20, tp=2),
            _pp_specs([0, 1, 0, 1]),
            [6 * 1024, 2 * 1024] * 2,
            [64 << 20] * 4,
        )


def test_pp_prop_kv_cache_attention_free_model_keeps_its_memory():
    memory = kv_cache_planning._split_kv_budget_across_pp_stages(
        _pp_config(64 << 20), [{}, {}], [0, 0], [5, 7]
    )
    assert memory == [5, 7]


def test_pp_prop_kv_cache_requires_kv_cache_memory_bytes():
    with pytest.raises(ValueError, match="set kv_cache_memory_bytes as well"):
        CacheConfig(enable_pp_prop_kv_cache=True)
