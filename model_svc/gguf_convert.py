"""Convert a llama-architecture GGUF file into a Hugging Face-layout checkpoint folder.

``python -m model_svc.gguf_convert GGUF OUT_DIR`` (or :func:`convert_gguf`) writes::

    config.json              LlamaConfig fields, from the GGUF's ``llama.*`` metadata
    model.safetensors        float32, HF tensor names (every tensor dequantized)
    tokenizer.json           a byte-level BPE ``tokenizers`` file from ``tokenizer.ggml.*``
    tokenizer_config.json    special tokens and ``chat_template``
    generation_config.json   bos / eos / pad ids
    conversion.json          where it came from (the GGUF's name, size and format)

The folder is written into a temporary sibling and renamed into place, so a
crash never leaves half a checkpoint behind.

Reading the GGUF is :mod:`model_svc.gguf_reader`, its tokenizer
:mod:`model_svc.gguf_tokenizer`; this module writes the folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from model_svc.checkpoint import WEIGHTS_FILE
from model_svc.config import CONFIG_FILE, GENERATION_CONFIG_FILE
from model_svc.gguf_reader import GGUFConvertError, model_config, open_gguf, state_dict
from model_svc.gguf_tokenizer import build_tokenizer, read_vocab, tokenizer_config
from model_svc.tiny import write_checkpoint
from model_svc.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

__all__ = ["CONVERTED_FILES", "GGUFConvertError", "convert_gguf", "is_converted", "main"]

CONVERSION_FILE = "conversion.json"
# Every file of a converted folder; CONVERSION_FILE is the one that marks it as ours.
CONVERTED_FILES = (
    CONFIG_FILE,
    WEIGHTS_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    CONVERSION_FILE,
)
CONVERTER_VERSION = 1

# -- writing the folder ------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the HF-layout checkpoint of ``gguf_path`` as the folder ``out_dir``.

    ``out_dir`` must not exist (unless ``overwrite``): the folder appears whole, by a
    rename of a temporary sibling. Raises :class:`GGUFConvertError`.
    """
    src_path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not overwrite:
        raise GGUFConvertError(f"{out}: already exists (pass overwrite=True to replace it)")
    src = open_gguf(src_path)
    tensor_names = {t.name for t in src.reader.tensors}
    config = model_config(src, tensor_names)
    vocab = read_vocab(src, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_checkpoint(staging, config, state_dict(src, config))
        build_tokenizer(vocab).save(str(staging / TOKENIZER_FILE))
        _write_json(staging / TOKENIZER_CONFIG_FILE, tokenizer_config(src, vocab, config))
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.to_dict()["eos_token_id"],
            "pad_token_id": config.pad_token_id,
        }
        _write_json(
            staging / GENERATION_CONFIG_FILE,
            {key: value for key, value in generation.items() if value is not None},
        )
        _write_json(
            staging / CONVERSION_FILE,
            {
                "converter": "model_svc.gguf_convert",
                "converter_version": CONVERTER_VERSION,
                "source": src_path.name,
                "source_bytes": src_path.stat().st_size,
                "source_name": src.get("general.name"),
                "source_file_type": src.get("general.file_type"),
                "dtype": "float32",
            },
        )
        _make_readable(staging)
        _move_into_place(staging, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return out


def _make_readable(folder: Path) -> None:
    """The permissions of a plain ``mkdir`` and file write (``mkdtemp`` makes 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for file in folder.iterdir():
        os.chmod(file, 0o666 & ~umask)


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``; an existing ``out`` is first renamed aside."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
        os.rename(out, old / out.name)
    try:
        os.rename(staging, out)
    except OSError as exc:
        raise GGUFConvertError(
            f"{out}: could not move the converted folder into place ({exc})"
        ) from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def is_converted(folder: str | Path) -> bool:
    """Whether ``folder`` is a complete checkpoint written by this converter version."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in CONVERTED_FILES):
        return False
    try:
        marker = json.loads((folder / CONVERSION_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_svc.gguf_convert",
        description="Convert a llama GGUF file into a Hugging Face-layout checkpoint folder.",
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the folder to create")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        out = convert_gguf(args.gguf, args.out_dir, overwrite=args.overwrite)
    except GGUFConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
