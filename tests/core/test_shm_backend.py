"""The shm backend: zero-copy attach from another process, torch views, cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from memsvc.core import KVPool, attach, create_buffers
from memsvc.core.backends.shm import SHM_DIR, list_segments
from memsvc.core.errors import BackendUnavailableError, InvalidArgumentError
from tests.helpers import small_layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_child_process_writes_parent_reads_same_bytes(make_pool) -> None:
    pool = make_pool()
    pool.open_request("r")
    slots = pool.alloc_extend([("r", 10)])
    child = run_python(
        """
        import json, sys
        import numpy as np
        from memsvc.core import attach
        handle, slots = json.loads(sys.argv[1]), np.array(json.loads(sys.argv[2]))
        with attach(handle) as pool:
            kv = pool.kv_torch()
            ps = pool.layout.page_size
            for i, slot in enumerate(slots):
                kv[slot // ps, :, :, slot % ps] = float(i + 1)   # writes through torch
            row = pool.req_to_token_torch()[1, : len(slots)].tolist()
            print(json.dumps(row))
        """,
        json.dumps(pool.buffers.handle()),
        json.dumps(slots.tolist()),
    )
    assert child.returncode == 0, child.stderr
    # the child saw the parent's req_to_token row ...
    assert json.loads(child.stdout) == slots.tolist()
    # ... and the parent sees the child's writes, without any copy
    data = pool.buffers.read_slots(slots)
    for i in range(slots.size):
        assert (data[i] == i + 1).all()
    every_slot = pool.allocator.pages_to_slots(np.arange(1, pool.layout.num_pages + 1))
    assert (pool.buffers.read_slots(np.setdiff1d(every_slot, slots)) == 0).all()
    pool.release("r", is_insert=False)
    pool.check_integrity(idle=True)


def test_attach_in_process_gives_numpy_and_torch_views_of_same_memory(make_pool) -> None:
    torch = pytest.importorskip("torch")
    pool = make_pool(small_layout(dtype="bfloat16"))
    with attach(pool.buffers.handle()) as attached:
        kv = attached.kv_torch()
        assert kv.dtype == torch.bfloat16 and tuple(kv.shape) == pool.layout.kv_shape
        kv[1, 0, 0, 0, 0, 0] = 1.5
        # bfloat16 1.5 is 0x3FC0
        assert int(pool.buffers.kv[1, 0, 0, 0, 0, 0]) == 0x3FC0
        table = attached.req_to_token_torch()
        pool.buffers.write_row(3, 0, np.array([7, 8, 9]))
        assert table[3, :3].tolist() == [7, 8, 9]
    pool.check_integrity(idle=True)


def test_close_unlinks_segments_and_is_idempotent() -> None:
    buffers = create_buffers(small_layout())
    names = [buffers.kv_name, buffers.req_to_token_name]
    assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    handle = buffers.handle()
    buffers.close()
    buffers.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    with pytest.raises(BackendUnavailableError):
        attach(handle)


def test_attach_rejects_foreign_names() -> None:
    handle = {
        "backend": "shm",
        "layout": small_layout().to_dict(),
        "kv": "../etc/passwd",
        "req_to_token": "kvstack-x",
    }
    with pytest.raises(InvalidArgumentError):
        attach(handle)
    with pytest.raises(InvalidArgumentError):
        attach({"backend": "nope"})
    with pytest.raises(InvalidArgumentError):
        create_buffers(small_layout(), "nope")


OWNER_SCRIPT = """
    import sys, time
    from memsvc.core import KVPool
    from memsvc.core.backends.shm import install_sigterm_cleanup
    from tests.helpers import small_layout
    {setup}
    pool = KVPool(small_layout())
    print(pool.buffers.kv_name, pool.buffers.req_to_token_name, flush=True)
    {then}
"""


@pytest.mark.parametrize(
    ("setup", "then", "how"),
    [
        ("install_sigterm_cleanup()", "time.sleep(60)", "sigterm"),
        ("", "sys.exit(0)", "exit"),
        ("", "raise RuntimeError('boom')", "exception"),
    ],
)
def test_owner_process_unlinks_on_sigterm_exit_and_crash(setup: str, then: str, how: str) -> None:
    code = textwrap.dedent(OWNER_SCRIPT).format(setup=setup, then=then)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2, proc.stderr.read()
        if how == "sigterm":
            assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + 5
    while any(n in list_segments() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(n in list_segments() for n in names)


def test_pool_constructor_failure_leaves_no_segment(monkeypatch) -> None:
    import memsvc.core.pool as pool_module

    def broken(*args, **kwargs):
        raise RuntimeError("allocator failed")

    monkeypatch.setattr(pool_module, "PageAllocator", broken)
    before = set(list_segments())
    with pytest.raises(RuntimeError):
        KVPool(small_layout())
    assert set(list_segments()) == before
