def test_lazy_late_spill_emits_block_stored_on_completion() -> None:
    fix = make_events_scheduler(num_cpu_blocks=8, num_gpu_blocks=8, lazy=True)
    sched, gpu_pool = fix.scheduler, fix.gpu_block_pool
    request = make_request(num_blocks=2)
    gpu_pool.free_blocks(_allocate_gpu_blocks(gpu_pool, request, 2))
    gpu_pool.get_new_blocks(gpu_pool.get_num_free_blocks())  # evicted unstored
    meta = sched.build_connector_meta(make_scheduler_output({}))
    assert len(meta.spill_gpu_blocks) == 2
    assert not [e for e in sched.take_events() if isinstance(e, BlockStored)]
    simulate_store_completion(sched, meta.spill_event)
    stored = [e for e in sched.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 2
    assert all(e.medium == MEDIUM_CPU and e.group_idx == 0 for e in stored)
