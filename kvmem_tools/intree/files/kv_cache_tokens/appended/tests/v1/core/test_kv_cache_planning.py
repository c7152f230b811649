@pytest.fixture(scope="module")
def kv_cache_tokens_model(tmp_path_factory) -> str:
    """A model config without weights: planning reads only its limits."""
    path = tmp_path_factory.mktemp("model")
    LlamaConfig(
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=8192,
    ).save_pretrained(path)
    return str(path)


def _tokens_layers(first: int, last: int, block_size: int = 128) -> dict:
    spec = new_kv_cache_spec(block_size=block_size, dtype=torch.bfloat16)
    return {f"layers.{i}": spec for i in range(first, last)}


def _tokens_plan(model, tokens, specs, memory, max_model_len=2048, block_size=128):
    config = VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, max_model_len=max_model_len
        ),
        cache_config=CacheConfig(kv_cache_tokens=tokens, block_size=block_size),
    )
    config.cache_config.kv_cache_layout = "LBHNC"
    return config, get_kv_cache_configs(config, specs, memory)


def _tokens_held(config, kv_cache_config, num_blocks) -> int:
    """Tokens `num_blocks` blocks hold, as vLLM reports the KV cache capacity."""
    return kv_cache_utils.get_kv_cache_capacity(
        config, replace(kv_cache_config, num_blocks=num_blocks)
    )[0]


def _holds_just_enough(config, kv_cache_config, tokens) -> bool:
    """The blocks besides the null block hold `tokens`; one fewer would not."""
    n = kv_cache_config.num_blocks
    return (
        _tokens_held(config, kv_cache_config, n - 1)
        >= tokens
        > _tokens_held(config, kv_cache_config, n - 2)
    )


@pytest.mark.parametrize(
    "tokens,block_size,max_model_len,num_blocks",
    [
        (3000, 128, 2048, 25),  # 24 blocks hold 3,072 tokens, plus the null block
        (3072, 128, 2048, 25),
        (3073, 128, 2048, 26),
        (3000, 128, 2000, 25),  # a request of 2,000 tokens takes 16 blocks
        (3000, 16, 2048, 189),
        (400_000, 16, 8192, 25_001),
    ],
)
def test_kv_cache_tokens_blocks_hold_the_tokens_after_the_null_block(
    kv_cache_tokens_model, tokens, block_size, max_model_len, num_blocks
):
    config, (kv_cache_config,) = _tokens_plan(
        kv_cache_tokens_model,
        tokens,
        [_tokens_layers(0, 8, block_size)],
        [1 << 40],
        max_model_len,
        block_size,
    )
    assert kv_cache_config.num_blocks == num_blocks
    assert _holds_just_enough(config, kv_cache_config, tokens)
    page = new_kv_cache_spec(block_size=block_size, dtype=torch.bfloat16)
    assert sum(t.size for t in kv_cache_config.kv_cache_tensors) == (
        num_blocks * 8 * page.page_size_bytes
    )


def test_kv_cache_tokens_pipeline_stages_allocate_their_own_bytes(
    kv_cache_tokens_model,
):
    specs = [_tokens_layers(0, 6), _tokens_layers(6, 8)]
    _, configs = _tokens_plan(kv_cache_tokens_model, 3000, specs, [1 << 40] * 2)
    assert [c.num_blocks for c in configs] == [25, 25]
    page = new_kv_cache_spec(block_size=128, dtype=torch.bfloat16).page_size_bytes
    sizes = [sum(t.size for t in c.kv_cache_tensors) for c in configs]
    assert sizes == [25 * 6 * page, 25 * 2 * page]


def test_kv_cache_tokens_hybrid_model_counts_every_group(kv_cache_tokens_model):
    sliding = new_sliding_window_spec(
        block_size=128, dtype=torch.bfloat16, sliding_window=512
    )
    specs = {**_tokens_layers(0, 4), **{f"layers.{i}": sliding for i in range(4, 8)}}
    config, (kv_cache_config,) = _tokens_plan(
        kv_cache_tokens_model, 10_000, [specs], [1 << 40], 4096
    )
    assert len(kv_cache_config.kv_cache_groups) == 2
    assert _holds_just_enough(config, kv_cache_config, 10_000)


def test_kv_cache_tokens_auto_max_model_len_fits_the_tokens(kv_cache_tokens_model):
    config, (kv_cache_config,) = _tokens_plan(
        kv_cache_tokens_model, 3000, [_tokens_layers(0, 8)], [1 << 40], -1
    )
    assert kv_cache_config.num_blocks == 25
    assert config.model_config.max_model_len == 3072
    assert _holds_just_enough(config, kv_cache_config, 3000)


def test_kv_cache_tokens_beyond_a_workers_memory_are_refused(kv_cache_tokens_model):
    # 10 MiB holds 20 blocks of 8 layers: 19 of them besides the null block.
    with pytest.raises(ValueError, match="on worker 0.*at most 2432 tokens fit"):
        _tokens_plan(kv_cache_tokens_model, 3000, [_tokens_layers(0, 8)], [10 << 20])
    # 2 MiB holds 16 blocks of 2 layers.
    specs = [_tokens_layers(0, 6), _tokens_layers(6, 8)]
    with pytest.raises(ValueError, match="on worker 1.*at most 1920 tokens fit"):
        _tokens_plan(kv_cache_tokens_model, 3000, specs, [1 << 40, 2 << 20])


def test_kv_cache_tokens_below_one_request_are_refused(kv_cache_tokens_model):
    with pytest.raises(ValueError, match="less than one request of max_model_len"):
        _tokens_plan(kv_cache_tokens_model, 1000, [_tokens_layers(0, 8)], [1 << 40])


def test_kv_cache_tokens_stage_without_kv_cache_layers_is_refused(
    kv_cache_tokens_model,
):
    specs = [_tokens_layers(0, 8), {}]
    with pytest.raises(ValueError, match=r"worker\(s\) \[1\] hold no KV cache"):
        _tokens_plan(kv_cache_tokens_model, 3000, specs, [1 << 40] * 2)


def test_kv_cache_tokens_logs_no_override(kv_cache_tokens_model):
    with patch.object(kv_cache_planning, "logger") as logger:
        _tokens_plan(kv_cache_tokens_model, 3000, [_tokens_layers(0, 8)], [1 << 40])
    logged = [call.args[0] for call in logger.info.call_args_list]
    assert not [m for m in logged if "num_gpu_blocks_override" in m]
    assert [m for m in logged if m.startswith("kv_cache_tokens=")]


def test_kv_cache_tokens_capacity_log_says_the_tokens_after_the_null_block(
    kv_cache_tokens_model,
):
    config, (kv_cache_config,) = _tokens_plan(
        kv_cache_tokens_model, 3000, [_tokens_layers(0, 8)], [1 << 40]
    )
    with patch.object(kv_cache_utils, "logger") as logger:
        kv_cache_utils.update_kv_cache_capacity(config, kv_cache_config)
    message, *args = logger.info_once.call_args.args
    assert message % tuple(args) == (
        "CPU KV cache size: 3,200 tokens (3,072 after the null block, "
        "kv_cache_tokens=3,000), Maximum concurrency for 2,048 tokens per "
        "request: 1.56x"
    ).replace("CPU", kv_cache_utils._kv_cache_device_name(config))


@pytest.mark.parametrize(
    "other", [{"kv_cache_memory_bytes": 1 << 30}, {"num_gpu_blocks_override": 100}]
)
def test_kv_cache_tokens_other_ways_to_size_the_cache_are_refused(other):
    (name,) = other
    with pytest.raises(ValueError, match=f"cannot be combined with {name}"):
        CacheConfig(kv_cache_tokens=3000, **other)


def test_kv_cache_tokens_flag_accepts_human_readable_ints(kv_cache_tokens_model):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = ["--model", kv_cache_tokens_model, "--kv-cache-tokens", "400k"]
    engine_args = EngineArgs.from_cli_args(parser.parse_args(args))
    assert engine_args.kv_cache_tokens == 400_000
    engine_args.skip_tokenizer_init = True
    config = engine_args.create_engine_config()
    assert config.cache_config.kv_cache_tokens == 400_000
