"""KV connectors shipped with vllm-kvmem."""
