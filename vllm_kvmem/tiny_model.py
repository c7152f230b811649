"""Build a tiny random-weight Llama-style model directory that vLLM can serve.

Tests and benchmarks of KV-cache sizing need a real model directory, but no
model hub is reachable and real checkpoints are large. This writes one offline,
in a second or two, with the same bytes for the same options on every run, so
results and cache keys can be compared across machines and runs.

Written files: ``config.json``, ``generation_config.json``, ``model.safetensors``
and a byte-level BPE tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) trained here on a built-in corpus.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
from typing import Any

from vllm_kvmem.core.stats import lcg

DTYPES = ("bfloat16", "float16", "float32")

# Special tokens, in id order (ids 0..3), the way Llama tokenizers number them.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

# 256 byte symbols plus the special tokens: the least a byte-level BPE can hold.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

WEIGHT_STD = 0.02

# A minimal chat template so chat endpoints work; the model itself is random.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

_WORDS = (
    "the a an this that one some every each other small large quick slow "
    "red green blue old new cache memory block token layer model page window "
    "server request batch queue head value key query budget pipeline stage "
    "engine worker device host tier copy move swap keep drop fill read write "
    "is was will can may must should could runs holds sends takes gives makes "
    "and or but so then when while if because after before under over into "
    "from with without between across through about time day year number "
    "data text word line file system network user people world water light "
    "good fast long short high low first last next same different many few"
).split()
_PUNCT = (".", ".", ".", ",", "?", "!", ";", ":")


# Pseudo-word syllables: real words alone saturate BPE at ~700 merges; these
# give it enough distinct pairs to fill the default 2048-token vocabulary.
_ONSETS = "b c d f g h j k l m n p r s t v w z br cl dr fl gr pl sh st th tr ch".split()
_VOWELS = "a e i o u ai ea io ou".split()
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st")
_EXTRAS = ("42", "2024", "3.14", "x86_64", "'quoted'", '"said"', "café", "naïve")


def _corpus(num_sentences: int = 1200) -> list[str]:
    """English-like sentences (~70 KB) from a fixed LCG, so the tokenizer is fixed.

    A hand-rolled generator (not ``random``) keeps the text identical across
    Python versions. Real words, pseudo-words, digits, quotes and a few
    non-ASCII words are mixed so the learned merges look like a real vocabulary.
    """
    numbers = lcg(0x2545F491)

    def nxt(n: int) -> int:
        return next(numbers) % n

    def pick(options: tuple[str, ...] | list[str]) -> str:
        return options[nxt(len(options))]

    def word() -> str:
        kind = nxt(12)
        if kind == 0:
            return pick(_EXTRAS)
        if kind <= 4:
            syllables = 1 + nxt(3)
            return "".join(
                pick(_ONSETS) + pick(_VOWELS) + pick(_CODAS) for _ in range(syllables)
            )
        return pick(_WORDS)

    lines = []
    for _ in range(num_sentences):
        words = [word() for _ in range(4 + nxt(10))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + pick(_PUNCT))
    return lines


def _option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return dataclasses.field(
        default=default, metadata={"help": help, "argparse": argparse_kwargs}
    )


@dataclasses.dataclass(frozen=True)
class TinyModelOptions:
    """Every option of the tiny model, declared once: ``build_tiny_model``'s
    keywords, the ``kvmem tiny-model`` flags with their defaults and help, and
    the checks (at construction, naming the flag) all come from here."""

    num_layers: int = _option(8, "decoder layers (default %(default)s)")
    hidden_size: int = _option(
        256, "model width; --num-heads must divide it (default %(default)s)"
    )
    num_heads: int = _option(4, "attention (query) heads (default %(default)s)")
    num_kv_heads: int = _option(
        2,
        "KV heads, must divide --num-heads; sets KV bytes per token "
        "(default %(default)s)",
    )
    head_dim: int = _option(
        64, "size of one head, even; sets KV bytes per token (default %(default)s)"
    )
    vocab_size: int = _option(
        2048,
        f"embedding rows, at least {MIN_VOCAB_SIZE}; the tokenizer learns "
        "up to this many tokens (default %(default)s)",
    )
    intermediate_size: int | None = _option(
        None, "MLP width (default: 2 * --hidden-size)"
    )
    max_position_embeddings: int = _option(
        4096, "longest context the config declares (default %(default)s)"
    )
    dtype: str = _option(
        "bfloat16",
        "weight dtype written to disk and into config.json (default %(default)s)",
        choices=DTYPES,
    )
    sliding_window: int | None = _option(
        None,
        "write a Mistral-style config with this window, so vLLM gives every "
        "layer a sliding-window KV cache (default: none, full attention)",
    )
    sliding_window_pattern: int | None = _option(
        None,
        "with --sliding-window: every Nth layer is full attention and the "
        "others slide, written as a per-layer layer_types pattern (Gemma 3's "
        "sliding_window_pattern: 6 is five sliding layers to one full one; 2 "
        "alternates, as Gemma 2 and gpt-oss), so vLLM's hybrid KV cache manager "
        "gives the model several KV cache groups (default: none, the window on "
        "every layer)",
    )
    seed: int = _option(
        0,
        "weight RNG seed; same options and seed give the same bytes "
        "(default %(default)s)",
    )

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @property
    def mlp_size(self) -> int:
        """``intermediate_size``, or its default of twice the width."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 2 * self.hidden_size if isinstance(self.hidden_size, int) else 0

    def __post_init__(self) -> None:
        """Refuse bad options up front with the flag, the value and what would
        work."""
        for f in dataclasses.fields(self):
            value = (
                self.mlp_size
                if f.name == "intermediate_size"
                else getattr(self, f.name)
            )
            if f.type.startswith("int") and not (value is None and f.default is None):
                _check_positive(self.flag(f.name), value, seed=f.name == "seed")
        hidden, heads, kv_heads = self.hidden_size, self.num_heads, self.num_kv_heads
        if hidden % heads:
            divisors = [d for d in range(1, min(hidden, 64) + 1) if hidden % d == 0]
            raise ValueError(
                f"--num-heads={heads} does not divide --hidden-size={hidden}; "
                f"use one of {divisors} or change --hidden-size"
            )
        if heads % kv_heads:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(
                f"--num-kv-heads={kv_heads} does not divide --num-heads={heads};"
                f" use one of {divisors}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"--head-dim={self.head_dim}: rotary embeddings need an even head "
                f"size; use e.g. {self.head_dim + 1} (vLLM's CPU backend takes 32, "
                "64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"--vocab-size={self.vocab_size}: a byte-level tokenizer needs 256 "
                f"byte tokens plus {len(SPECIAL_TOKENS)} special ones; use at least "
                f"{MIN_VOCAB_SIZE}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
        self._check_pattern()

    def _check_pattern(self) -> None:
        pattern, flag = self.sliding_window_pattern, self.flag("sliding_window_pattern")
        if pattern is None:
            return
        if self.sliding_window is None:
            raise ValueError(
                f"{flag}={pattern} says which layers slide, but no window is "
                "set: add --sliding-window (e.g. --sliding-window 256)"
            )
        if not 2 <= pattern <= self.num_layers:
            raise ValueError(
                f"{flag}={pattern}: use 2 to --num-layers={self.num_layers} (one "
                "full-attention layer in every N); leave it out to slide on every "
                "layer"
            )

    @property
    def layer_types(self) -> list[str] | None:
        """Per-layer attention kinds (``sliding_attention`` or
        ``full_attention``), or None when every layer is alike."""
        if self.sliding_window_pattern is None:
            return None
        n = self.sliding_window_pattern
        return [
            "full_attention" if (i + 1) % n == 0 else "sliding_attention"
            for i in range(self.num_layers)
        ]


def _check_positive(flag: str, value: Any, *, seed: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        ok = False
    else:
        ok = 0 <= value < 2**63 if seed else value > 0
    if not ok:
        hint = "use an integer in [0, 2**63)" if seed else "must be a positive integer"
        raise ValueError(f"{flag}={value!r}: {hint}")


#: Each option's default, from the declaration.
DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(TinyModelOptions)
}


def _train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE on the built-in corpus.

    Byte level means any text tokenizes without ``<unk>``. The BPE trainer breaks
    count ties by pair id and sorts its alphabet, so the result does not depend
    on thread scheduling (checked by the tests, which build twice).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prepend BOS like Llama tokenizers do; vLLM prompts then start with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, BOS_ID)],
    )
    for token, token_id in zip(SPECIAL_TOKENS, range(4), strict=True):
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"tokenizer put {token} at {tok.token_to_id(token)}")
    return tok


def _weight_shapes(o: TinyModelOptions) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in the order they are generated."""
    hidden_size, vocab_size, head_dim = o.hidden_size, o.vocab_size, o.head_dim
    num_heads, num_kv_heads, intermediate_size = o.num_heads, o.num_kv_heads, o.mlp_size
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden_size))
    ]
    for i in range(o.num_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (num_heads * head_dim, hidden_size)),
            (f"{p}.self_attn.k_proj.weight", (num_kv_heads * head_dim, hidden_size)),
            (f"{p}.self_attn.v_proj.weight", (num_kv_heads * head_dim, hidden_size)),
            (f"{p}.self_attn.o_proj.weight", (hidden_size, num_heads * head_dim)),
            (f"{p}.mlp.gate_proj.weight", (intermediate_size, hidden_size)),
            (f"{p}.mlp.up_proj.weight", (intermediate_size, hidden_size)),
            (f"{p}.mlp.down_proj.weight", (hidden_size, intermediate_size)),
            (f"{p}.input_layernorm.weight", (hidden_size,)),
            (f"{p}.post_attention_layernorm.weight", (hidden_size,)),
        ]
    shapes += [
        ("model.norm.weight", (hidden_size,)),
        ("lm_head.weight", (vocab_size, hidden_size)),
    ]
    return shapes


def model_config(o: TinyModelOptions) -> dict[str, Any]:
    """The ``config.json`` content, written out rather than built by transformers.

    It is what ``LlamaConfig(...).to_diff_dict()`` (``MistralConfig`` with a
    window, ``MinistralConfig`` with a window pattern) gives, less
    ``transformers_version``: importing transformers would double the build
    time, and leaving the version out keeps the bytes the same across
    transformers releases. The tests check it loads as that class.
    """
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "head_dim": o.head_dim,
        "hidden_act": "silu",
        "hidden_size": o.hidden_size,
        "initializer_range": WEIGHT_STD,
        "intermediate_size": o.mlp_size,
        "max_position_embeddings": o.max_position_embeddings,
        "num_attention_heads": o.num_heads,
        "num_hidden_layers": o.num_layers,
        "num_key_value_heads": o.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": o.vocab_size,
        # transformers >= 4.56 reads dtype; older readers look for torch_dtype.
        "dtype": o.dtype,
        "torch_dtype": o.dtype,
    }
    if o.sliding_window is not None:
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            del config[key]
        config["architectures"] = ["MistralForCausalLM"]
        config["model_type"] = "mistral"
        config["sliding_window"] = o.sliding_window
    if o.layer_types is not None:
        # transformers' Ministral config is Mistral's with layer_types (the
        # interleaved Ministral-8B); vLLM serves it as MistralForCausalLM,
        # whose attention reads the window of each layer from layer_types.
        config["model_type"] = "ministral"
        config["layer_types"] = o.layer_types
    return config


def write_text(path: pathlib.Path, text: str) -> None:
    """UTF-8 with ``\n`` line ends whatever the platform, so bytes match."""
    path.write_bytes(text.encode("utf-8"))


def dump_json(path: pathlib.Path, obj: Any) -> None:
    """Sorted keys and a fixed layout so the bytes depend only on the content."""
    write_text(
        path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    )


def write_generation_config(out: pathlib.Path) -> None:
    """``generation_config.json`` with the project tokenizer's special ids."""
    dump_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )


def write_tokenizer(out: pathlib.Path, vocab_size: int, model_max_length: int) -> None:
    """The locally trained byte-level BPE and its configs (ids ``< vocab_size``).

    ``kvmem shape-model`` writes the same tokenizer beside a published
    architecture's config, so that no tokenizer is ever downloaded.
    """
    tok = _train_tokenizer(vocab_size)
    write_text(out / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    dump_json(out / "special_tokens_map.json", specials)
    dump_json(
        out / "tokenizer_config.json",
        {
            **specials,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {
                str(i): {
                    "content": token,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, token in enumerate(SPECIAL_TOKENS)
            },
            "chat_template": CHAT_TEMPLATE,
        },
    )


def build_tiny_model(
    outdir: str | os.PathLike[str],
    options: TinyModelOptions | None = None,
    **overrides: Any,
) -> pathlib.Path:
    """Write the model directory and return its path.

    ``overrides`` are :class:`TinyModelOptions` fields (``num_layers=2``), on
    top of ``options`` or the defaults. With ``sliding_window`` the config is
    a ``MistralForCausalLM`` (same tensor names): vLLM copies a model-level
    ``sliding_window`` into every attention layer when the config has no
    ``layer_types``, so each layer gets a ``SlidingWindowSpec``. With
    ``sliding_window_pattern`` too it is a Ministral config (Mistral's, with
    ``layer_types``): every Nth layer is full attention, the others slide, so
    vLLM's hybrid KV cache manager forms several KV cache groups. Raises
    ``ValueError`` naming the CLI flag on bad input.
    """
    o = dataclasses.replace(options or TinyModelOptions(), **overrides)

    import torch
    from safetensors.torch import save_file

    out = pathlib.Path(outdir)
    out.mkdir(parents=True, exist_ok=True)

    dump_json(out / "config.json", model_config(o))
    write_generation_config(out)

    torch_dtype = getattr(torch, o.dtype)
    gen = torch.Generator(device="cpu").manual_seed(o.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(o):
        if len(shape) == 1:  # RMSNorm scales start at one, as in HF init
            tensors[name] = torch.ones(shape, dtype=torch_dtype)
        else:
            weight = torch.randn(shape, generator=gen, dtype=torch.float32)
            tensors[name] = (weight * WEIGHT_STD).to(torch_dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    write_tokenizer(out, o.vocab_size, o.max_position_embeddings)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``outdir`` and one flag per :class:`TinyModelOptions` field."""
    parser.add_argument("outdir", help="directory to write the model into")
    for f in dataclasses.fields(TinyModelOptions):
        extra = f.metadata["argparse"] or {"type": int}
        parser.add_argument(
            TinyModelOptions.flag(f.name),
            default=f.default,
            help=f.metadata["help"],
            **extra,
        )


def run(args: argparse.Namespace) -> int:
    """Build from parsed CLI args and print a one-line summary."""
    options = {key: getattr(args, key) for key in DEFAULTS}
    out = build_tiny_model(args.outdir, TinyModelOptions(**options))

    from safetensors import safe_open

    params = 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            n = 1
            for dim in shape:
                n *= dim
            params += n
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    arch = "mistral" if args.sliding_window is not None else "llama"
    window = f", sliding window {args.sliding_window}" if args.sliding_window else ""
    if args.sliding_window_pattern:
        arch = "ministral"
        window += f" on {args.sliding_window_pattern - 1} of every "
        window += f"{args.sliding_window_pattern} layers"
    print(
        f"wrote {out}: {arch}, {args.num_layers} layers, {params / 1e6:.2f}M params "
        f"({args.dtype}{window}), {size / 2**20:.1f} MiB on disk"
    )
    return 0
