"""How much host memory a workload wants: a request trace replayed through
vLLM's block hashing and a model of its prefix cache with the host tier
behind it (:mod:`vllm_kvmem.planner.replay`), for a sweep of host sizes.

The trace formats (``kvmem plan --trace FILE [--trace-format F]``):

- ``tokens``: JSON lines ``{"prompt_token_ids": [...]}``, optionally with
  ``"output_len"`` (tokens generated, default 1) or ``"output_token_ids"``.
- ``text``: JSON lines ``{"prompt": "..."}`` (tokenized by the model
  directory's tokenizer, as ``LLM.generate`` tokenizes a string) or
  ``{"messages": [...]}`` (one chat request), with an optional
  ``"output_len"``.
- ``lengths``: JSON lines ``{"prefix_id": "sys1", "prefix_len": 512,
  "suffix_len": 64}``: lines with the same ``prefix_id`` share their first
  ``prefix_len`` tokens; every suffix is its own. Token ids are generated,
  deterministically.
- ``conversations``: the JSON list vLLM's multi-turn benchmark client
  (``benchmarks/multi_turn/benchmark_serving_multi_turn.py``) reads and
  writes with ``--output-file``, ``[{"id": ..., "messages": [{"role":
  "user", "content": ...}, {"role": "assistant", ...}, ...]}]``. Each user
  turn is one request, as the client sends it: the whole history so far,
  the answers included, chat-templated with the generation prompt. The
  turns of different conversations interleave as one client of the
  benchmark orders them (``max_active_conversations`` at a time, round
  robin).

Generated tokens hold device blocks and are cached like the prompt, so a
request with ``output_len`` n holds the KV of its prompt and n - 1 more
tokens; in a conversation those are the answer as the next turn re-sends
it, so the next turn can hit them as it does on a real engine.

Hashing is vLLM's own (``hash_block_tokens`` chained from the parent block,
sha256 as vLLM's default ``--prefix-caching-hash-algo``); vLLM is imported
only when a trace is replayed.
"""

from __future__ import annotations

import json
import os
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvmem.core.units import cdiv, format_bytes, parse_size
from vllm_kvmem.planner.replay import Replay, ReplayRequest

TRACE_FORMATS = ("auto", "tokens", "text", "lengths", "conversations")
#: Generated token ids of the ``lengths`` format lie in [_LOW, _HIGH): clear of
#: the special tokens, inside any real vocabulary.
_LOW, _HIGH = 4, 32000
#: Blocks near the free queue's head the tier copies ahead of eviction: its
#: scan window (vllm_kvmem/host_tier/scheduler.py), from the step's tokens.
MIN_SPILL_AHEAD = 64


@dataclass
class TraceRequest:
    """One request: its prompt, and the tokens after it whose KV it caches
    (generated tokens but the last, which vLLM samples and never computes).
    ``None`` ids in ``cached_output`` are tokens no later prompt can match
    (unknown generated tokens)."""

    prompt_token_ids: list[int]
    cached_output: list[int | None]


def spill_ahead_blocks(max_num_batched_tokens: int, block_size: int) -> int:
    """The tier's scan window: blocks the next two steps could evict."""
    return max(2 * cdiv(max_num_batched_tokens, block_size), MIN_SPILL_AHEAD)


# -------------------------------------------------------------- hashing


def vllm_block_hasher(hash_algo: str = "sha256") -> Callable[[list[Any]], list[bytes]]:
    """Chained full-block hashes as vLLM's prefix cache computes them."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)

    def hasher(tokens: list[Any], block_size: int) -> list[bytes]:
        out: list[bytes] = []
        parent = None
        for i in range(len(tokens) // block_size):
            block = tokens[i * block_size : (i + 1) * block_size]
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block, None)
            out.append(parent)
        return out

    return hasher


def token_block_keys(tokens: list[Any], block_size: int) -> list[Hashable]:
    """Chained full-block keys from the tokens themselves: collision-free,
    vLLM-free, for tests and for traces where vLLM is not installed."""
    out: list[Hashable] = []
    parent: Hashable = None
    for i in range(len(tokens) // block_size):
        parent = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def _replay_requests(
    trace: Sequence[TraceRequest], block_size: int, hasher: Callable[..., list]
) -> list[ReplayRequest]:
    out = []
    for n, req in enumerate(trace):
        # Unknown generated tokens: an id no prompt holds, unique per request.
        output = [
            t if t is not None else ("out", n, i)
            for i, t in enumerate(req.cached_output)
        ]
        tokens = [*req.prompt_token_ids, *output]
        out.append(
            ReplayRequest(
                keys=hasher(tokens, block_size),
                prompt_len=len(req.prompt_token_ids),
                num_tokens=len(tokens),
            )
        )
    return out


# -------------------------------------------------------------- prediction


def predict(
    trace: Sequence[TraceRequest | dict[str, Any]] | str | os.PathLike[str],
    device_blocks: int,
    host_blocks_list: Iterable[int],
    block_size: int,
    *,
    policy: str = "lru",
    max_concurrency: int = 1,
    spill_ahead: int | None = None,
    send_delay: int = 1,
    max_num_batched_tokens: int = 2048,
    hash_algo: str | None = "sha256",
    per_request: bool = False,
    **load_kwargs: Any,
) -> list[dict[str, Any]]:
    """Device and host hits of ``trace`` for each host size.

    ``trace``: :class:`TraceRequest` s, dicts of the ``tokens`` format, or a
    trace file (``load_kwargs`` go to :func:`load_trace`: ``fmt``,
    ``model_dir``, ``max_active_conversations``). ``device_blocks``: vLLM's
    ``num_gpu_blocks`` (the null block included; the planner's
    ``Capacity.num_blocks``, or vLLM's "GPU KV cache size" / block size + 1).
    ``host_blocks_list``: host tier slots to try (0: no tier).
    ``spill_ahead``: blocks the tier copies ahead of eviction (default: its
    scan window for ``max_num_batched_tokens``). ``max_concurrency``: clients
    of a closed loop, each sending its next request of the trace once its
    last one ended, ``send_delay`` steps later (1: through a server; 0: in
    the engine's process). ``hash_algo``: vLLM's
    ``--prefix-caching-hash-algo``; ``None`` keys blocks by their tokens
    (same hits, no vLLM import). ``per_request``: add each request's hits.

    Returns one dict per host size, in order: ``host_blocks``,
    ``prompt_tokens``, ``device_hit_tokens``, ``host_hit_tokens`` and the
    rates as fractions of the prompt tokens (``device_hit_rate``,
    ``host_hit_rate``, ``hit_rate``), plus ``device_evictions``,
    ``host_saves`` and ``host_drops``.
    """
    if isinstance(trace, (str, os.PathLike)):
        trace = load_trace(trace, **load_kwargs)
    elif load_kwargs:
        raise TypeError(f"unexpected arguments {sorted(load_kwargs)} with a trace list")
    reqs = [
        r if isinstance(r, TraceRequest) else _from_dict(r, n)
        for n, r in enumerate(trace)
    ]
    hasher = vllm_block_hasher(hash_algo) if hash_algo else token_block_keys
    replayed = _replay_requests(reqs, block_size, hasher)
    if spill_ahead is None:
        spill_ahead = spill_ahead_blocks(max_num_batched_tokens, block_size)
    rows = []
    for host_blocks in host_blocks_list:
        result = Replay(
            device_blocks,
            host_blocks,
            block_size,
            policy=policy,
            max_concurrency=max_concurrency,
            spill_ahead=spill_ahead,
            send_delay=send_delay,
        ).run(replayed)
        total = result.prompt_tokens
        row: dict[str, Any] = {
            "host_blocks": host_blocks,
            "prompt_tokens": total,
            "device_hit_tokens": result.device_hit_tokens,
            "host_hit_tokens": result.host_hit_tokens,
            "device_hit_rate": result.device_hit_tokens / total if total else 0.0,
            "host_hit_rate": result.host_hit_tokens / total if total else 0.0,
            "hit_rate": (result.device_hit_tokens + result.host_hit_tokens) / total
            if total
            else 0.0,
            "device_evictions": result.device_evictions,
            "host_saves": result.host_saves,
            "host_drops": result.host_drops,
        }
        if per_request:
            row["requests"] = [
                [r.prompt_tokens, r.device_hit_tokens, r.host_hit_tokens]
                for r in result.requests
            ]
        rows.append(row)
    return rows


# -------------------------------------------------------------- host sizes


def parse_host_sizes(
    text: str, *, device_blocks: int, block_bytes: int
) -> list[tuple[str, int]]:
    """``--host-sizes``: ``(label, host blocks)`` for each comma-separated
    size: bytes (``0``, ``512M``, ``8G``, ``1.5g``) or a multiple of the
    device KV cache (``2x``, ``0.5x``). Bytes are cut to whole blocks, as the
    tier sizes itself."""
    flag = "--host-sizes"
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(
            f"{flag}={text!r}: give comma-separated sizes, e.g. 0,512M,2x (bytes, "
            "or multiples of the device KV cache)"
        )
    out = []
    for item in items:
        if item.lower().endswith("x"):
            try:
                factor = float(item[:-1])
            except ValueError:
                factor = -1.0
            if factor < 0:
                raise ValueError(
                    f"{flag}: {item!r} is not a multiple of the device KV cache; "
                    "use e.g. 2x or 0.5x, or bytes like 512M"
                )
            out.append((item, int(factor * device_blocks)))
            continue
        try:
            size = parse_size(item, flag=flag)
        except ValueError as e:
            raise ValueError(
                f"{flag}: {item!r} is not a size; use bytes (0, 512M, 8G, 1.5g) or "
                f"a multiple of the device KV cache (2x) [{e}]"
            ) from None
        if size < 0:
            raise ValueError(f"{flag}: {item!r} is negative; use 0 or more")
        out.append((item, size // block_bytes))
    return out


# -------------------------------------------------------------- trace files


def load_trace(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    *,
    model_dir: str | os.PathLike[str] | None = None,
    max_active_conversations: int = 1,
) -> list[TraceRequest]:
    """The requests of a trace file (formats: the module's docstring).

    ``model_dir``: the tokenizer for ``text`` and ``conversations``;
    ``max_active_conversations``: conversations one benchmark client keeps
    going at once (its ``--max-active-conversations``), which orders the
    turns."""
    flag = "--trace"
    if fmt not in TRACE_FORMATS:
        raise ValueError(
            f"--trace-format={fmt!r}: use one of {', '.join(TRACE_FORMATS)}"
        )
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag}={str(path)!r}: no such file; pass a trace file")
    text = p.read_text()
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"{flag}={str(path)!r}: the file is empty")
    if fmt == "auto":
        fmt = "conversations" if stripped[0] == "[" else "jsonl"
    if stripped[0] == "{" and fmt == "conversations":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and "filetype" in whole:
            raise ValueError(
                f"{flag}={str(path)!r} is a configuration for vLLM's multi-turn "
                "client, not conversations: run the client with --output-file "
                "and pass the file it writes"
            )
    tokenizer = _Tokenizer(model_dir) if model_dir is not None else None
    if fmt == "conversations":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{flag}={str(path)!r}: not JSON ({e}); the conversations format is "
                'a JSON list of {"id": ..., "messages": [...]}'
            ) from None
        return conversation_requests(
            data,
            _need_tokenizer(tokenizer, "conversations"),
            max_active_conversations=max_active_conversations,
            source=str(path),
        )
    return _jsonl_requests(text.splitlines(), fmt, tokenizer, str(path))


def _need_tokenizer(tokenizer: _Tokenizer | None, what: str) -> _Tokenizer:
    if tokenizer is None:
        raise ValueError(f"a {what} trace needs a tokenizer: pass the model directory")
    return tokenizer


def _jsonl_requests(
    lines: list[str], fmt: str, tokenizer: _Tokenizer | None, source: str
) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--trace={source!r} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: not JSON ({e.msg}); each line is one request, e.g. "
                '{"prompt_token_ids": [1, 2, 3]} or {"prompt": "..."}'
            ) from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object, got {line[:60]!r}")
        kind = _line_kind(item)
        if kind is None or (fmt not in ("auto", "jsonl") and kind != fmt):
            raise ValueError(
                f"{where}: {_keys(item)} is not a {fmt if fmt != 'jsonl' else 'known'}"
                " request; use prompt_token_ids (tokens), prompt or messages (text), "
                "prefix_len/suffix_len (lengths), or --trace-format"
            )
        try:
            out.append(_line_request(item, kind, tokenizer, n))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    if not out:
        raise ValueError(f"--trace={source!r}: no requests in the file")
    return out


def _keys(item: dict[str, Any]) -> str:
    return "{" + ", ".join(sorted(item)) + "}"


def _line_kind(item: dict[str, Any]) -> str | None:
    if "prompt_token_ids" in item:
        return "tokens"
    if "prompt" in item or "messages" in item:
        return "text"
    if "prefix_len" in item or "suffix_len" in item:
        return "lengths"
    return None


def _from_dict(item: dict[str, Any], n: int) -> TraceRequest:
    if "prompt_token_ids" not in item:
        raise ValueError(f"trace request {n}: no prompt_token_ids ({_keys(item)})")
    return _line_request(item, "tokens", None, n)


def _output(item: dict[str, Any]) -> list[int | None]:
    """Generated tokens whose KV is cached: all but the last."""
    if "output_token_ids" in item:
        ids = _int_list(item["output_token_ids"], "output_token_ids")
        return list(ids[:-1])
    n = item.get("output_len", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"output_len={n!r}: must be a whole number of tokens >= 1")
    return [None] * (n - 1)


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"{name} must be a list of token ids (integers)")
    return value


def _line_request(
    item: dict[str, Any], kind: str, tokenizer: _Tokenizer | None, n: int
) -> TraceRequest:
    if kind == "tokens":
        prompt = _int_list(item["prompt_token_ids"], "prompt_token_ids")
    elif kind == "text":
        tok = _need_tokenizer(tokenizer, "text")
        if "messages" in item:
            prompt = tok.chat(_messages(item["messages"]), generation_prompt=True)
        else:
            if not isinstance(item["prompt"], str):
                raise ValueError("prompt must be a string")
            prompt = tok.encode(item["prompt"])
    else:
        prompt = _lengths_prompt(item, n)
    if not prompt:
        raise ValueError("the prompt is empty")
    return TraceRequest(list(prompt), _output(item))


def _lengths_prompt(item: dict[str, Any], n: int) -> list[int]:
    prefix_len, suffix_len = item.get("prefix_len", 0), item.get("suffix_len", 0)
    for name, v in (("prefix_len", prefix_len), ("suffix_len", suffix_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}={v!r}: must be a whole number of tokens >= 0")
    prefix_id = str(item.get("prefix_id", f"line {n}"))
    prefix = random.Random(f"prefix:{prefix_id}")
    suffix = random.Random(f"suffix:{n}")
    return [prefix.randrange(_LOW, _HIGH) for _ in range(prefix_len)] + [
        suffix.randrange(_LOW, _HIGH) for _ in range(suffix_len)
    ]


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in value
    ):
        raise ValueError(
            'messages must be a list of {"role": ..., "content": "..."} objects'
        )
    return value


class _Tokenizer:
    """The model directory's tokenizer, as vLLM's ``LLM.generate`` (a string
    prompt, special tokens added) and its chat endpoint (the chat template
    rendered with the generation prompt, tokenized without adding special
    tokens) use it. Without a chat template, a conversation is rendered as
    ``"{role}: {content}\\n"`` per message (then ``"assistant: "`` for the
    generation prompt) and tokenized as a plain prompt."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(
                f"no tokenizer in {str(model_dir)!r} for a text trace ({e}); use a "
                "model directory with one, or a trace of prompt_token_ids"
            ) from None
        self.templated = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text).input_ids)

    def chat(
        self, messages: list[dict[str, str]], generation_prompt: bool
    ) -> list[int]:
        if self.templated:
            text = self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            return list(self.tok(text, add_special_tokens=False).input_ids)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if generation_prompt else ""))

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False).input_ids)


def conversation_requests(
    conversations: Any,
    tokenizer: _Tokenizer,
    *,
    max_active_conversations: int = 1,
    source: str = "conversations",
) -> list[TraceRequest]:
    """The requests vLLM's multi-turn client sends for ``conversations``, in
    the order one client sends them: it keeps ``max_active_conversations``
    going, takes the newest-started first and sends one turn of each in
    turn (round robin), starting the next conversation when one ends."""
    if max_active_conversations < 1:
        raise ValueError(
            f"--max-active-conversations={max_active_conversations}: must be at least 1"
        )
    where = f"--trace={source!r}"
    if not isinstance(conversations, list) or not conversations:
        raise ValueError(
            f"{where}: expected a non-empty JSON list of "
            '{"id": ..., "messages": [...]} (vLLM\'s multi-turn client format)'
        )
    convs: list[tuple[str, list[dict[str, str]]]] = []
    for i, item in enumerate(conversations):
        if not isinstance(item, dict) or "messages" not in item:
            raise ValueError(
                f"{where}: item {i} has no messages; each item is "
                '{"id": ..., "messages": [...]}'
            )
        try:
            messages = _messages(item["messages"])
        except ValueError as e:
            raise ValueError(
                f"{where}: conversation {item.get('id', i)!r}: {e}"
            ) from None
        for j, m in enumerate(messages):
            want = "user" if j % 2 == 0 else "assistant"
            if m["role"] != want:
                raise ValueError(
                    f"{where}: conversation {item.get('id', i)!r} message {j} is "
                    f"{m['role']!r}; the client alternates user (first) and "
                    "assistant messages"
                )
        convs.append((str(item.get("id", i)), messages))
    out = []
    for c, turn in _client_order(convs, max_active_conversations):
        messages = convs[c][1]
        prompt = tokenizer.chat(messages[: turn + 1], generation_prompt=True)
        cached: list[int | None] = []
        if turn + 1 < len(messages):
            answer = tokenizer.count(messages[turn + 1]["content"])
            full = tokenizer.chat(messages[: turn + 2], generation_prompt=False)
            if full[: len(prompt)] == prompt:
                cached = list(full[len(prompt) : len(prompt) + answer])
            cached += [None] * (answer - len(cached))
        out.append(TraceRequest(prompt, cached))
    return out


def _client_order(
    convs: list[tuple[str, list[dict[str, str]]]], active: int
) -> list[tuple[int, int]]:
    """(conversation, user message index) in one client's order."""
    pending = deque(range(len(convs)))
    queue: deque[int] = deque()
    next_turn = dict.fromkeys(range(len(convs)), 0)
    order = []
    while True:
        while len(queue) < active and pending:
            queue.append(pending.popleft())
        if not queue:
            return order
        c = queue.pop()
        order.append((c, next_turn[c]))
        next_turn[c] += 2
        if next_turn[c] < len(convs[c][1]):
            queue.appendleft(c)


# -------------------------------------------------------------- the report


def trace_report(
    model: str | os.PathLike[str],
    options: Any,
    *,
    trace: str | os.PathLike[str],
    trace_format: str = "auto",
    host_sizes: str = "0,1x,2x,4x",
    budget_bytes: int | str | None = None,
    budget_tokens: int | str | None = None,
    policy: str = "lru",
    max_concurrency: int = 1,
    max_active_conversations: int = 1,
) -> dict[str, Any]:
    """``kvmem plan --trace``: the device KV cache the planner predicts for
    the budget (vLLM's default per-GPU mode), the trace replayed for each
    host size."""
    from vllm_kvmem.planner.model import as_model
    from vllm_kvmem.planner.plans import plan_capacity
    from vllm_kvmem.planner.setup import resolve_setup

    setup = resolve_setup(as_model(model, options.dtype), options)
    cap = plan_capacity(
        model, options, budget_bytes=budget_bytes, budget_tokens=budget_tokens
    )
    block_bytes = sum(s.bytes_per_block for s in cap.stages)
    sizes = parse_host_sizes(
        host_sizes, device_blocks=cap.num_blocks, block_bytes=block_bytes
    )
    requests = load_trace(
        trace,
        trace_format,
        model_dir=model,
        max_active_conversations=max_active_conversations,
    )
    spill = spill_ahead_blocks(setup.max_num_batched_tokens, setup.block_size)
    rows = predict(
        requests,
        cap.num_blocks,
        [blocks for _, blocks in sizes],
        setup.block_size,
        policy=policy,
        max_concurrency=max_concurrency,
        spill_ahead=spill,
    )
    for (label, blocks), row in zip(sizes, rows):
        row["label"] = label
        row["host_bytes"] = blocks * block_bytes
    return {
        "trace": str(trace),
        "requests": len(requests),
        "prompt_tokens": rows[0]["prompt_tokens"] if rows else 0,
        "device": {
            "blocks": cap.num_blocks,
            "block_size": setup.block_size,
            "bytes": cap.num_blocks * block_bytes,
            "block_bytes": block_bytes,
        },
        "max_concurrency": max_concurrency,
        "policy": policy,
        "spill_ahead": spill,
        "rows": rows,
    }


def format_trace_report(report: dict[str, Any]) -> str:
    """The ``kvmem plan --trace`` table."""
    d = report["device"]
    lines = [
        f"Workload {report['trace']}: {report['requests']:,} requests, "
        f"{report['prompt_tokens']:,} prompt tokens.",
        f"Device KV cache: {d['blocks']:,} blocks of {d['block_size']} tokens "
        f"({format_bytes(d['bytes'])}, vLLM's null block included); one block is "
        f"{format_bytes(d['block_bytes'])} on the host per TP shard.",
        f"Replay: {report['max_concurrency']} request(s) at a time, host "
        f"{report['policy']} eviction, free blocks copied ahead of eviction "
        f"within {report['spill_ahead']} blocks of the free queue's head.",
        "",
    ]
    head = ("host size", "host bytes", "host blocks", "device hit", "host hit", "total")
    rows = [head]
    for r in report["rows"]:
        rows.append(
            (
                r["label"],
                format_bytes(r["host_bytes"]),
                f"{r['host_blocks']:,}",
                f"{100 * r['device_hit_rate']:.1f}%",
                f"{100 * r['host_hit_rate']:.1f}%",
                f"{100 * r['hit_rate']:.1f}%",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for k, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "Hit rates are fractions of prompt tokens, as vLLM's prefix cache "
        "metrics and vllm:kvmem_host_hit_tokens_total count them. Host size: "
        "--kv-host-cache-bytes per TP shard.",
    ]
    return "\n".join(lines)
