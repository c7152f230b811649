"""The real-size run's steps, their order and their costs (issue 36).

What ``real_size.py`` runs and in which order: the steps of its plan
(``items``), the servers' starts and stops around them (``schedule``) and
each one's estimate (``COST_S``). Pure (no vLLM, no torch), so the dry run
and stage 2's plan read it on any machine.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_bench as sb  # noqa: E402  (no vLLM or torch at import)
from gpu_common import MEASURED_S  # noqa: E402

#: What the plan's estimate uses. Measured on the H200 (2026-11-26, the
#: tiny model): a server's start and warm-up, a client call. Assumed for the
#: 8B shape (not measured anywhere yet): the extra start cost (dummy
#: weights, CUDA graph capture at 7 sizes, pinning the host bytes), servers
#: started together, prefill speed and a decode step at batch 16.
COST_S = {
    "server_start": MEASURED_S["server_start_eager"] + 15.0,
    "parallel_start_extra": 10.0,
    "stop": 5.0,
    "client_call": MEASURED_S["ab_probe"] / 3,
    "metrics_settle": 1.5,
    # The series' vLLM copy for the lazy+series arm (series_tree.build): 8.7 s
    # on a development CPU with git; assumed 15 s on the machine.
    "series_build": 15.0,
    "prefill_tokens_per_s": 20000.0,
    "decode_step": 0.012,
    "fixed": 20.0,
}
COST_MEASURED = ("server_start (its 60 s base)", "client_call")


@dataclass
class Item:
    """One measuring step of the plan."""

    step: str
    arm: str
    phase: str
    level: str = "unique"
    repeat: int = 0
    length: int = 0  # ttft: prompt tokens
    probe: int = 0
    cold_only: bool = False  # ttft of none: a recompute either way

    @property
    def name(self) -> str:
        if self.step == "ttft":
            return f"ttft {self.length} #{self.probe} {self.arm}"
        return f"{self.step} {self.level} #{self.repeat} {self.arm}"


def items(args: argparse.Namespace) -> list[Item]:
    """Every step of the plan in the order it runs (phases A, B, C)."""
    steps = args.step_list
    conn = [a for a in args.ttft_arm_list if a != "none"]
    later = set(args.throughput_arm_list if "throughput" in steps else []) | set(
        args.layout_arm_list if "layout" in steps else []
    )
    out: list[Item] = []
    if "ttft" in steps:
        for length in args.ttft_len_list:
            for k in range(args.probes):
                out += [Item("ttft", a, "A", length=length, probe=k) for a in conn]
    profiled = set()
    if "profile" in steps:  # A's arms whose last use this is
        for a in args.profile_arm_list:
            if a in conn and a not in later:
                out.append(Item("profile", a, "A"))
                profiled.add(a)
        for a in args.profile_arm_list:
            if a in later and a not in profiled:
                out.append(Item("profile", a, "B"))
                profiled.add(a)
    if "throughput" in steps:
        for rep in range(args.repeats):
            for lv in args.level_list:
                if lv.name == "unique" and rep == 0 and "profile" in steps:
                    # step 2's runs; arms it did not profile run here
                    missing = [a for a in args.throughput_arm_list if a not in profiled]
                    out += [Item("throughput", a, "B") for a in missing]
                    profiled.update(missing)
                    continue
                out += [
                    Item("throughput", a, "B", level=lv.name, repeat=rep)
                    for a in args.throughput_arm_list
                ]
    if "ttft" in steps and "none" in args.ttft_arm_list:
        out += [
            Item("ttft", "none", "B", length=n, cold_only=True)
            for n in args.ttft_len_list
        ]
    if "profile" in steps:
        out += [
            Item("profile", a, "C") for a in args.profile_arm_list if a not in profiled
        ]
        profiled.update(args.profile_arm_list)
    if "layout" in steps:
        for rep in range(args.layout_repeats):
            for a in args.layout_arm_list:
                if rep == 0 and a in profiled:
                    continue  # step 2's run of that arm is this one
                out.append(Item("layout", a, "C", repeat=rep))
    return out


@dataclass
class Action:
    kind: str  # start, item, stop
    arms: list[str] = field(default_factory=list)
    item: Item | None = None
    estimate_s: float = 0.0


def _run_cost(args: argparse.Namespace, level: str) -> float:
    lv = sb.LEVELS[level]
    n = args.num_prompts
    prompt = args.prefix_len + args.suffix_len
    if level == "unique":
        new = n * prompt
    else:  # every prefix computed once; host hits load the rest
        new = lv.num_prefixes(n) * args.prefix_len + n * args.suffix_len
    waves = math.ceil(n / args.concurrency)
    return (
        COST_S["client_call"]
        + COST_S["metrics_settle"]
        + new / COST_S["prefill_tokens_per_s"]
        + waves * args.output_len * COST_S["decode_step"]
    )


def _prefill_s(tokens: int) -> float:
    """A prefill's seconds, attention's quadratic part included."""
    return tokens / COST_S["prefill_tokens_per_s"] * (1 + tokens / 65536)


def item_cost(args: argparse.Namespace, it: Item) -> float:
    if it.step != "ttft":
        return _run_cost(args, it.level)
    if it.cold_only:
        return COST_S["client_call"] + _prefill_s(it.length)
    fill = filler_count(args) * args.filler_len
    return (
        3 * COST_S["client_call"]
        + COST_S["metrics_settle"]
        + 2 * _prefill_s(it.length)  # cold; the repeat at worst recomputes
        + fill / COST_S["prefill_tokens_per_s"]
    )


def start_cost(n: int) -> float:
    return COST_S["server_start"] + COST_S["parallel_start_extra"] * max(0, n - 1)


def schedule(args: argparse.Namespace) -> list[Action]:
    """Starts, steps and stops in order: a phase's missing servers start
    together (at most ``--max-live`` live); a server stops after its last
    step; with no free slot, the live server used last goes first."""
    plan = items(args)
    actions: list[Action] = []
    live: list[str] = []

    def next_use(arm: str, i: int) -> int:
        return next((j for j in range(i, len(plan)) if plan[j].arm == arm), 10**9)

    for i, it in enumerate(plan):
        if it.arm not in live:
            phase_arms = list(
                dict.fromkeys(p.arm for p in plan[i:] if p.phase == it.phase)
            )
            missing = [a for a in phase_arms if a not in live]
            free = args.max_live - len(live)
            if free <= 0:
                victim = max(live, key=lambda a: next_use(a, i))
                live.remove(victim)
                actions.append(Action("stop", [victim], estimate_s=COST_S["stop"]))
                free = 1
            batch = [it.arm] + [a for a in missing if a != it.arm][: free - 1]
            actions.append(Action("start", batch, estimate_s=start_cost(len(batch))))
            live += batch
        actions.append(Action("item", [it.arm], it, item_cost(args, it)))
        done = [a for a in live if next_use(a, i + 1) == 10**9]
        for a in done:
            live.remove(a)
        if done:
            actions.append(Action("stop", done, estimate_s=COST_S["stop"] * len(done)))
    return actions


def filler_count(args: argparse.Namespace) -> int:
    """Filler prompts that overflow the device cache (1.25 times)."""
    return max(2, math.ceil(1.25 * args.device_kv_tokens / args.filler_len))
