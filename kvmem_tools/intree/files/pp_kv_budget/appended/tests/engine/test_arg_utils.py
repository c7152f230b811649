def test_enable_pp_prop_kv_cache_reaches_the_engine_args():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--kv-cache-memory-bytes", "5G", "--enable-pp-prop-kv-cache"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.enable_pp_prop_kv_cache
    assert engine_args.kv_cache_memory_bytes == 5 << 30
