"""Every command the README and the pages of docs/ show must be one the code accepts.

Each shell line in a fenced block is checked against the real entry point:
the service's own argparse parser parses it (so a renamed or removed flag, or
a bad value, fails here), a ``make`` target must exist in the Makefile, a
script or test path must exist, a compose profile must be defined. Python
blocks must compile. A YAML block is a ``--config`` file of ``kvstack serve``:
each key must be one of its flags, and the values must parse as on the command
line. A command of a kind this test does not know fails it, so a new kind of
command gets a check too.
"""

from __future__ import annotations

import functools
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# The README, then the reference pages (the docs site, tests/test_docs.py).
DOCUMENTS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
README = (REPO / "README.md").read_text()

# program -> module whose build_parser() parses its arguments
PARSERS = {
    "memsvc": "memsvc.__main__",
    "model_svc": "model_svc.__main__",
    "scheduler_svc": "scheduler_svc.__main__",
    "scheduler_svc.pd.router": "scheduler_svc.pd.router",
}


def page(name: str) -> str:
    return (REPO / name).read_text()


def blocks(text: str) -> list[tuple[str, str]]:
    """Fenced blocks as (info string, body), except ```text ones (diagrams)."""
    found, current, kind = [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, kind = [], line[3:].strip()
            else:
                if kind != "text":
                    found.append((kind, "".join(current)))
                current = None
        elif current is not None:
            current.append(line)
    return found


def is_python(block: str) -> bool:
    return block.lstrip().startswith(("from ", "import ", "with "))


def is_yaml(kind: str) -> bool:
    return kind == "yaml"


def shell_commands(text: str) -> list[str]:
    commands = []
    for kind, block in blocks(text):
        if is_python(block) or is_yaml(kind):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#\s.*$", "", line).strip().rstrip("&").strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def documented(pick) -> list:
    """``pick(text)``'s items of every document, each with the document's name."""
    return [
        pytest.param(name, item, id=f"{name}: {str(item)[:60]}")
        for name in DOCUMENTS
        for item in pick(page(name))
    ]


def parse(module: str, args: list[str]) -> None:
    parser = importlib.import_module(module).build_parser()
    if "--help" in args:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--help"])
        assert exit_.value.code == 0
        return
    parser.parse_args(args)


@functools.cache
def smg_launch_help() -> frozenset[str]:
    """The flags of SMG's (the cluster extra's router) own ``smg launch --help``."""
    smg = Path(sys.executable).parent / "smg"
    assert smg.exists(), f"{smg} is missing: the cluster extra is not installed"
    out = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"--[a-z0-9-]+", out.stdout))


def check(words: list[str]) -> None:
    program, args = words[0].removeprefix(".venv/bin/"), words[1:]
    if program == "make":
        targets = re.findall(r"^([a-z]+):", (REPO / "Makefile").read_text(), flags=re.M)
        assert set(args) <= set(targets), f"no make target {args}"
    elif program in PARSERS:
        parse(PARSERS[program], args)
    elif program == "kvstack":
        from kvstack.cli import build_parser

        build_parser(args).parse_args(args)
    elif program == "python" and args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module in PARSERS:
            parse(PARSERS[module], rest)
        elif module == "pytest":
            assert all((REPO / path).exists() for path in rest if not path.startswith("-"))
        else:
            importlib.import_module(module)
    elif program == "python":
        assert (REPO / args[0]).is_file(), f"{args[0]} does not exist"
    elif program == "docker" and args[:1] == ["compose"]:
        files = [args[i + 1] for i, a in enumerate(args) if a == "-f"]
        profile = args[args.index("--profile") + 1]
        services = {}
        for path in files:
            services.update(yaml.safe_load((REPO / path).read_text())["services"])
        profiles = {p for s in services.values() for p in s.get("profiles", [])}
        assert profile in profiles
    elif program == "smg":
        assert args[:1] == ["launch"], f"smg has no subcommand {args[:1]}"
        usage = smg_launch_help()
        unknown = [a for a in args if a.startswith("--") and a not in usage]
        assert not unknown, f"smg launch has no flags {unknown}"
    elif program == "curl":
        assert re.search(r"localhost:\d+/", " ".join(args))
    else:
        raise AssertionError(f"the docs show a command this test cannot check: {words}")


def check_config(block: str, folder: Path) -> None:
    """A ``--config`` YAML of ``kvstack serve``: keys are its flags without ``--``, and
    ``kvstack serve --config FILE`` reads each value as that flag given on the command
    line."""
    from kvstack.cli import build_parser, parse_args

    serve = build_parser(["serve"]).subcommands["serve"]
    flags = {flag for action in serve._actions for flag in action.option_strings}
    config = yaml.safe_load(block)
    assert isinstance(config, dict) and config, "a config file is a mapping of flags"
    argv = []
    for key, value in config.items():
        assert f"--{key}" in flags, f"kvstack serve has no flag --{key}"
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    path = folder / "config.yaml"
    path.write_text(block)
    assert vars(parse_args(["serve", "--config", str(path)])) == {
        **vars(parse_args(["serve", *argv])),
        "config": str(path),
    }


@pytest.mark.parametrize(("document", "command"), documented(shell_commands))
def test_documented_command_is_accepted(document: str, command: str) -> None:
    check(shlex.split(command))


@pytest.mark.parametrize(
    ("document", "block"), documented(lambda t: [b for _, b in blocks(t) if is_python(b)])
)
def test_documented_python_compiles(document: str, block: str) -> None:
    compile(block, document, "exec")


@pytest.mark.parametrize(
    ("document", "block"), documented(lambda t: [b for k, b in blocks(t) if is_yaml(k)])
)
def test_documented_config_file_names_real_flags(document: str, block: str, tmp_path: Path) -> None:
    check_config(block, tmp_path)


def test_the_docs_pages_are_covered() -> None:
    """The reference moved to docs/: its pages are checked, not only the README."""
    assert "docs/tuning.md" in DOCUMENTS and len(DOCUMENTS) > 10
    assert any(name.startswith("docs/") for name in DOCUMENTS[1:])


def test_a_bad_flag_would_be_caught(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        check(["memsvc", "--no-such-flag"])
    with pytest.raises(AssertionError):
        check(["make", "no-such-target"])
    with pytest.raises(AssertionError):
        check_config("no-such-flag: 1\n", tmp_path)
    with pytest.raises(SystemExit):
        check_config("retract-mode: no-such-mode\n", tmp_path)


def test_the_docs_name_the_compose_version_the_compose_files_need() -> None:
    """docker-compose 1.x refuses docker/compose.yaml (its top-level ``name``, ``restart``
    under ``depends_on``, which Docker Compose 2.17.0 introduced): the Docker page must
    say so."""
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    depends = [
        condition
        for service in compose["services"].values()
        for condition in (service.get("depends_on") or {}).values()
    ]
    assert "name" in compose and any("restart" in condition for condition in depends)
    docker = page("docs/docker.md")
    assert re.search(r"Docker Compose v?2\.17\.0 or later", docker), "no minimum Compose version"


def test_the_docs_do_not_call_the_openai_endpoints_missing() -> None:
    """They are served (and documented in the HTTP API page, and named by the README)."""
    for text in (page("docs/http-api.md"), README):
        assert "/v1/chat/completions" in text
        stale = re.search(r"OpenAI-compatible endpoints[^.]*\bnot\s+there\s+yet", text)
        assert stale is None, stale.group(0)
