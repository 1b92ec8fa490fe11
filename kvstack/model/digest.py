"""A checkpoint's model digest: the sha256 of its config and weights, computed once.

memsvc names every stored KV page by it (``--model-digest``,
:mod:`memsvc.core.identity`), so a kept storage tier never serves KV another
checkpoint computed. Hashing the weights takes a while (about 1 s per GB), so
the digest is cached in ``<kvstack home>/model-digests/``, one small JSON file
per checkpoint folder (keyed by its resolved path), next to the models kvstack
converts. The cache entry holds each hashed file's name, size and mtime; any
change and the digest is computed again.

What is hashed, in name order: ``config.json`` and every weights file
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), each as its
name, its size and its bytes. Tokenizer files are not: they do not change a
KV page's meaning for a given token id.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_VERSION = 1
_CHUNK = 1 << 20


def digest_files(checkpoint: Path) -> list[Path]:
    """The files :func:`model_digest` hashes, in name order."""
    names = sorted(
        p.name
        for p in checkpoint.iterdir()
        if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    )
    if "config.json" not in names:
        raise FileNotFoundError(f"{checkpoint}: no config.json")
    return [checkpoint / name for name in names]


def _stamp(files: list[Path]) -> list[list]:
    return [[f.name, (st := f.stat()).st_size, st.st_mtime_ns] for f in files]


def compute_digest(files: list[Path]) -> str:
    digest = hashlib.sha256(b"kvstack-model-digest/1\0")
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def cache_path(checkpoint: Path, home: Path | None = None) -> Path:
    from model_svc.tiny import kvstack_home

    key = hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:24]
    return (home if home is not None else kvstack_home()) / "model-digests" / f"{key}.json"


def model_digest(checkpoint: str | Path, *, home: Path | None = None) -> str:
    """``checkpoint``'s model digest (64 hex digits), from the cache when it is current."""
    checkpoint = Path(checkpoint)
    files = digest_files(checkpoint)
    stamp = _stamp(files)
    cached = cache_path(checkpoint, home)
    with contextlib.suppress(OSError, ValueError):
        entry = json.loads(cached.read_text(encoding="utf-8"))
        if (
            entry.get("version") == _VERSION
            and entry.get("path") == str(checkpoint.resolve())
            and entry.get("files") == stamp
        ):
            return str(entry["digest"])
    digest = compute_digest(files)
    if _stamp(files) != stamp:  # changed while it was read: not cached, the next start rehashes
        return digest
    entry = {"version": _VERSION, "path": str(checkpoint.resolve()), "files": stamp}
    entry["digest"] = digest
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry), encoding="utf-8")
        os.replace(tmp, cached)
    return digest
