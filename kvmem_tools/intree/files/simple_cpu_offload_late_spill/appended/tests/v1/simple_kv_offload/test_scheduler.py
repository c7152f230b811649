def _evict_before_the_walk(fix: SchedulerFixture, num_blocks: int = 2):
    """Cache a finished request's blocks, then hand every free block out in
    the same pass, before the lazy walk: the allocator evicts them."""
    gpu_pool = fix.gpu_block_pool
    request = make_request(num_blocks=num_blocks)
    blocks = _allocate_gpu_blocks(gpu_pool, request, num_blocks)
    gpu_pool.free_blocks(reversed(blocks))
    gpu_pool.get_new_blocks(gpu_pool.get_num_free_blocks())
    return request, [b.block_id for b in blocks]


def _cpu_hit_tokens(sched: SimpleCPUOffloadScheduler, request: Request) -> int:
    again = Request(
        request_id=f"{request.request_id}-again",
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=request._block_hasher,
    )
    hit, _ = sched.get_num_new_matched_tokens(again, num_computed_tokens=0)
    sched.request_finished(again, [])
    return hit or 0


def test_block_pool_eviction_listeners_see_each_cached_block_once() -> None:
    gpu_pool = BlockPool(8, enable_caching=True, hash_block_size=BLOCK_SIZE)
    request = make_request(num_blocks=2)
    cached = _allocate_gpu_blocks(gpu_pool, request, 2)
    gpu_pool.free_blocks(cached)
    seen: list[list[tuple[int, bool]]] = [[], []]
    for record in seen:
        gpu_pool.add_eviction_listener(
            lambda b, r=record: r.append((b.block_id, b.block_hash is not None))
        )
    gpu_pool.get_new_blocks(gpu_pool.get_num_free_blocks())
    # Every listener, each cached block once, while it still holds its hash.
    assert seen[0] == seen[1] == [(b.block_id, True) for b in cached]


def test_lazy_late_spill_is_registered_when_the_copy_completes() -> None:
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=8, lazy=True)
    sched = fix.scheduler
    request, evicted = _evict_before_the_walk(fix)
    meta = sched.build_connector_meta(make_scheduler_output({}))
    assert sorted(meta.spill_gpu_blocks) == sorted(evicted)
    assert len(set(meta.spill_cpu_blocks)) == 2 and meta.store_gpu_blocks == []
    assert _cpu_hit_tokens(sched, request) == 0  # not before every worker copied
    simulate_store_completion(sched, meta.spill_event)
    assert get_cpu_free_blocks(sched) == sched.num_cpu_blocks - 1  # no ref held
    assert all(fix.gpu_block_pool.blocks[b].ref_cnt == 1 for b in evicted)
    assert _cpu_hit_tokens(sched, request) == 2 * BLOCK_SIZE
    assert sched.build_connector_meta(make_scheduler_output({})).spill_event < 0


def test_lazy_late_spill_skips_blocks_already_on_cpu() -> None:
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=8, lazy=True)
    sched, gpu_pool = fix.scheduler, fix.gpu_block_pool
    request = make_request(num_blocks=2)
    gpu_pool.free_blocks(_allocate_gpu_blocks(gpu_pool, request, 2))
    fillers = _flush_old_blocks_to_lru_head(gpu_pool, num_filler_blocks=5)
    meta = sched.build_connector_meta(make_scheduler_output({}))  # the walk
    assert len(meta.store_gpu_blocks) == 2
    simulate_store_completion(sched, meta.store_event)
    gpu_pool.get_new_blocks(gpu_pool.get_num_free_blocks())  # now evicted
    meta = sched.build_connector_meta(make_scheduler_output({}))
    assert meta.spill_gpu_blocks == []  # already on CPU
    gpu_pool.free_blocks(fillers)


def test_lazy_reset_drops_recorded_evictions() -> None:
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=8, lazy=True)
    request, _ = _evict_before_the_walk(fix)
    assert fix.scheduler.reset()
    meta = fix.scheduler.build_connector_meta(make_scheduler_output({}))
    assert meta.spill_gpu_blocks == []
    assert _cpu_hit_tokens(fix.scheduler, request) == 0


def test_eager_mode_listens_to_no_eviction() -> None:
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=8, lazy=False)
    assert fix.gpu_block_pool._eviction_listeners == []
