"""Hybrid (sliding-window) PoolLayout: fields, derived layers and sizes, wire form, buffers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from memsvc.core import PoolLayout, attach, create_buffers
from memsvc.core.backends.shm import SHM_DIR
from memsvc.core.errors import InvalidArgumentError
from tests.core.test_shm_backend import run_python
from tests.helpers import small_layout

F, S = "full_attention", "sliding_attention"


def hybrid_layout(**overrides) -> PoolLayout:
    fields: dict = dict(
        num_layers=6,
        layer_types=(S, S, F, S, S, S),
        sliding_window=8,
        swa_num_pages=10,
        num_kv_heads=2,
        head_dim=4,
        page_size=4,
        num_pages=6,
        max_running_requests=4,
        max_context_len=64,
        dtype="float32",
    )
    fields.update(overrides)
    return PoolLayout(**fields)


def test_hybrid_layers_and_sizes() -> None:
    layout = hybrid_layout()
    assert layout.is_hybrid
    assert layout.full_layer_ids == (2,) and layout.swa_layer_ids == (0, 1, 3, 4, 5)
    assert [layout.layer_slot(i) for i in range(6)] == [
        ("swa", 0),
        ("swa", 1),
        ("full", 0),
        ("swa", 2),
        ("swa", 3),
        ("swa", 4),
    ]
    per_layer = 2 * 2 * 4 * 4
    assert layout.bytes_per_token == per_layer and layout.swa_bytes_per_token == 5 * per_layer
    assert layout.kv_shape == (7, 1, 2, 4, 2, 4)
    assert layout.swa_kv_shape == (11, 5, 2, 4, 2, 4)
    assert layout.kv_bytes == 7 * 4 * per_layer
    assert layout.swa_kv_bytes == 11 * 4 * 5 * per_layer
    assert layout.swa_capacity_tokens == 40 and layout.capacity_tokens == 24
    assert layout.full_to_swa_page_shape == (7,) and layout.full_to_swa_page_bytes == 28
    with pytest.raises(InvalidArgumentError):
        layout.layer_slot(6)


def test_non_hybrid_layout_is_as_before() -> None:
    layout = small_layout()
    assert not layout.is_hybrid
    assert layout.full_layer_ids == (0, 1) and layout.swa_layer_ids == ()
    assert layout.layer_slot(1) == ("full", 1)
    assert layout.bytes_per_token == 2 * 2 * 2 * 8 * 2
    assert layout.swa_kv_bytes == 0 and layout.full_to_swa_page_bytes == 0
    assert layout.swa_capacity_tokens == 0
    # every layer named full is the same pool as no names at all
    named = small_layout(layer_types=(F, F))
    assert not named.is_hybrid and named.kv_shape == layout.kv_shape


def test_pure_swa_layout_has_an_empty_full_buffer() -> None:
    layout = hybrid_layout(layer_types=(S,) * 6)
    assert layout.full_layer_ids == () and layout.kv_bytes == 0
    assert layout.kv_shape == (7, 0, 2, 4, 2, 4)


def test_wire_form_round_trips_through_json() -> None:
    layout = hybrid_layout()
    wire = json.loads(json.dumps(layout.to_dict()))
    assert wire["layer_types"] == list(layout.layer_types)
    back = PoolLayout.from_dict(wire)
    assert back == layout and isinstance(back.layer_types, tuple)
    assert hash(back) == hash(layout)
    assert PoolLayout.from_dict(small_layout().to_dict()) == small_layout()


@pytest.mark.parametrize(
    "bad",
    [
        {"layer_types": (S, F)},  # wrong length
        {"layer_types": (S, S, F, S, S, "linear_attention")},
        {"layer_types": "sliding_attention"},
        {"sliding_window": 0},
        {"swa_num_pages": 0},
        {"sliding_window": -1},
        {"swa_num_pages": 1.5},
        {"layer_types": (F,) * 6},  # no sliding layer, but a window and SWA pages
        {"layer_types": (), "swa_num_pages": 0},  # a window without a sliding layer
    ],
)
def test_bad_hybrid_layout_is_rejected(bad: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        hybrid_layout(**bad)


def test_non_hybrid_buffers_make_the_same_segments_as_before() -> None:
    with create_buffers(small_layout()) as buffers:
        handle = buffers.handle()
        assert set(handle) == {"backend", "layout", "kv", "req_to_token"}
        assert buffers.swa_kv is None and buffers.full_to_swa_page is None
        assert os.path.getsize(os.path.join(SHM_DIR, buffers.kv_name)) == small_layout().kv_bytes
        with attach(handle) as attached:
            assert attached.swa_kv_torch() is None and attached.full_to_swa_page_torch() is None


def test_hybrid_buffers_are_shared_with_an_attacher_in_another_process() -> None:
    pytest.importorskip("torch")
    layout = hybrid_layout()
    buffers = create_buffers(layout)
    names = [buffers.kv_name, buffers.req_to_token_name]
    names += [buffers.swa_kv_name, buffers.full_to_swa_page_name]
    try:
        assert buffers.swa_kv.shape == layout.swa_kv_shape and not buffers.swa_kv.any()
        assert buffers.full_to_swa_page.shape == (7,) and not buffers.full_to_swa_page.any()
        buffers.write_full_to_swa(np.array([1, 3]), np.array([9, 4]))
        child = run_python(
            """
            import json, sys
            from memsvc.core import attach
            with attach(json.loads(sys.argv[1])) as pool:
                swa, table, kv = pool.swa_kv_torch(), pool.full_to_swa_page_torch(), pool.kv_torch()
                print(json.dumps([list(swa.shape), list(kv.shape), table.tolist()]))
                swa[9, 4, 1, 3] = 2.5       # SWA layer 4 (model layer 5), V, offset 3
                kv[3, 0, 0, 0] = -1.0
            """,
            json.dumps(buffers.handle()),
        )
        assert child.returncode == 0, child.stderr
        swa_shape, kv_shape, table = json.loads(child.stdout)
        assert tuple(swa_shape) == layout.swa_kv_shape and tuple(kv_shape) == layout.kv_shape
        assert table == [0, 9, 0, 4, 0, 0, 0]
        assert (buffers.swa_kv[9, 4, 1, 3] == 2.5).all() and buffers.swa_kv.sum() == 2.5 * 8
        assert (buffers.kv[3, 0, 0, 0] == -1.0).all()
    finally:
        buffers.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


def test_pure_swa_buffers_attach() -> None:
    torch = pytest.importorskip("torch")
    layout = hybrid_layout(layer_types=(S,) * 6, dtype="bfloat16")
    with create_buffers(layout) as buffers, attach(buffers.handle()) as attached:
        assert tuple(attached.kv_torch().shape) == layout.kv_shape
        swa = attached.swa_kv_torch()
        assert swa.dtype == torch.bfloat16 and tuple(swa.shape) == layout.swa_kv_shape
        assert attached.full_to_swa_page_torch().dtype == torch.int32
