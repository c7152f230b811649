"""The vLLM-free arithmetic of the pipeline-proportional split."""

from __future__ import annotations

import random

import pytest

from vllm_kvmem.core import kv_arith
from vllm_kvmem.core.units import GiB, flag_size, gib


def test_seed_56_8_split_matches_the_seed_numbers():
    # The seed's figures imply 2 KiB per token per layer (Qwen3-32B: 8 KV heads
    # x 128 x (K+V) with a 1-byte fp8 KV cache), 16-token blocks.
    per_layer_block = 16 * 2048
    bpb = [56 * per_layer_block, 8 * per_layer_block]
    shares = kv_arith.split_budget(5 * GiB, bpb)
    assert [gib(s.share_bytes) for s in shares] == ["4.38", "0.62"]
    blocks = {s.num_blocks for s in shares}
    assert blocks == {5 * GiB // (64 * per_layer_block)}
    # 40,960 tokens on both ranks, as in the seed.
    assert blocks.pop() * 16 == 40_960
    # Without the flag both ranks are handed 5 GiB and cut to the fatter
    # stage's count: 46,800 tokens (the seed's baseline line), not rank 1's
    # 327,680.
    assert kv_arith.uniform_blocks(5 * GiB, bpb) * 16 == 46_800


@pytest.mark.parametrize(
    "budget,bpb",
    [
        (10**9 + 7, [3, 5, 11]),
        (64 << 20, [49152, 16384]),
        (12345, [7, 7]),
        (999, [1000]),
    ],
)
def test_split_has_equal_blocks_and_never_exceeds_the_budget(budget, bpb):
    shares = kv_arith.split_budget(budget, bpb)
    assert len({s.num_blocks for s in shares}) == 1
    assert sum(s.share_bytes for s in shares) <= budget
    for s in shares:
        exact = budget * s.bytes_per_block / sum(bpb)
        assert exact - s.bytes_per_block < s.share_bytes <= exact  # whole blocks


def test_min_and_max_budget_are_tight():
    bpb, needs = [300, 100], [3000, 1000]
    lo = kv_arith.min_budget_for(needs, bpb)
    assert all(
        s.share_bytes >= n for s, n in zip(kv_arith.split_budget(lo, bpb), needs)
    )
    assert any(
        s.share_bytes < n for s, n in zip(kv_arith.split_budget(lo - 1, bpb), needs)
    )
    limits = [3000, 5000]
    hi = kv_arith.max_budget_for(limits, bpb)
    assert all(
        s.share_bytes <= m for s, m in zip(kv_arith.split_budget(hi, bpb), limits)
    )
    assert any(
        s.share_bytes > m for s, m in zip(kv_arith.split_budget(hi + 1, bpb), limits)
    )


def test_split_blocks_are_the_proportional_shares_blocks():
    # Whole-block shares ((T // S) * b) hold exactly the blocks that the
    # proportional shares (T * b // S) held, so no block count moved.
    rng = random.Random(37)
    for _ in range(2000):
        bpb = [rng.randint(1, 1 << 20) for _ in range(rng.randint(1, 5))]
        budget = rng.randint(1, 1 << 36)
        proportional = [budget * b // sum(bpb) // b for b in bpb]
        shares = kv_arith.split_kv_budget(budget, bpb)
        assert [s // b for s, b in zip(shares, bpb)] == proportional


def test_layer_bytes_of_the_seed_model():
    # Qwen3-32B with an fp8 KV cache: 8 KV heads of 128 (K and V), 1 byte.
    per_token = kv_arith.layer_bytes_per_token(8, 128, 128, 1)
    assert per_token == 2048
    assert kv_arith.layer_page_bytes(per_token, 16) == 16 * 2048


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="positive"):
        kv_arith.split_budget(bad, [1, 2])


def test_flag_size_rounds_to_a_value_vllm_parses():
    from vllm.utils.argparse_utils import human_readable_int

    for n in (1, GiB, GiB + 1, 5 * GiB - 3, 123456789):
        up = human_readable_int(flag_size(n))
        down = human_readable_int(flag_size(n, round_up=False))
        assert down <= n <= up and up - down <= 1 << 20
