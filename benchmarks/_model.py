"""The benchmarks' random-weight models, built by ``vllm_kvmem.tiny_model``.

A benchmark varies a few fields of the model (layers, width, heads, dtype);
this names them, says the KV bytes one token costs, and builds each shape
once per model cache (the bytes are deterministic, so a cached model is the
same model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama: the ``TinyModelOptions`` fields benchmarks vary."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 64
    dtype: str = "float32"
    max_position_embeddings: int = 8192

    @property
    def tag(self) -> str:
        return (
            f"L{self.num_layers}-H{self.hidden_size}-A{self.num_heads}"
            f"-KV{self.num_kv_heads}-D{self.head_dim}-{self.dtype}"
            f"-P{self.max_position_embeddings}"
        )

    def kv_bytes_per_token(self) -> int:
        elem = 2 if self.dtype in ("bfloat16", "float16") else 4
        return 2 * self.num_kv_heads * self.head_dim * elem * self.num_layers

    def ensure(self, cache: Path) -> Path:
        """The model directory under ``cache``, built on first use."""
        from vllm_kvmem.tiny_model import TinyModelOptions, build_tiny_model

        path = cache / self.tag
        if not (path / "model.safetensors").exists():
            build_tiny_model(path, TinyModelOptions(**vars(self)))
        return path
