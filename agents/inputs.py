"""Deterministic, integer-valued inputs so AllReduce results can be checked exactly.

Every value is an integer in [-K, K] with K chosen so that any partial sum over up to
``MAX_NODES`` inputs is exactly representable in the dtype (|sum| < 2**24 for float32):
floating-point addition is then exact and order-independent, and every node can check
its result with ``==`` by regenerating all participants' inputs from the seed.

Iteration i of a vector of n elements is block i // n's random vector rotated by i mod n
elements (:func:`rotation`): consecutive iterations differ at almost every element, so data
left from an earlier iteration fails the check, and a node makes its block's input and true
sum once and only rotates them per iteration (:func:`rotate_into`; a true sum of large
inputs costs seconds of CPU, which later iterations would spend while others communicate).
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


def rotation(iteration: int, length: int) -> tuple[int, int]:
    """(block, shift) of ``iteration``: its inputs are the block's random vectors rotated by
    ``shift`` elements (``np.roll``)."""
    return divmod(int(iteration), max(1, int(length)))


def rotate_into(out: np.ndarray, v: np.ndarray, shift: int) -> None:
    """``out[:] = np.roll(v, shift)`` without a temporary (0 <= shift < len(v))."""
    n = len(v) - shift
    np.copyto(out[shift:], v[:n], casting="same_kind")
    np.copyto(out[:shift], v[n:], casting="same_kind")


def make_input(seed: int, node_index: int, iteration: int, length: int, dtype="float32") -> np.ndarray:
    """The input vector of node ``node_index`` (its index in ``plan.nodes``) in ``iteration``."""
    k = bound(dtype)
    block, shift = rotation(iteration, length)
    rng = np.random.default_rng([int(seed), int(node_index), block])
    x = rng.integers(-k, k + 1, size=int(length), dtype=np.int16).astype(dtype)
    return np.roll(x, shift) if shift else x


def expected_sum(seed: int, node_indices, iteration: int, length: int, dtype="float32") -> np.ndarray:
    """Sum of the inputs of the given nodes (what every receiver must end with)."""
    acc = np.zeros(int(length), dtype)
    for i in node_indices:
        np.add(acc, make_input(seed, i, iteration, length, dtype), out=acc)
    return acc
