"""Turn the host KV tier off for a model it cannot serve, once vLLM knows the
model and before it builds the VllmConfig."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def create_model_config(self, *args, **kwargs):
        model_config = original(self, *args, **kwargs)
        from vllm_kvmem.host_tier_setup import refuse_unservable_model

        refuse_unservable_model(self, model_config)
        return model_config

    return create_model_config


PATCH = Patch(
    name="engine_args_model_config",
    target="vllm.engine.arg_utils:EngineArgs.create_model_config",
    make_replacement=_make,
    signature=("self",),
    processes=("API server / LLM process",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="A model the host tier cannot serve (MLA, Mamba or linear-attention "
    "state, no attention, encoder-decoder) must run exactly as without "
    "`--kv-host-cache-bytes`. The VllmConfig picks its KV cache manager from "
    "the configured connector (`SupportsHMA`), so the connector must be gone "
    "before the VllmConfig is built, and the model is known only once vLLM has "
    "built the ModelConfig: `create_engine_config` builds both, calling this "
    "method in between.",
    how="Wraps the method: vLLM builds the ModelConfig; where "
    "`--kv-host-cache-bytes` added the host tier connector (`engine_args_config`) "
    "and the model is one the tier cannot serve "
    "(`host_tier_setup.unsupported_model_reason`), sets `kv_transfer_config` "
    "back to None with one warning (`Host KV tier off: <why>; serving continues "
    "without it.`).",
    upstream="None: the host tier is vllm-kvmem's own connector, and vLLM "
    "asks a connector about the KV cache manager by its class, never with the "
    "model (`KVConnectorFactory.supports_hma_config`).",
    remove_when="vLLM lets a KV connector decline a model before it picks the "
    "KV cache manager, or the host tier serves every model vLLM does.",
    idle="Calls vLLM's method and returns its ModelConfig; with no host tier "
    "connector added by `--kv-host-cache-bytes` nothing is checked or changed.",
)
