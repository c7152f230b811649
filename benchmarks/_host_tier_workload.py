"""The host-tier benchmark's workload: documents, questions and the schedule.

Every prompt is one document (distinct text per document from a fixed word
generator, cut to exactly ``doc_tokens`` tokens) and a short question; a
run's schedule (identical for every configuration) opens new documents and,
at reuse ``r``, comes back to the least recently used one. Deterministic, so
every configuration and every repeat serves the same token ids.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

from vllm_kvmem.core.stats import lcg

_WORDS = (
    "river stone market garden winter summer letter engine harbor station "
    "village forest bridge signal mountain silver copper lantern window "
    "captain teacher doctor farmer painter sailor writer student merchant "
    "apple bread honey salt pepper coffee tea milk orange lemon "
    "north south east west early late quiet loud bright dark warm cold "
    "builds carries finds keeps opens closes follows reaches writes reads "
    "under over beside between across through around behind beyond within "
    "seven twelve forty hundred thousand first second third last next "
    "report record ledger budget contract invoice schedule account policy"
).split()
_SYLLABLES = "ka lo mi ne ru ta vo shi den mar tor lin gas pel quo rix".split()


def _lcg(seed: int):
    """A fixed generator (not ``random``): same text on every Python."""
    return lcg(seed * 0x9E3779B97F4A7C15 + 0x2545F491)


def document_text(doc: int, num_words: int) -> str:
    """Distinct text per document; its id comes first, so documents already
    differ in their first KV block and share no prefix."""
    rng = _lcg(doc + 1)
    words = [f"Document {doc}."]
    for i in range(num_words):
        r = next(rng)
        if r % 7 == 0:  # a made-up name, so documents differ in vocabulary too
            w = "".join(_SYLLABLES[(r >> (4 * k)) % len(_SYLLABLES)] for k in range(3))
        else:
            w = _WORDS[r % len(_WORDS)]
        words.append(w + ("." if i % 11 == 10 else ""))
    return " ".join(words)


def question_text(doc: int, question: int) -> str:
    rng = _lcg(1_000_003 * (doc + 1) + question)
    a, b = (_WORDS[next(rng) % len(_WORDS)] for _ in range(2))
    return f"\nQuestion {question + 1}: what does it say about {a} and {b}?\nAnswer:"


class PromptBuilder:
    """Token ids of ``document + question``, documents cut to exactly
    ``doc_tokens`` tokens (BOS included) so every prefix is the same size."""

    def __init__(self, model_dir: Path, doc_tokens: int) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.doc_tokens = doc_tokens
        self._docs: dict[int, list[int]] = {}

    def document(self, doc: int) -> list[int]:
        if doc not in self._docs:
            words = self.doc_tokens
            while True:
                ids = self.tok.encode(document_text(doc, words)).ids
                if len(ids) >= self.doc_tokens:
                    break
                words *= 2
            self._docs[doc] = ids[: self.doc_tokens]
        return self._docs[doc]

    def prompt(self, doc: int, question: int) -> list[int]:
        q = self.tok.encode(question_text(doc, question), add_special_tokens=False)
        return self.document(doc) + q.ids


WARMUP_DOC = 1_000_000  # a document no measured request uses


def build_schedule(reuse: float, pool_docs: int, requests: int) -> list[dict]:
    """The requests of one run, identical for every configuration.

    ``kind``: ``warmup`` (untimed, first-call costs), ``seed`` (fills the pool
    of documents to come back to; only when ``reuse > 0``), ``new`` or
    ``revisit`` (measured). Revisits go to the least recently used document,
    ``pool_docs - 1`` or more documents ago, so its prefix has been evicted
    from the device KV cache.
    """
    ops = [{"doc": WARMUP_DOC, "question": 0, "kind": "warmup"}]
    lru: OrderedDict[int, int] = OrderedDict()  # doc -> questions asked
    next_doc = 0

    def new(kind: str) -> None:
        nonlocal next_doc
        ops.append({"doc": next_doc, "question": 0, "kind": kind})
        lru[next_doc] = 1
        next_doc += 1

    if reuse > 0:
        for _ in range(pool_docs):
            new("seed")
    for i in range(requests):
        # Evenly spread: floor(requests * reuse) revisits in all.
        if math.floor((i + 1) * reuse) > math.floor(i * reuse) and lru:
            doc, asked = lru.popitem(last=False)
            ops.append({"doc": doc, "question": asked, "kind": "revisit"})
            lru[doc] = asked + 1
        else:
            new("new")
    return ops
