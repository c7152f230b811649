"""``kvmem plan --trace``: a workload's device and host hits per host size.

Unit tests replay hand-built traces whose hits follow from vLLM's block pool
rules by reasoning (block size 4 unless said: a "block" below is 4 tokens);
two engine tests hold the prediction to a real engine with the host tier,
request by request: one request at a time, and clients in a closed loop.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.helpers import ROOT, engine_env
from vllm_kvmem.cli import main as kvmem_main
from vllm_kvmem.demo_engine import REPORT_PREFIX
from vllm_kvmem.planner import plan_capacity
from vllm_kvmem.planner.replay import HostCache
from vllm_kvmem.planner.trace import (
    load_trace,
    parse_host_sizes,
    predict,
    token_block_keys,
    vllm_block_hasher,
)

BS = 4
PREFIX = list(range(100, 112))  # 3 full blocks
FILLER = list(range(200, 213))  # 3 blocks and one token: 4 device blocks


def _hits(trace, device_blocks, host_blocks, **kw):
    """Per request (device, host) hit blocks, one list per host size."""
    kw = {"hash_algo": None, "spill_ahead": 0, **kw}
    rows = predict(trace, device_blocks, host_blocks, BS, per_request=True, **kw)
    return [[(d // BS, h // BS) for _, d, h in row["requests"]] for row in rows]


def _tokens(*prompts, output_len=1):
    return [{"prompt_token_ids": p, "output_len": output_len} for p in prompts]


def test_shared_prefix_comes_back_from_the_host():
    """Two requests share a 3-block prefix; a filler between them takes every
    device block (4 usable: 5 with vLLM's null block). vLLM frees a request's
    blocks last-first, so the filler evicts the prefix's blocks 3, 2, 1 in
    that order, all in one step: a host of 4 takes all three and serves the
    whole prefix; a host of 2 takes blocks 3 and 2 (the tier pins a step's
    copies, so block 1 finds no slot) and serves nothing, as the lookup stops
    at block 1."""
    trace = _tokens(PREFIX + [1], FILLER, PREFIX + [2])
    none, two, four = _hits(trace, 5, [0, 2, 4])
    assert none[2] == (0, 0)
    assert two[2] == (0, 0)
    assert four[2] == (0, 3)
    # One usable block more: block 1 stays on the device, 2 and 3 come back.
    none, two, four = _hits(trace, 6, [0, 2, 4])
    assert none[2] == (1, 0)
    assert two[2] == (1, 2) and four[2] == (1, 2)


def test_last_prompt_token_is_always_computed():
    """A block-aligned prompt sent twice hits all blocks but the last, on the
    device as on the host: vLLM computes at least one prompt token."""
    prompt = PREFIX + list(range(300, 304))  # 4 full blocks
    assert _hits(_tokens(prompt, prompt), 9, [0])[0] == [(0, 0), (3, 0)]
    evicting = _tokens(prompt, list(range(400, 420)), prompt)
    assert _hits(evicting, 6, [8])[0][2] == (0, 3)


def test_generated_tokens_hold_blocks_and_spill():
    """Generated tokens fill blocks too: with 2 generated tokens of KV (3
    generated), a 13-token prompt holds 4 blocks and its 4th is cached, so
    the same prompt with its answer appended hits 4 blocks."""
    first = {"prompt_token_ids": PREFIX + [1], "output_token_ids": [2, 3, 4, 99]}
    again = {"prompt_token_ids": PREFIX + [1, 2, 3, 4, 5]}
    assert _hits([first, again], 9, [0])[0][1] == (4, 0)
    # The answer's blocks are evicted to the host like any other.
    filler = {"prompt_token_ids": list(range(500, 517))}  # 5 blocks
    assert _hits([first, filler, again], 6, [8])[0][2] == (0, 4)


def test_lru_keeps_what_was_hit_fifo_does_not():
    """Host of 3 holding a, b, c (saved in that order), a hit on a, then a
    save of d: LRU drops b, FIFO drops a."""
    for policy, kept in (("lru", {"a", "c", "d"}), ("fifo", {"b", "c", "d"})):
        host = HostCache(3, policy)
        for key in "abc":
            host.put(key)
        host.pinned = set()  # a new step
        host.touch("a")  # a host hit
        host.put("d")
        assert {k for k in "abcd" if k in host} == kept, policy


def test_copies_ahead_of_eviction_can_crowd_a_small_host():
    """The tier copies free cached blocks near the free queue's head before
    they are evicted. Device of 8 usable blocks, host of 2: the second
    request leaves the first's prefix free on the device, and the walk
    copies its blocks 3 and 2 ahead (block 1 finds the host full of this
    step's copies). The third request evicts 3 and 2 (already on the host)
    and the walk goes on with block 1 and the second request's blocks,
    which push 3 and 2 out: the fourth request finds block 1 on the device
    and nothing on the host. Without copies ahead, the evicted 3 and 2 stay
    on the host and come back."""
    other = list(range(800, 813))
    trace = _tokens(PREFIX + [1], other, list(range(900, 913)), PREFIX + [2])
    assert _hits(trace, 9, [2], spill_ahead=64)[0][3] == (1, 0)
    assert _hits(trace, 9, [2], spill_ahead=0)[0][3] == (1, 2)


def test_concurrent_requests_share_held_blocks():
    """With 2 requests at a time the second finds the first's prefix held on
    the device (a hit on a running request's blocks, cached as they were
    scheduled); where both do not fit, the second waits for the first to
    finish, whose cached blocks still serve the hit."""
    trace = _tokens(PREFIX + [1], PREFIX + [2])
    assert _hits(trace, 9, [0], max_concurrency=2)[0][1] == (3, 0)
    assert _hits(trace, 5, [0], max_concurrency=2)[0][1] == (3, 0)
    too_big = _tokens(FILLER, list(range(950, 963)))
    assert _hits(too_big, 5, [0], max_concurrency=2)[0] == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        _hits(_tokens(list(range(17))), 5, [0])


def test_a_waiting_request_that_does_not_fit_holds_its_host_hit():
    """vLLM looks a waiting request up before it allocates: the tier pins
    and refreshes its host hit even when it does not fit, until its next
    lookup. Four requests at once, 4 usable blocks, 3 host slots: A (2
    blocks, 3 with its output) runs first; B (4 blocks) evicts A's blocks
    to the host once A is done; when B is done, C takes 3 blocks, two of
    them B's, whose copies would fill the host past A's; the second A
    waits behind C (one block free), and its lookup keeps A's two host
    blocks, which it loads once C is done."""
    a, b, c = list(range(100, 108)), list(range(200, 212)), list(range(300, 308))
    trace = [
        {"prompt_token_ids": a + [0], "output_len": 3},
        {"prompt_token_ids": b + [1], "output_len": 3},
        {"prompt_token_ids": c + [2], "output_len": 3},
        {"prompt_token_ids": a + [3], "output_len": 2},
    ]
    (hits,) = _hits(trace, 5, [3], max_concurrency=4, send_delay=0)
    assert hits == [(0, 0), (0, 0), (0, 0), (0, 2)]


def test_vllm_hashes_give_the_same_hits():
    """vLLM's own chained block hashes (sha256) key the replay by default:
    the first key is hash_block_tokens of the first block, and the hits are
    those of the token-keyed replay."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    hasher = vllm_block_hasher("sha256")
    keys = hasher(PREFIX, BS)
    assert keys[0] == hash_block_tokens(sha256, None, PREFIX[:4], None)
    assert keys[1] == hash_block_tokens(sha256, keys[0], PREFIX[4:8], None)
    assert len(token_block_keys(PREFIX, BS)) == len(keys) == 3
    trace = _tokens(PREFIX + [1], FILLER, PREFIX + [2])
    vllm_rows = predict(trace, 6, [0, 2, 4], BS, spill_ahead=0)
    token_rows = predict(trace, 6, [0, 2, 4], BS, spill_ahead=0, hash_algo=None)
    assert vllm_rows == token_rows
    assert vllm_rows[2]["host_hit_rate"] == pytest.approx(8 / 39)


# -- trace files ----------------------------------------------------------------


def test_trace_formats(tmp_path, model_8l):
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text(
        '{"prefix_id": "sys", "prefix_len": 8, "suffix_len": 3}\n\n'
        '{"prefix_id": "sys", "prefix_len": 8, "suffix_len": 5, "output_len": 4}\n'
    )
    a, b = load_trace(lengths)
    assert a.prompt_token_ids[:8] == b.prompt_token_ids[:8]
    assert a.prompt_token_ids[8:] != b.prompt_token_ids[8:11]
    assert (len(a.prompt_token_ids), len(b.prompt_token_ids)) == (11, 13)
    assert b.cached_output == [None] * 3
    assert load_trace(lengths)[0] == a  # deterministic

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "The KV cache is large."}) + "\n")
    (req,) = load_trace(text, model_dir=model_8l)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_8l))
    assert req.prompt_token_ids == tok("The KV cache is large.").input_ids


def test_conversations_replay_as_vllms_multi_turn_client_sends_them(tmp_path, model_8l):
    """vLLM's multi-turn client format: each user turn re-sends the history
    with the answers; one client with 2 active conversations sends the
    newest-started first, then alternates. The tiny model has no chat
    template: the fallback rendering is a plain prompt."""
    convs = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question one of {i} " * 30},
                {"role": "assistant", "content": f"Answer one for {i} " * 20},
                {"role": "user", "content": f"Question two of {i} " * 10},
                {"role": "assistant", "content": "Done."},
            ],
        }
        for i in range(3)
    ]
    path = tmp_path / "convs.json"
    path.write_text(json.dumps(convs))
    reqs = load_trace(path, model_dir=model_8l, max_active_conversations=2)
    assert len(reqs) == 6
    # Order: c1 t1, c0 t1, c1 t2, c0 t2, c2 t1, c2 t2.
    first_c1, first_c0, second_c1 = reqs[0], reqs[1], reqs[2]
    assert "of 1" in _decode(model_8l, first_c1.prompt_token_ids)
    assert "of 0" in _decode(model_8l, first_c0.prompt_token_ids)
    # The next turn starts with this turn's prompt and its answer as cached.
    sent = first_c1.prompt_token_ids + first_c1.cached_output
    assert second_c1.prompt_token_ids[: len(sent)] == sent
    assert None not in first_c1.cached_output and first_c1.cached_output
    # Replayed with room on the device, turn two hits the whole first
    # exchange but the partial block.
    rows = predict(reqs, 64, [0], 16, hash_algo=None, per_request=True)
    assert rows[0]["requests"][2][1] == len(sent) // 16 * 16


def _decode(model, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model)).decode(ids)


def test_host_sizes():
    sizes = parse_host_sizes("0, 2M,1.5x,3x", device_blocks=10, block_bytes=1 << 20)
    assert sizes == [("0", 0), ("2M", 2), ("1.5x", 15), ("3x", 30)]


ONE = '{"prompt_token_ids": [1]}\n'
MISSING = None


@pytest.mark.parametrize(
    "extra, content, message",
    [
        ([], MISSING, "--trace='t.jsonl': no such file"),
        ([], ONE + "{oops\n", "line 2: not JSON"),
        ([], '{"tokens": [1]}\n', "line 1: {tokens} is not a known"),
        (["--trace-format", "lengths"], ONE, "{prompt_token_ids} is not a lengths"),
        ([], '{"prompt_token_ids": [1, "a"]}\n', "must be a list of token ids"),
        (["--host-sizes", "0,lots"], ONE, "--host-sizes: 'lots' is not a size"),
        (["--host-sizes", "0,-2x"], ONE, "'-2x' is not a multiple of the device"),
        (
            ["--trace-format", "conversations"],
            '{"filetype": "generate_conversations"}',
            "run the client with --output-file",
        ),
    ],
)
def test_bad_trace_input_names_the_flag(
    tmp_path, model_8l, monkeypatch, capsys, extra, content, message
):
    monkeypatch.chdir(tmp_path)
    if content is not MISSING:
        (tmp_path / "t.jsonl").write_text(content)
    argv = ["plan", str(model_8l), "--kv-cache-memory-bytes", "24M"]
    code = kvmem_main([*argv, "--trace", "t.jsonl", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_unknown_trace_format_is_refused(tmp_path, model_8l, capsys):
    with pytest.raises(SystemExit):
        kvmem_main(["plan", str(model_8l), "--trace", "x", "--trace-format", "csv"])
    assert "--trace-format: invalid choice: 'csv'" in capsys.readouterr().err


def test_plan_trace_table_and_json(tmp_path, model_8l, capsys):
    """The CLI: the planner's device blocks for the budget, a row per host
    size, the same figures as JSON."""
    trace = tmp_path / "t.jsonl"
    prefix = list(range(10, 10 + 4 * 128))
    lines = [
        {"prompt_token_ids": prefix + [i] * 40}
        if i % 3 == 0
        else {"prompt_token_ids": list(range(2000 * i, 2000 * i + 1500))}
        for i in range(9)
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["plan", str(model_8l), "--platform", "cpu", "--dtype", "float32"]
    argv += ["--kv-cache-memory-bytes", "24M", "--max-model-len", "2048"]
    argv += ["--trace", str(trace), "--host-sizes", "0,8M,2x"]
    assert kvmem_main(argv) == 0
    table = capsys.readouterr().out
    assert "Device KV cache: 24 blocks of 128 tokens" in table
    assert kvmem_main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert [(r["label"], r["host_blocks"]) for r in rows] == [
        ("0", 0),
        ("8M", 8),
        ("2x", 48),
    ]
    assert rows[0]["host_hit_tokens"] == 0 < rows[2]["host_hit_tokens"]
    for r in rows:
        line = f"{100 * r['host_hit_rate']:.1f}%"
        assert any(r["label"] in x and line in x for x in table.splitlines())


# -- against a real engine -----------------------------------------------------

ENGINE_SCRIPT = ROOT / "tests" / "trace_replay_engine.py"
ENGINE_BS = 128
ENGINE_HOST_MB = 16


def _engine_trace() -> list[dict]:
    """Six 4-block system prompts in turn, every 7th request a fresh
    5-block one, with short and long answers: 30 blocks of prefixes cycled
    through a 23-block device, so every reuse is a host hit or a miss, and a
    16-block host holds part of the cycle (its LRU and the tier's copies
    ahead of eviction decide which part)."""
    rng = random.Random(7)

    def toks(n):
        return [rng.randrange(4, 2000) for _ in range(n)]

    systems = [toks(4 * ENGINE_BS) for _ in range(6)]
    trace = []
    for i in range(18):
        head = systems[i % 6] if i % 7 != 6 else toks(5 * ENGINE_BS)
        trace.append(
            {
                "prompt_token_ids": head + toks(60 + 37 * (i % 3)),
                "output_len": 1 + 90 * (i % 2),
            }
        )
    return trace


def _serve(model, trace, host_mb, concurrency=0, max_num_seqs=1):
    """The engine's report for ``trace`` (tests/trace_replay_engine.py): 24
    MiB of device KV, ``host_mb`` MiB of host; ``concurrency`` clients in a
    closed loop (0: one request at a time through ``LLM.generate``)."""
    kwargs = dict(
        model=str(model),
        kv_cache_memory_bytes=24 << 20,
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        dtype="float32",
        enforce_eager=True,
        kv_host_cache_bytes=host_mb << 20,
    )
    workload = {"requests": trace, "concurrency": concurrency}
    done = subprocess.run(
        [sys.executable, str(ENGINE_SCRIPT), json.dumps(kwargs), json.dumps(workload)],
        cwd=ROOT,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(REPORT_PREFIX)]
    engine = json.loads(line[len(REPORT_PREFIX) :])
    assert engine["num_gpu_blocks"] == 24
    assert engine["block_size"] == ENGINE_BS
    assert engine["host_slots"] == host_mb  # 1 MiB blocks
    assert [r["generated"] for r in engine["requests"]] == [
        t["output_len"] for t in trace
    ]
    return engine


def _predict_engine(trace, engine, num_blocks, **kw):
    """The prediction, request by request, for ``trace`` on a device of
    ``num_blocks`` blocks and ``engine``'s host and batch size."""
    (row,) = predict(
        trace,
        num_blocks,
        [engine["host_slots"]],
        ENGINE_BS,
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        per_request=True,
        **kw,
    )
    return row


def _measured(engine):
    return [[r["prompt_tokens"], r["device"], r["host"]] for r in engine["requests"]]


@pytest.mark.engine
def test_prediction_matches_the_engine_request_by_request(model_8l):
    """One request at a time on a CPU engine with the host tier (24 MiB of
    device KV, 16 MiB of host): the device and host hit tokens of every
    request are the prediction's, with the device's block count the
    planner's."""
    trace = _engine_trace()
    engine = _serve(model_8l, trace, ENGINE_HOST_MB)
    cap = plan_capacity(
        model_8l,
        platform="cpu",
        dtype="float32",
        max_model_len=2048,
        budget_bytes=24 << 20,
    )
    assert cap.num_blocks == engine["num_gpu_blocks"]
    row = _predict_engine(trace, engine, cap.num_blocks)
    measured = _measured(engine)
    assert row["requests"] == measured
    # The case is not trivial: host hits, whole and partial, and misses.
    host = [h for _, _, h in measured]
    assert sum(host) > 0 and 0 in host[6:] and ENGINE_BS * 2 in host


@pytest.mark.engine
def test_prediction_matches_concurrent_clients(model_8l):
    """Three clients in a closed loop (each sends the trace's next request as
    soon as its last one ends, in the engine's process: ``send_delay=0``) on
    a CPU engine with an 8-block host: every request's device and host hit
    tokens are the prediction's, exactly. Requests hit prefixes that running
    requests hold or that finished between their steps, so a replay of one
    request at a time gets them wrong."""
    trace = _engine_trace()
    engine = _serve(model_8l, trace, 8, concurrency=3, max_num_seqs=3)
    blocks = engine["num_gpu_blocks"]
    row = _predict_engine(trace, engine, blocks, max_concurrency=3, send_delay=0)
    assert row["requests"] == _measured(engine)
    assert row["host_hit_tokens"] == engine["host_total"] > 0
    assert row["device_hit_tokens"] > 0
    # Concurrency changes the hits: one at a time predicts other ones.
    alone = _predict_engine(trace, engine, blocks)
    assert alone["requests"] != row["requests"]


@pytest.mark.engine
def test_prediction_matches_an_offline_batch_of_documents(model_8l):
    """vLLM's long-document benchmark: every prompt in one ``generate`` call,
    four documents of 13 blocks and then the same four again, on a 24-block
    device with a 48-block host. Requests wait at the head of the queue
    while the device is full, and each step's lookup holds their host hits:
    every request's hits are the prediction's."""
    rng = random.Random(5)
    docs = [[rng.randrange(4, 2000) for _ in range(1700)] for _ in range(4)]
    trace = [{"prompt_token_ids": d, "output_len": 8} for d in docs + docs]
    engine = _serve(model_8l, trace, 48, concurrency=len(trace), max_num_seqs=8)
    blocks = engine["num_gpu_blocks"]
    row = _predict_engine(
        trace, engine, blocks, max_concurrency=len(trace), send_delay=0
    )
    measured = _measured(engine)
    assert row["requests"] == measured
    # Not trivial: every repeat comes from the host, one only in part (a
    # replay that let waiting requests' hits go predicts two partial ones).
    host = [h for _, _, h in measured]
    assert host[:4] == [0] * 4 and all(host[4:])
    assert sorted(host[4:])[:2] == [9 * ENGINE_BS, 13 * ENGINE_BS]
