"""Helpers shared by the tests."""

from __future__ import annotations

from memsvc.core import PoolLayout


def small_layout(**overrides: int | str) -> PoolLayout:
    fields: dict = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        num_pages=64,
        max_running_requests=16,
        max_context_len=512,
    )
    fields.update(overrides)
    return PoolLayout(**fields)
