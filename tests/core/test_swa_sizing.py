"""Sizing the two pools of a hybrid model as SGLang does (--swa-full-tokens-ratio), and
the memsvc flags that ask for it."""

from __future__ import annotations

import pytest

from memsvc.__main__ import build_parser
from memsvc.config import MemsvcConfig
from memsvc.core import KVPool
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.layout import hybrid_layout, split_hybrid_pages
from memsvc.settings import from_args
from tests.helpers import small_layout

F, S = "full_attention", "sliding_attention"


def test_sglang_split_with_its_worked_numbers() -> None:
    # 24 layers, half sliding, 1000 tokens of every layer, r = 0.8:
    # F = int(24000 / (0.8 * 12 + 12)) = int(1111.1) = 1111, S = int(1111 * 0.8) = 888
    assert split_hybrid_pages(1000, 1, 12, 12, 0.8) == (1111, 888)
    # page size 16: the same tokens, each pool rounded down to whole pages
    # F = int(1024 * 24 / 21.6) = 1137 -> 71 pages; S = int(1137 * 0.8) = 909 -> 56 pages
    assert split_hybrid_pages(64, 16, 12, 12, 0.8) == (71, 56)
    # 5 of 6 layers sliding: F = 6T / 5, S = 0.96 T
    assert split_hybrid_pages(1000, 1, 1, 5, 0.8) == (1200, 960)
    # pure SWA (every layer windowed): the full pool holds ids only, F = T / r, in floats
    # as SGLang computes it: 0.8 * 6 = 4.800000000000001, so int(6000 / that) = 1249
    assert split_hybrid_pages(1000, 1, 0, 6, 0.8) == (1249, 999)
    # r = 1: as many SWA tokens as full ones, each pool the plain pool's size
    assert split_hybrid_pages(1000, 1, 3, 3, 1.0) == (1000, 1000)


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.8, 1.0, 2.0])
@pytest.mark.parametrize("layers", [(1, 5), (3, 3), (5, 1), (0, 4)])
def test_the_split_stays_within_the_bytes_of_the_plain_pool(ratio, layers) -> None:
    full_layers, swa_layers = layers
    plain = small_layout(num_layers=full_layers + swa_layers, num_pages=200, page_size=4)
    types = [F] * full_layers + [S] * swa_layers
    layout = hybrid_layout(plain, types, sliding_window=16, swa_full_tokens_ratio=ratio)
    assert layout.kv_bytes + layout.swa_kv_bytes <= plain.kv_bytes + layout.swa_bytes_per_page
    # and wastes less than a page of each pool (plus the rounding of int())
    used = (
        layout.num_pages * layout.bytes_per_page + layout.swa_num_pages * layout.swa_bytes_per_page
    )
    spare = plain.num_pages * plain.bytes_per_page - used
    assert (
        0 <= spare < layout.bytes_per_page + 2 * layout.swa_bytes_per_page + plain.bytes_per_token
    )
    assert (
        layout.swa_num_pages
        == int(int(800 * (full_layers + swa_layers) / (ratio * swa_layers + full_layers)) * ratio)
        // 4
    )


def test_bad_splits_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="ratio"):
        split_hybrid_pages(100, 1, 1, 1, 0.0)
    with pytest.raises(InvalidArgumentError, match="at least one"):
        split_hybrid_pages(1, 16, 1, 1, 0.01)
    with pytest.raises(InvalidArgumentError):
        split_hybrid_pages(100, 1, 2, 0, 0.8)


def parse(*argv: str) -> MemsvcConfig:
    base = ["--num-layers", "6", "--num-kv-heads", "1", "--head-dim", "4", "--page-size", "4"]
    return from_args(MemsvcConfig, build_parser().parse_args([*base, "--num-pages", "100", *argv]))


def test_memsvc_flags_size_both_pools_from_the_num_pages_budget() -> None:
    config = parse(
        "--layer-types",
        "sliding_attention,sliding_attention,full_attention," * 2,
        "--sliding-window",
        "32",
    )
    layout = config.layout
    assert layout.layer_types == (S, S, F) * 2 and layout.sliding_window == 32
    # T = 400, 6 layers, r = 0.8 (the default): F = int(2400 / 5.2) = 461 -> 115 pages,
    # S = int(461 * 0.8) = 368 -> 92 pages
    assert (layout.num_pages, layout.swa_num_pages) == (115, 92)
    ratio = parse(
        "--layer-types",
        ",".join([S] * 5 + [F]),
        "--sliding-window",
        "8",
        "--swa-full-tokens-ratio",
        "0.5",
    ).layout
    # F = int(2400 / 3.5) = 685 -> 171 pages; S = int(685 * 0.5) = 342 -> 85 pages
    assert (ratio.num_pages, ratio.swa_num_pages) == (171, 85)
    with KVPool(layout) as pool:
        assert pool.capacity == 460 and pool.swa_capacity == 368
        pool.check_integrity(idle=True)


def test_memsvc_flags_without_layer_types_keep_the_plain_pool() -> None:
    config = parse()
    assert not config.layout.is_hybrid and config.layout.num_pages == 100
    assert parse("--layer-types", ",".join([F] * 6)).layout == config.layout.__class__(
        **{**config.layout.to_dict(), "layer_types": (F,) * 6}
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("--sliding-window", "8"),  # no layer types
        ("--layer-types", "sliding_attention,full_attention"),  # 2 names for 6 layers
        ("--layer-types", ",".join(["linear_attention"] * 6), "--sliding-window", "8"),
        ("--layer-types", ",".join([S] * 6)),  # sliding layers, no window
        ("--layer-types", ",".join([F] * 6), "--sliding-window", "8"),  # window, no sliding
    ],
)
def test_bad_hybrid_flags_are_refused(argv) -> None:
    with pytest.raises(InvalidArgumentError):
        parse(*argv)
