"""Bijective index cipher: a keyed permutation of ``range(n)`` with O(1) memory.

A balanced Feistel network over the smallest even-bit power of two >= n is a bijection
on that power of two; cycle-walking (re-encrypting while the value is >= n) restricts it
to a bijection on ``range(n)``. Nothing is stored but four round keys, so the order of an
epoch is a pure function of the key and a document's place in it is just an integer.
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def derive_key(*parts: object) -> int:
    """A stable 64-bit key from any printable parts (seed, dataset, epoch, shard, ...)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class IndexCipher:
    """Keyed permutation of ``range(n)``; ``cipher(idx)`` maps positions to indices.

    Round function: multiplicative hashing, ``F(R) = top half-bits of (R ^ k_r) * m_r``
    (odd 64-bit ``m_r``), cheap in numpy; any round function gives a bijection.
    """

    __slots__ = ("n", "_half", "_mask", "_shift", "_keys")

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"IndexCipher: n must be >= 0, got {n}")
        self.n = int(n)
        bits = max(2, (max(self.n, 2) - 1).bit_length())
        bits += bits % 2  # balanced halves
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._shift = np.uint64(64 - bits // 2)
        k = np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        golden = np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            raw = [_mix(k + np.uint64(r + 1) * golden) for r in range(2 * _ROUNDS)]
        self._keys = [(raw[2 * r][0], raw[2 * r + 1][0] | np.uint64(1)) for r in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k, m in self._keys:
            left, right = right, left ^ (((right ^ k) * m) >> self._shift)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray | list[int] | int) -> np.ndarray:
        """Map positions in ``range(n)`` to permuted indices in ``range(n)`` (vectorized)."""
        x = np.atleast_1d(np.asarray(positions, dtype=np.uint64))
        if x.size and int(x.max()) >= self.n:
            raise ValueError(f"IndexCipher: position {int(x.max())} out of range(n={self.n})")
        n = np.uint64(self.n)
        y = self._encrypt(x)
        out = y >= n
        while out.any():  # cycle-walk: expected < 4 extra rounds (domain < 4n)
            y[out] = self._encrypt(y[out])
            out = y >= n
        return y.astype(np.int64)
