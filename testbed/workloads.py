"""Workloads: vector sizes and model tensor tables.

A synchronisation round moves one gradient (or parameter) vector.  Experiments name it
either as a size (``parse_size("8MB")``) or as a model whose tensors are listed in
:data:`MODELS`.  The tables are derived from the published architectures by small
functions that count each layer's weight and bias elements from its shape, with the
tensor names PyTorch uses (torchvision for the CNNs, Hugging Face ``BertModel`` for BERT),
so the totals can be checked against the well-known figures:

=========  ==============  =========================================
model      parameters      source of the architecture
=========  ==============  =========================================
alexnet    61,100,840      torchvision AlexNet (Krizhevsky et al. 2012, single-tower)
resnet50   25,557,032      He et al. 2016, torchvision ResNet-50 (v1.5 strides; same count)
vgg16      138,357,544     Simonyan & Zisserman 2015, configuration D, no batch norm
bert-base  109,482,240     Devlin et al. 2019, uncased vocab 30522, with pooler
=========  ==============  =========================================

Only trainable parameters are counted (batch-norm running statistics are buffers and
are not synchronised).  The NetStorm paper (§IX-C, Fig. 19a) notes that AlexNet's
FC-dominated tensors slice evenly into chunks — the per-tensor tables keep that visible.
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation

import numpy as np

Layer = tuple[str, int]

# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------
UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+\.)\s*([A-Za-z]*)\s*$")


def parse_size(text) -> int:
    """Bytes in a size such as ``"8MB"``, ``"1.5 GiB"``, ``"4096"`` or the int ``4096``.

    Units (case ignored; all are *bytes*): B, KB, MB, GB, TB (powers of 1000) and KiB,
    MiB, GiB, TiB (powers of 1024); no unit means bytes.  The result must be a whole,
    non-negative number of bytes.  Raises ValueError with the accepted forms otherwise.
    """
    if isinstance(text, bool):
        raise ValueError(f"size must be a number of bytes or a string like '8MB', not {text!r}")
    if isinstance(text, (int, np.integer)):
        value = Decimal(int(text))
    elif isinstance(text, float):
        if not text.is_integer():
            raise ValueError(f"size {text!r} is not a whole number of bytes")
        value = Decimal(int(text))
    elif isinstance(text, str):
        m = _SIZE_RE.match(text)
        unit = m.group(2).lower() if m else None
        if not m or unit not in UNITS:
            raise ValueError(
                f"cannot parse size {text!r}: expected a number with an optional unit "
                f"B, KB, MB, GB, TB, KiB, MiB, GiB or TiB (e.g. '8MB', '1.5GiB', '4096')")
        try:
            value = Decimal(m.group(1)) * UNITS[unit]
        except InvalidOperation:  # pragma: no cover - the regex admits only valid numbers
            raise ValueError(f"cannot parse size {text!r}") from None
    else:
        raise ValueError(f"size must be a number of bytes or a string like '8MB', not {type(text).__name__}")
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    if value != value.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number of bytes ({value})")
    return int(value)


# ---------------------------------------------------------------------------
# Layer counting helpers: weight and bias elements from layer shapes
# ---------------------------------------------------------------------------
def conv2d(name: str, c_in: int, c_out: int, k: int, *, bias: bool = True, groups: int = 1) -> list[Layer]:
    """Conv layer: weight c_out × (c_in/groups) × k × k, bias c_out."""
    out = [(f"{name}.weight", c_out * (c_in // groups) * k * k)]
    return out + [(f"{name}.bias", c_out)] if bias else out


def linear(name: str, f_in: int, f_out: int, *, bias: bool = True) -> list[Layer]:
    """Fully connected layer: weight f_out × f_in, bias f_out."""
    out = [(f"{name}.weight", f_out * f_in)]
    return out + [(f"{name}.bias", f_out)] if bias else out


def norm(name: str, c: int) -> list[Layer]:
    """Batch / layer norm: scale and shift of c elements each (running stats are buffers)."""
    return [(f"{name}.weight", c), (f"{name}.bias", c)]


def embedding(name: str, num: int, dim: int) -> list[Layer]:
    """Embedding table num × dim."""
    return [(f"{name}.weight", num * dim)]


# ---------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------
def alexnet(num_classes: int = 1000) -> list[Layer]:
    """AlexNet as in torchvision (single tower: 64-192-384-256-256 convs, 4096-4096 FC,
    6×6 pooled feature map), 61,100,840 parameters."""
    layers: list[Layer] = []
    for idx, (c_in, c_out, k) in zip((0, 3, 6, 8, 10),
                                     ((3, 64, 11), (64, 192, 5), (192, 384, 3), (384, 256, 3), (256, 256, 3))):
        layers += conv2d(f"features.{idx}", c_in, c_out, k)
    layers += linear("classifier.1", 256 * 6 * 6, 4096)
    layers += linear("classifier.4", 4096, 4096)
    layers += linear("classifier.6", 4096, num_classes)
    return layers


def vgg16(num_classes: int = 1000) -> list[Layer]:
    """VGG-16 (configuration D, 3×3 convs, no batch norm) with torchvision's tensor
    names, 138,357,544 parameters."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers: list[Layer] = []
    idx, c_in = 0, 3
    for v in cfg:
        if v == "M":
            idx += 1  # max-pool
            continue
        layers += conv2d(f"features.{idx}", c_in, v, 3)
        idx += 2  # conv + ReLU
        c_in = v
    layers += linear("classifier.0", 512 * 7 * 7, 4096)
    layers += linear("classifier.3", 4096, 4096)
    layers += linear("classifier.6", 4096, num_classes)
    return layers


def resnet50(num_classes: int = 1000) -> list[Layer]:
    """ResNet-50: 7×7 stem, bottleneck stages of 3, 4, 6, 3 blocks (1×1, 3×3, 1×1 convs,
    expansion 4, no conv biases, batch norm after each conv, 1×1 projection shortcut in
    each stage's first block), 2048→classes FC; 25,557,032 parameters."""
    layers: list[Layer] = conv2d("conv1", 3, 64, 7, bias=False) + norm("bn1", 64)
    c_in = 64
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512)), start=1):
        for blk in range(blocks):
            p = f"layer{stage}.{blk}"
            c_out = width * 4
            layers += conv2d(f"{p}.conv1", c_in, width, 1, bias=False) + norm(f"{p}.bn1", width)
            layers += conv2d(f"{p}.conv2", width, width, 3, bias=False) + norm(f"{p}.bn2", width)
            layers += conv2d(f"{p}.conv3", width, c_out, 1, bias=False) + norm(f"{p}.bn3", c_out)
            if blk == 0:
                layers += conv2d(f"{p}.downsample.0", c_in, c_out, 1, bias=False)
                layers += norm(f"{p}.downsample.1", c_out)
            c_in = c_out
    layers += linear("fc", 2048, num_classes)
    return layers


def bert(*, vocab: int = 30522, hidden: int = 768, layers_n: int = 12, intermediate: int = 3072,
         max_positions: int = 512, type_vocab: int = 2) -> list[Layer]:
    """BERT encoder (Devlin et al. 2019) with Hugging Face ``BertModel`` tensor names:
    word/position/token-type embeddings + LayerNorm, ``layers_n`` transformer layers
    (Q, K, V and output projections, LayerNorm, feed-forward hidden→intermediate→hidden,
    LayerNorm) and the pooler.  Defaults give BERT-base: 109,482,240 parameters."""
    out: list[Layer] = []
    out += embedding("embeddings.word_embeddings", vocab, hidden)
    out += embedding("embeddings.position_embeddings", max_positions, hidden)
    out += embedding("embeddings.token_type_embeddings", type_vocab, hidden)
    out += norm("embeddings.LayerNorm", hidden)
    for i in range(layers_n):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            out += linear(f"{p}.attention.self.{proj}", hidden, hidden)
        out += linear(f"{p}.attention.output.dense", hidden, hidden)
        out += norm(f"{p}.attention.output.LayerNorm", hidden)
        out += linear(f"{p}.intermediate.dense", hidden, intermediate)
        out += linear(f"{p}.output.dense", intermediate, hidden)
        out += norm(f"{p}.output.LayerNorm", hidden)
    out += linear("pooler.dense", hidden, hidden)
    return out


MODELS: dict[str, list[Layer]] = {
    "alexnet": alexnet(),
    "resnet50": resnet50(),
    "vgg16": vgg16(),
    "bert-base": bert(),
}

# Commonly quoted totals (the brief: test within 1 %).
WELL_KNOWN_PARAMS = {"alexnet": 61.1e6, "resnet50": 25.6e6, "vgg16": 138.4e6, "bert-base": 110e6}

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4, "f32": 4,
    "float16": 2, "fp16": 2, "half": 2, "f16": 2,
    "bfloat16": 2, "bf16": 2,
    "float64": 8, "fp64": 8, "double": 8, "f64": 8,
    "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}


def _key(name: str) -> str:
    return re.sub(r"[-_ ]", "", str(name).lower())


_BY_KEY = {_key(n): n for n in MODELS}


def model_name(name: str) -> str:
    """Canonical model name (``ResNet-50``, ``resnet_50``, ``bert_base`` are accepted)."""
    hit = _BY_KEY.get(_key(name))
    if hit is None:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}")
    return hit


def model_params(name: str) -> int:
    """Total parameter count of a model in :data:`MODELS`."""
    return sum(n for _, n in MODELS[model_name(name)])


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype``: a name (float32/fp32, float16/fp16, bf16, float64,
    int8, ...), a numpy dtype, or an int (bytes per element)."""
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if dtype < 1:
            raise ValueError(f"element size must be >= 1 byte, got {dtype}")
        return int(dtype)
    if isinstance(dtype, str) and dtype.lower() in DTYPE_BYTES:
        return DTYPE_BYTES[dtype.lower()]
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. float32, float16, bf16, float64") from None


#: Vectors of the workload's length one agent holds at once: its buffer ``x``, the reference
#: sum it checks against, and the input being generated (agents/executor.py, agents/inputs.py).
AGENT_VECTORS = 3


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_vector_bytes(agents: int) -> int:
    """Largest vector ``agents`` agents on this machine can hold (each AGENT_VECTORS of them)."""
    return machine_memory() // (max(1, agents) * AGENT_VECTORS)


def model_bytes(name: str, dtype="float32") -> int:
    """Bytes of one full gradient/parameter vector of model ``name`` in ``dtype``."""
    return model_params(name) * dtype_bytes(dtype)


def workload_bytes(spec, dtype="float32") -> int:
    """Bytes of a workload given either as a model name or as a size (see :func:`parse_size`)."""
    if isinstance(spec, str) and _key(spec) in _BY_KEY:
        return model_bytes(spec, dtype)
    try:
        return parse_size(spec)
    except ValueError as e:
        raise ValueError(f"{e}; or name a model: {sorted(MODELS)}") from None


# -- compute time per iteration (workload.compute_s) -------------------------------------------
# CREW §V-A's per-iteration compute times: T1 (LSTM on UCF101) and T2 (Transformer on
# WMT16), from Eager-SGD (Li et al., PPoPP 2020), "rescaled to [0.05, 0.2] s".  The paper
# gives no shape; both are long-tailed (input lengths vary), so: 0.05 + 0.15 * Beta(a, b),
# right-skewed, T2 with the heavier tail (a choice; Beta parameters below).
CREW_TIMES = {"T1": (2.0, 5.0), "T2": (1.2, 2.5)}


def compute_times(spec, nodes: list[str], iterations: int, seed: int) -> dict[str, list[float]]:
    """Per-worker compute seconds per iteration from the ``workload.compute_s`` spec; each
    worker draws from its own seeded generator, so the order of ``nodes`` does not matter."""
    import random

    out: dict[str, list[float]] = {}
    for n in nodes:
        rng = random.Random(f"{seed}:{n}")
        if isinstance(spec, (int, float)):
            out[n] = [float(spec)] * iterations
        elif "per_worker" in spec:  # a number per worker, or a per-iteration trace (cycled)
            v = spec["per_worker"].get(n, 0.0)
            out[n] = [float(v[i % len(v)]) for i in range(iterations)] if isinstance(v, list) \
                else [float(v)] * iterations
        elif "uniform" in spec:
            lo, hi = spec["uniform"]
            out[n] = [rng.uniform(lo, hi) for _ in range(iterations)]
        elif set(spec) & set(CREW_TIMES):  # CREW §V-A's T1 / T2, times a factor (Fig. 9: x2..6)
            (kind, factor), = spec.items()
            a, b = CREW_TIMES[kind]
            out[n] = [factor * (0.05 + 0.15 * rng.betavariate(a, b)) for _ in range(iterations)]
        else:
            mean, std = spec["normal"]
            out[n] = [max(0.0, rng.gauss(mean, std)) for _ in range(iterations)]
    return out
