"""The one percentile and the one fixed generator (``vllm_kvmem.core.stats``)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from vllm_kvmem.core.stats import lcg, percentile


@pytest.mark.parametrize("values", [[3.0, 1.0, 2.0], [5.0, 1.5, 9.0, 2.0, 7.25]])
def test_percentile_is_the_inclusive_quantile(values):
    """numpy's default and ``statistics.quantiles(method="inclusive")`` agree."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in range(1, 100):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])
    assert percentile(values, 0) == min(values)
    assert percentile(values, 100) == max(values)
    assert percentile([], 50) is None


def test_lcg_is_a_fixed_31_bit_stream():
    first = list(itertools.islice(lcg(42), 1000))
    assert first == list(itertools.islice(lcg(42), 1000))
    assert first != list(itertools.islice(lcg(43), 1000))
    assert all(0 <= x < 1 << 31 for x in first)
    assert len(set(first)) == len(first)
    # A seed above 64 bits is the same generator as its low 64 bits.
    assert next(lcg(42 + (1 << 64))) == first[0]
