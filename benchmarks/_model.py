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

    def engine_kwargs(self) -> dict[str, str]:
        """What vLLM needs besides the folder: weights are on disk."""
        return {"dtype": self.dtype}


@dataclass(frozen=True)
class PublishedShape:
    """A published architecture (``kvmem shape-model NAME``): its config and
    the project's tokenizer, no weight files; vLLM makes random weights in
    memory (``load_format="dummy"``), so the run costs what the real model
    costs and has its KV geometry."""

    name: str
    dtype: str = "bfloat16"
    num_layers: int | None = None  # None: the published depth

    @property
    def tag(self) -> str:
        depth = f"-L{self.num_layers}" if self.num_layers else ""
        return f"{self.name}{depth}-{self.dtype}"

    def kv_bytes_per_token(self) -> int:
        from vllm_kvmem.shape_model import kv_bytes_per_token, shape_info

        return kv_bytes_per_token(shape_info(self.name, self.num_layers, self.dtype))

    def ensure(self, cache: Path) -> Path:
        """The model folder under ``cache``, written on first use."""
        from vllm_kvmem.shape_model import build_shape_model

        path = cache / self.tag
        if not (path / "config.json").exists():
            build_shape_model(
                self.name, path, num_layers=self.num_layers, dtype=self.dtype
            )
        return path

    def engine_kwargs(self) -> dict[str, str]:
        return {"dtype": self.dtype, "load_format": "dummy"}
