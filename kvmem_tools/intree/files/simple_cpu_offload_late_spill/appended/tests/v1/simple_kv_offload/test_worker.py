def test_late_spill_copies_before_the_compute_stream_overwrites():
    """The spill reads the block after the compute stream's queued writes and
    before its next ones: both races would show in the CPU copy."""
    backend, gpu, cpu = _make_backend()
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        gpu[5].fill_(7)  # the block's KV, written late on the compute stream
        backend.copy_before_overwrite([5], [3])
        gpu[5].fill_(-1)  # the new owner's write
        torch.cuda.synchronize()
        assert bool((cpu[3] == 7).all())
    finally:
        backend.shutdown()


def test_late_spill_does_not_wait_on_the_host():
    backend, gpu, cpu = _make_backend()
    worker = _make_worker(None, 0)
    worker._backend = backend
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        worker.handle_preemptions(
            SimpleCPUOffloadMetadata(
                spill_event=0, spill_gpu_blocks=[2], spill_cpu_blocks=[0]
            )
        )
        # Back on the host while the copy still waits for the compute stream.
        assert not worker._spill_events[0][1].query()
        torch.cuda.synchronize()
        worker.get_finished(set())
        meta = worker.build_connector_worker_meta()
        assert meta is not None and meta.completed_store_events == {0: 1}
    finally:
        backend.shutdown()
