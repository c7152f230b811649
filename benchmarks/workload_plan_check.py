"""``kvmem plan --trace`` against workload_bench.py's measured hit rates
(issue 45, item 5: the planner's prediction within 5 points).

workload_bench.py writes ``<out>_trace.json``: per run, the requests in the
order the server received them (prompt token ids as it tokenized them,
max_tokens) and the run's counter deltas. Per run this script writes the
requests as JSON lines of the planner's ``tokens`` format, replays them with
``kvmem plan --trace`` at that run's device KV and host size, and sets the
predicted device and host hit rates beside the measured ones.

Each request's ``output_token_ids`` are the tokens its conversation's next
turn sends where the answer stood (the answer as the server re-tokenizes
it): vLLM caches the generated tokens' KV and the next turn can hit it, which
a trace of ``output_len`` alone (unknown ids) cannot show. A request whose
conversation has no later turn keeps ``output_len``. That holds for a model
with real weights, whose answer re-tokenizes to the ids it generated; a
published shape served with ``--load-format dummy`` (the trace's
``model.shape``) generates random ids, which decode to little but spaces
and re-tokenize to other ids (an answer of n tokens comes back as about n/2
space tokens), so its generated KV never matches a later prompt: there every
request keeps ``output_len`` (``--answers auto``).

The replay runs the multi-turn bench's clients as a closed loop
(``--max-concurrency``, the bench's ``--clients``) through a server
(``send_delay=1``, the planner's default). A long-document run is one
``generate`` call of vLLM's offline client: every prompt is submitted at once
(``--max-concurrency`` the run's request count). Its trace is the measured
pass only; the client's warm-up pass before it ("This is warm up request
i ...") shares no block with it (vLLM's block hashes chain from the first
token), so the replay from empty caches counts the same hits.

Usage::

    python benchmarks/workload_plan_check.py benchmarks/results/X_trace.json
        [--out benchmarks/results/X_plan.json] [--max-concurrency 2]
        [--answers auto|next-turn|unknown]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


ANSWERS = ("auto", "next-turn", "unknown")


def with_output_ids(
    requests: list[dict[str, Any]], answers: bool = True
) -> list[dict[str, Any]]:
    """The trace's requests as planner lines, each answer's token ids taken
    from the first later prompt that extends this one (``answers``; else
    every answer is ``output_len`` unknown tokens)."""
    lines = []
    for i, r in enumerate(requests):
        ids, n = r["prompt_token_ids"], r.get("output_len") or 1
        line: dict[str, Any] = {"prompt_token_ids": ids, "output_len": n}
        for later in requests[i + 1 :] if answers else ():
            nxt = later["prompt_token_ids"]
            if len(nxt) > len(ids) and nxt[: len(ids)] == ids:
                line["output_token_ids"] = nxt[len(ids) : len(ids) + n]
                del line["output_len"]
                break
        lines.append(line)
    return lines


def predict(
    trace: dict[str, Any],
    run: dict[str, Any],
    max_concurrency: int,
    tmp: Path,
    answers: bool = True,
) -> dict[str, Any]:
    """``kvmem plan --trace`` on one run's requests at its host size."""
    sizes = trace["sizes"]
    path = tmp / f"{run['cell']}-{run['repeat']}.jsonl"
    lines = with_output_ids(run["requests"], answers)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    multiple = run["host_bytes"] / sizes["device_bytes"]
    argv = [
        "plan", trace["model"]["path"],
        "--trace", str(path), "--trace-format", "tokens",
        "--kv-cache-memory-bytes", str(sizes["device_bytes"]),
        "--max-model-len", str(
            sizes.get("max_model_len", sizes["device_tokens"] - sizes["block_size"])
        ),
        "--block-size", str(sizes["block_size"]), "--platform", "cpu",
        "--dtype", trace["model"].get("dtype", "float32"),
        "--host-sizes", f"{multiple:g}x" if multiple else "0",
        "--max-concurrency", str(max_concurrency), "--json",
    ]  # fmt: skip
    # In this process: vLLM (the block hasher) is imported once, not per run.
    from vllm_kvmem.cli import main as kvmem

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = kvmem(argv)
    if code != 0:
        raise RuntimeError(f"kvmem {' '.join(argv)} exited {code}")
    (row,) = json.loads(text.getvalue())["rows"]
    return {"argv": argv, "row": row}


def ensure_model(model: dict[str, Any]) -> None:
    """The trace's published shape is rebuilt where it was (its config and
    tokenizer: ``out/`` is scratch); a tiny model must still be there."""
    path = Path(model["path"])
    if (path / "config.json").exists() or not model.get("shape"):
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _model import PublishedShape

    PublishedShape(model["shape"], model.get("dtype", "bfloat16")).ensure(path.parent)


def measured(run: dict[str, Any]) -> dict[str, float | None]:
    m = run["measured"]
    q = m.get("vllm:prefix_cache_queries") or 0
    if not q:
        return {"device_hit_rate": None, "host_hit_rate": None}
    return {
        "device_hit_rate": (m.get("vllm:prefix_cache_hits") or 0) / q,
        "host_hit_rate": (m.get("vllm:external_prefix_cache_hits") or 0) / q,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="workload_bench.py's <out>_trace.json")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=2,
        help="multi-turn runs: clients in the replay's closed loop (the bench's "
        "--clients); a long-document run submits every prompt at once",
    )
    p.add_argument(
        "--answers",
        choices=ANSWERS,
        default="auto",
        help="each answer's KV: the ids the next turn re-sends (next-turn), or "
        "tokens no prompt matches (unknown); auto: unknown for a published "
        "shape served with dummy weights, else next-turn",
    )
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"trace {args.trace}: no such file (workload_bench.py writes it)")
    trace = json.loads(args.trace.read_text())
    ensure_model(trace["model"])
    answers = args.answers
    if answers == "auto":
        answers = "unknown" if trace["model"].get("shape") else "next-turn"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in trace["runs"]:
            offline = run["workload"] == "long_doc"
            clients = len(run["requests"]) if offline else args.max_concurrency
            pred = predict(trace, run, clients, Path(tmp), answers == "next-turn")
            meas = measured(run)
            row = {
                "workload": run["workload"],
                "cell": run["cell"],
                "repeat": run["repeat"],
                "host_bytes": run["host_bytes"],
                "measured": meas,
                "predicted": {
                    k: pred["row"][k] for k in ("device_hit_rate", "host_hit_rate")
                },
                "plan_argv": pred["argv"],
            }
            row["error_points"] = {
                k: None if meas[k] is None else 100 * (row["predicted"][k] - meas[k])
                for k in meas
            }
            rows.append(row)
            print(
                f"{run['workload']:<10} {run['cell']:<10} #{run['repeat']}  device "
                f"{_pct(meas['device_hit_rate'])} predicted "
                f"{_pct(row['predicted']['device_hit_rate'])}   host "
                f"{_pct(meas['host_hit_rate'])} predicted "
                f"{_pct(row['predicted']['host_hit_rate'])}"
            )
    worst = {
        k: max(
            (
                abs(r["error_points"][k])
                for r in rows
                if r["error_points"][k] is not None
            ),
            default=None,
        )
        for k in ("device_hit_rate", "host_hit_rate")
    }
    med = (
        {
            k: statistics.median(abs(r["error_points"][k]) for r in rows)
            for k in ("device_hit_rate", "host_hit_rate")
        }
        if rows
        else {}
    )
    print(f"largest |predicted - measured| (points): {worst}; median {med}")
    out = args.out or args.trace.with_name(
        args.trace.name.removesuffix("_trace.json") + "_plan.json"
    )
    out.write_text(
        json.dumps(
            {
                "trace": str(args.trace),
                "max_concurrency": args.max_concurrency,
                "answers": answers,
                "goal_points": 5,
                "largest_error_points": worst,
                "median_abs_error_points": med,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"JSON: {out}")
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


if __name__ == "__main__":
    sys.exit(main())
