"""PoolLayout's derived sizes and validation."""

from __future__ import annotations

import pytest

from memsvc.core import PoolLayout
from memsvc.core.errors import InvalidArgumentError


def test_derived_sizes_of_a_realistic_layout() -> None:
    layout = PoolLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, num_pages=100)
    assert layout.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert layout.bytes_per_page == 16 * 131072
    assert layout.capacity_tokens == 1600
    assert layout.kv_shape == (101, 32, 2, 16, 8, 128)
    assert layout.kv_bytes == 101 * layout.bytes_per_page
    assert layout.req_to_token_shape == (257, 4096)
    assert PoolLayout.from_dict(layout.to_dict()) == layout


def test_dtype_sizes() -> None:
    base = dict(num_layers=1, num_kv_heads=1, head_dim=4, page_size=1, num_pages=1)
    assert PoolLayout(**base, dtype="float32").bytes_per_token == 2 * 4 * 4
    assert PoolLayout(**base, dtype="bfloat16").bytes_per_token == 2 * 4 * 2


@pytest.mark.parametrize(
    "bad",
    [
        {"num_layers": 0},
        {"page_size": -1},
        {"num_pages": 2.5},
        {"dtype": "int8"},
        {"head_dim": True},
    ],
)
def test_bad_layout_is_rejected(bad: dict) -> None:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    fields.update(bad)
    with pytest.raises(InvalidArgumentError):
        PoolLayout(**fields)


def test_layout_is_frozen() -> None:
    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=1, num_pages=1)
    with pytest.raises(AttributeError):
        layout.num_pages = 2  # type: ignore[misc]
