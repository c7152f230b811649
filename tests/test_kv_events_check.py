"""benchmarks/kv_events_check.py: a KV-aware router's index from vLLM's KV
events, checked against the cached tokens a live server reports.

The index and its prediction are tested on hand-built vLLM event objects;
the subscriber on batches sent through a real ZMQ PUB socket, encoded as
vLLM's publisher encodes them; the whole check on a live server (the
tiny model), with the host tier off (the control) and on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, import_script

BENCH = ROOT / "benchmarks"
BS = 4  # block size of the hand-built events


@pytest.fixture(scope="module")
def idx():
    yield from import_script(BENCH / "_kv_event_index.py")


@pytest.fixture(scope="module")
def check():
    yield from import_script(BENCH / "kv_events_check.py")


def stored(tokens, hashes, parent=None, medium="GPU", block_size=BS):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes, medium="GPU"):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(hashes), medium=medium)


PROMPT = list(range(100, 118))  # 4 full blocks of 4 and 2 tokens
HASHES = [11, 12, 13, 14]


def blocks(first: int, last: int) -> list[int]:
    """The prompt's tokens of blocks ``first`` to ``last - 1``."""
    return PROMPT[first * BS : last * BS]


def test_device_prefix_is_the_run_of_stored_blocks(idx):
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 2), HASHES[:2]))
    index.apply(stored(blocks(2, 3), HASHES[2:3], parent=HASHES[1], medium=None))
    p = index.predict(PROMPT, BS)
    assert (p.device_blocks, p.host_blocks, p.tokens) == (3, 0, 12)
    # Another prompt shares the first block only.
    assert index.predict(PROMPT[:4] + [7] * 8, BS).device_blocks == 1
    # Same tokens at another position are another block (keys chain).
    assert index.predict(PROMPT[4:], BS).device_blocks == 0


def test_removal_by_hash_cuts_the_prefix(idx):
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 4), HASHES))
    index.apply(removed([HASHES[1]]))
    assert index.predict(PROMPT, BS).device_blocks == 1
    assert index.unknown_removals == 0
    index.apply(removed([999]))  # never stored
    assert index.unknown_removals == 1


def test_last_token_is_always_computed(idx):
    """A prompt of exactly 4 blocks hits at most 3: vLLM computes its last
    token, so the cap is (len - 1) // block_size blocks."""
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 4), HASHES))
    assert index.predict(PROMPT[:16], BS).tokens == 12
    assert index.predict(PROMPT[:17], BS).tokens == 16


def test_duplicate_blocks_are_counted(idx):
    """vLLM does not deduplicate: a whole-block prompt recomputes and caches
    its last block again; one removal leaves the other copy."""
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 2), HASHES[:2]))
    index.apply(stored(blocks(1, 2), HASHES[1:2], parent=HASHES[0]))
    index.apply(removed([HASHES[1]]))
    assert index.predict(PROMPT, BS).device_blocks == 2
    index.apply(removed([HASHES[1]]))
    assert index.predict(PROMPT, BS).device_blocks == 1


def test_host_run_starts_where_the_device_hit_ends(idx):
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 4), HASHES, medium="CPU"))
    index.apply(stored(blocks(0, 1), HASHES[:1]))
    p = index.predict(PROMPT, BS)
    assert (p.device_blocks, p.host_blocks, p.tokens) == (1, 3, 16)
    # The device's second block alone does not count: its first is missing.
    index.apply(removed([HASHES[0]]))
    index.apply(stored(blocks(1, 2), HASHES[1:2], parent=HASHES[0]))
    p = index.predict(PROMPT, BS)
    assert (p.device_blocks, p.host_blocks) == (0, 4)
    # The host's blocks past a hole do not count either.
    index.apply(removed([HASHES[2]], medium="CPU"))
    p = index.predict(PROMPT, BS)
    assert (p.device_blocks, p.host_blocks) == (0, 2)


def test_storage_run_goes_back_and_forth_with_the_host(idx):
    """Past the host's run, the disk tier continues from a block in storage,
    taking each block from storage or the host, as the tier does."""
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 1), HASHES[:1], medium="STORAGE"))
    index.apply(stored(blocks(1, 2), HASHES[1:2], parent=HASHES[0], medium="CPU"))
    index.apply(stored(blocks(2, 3), HASHES[2:3], parent=HASHES[1], medium="STORAGE"))
    p = index.predict(PROMPT, BS)
    assert (p.device_blocks, p.host_blocks, p.storage_blocks) == (0, 1, 2)
    assert p.tokens == 12
    # A host run first, then storage, then the host again.
    index.apply(stored(blocks(0, 1), HASHES[:1], medium="CPU"))
    index.apply(stored(blocks(3, 4), HASHES[3:], parent=HASHES[2], medium="CPU"))
    p = index.predict(PROMPT, BS)
    assert (p.host_blocks, p.storage_blocks) == (3, 1)
    # A block only on the host after the host's run and before any storage
    # block ends it: the host's run is the whole hit.
    index.apply(removed(HASHES[2:3], medium="STORAGE"))
    assert index.predict(PROMPT, BS).tokens == 2 * BS


def test_host_store_names_a_parent_gone_from_both_tiers(idx):
    """The tier copies the device event's parent hash; the parent may have
    left every tier by then, and the key still chains through it."""
    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 2), HASHES[:2]))
    index.apply(removed(HASHES[:2]))
    index.apply(stored(blocks(1, 2), HASHES[1:2], parent=HASHES[0], medium="CPU"))
    assert index.unknown_parent_events == 0
    p = index.predict(PROMPT, BS)
    assert (p.device_blocks, p.host_blocks) == (0, 0)  # block 0 is nowhere
    index.apply(stored(blocks(0, 1), HASHES[:1], medium="CPU"))
    assert index.predict(PROMPT, BS).host_blocks == 2


def test_all_blocks_cleared_empties_both_tiers(idx):
    from vllm.distributed.kv_events import AllBlocksCleared

    index = idx.KVEventIndex()
    index.apply(stored(blocks(0, 4), HASHES))
    index.apply(stored(blocks(0, 4), HASHES, medium="CPU"))
    index.apply(AllBlocksCleared())
    assert index.predict(PROMPT, BS).tokens == 0
    assert index.summary()["events"] == {
        "AllBlocksCleared/None": 1,
        "BlockStored/CPU": 1,
        "BlockStored/GPU": 1,
    }


def test_events_without_tokens_are_counted_not_indexed(idx):
    index = idx.KVEventIndex()
    index.apply(stored([], HASHES[:2], medium="CPU"))
    assert index.empty_token_events == 1
    assert index.predict(PROMPT, BS).tokens == 0
    index.apply(stored(blocks(1, 2), HASHES[1:2], parent=777))
    assert index.unknown_parent_events == 1
    index.apply(stored(blocks(0, 1), HASHES[:1], medium="NVME"))
    assert index.other_medium_events == 1
    with pytest.raises(ValueError, match="token ids"):
        index.apply(stored(blocks(0, 1)[:3], HASHES[:1]))


def test_subscriber_decodes_vllms_wire_format(idx):
    """Batches as ZmqEventPublisher sends them (topic, 8-byte seq, msgpack
    of KVEventBatch), from a PUB socket that connects to the subscriber."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    sub = idx.KVEventSubscriber(topic="t")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(sub.endpoint)
    try:
        assert sub.events_config()["endpoint"].startswith("tcp://127.0.0.1:")
        index = idx.KVEventIndex()
        enc = msgspec.msgpack.Encoder()
        batches = [
            [stored(blocks(0, 2), HASHES[:2])],
            [stored(blocks(2, 3), HASHES[2:3], parent=HASHES[1], medium="CPU")],
            [removed(HASHES[1:2])],
        ]
        # ZMQ drops what a PUB sends before the subscription reaches it:
        # resend a probe on seq 0 until it arrives.
        probe = enc.encode(KVEventBatch(ts=1.0, events=[]))
        for _ in range(50):
            pub.send_multipart((b"t", (0).to_bytes(8, "big"), probe))
            if sub.drain(index, 0.1):
                break
        else:
            pytest.fail("the subscriber got nothing")
        sub.next_seq = 0
        for seq, events in enumerate(batches):
            payload = enc.encode(KVEventBatch(ts=2.0 + seq, events=events))
            pub.send_multipart((b"t", seq.to_bytes(8, "big"), payload))
        pub.send_multipart((b"other", (9).to_bytes(8, "big"), b"not ours"))
        stamps = sub.drain(index, 0.5)
        assert stamps == [2.0, 3.0, 4.0] and sub.missed_seqs == 0
        p = index.predict(PROMPT, BS)
        assert (p.device_blocks, p.host_blocks) == (1, 0)  # block 1 left the device
        assert index.summary()["host_blocks_indexed"] == 1
        pub.send_multipart((b"t", (5).to_bytes(8, "big"), probe))
        sub.drain(index, 0.5)
        assert sub.missed_seqs == 2  # seqs 3 and 4 never came
        # Waiting for a batch published after ``since``: none comes...
        assert sub.drain(index, 0.01, since=10.0, wait_s=0.3) == []
        assert sub.waits_timed_out == 1
        # ... then one does; earlier ones are read on the way.
        for seq, ts in ((6, 9.0), (7, 11.0)):
            batch = enc.encode(KVEventBatch(ts=ts, events=[]))
            pub.send_multipart((b"t", seq.to_bytes(8, "big"), batch))
        assert sub.drain(index, 0.01, since=10.0, wait_s=5.0) == [9.0, 11.0]
        assert sub.waits_timed_out == 1
    finally:
        pub.close(linger=0)
        ctx.term()
        sub.close()


def test_workload_is_seeded_and_revisits(check):
    a = check.build_workload(3, 200, docs=50, systems=4, vocab=2048)
    assert a == check.build_workload(3, 200, docs=50, systems=4, vocab=2048)
    assert a != check.build_workload(4, 200, docs=50, systems=4, vocab=2048)
    assert max(len(r.prompt) for r in a) < check.MAX_MODEL_LEN
    kinds = [r.kind for r in a]
    assert 50 < kinds.count("revisit") < 200 and kinds[0] == "new"
    # Some prompts are whole blocks (the cap on the last token is exercised).
    assert any(len(r.prompt) % check.BLOCK_SIZE == 0 for r in a)


def run_check(check, model: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "kv_events.json"
    argv = ["--requests", "80", "--model", str(model), "--out", str(out), *extra]
    rc = check.main(argv)
    report = json.loads(out.read_text())
    report["returncode"] = rc
    return report


def assert_exact(report: dict) -> None:
    s, ev = report["summary"], report["events"]
    assert s["requests"] == 80
    assert s["mismatches"] == 0, json.dumps(s["first_mismatches"], indent=1)
    assert report["returncode"] == 0
    # The device evicted (so the index had to follow removals) and hit.
    assert ev["events"]["BlockStored/GPU"] > 0
    assert ev["events"]["BlockRemoved/GPU"] > 0
    assert s["reported_cached_tokens"] > 0
    assert ev["missed_seqs"] == 0 and ev["unknown_removals"] == 0
    assert ev["block_sizes"] == [report["sizes"]["block_size"]]


@pytest.mark.engine
def test_host_tier_events_predict_every_request(check, model_8l, tmp_path):
    """Over vLLM's ZMQ publisher, on 0.32 (tests/test_host_tier_events.py
    replays the same events in process on 0.33; the control without the tier,
    0 mismatches in 1,000 requests, is the benchmark's --no-host-tier). The
    disk tier behind a small host tier: its STORAGE events join the index,
    and prefixes come back from the host and from disk, exactly predicted."""
    disk = tmp_path / "disk"
    report = run_check(
        check, model_8l, tmp_path, "--host-blocks", "32", "--disk-dir", str(disk)
    )
    assert_exact(report)
    s, ev = report["summary"], report["events"]
    assert s["predicted_host_hits"] > 0  # revisits came back from the host
    assert s["predicted_storage_hits"] > 0  # and from disk
    assert ev["events"]["BlockStored/CPU"] > 0
    assert ev["events"]["BlockStored/STORAGE"] > 0
    assert ev["empty_token_events"] == 0
    metrics = report["disk_metrics"]
    assert metrics["vllm:kvmem_host_disk_hits_total"] > 0
    assert metrics["vllm:kvmem_host_disk_read_failures_total"] == 0
