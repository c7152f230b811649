"""``kvmem plan``: how much KV cache a budget gives, and what a target needs.

Works offline from a local model directory: ``config.json`` for the layer
shapes and the safetensors headers (never the tensor data) for the weight
bytes per layer. The arithmetic is :mod:`vllm_kvmem.planner.kv_math`, which
mirrors vLLM 0.32.0; this package reads models (``model``, ``weights``),
resolves the engine options (``setup``), assembles plans (``costs``,
``plans``, ``partition``) and prints them (``report``, ``cli``). Nothing here
imports vLLM, so tests can predict an engine's numbers cheaply:

    cap = plan_capacity(model_dir, pp=2, partition=[56, 8], budget_bytes=5 << 30,
                        max_model_len=32768, kv_cache_dtype="fp8", proportional=True)
    cap.num_blocks, cap.tokens, cap.concurrency, cap.stages[0].kv_bytes
"""

from __future__ import annotations

from vllm_kvmem.planner.cli import add_arguments, run
from vllm_kvmem.planner.costs import KVCosts
from vllm_kvmem.planner.model import ModelInfo, load_model, model_from_config
from vllm_kvmem.planner.partition import Recommendation, recommend_partition
from vllm_kvmem.planner.plans import Plan, plan, plan_capacity
from vllm_kvmem.planner.report import format_plan, plan_to_dict
from vllm_kvmem.planner.setup import Options, Setup, resolve_setup
from vllm_kvmem.planner.weights import WeightInfo, read_safetensors_header

__all__ = [
    "KVCosts",
    "ModelInfo",
    "Options",
    "Plan",
    "Recommendation",
    "Setup",
    "WeightInfo",
    "add_arguments",
    "format_plan",
    "load_model",
    "model_from_config",
    "plan",
    "plan_capacity",
    "plan_to_dict",
    "read_safetensors_header",
    "recommend_partition",
    "resolve_setup",
    "run",
]
