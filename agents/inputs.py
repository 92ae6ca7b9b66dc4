"""Deterministic, integer-valued inputs so AllReduce results can be checked exactly.

Every value is an integer in [-K, K] with K chosen so that any partial sum over up to
``MAX_NODES`` inputs is exactly representable in the dtype (|sum| < 2**24 for float32):
floating-point addition is then exact and order-independent, and every node can check
its result with ``==`` by regenerating all participants' inputs from the seed.
"""

from __future__ import annotations

import numpy as np

MAX_NODES = 1024


def bound(dtype) -> int:
    """K for ``dtype`` (at most 16383, so values are generated as int16)."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        exact = 2 ** (np.finfo(dt).nmant + 1) - 1  # largest run of exact integers
    elif dt.kind in "iu":
        exact = int(np.iinfo(dt).max)
    else:
        raise ValueError(f"unsupported dtype {dt}")
    k = min(exact // MAX_NODES, 2**14 - 1)
    if k < 1 or dt.kind == "u":
        raise ValueError(f"dtype {dt} cannot hold exact sums of {MAX_NODES} signed inputs")
    return k


def make_input(seed: int, node_index: int, iteration: int, length: int, dtype="float32") -> np.ndarray:
    """The input vector of node ``node_index`` (its index in ``plan.nodes``) in ``iteration``."""
    k = bound(dtype)
    rng = np.random.default_rng([int(seed), int(node_index), int(iteration)])
    return rng.integers(-k, k + 1, size=int(length), dtype=np.int16).astype(dtype)


def expected_sum(seed: int, node_indices, iteration: int, length: int, dtype="float32") -> np.ndarray:
    """Sum of the inputs of the given nodes (what every receiver must end with)."""
    acc = np.zeros(int(length), dtype)
    for i in node_indices:
        np.add(acc, make_input(seed, i, iteration, length, dtype), out=acc)
    return acc
