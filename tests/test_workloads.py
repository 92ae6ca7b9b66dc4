"""Workloads: size parsing and model tensor tables (testbed/workloads.py)."""

from __future__ import annotations

import pytest

from testbed.workloads import (
    MODELS,
    WELL_KNOWN_PARAMS,
    bert,
    conv2d,
    dtype_bytes,
    linear,
    model_bytes,
    model_name,
    model_params,
    parse_size,
    workload_bytes,
)


@pytest.mark.parametrize("text,want", [
    ("8MB", 8_000_000), ("8 MB", 8_000_000), ("8mb", 8_000_000), ("1KB", 1000), ("2GB", 2 * 10**9),
    ("1KiB", 1024), ("8MiB", 8 * 2**20), ("1.5GiB", 3 * 2**29), ("0.1KB", 100), ("512B", 512),
    ("4096", 4096), (4096, 4096), (0, 0), ("1e3", 1000), ("1TB", 10**12), (2.0, 2),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "MB", "8XB", "8 M B", "-1", "1.5B", "0.3KiB", "eight", True, None, 2.5, [8]])
def test_parse_size_errors(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_parse_size_message_lists_units():
    with pytest.raises(ValueError, match="KiB"):
        parse_size("12 parsecs")


def test_layer_helpers():
    assert conv2d("c", 3, 64, 11) == [("c.weight", 64 * 3 * 121), ("c.bias", 64)]
    assert conv2d("c", 64, 64, 3, bias=False) == [("c.weight", 36864)]
    assert linear("fc", 2048, 1000) == [("fc.weight", 2_048_000), ("fc.bias", 1000)]


@pytest.mark.parametrize("name", sorted(WELL_KNOWN_PARAMS))
def test_model_totals_match_well_known_figures(name):
    assert model_params(name) == pytest.approx(WELL_KNOWN_PARAMS[name], rel=0.01)


def test_model_totals_exact():
    # torchvision / Hugging Face counts of the same architectures
    assert model_params("alexnet") == 61_100_840
    assert model_params("resnet50") == 25_557_032
    assert model_params("vgg16") == 138_357_544
    assert model_params("bert-base") == 109_482_240


def test_tables_are_per_tensor():
    for name, layers in MODELS.items():
        names = [n for n, _ in layers]
        assert len(names) == len(set(names)), name
        assert all(isinstance(c, int) and c > 0 for _, c in layers)
    alex = dict(MODELS["alexnet"])
    assert alex["classifier.1.weight"] == 9216 * 4096  # FC-dominated (NetStorm §IX-C)
    assert sum(c for n, c in MODELS["alexnet"] if n.startswith("classifier")) > 0.9 * model_params("alexnet")
    res = dict(MODELS["resnet50"])
    assert res["conv1.weight"] == 64 * 3 * 49 and "conv1.bias" not in res
    assert res["layer4.0.downsample.0.weight"] == 2048 * 1024
    assert sum(1 for n in res if n.endswith("conv1.weight")) == 1 + 16  # stem + 16 bottlenecks
    b = dict(MODELS["bert-base"])
    assert b["embeddings.word_embeddings.weight"] == 30522 * 768
    assert sum(1 for n in b if n.endswith("attention.self.query.weight")) == 12
    assert "pooler.dense.weight" in b


def test_bert_large_is_derivable():
    large = sum(c for _, c in bert(hidden=1024, layers_n=24, intermediate=4096))
    assert large == pytest.approx(335_141_888, rel=1e-9)  # BERT-large, ~340M


def test_model_bytes_and_dtypes():
    assert model_bytes("resnet50", "float32") == 4 * 25_557_032
    assert model_bytes("resnet50", "fp16") == 2 * 25_557_032
    assert model_bytes("ResNet-50", "bf16") == 2 * 25_557_032
    assert model_bytes("bert_base", "float64") == 8 * 109_482_240
    assert dtype_bytes(2) == 2 and dtype_bytes("int8") == 1
    with pytest.raises(ValueError):
        dtype_bytes("float7")
    with pytest.raises(ValueError, match="known models"):
        model_name("gpt-5")


def test_workload_bytes():
    assert workload_bytes("vgg16") == 4 * 138_357_544
    assert workload_bytes("8MiB") == 8 * 2**20
    with pytest.raises(ValueError, match="model"):
        workload_bytes("nonsense")
