def test_preemptions_are_handled_before_update_requests_writes(
    monkeypatch: pytest.MonkeyPatch,
):
    """Model Runner V2 zeroes new blocks and applies copy-on-write copies in
    update_requests; the connector must see preemptions and evictions first."""
    events: list[str] = []
    connector = _make_connector(monkeypatch, events)
    monkeypatch.setattr(
        v2_runner, "copy_kv_cache_blocks_inplace", lambda *_: events.append("cow")
    )
    output = SchedulerOutput.make_empty()
    output.scheduled_cached_reqs = CachedRequestData.make_empty()
    output.new_block_ids_to_zero = [3]
    output.kv_cache_block_copies = [KVCacheBlockCopy(1, 4)]
    output.kv_connector_metadata = object()
    runner = SimpleNamespace(
        req_states=SimpleNamespace(
            num_computed_tokens_np=np.zeros(1, dtype=np.int32),
            prefill_len=SimpleNamespace(np=np.zeros(1, dtype=np.int32)),
            num_computed_prefill_tokens=np.zeros(1, dtype=np.int32),
            req_id_to_index={},
        ),
        kv_block_zeroer=SimpleNamespace(zero_block_ids=lambda _: events.append("zero")),
        kv_caches=[],
        kv_cache_config=SimpleNamespace(num_blocks=8),
        kv_connector=connector,
    )
    v2_runner.GPUModelRunner.update_requests(runner, output)
    assert events == ["handle", "zero", "cow"]

    connector.pre_forward(output)
    assert events == ["handle", "zero", "cow", "bind"]
