"""Which window of which source a sample is: a pure function of (seed, sample index).

Blend: sample k of the run comes from source pattern[k % period]. The pattern is the deterministic
"largest error first" order of Megatron's blends over a period in which every source gets exactly its
share (weights 0.3/0.7: period 10, 3 + 7; 0.001/0.999: period 1000, 1 + 999), so proportions are exact in
every period and off by less than one sample per source in any prefix, whatever the weights or the number of
sources. Sample k is then the j-th sample of its source, j = (k // period) x share + its rank in the pattern.

Epochs: a source's j-th sample is window perm_e[j mod n] of epoch e = j // n, where the n windows are the
source's block-sized windows shifted by a random offset, and perm_e a random permutation; both are drawn
from (seed, source, epoch). Each source runs through its windows without replacement and starts its next
epoch on its own.
"""
import math
from fractions import Fraction

import numpy as np

MAX_PERIOD = 100_000  # weights with a finer ratio are rounded to the nearest share of this period


class Blend:
    def __init__(self, weights: list[float]):
        fractions = [Fraction(w).limit_denominator(MAX_PERIOD) for w in weights]
        shares = [f / sum(fractions) for f in fractions]
        period = math.lcm(*(s.denominator for s in shares))
        if period > MAX_PERIOD:
            period = MAX_PERIOD
        counts = _largest_remainder([float(s) for s in shares], period)
        self.period, self.counts = period, np.array(counts, dtype=np.int64)
        self.pattern = _largest_error_first(counts, period)
        # rank[t]: how many earlier positions of the period hold the same source
        self.rank = np.zeros(period, dtype=np.int64)
        seen = np.zeros(len(counts), dtype=np.int64)
        for t, s in enumerate(self.pattern):
            self.rank[t], seen[s] = seen[s], seen[s] + 1

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of global sample indices k (int64)."""
        block, position = np.divmod(np.asarray(k, dtype=np.int64), self.period)
        source = self.pattern[position]
        return source, block * self.counts[source] + self.rank[position]

    def drawn(self, samples: int) -> np.ndarray:
        """How many of the first `samples` samples each source gave."""
        block, rest = divmod(samples, self.period)
        return block * self.counts + np.bincount(self.pattern[:rest], minlength=len(self.counts))


def _largest_remainder(shares: list[float], period: int) -> list[int]:
    counts = [math.floor(s * period) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i] * period)
    for i in by_remainder[:period - sum(counts)]:
        counts[i] += 1
    if min(counts) == 0:
        raise ValueError(f"a weight is below 1/{MAX_PERIOD} of the total: raise it or leave the source out")
    return counts


def _largest_error_first(counts: list[int], period: int) -> np.ndarray:
    """Each position goes to the source furthest behind its share (integer arithmetic: no float ties)."""
    counts_arr = np.array(counts, dtype=np.int64)
    given = np.zeros(len(counts), dtype=np.int64)
    pattern = np.empty(period, dtype=np.int64)
    for t in range(period):
        source = int(np.argmax(counts_arr * (t + 1) - given * period))
        pattern[t], given[source] = source, given[source] + 1
    return pattern


class Epochs:
    """Window starts of one source, epoch by epoch (see the module docstring)."""

    def __init__(self, n_tokens: int, block_size: int, source: int):
        self.block_size, self.source = block_size, source
        self.windows = (n_tokens - 1) // block_size  # each window needs block_size + 1 tokens
        self.slack = (n_tokens - 1) - self.windows * block_size  # room for the epoch's offset
        self._cache = {}  # (seed, epoch) -> (offset, permutation): the epochs in use only

    def starts(self, seed: int, index: np.ndarray) -> np.ndarray:
        epoch, position = np.divmod(index, self.windows)
        out = np.empty(len(index), dtype=np.int64)
        for e in np.unique(epoch):
            offset, permutation = self._epoch(seed, int(e))
            mask = epoch == e
            out[mask] = offset + permutation[position[mask]].astype(np.int64) * self.block_size
        return out

    def epochs(self, samples: int) -> float:
        return samples / self.windows

    def _epoch(self, seed: int, epoch: int):
        key = (seed, epoch)
        if key not in self._cache:
            rng = np.random.default_rng([seed, self.source, epoch])
            offset = int(rng.integers(0, self.slack + 1))
            dtype = np.uint32 if self.windows < 2**32 else np.int64
            self._cache = {k: v for k, v in self._cache.items() if k[0] == seed and k[1] >= epoch - 1}
            self._cache[key] = (offset, rng.permutation(self.windows).astype(dtype))
        return self._cache[key]
