"""Every command the README shows must be one the code accepts.

Each shell line in a fenced block is checked against the real entry point:
the service's own argparse parser parses it (so a renamed or removed flag, or
a bad value, fails here), a ``make`` target must exist in the Makefile, a
script or test path must exist, a compose profile must be defined. Python
blocks must compile. A command of a kind this test does not know fails it, so
a new kind of command gets a check too.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

# program -> module whose build_parser() parses its arguments
PARSERS = {
    "memsvc": "memsvc.__main__",
    "model_svc": "model_svc.__main__",
    "scheduler_svc": "scheduler_svc.__main__",
    "scheduler_svc.pd.router": "scheduler_svc.pd.router",
}


def blocks() -> list[str]:
    """Fenced blocks, except ```text ones (diagrams)."""
    found, current, kind = [], None, ""
    for line in README.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, kind = [], line[3:].strip()
            else:
                if kind != "text":
                    found.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return found


def is_python(block: str) -> bool:
    return block.lstrip().startswith(("from ", "import ", "with "))


def shell_commands() -> list[str]:
    commands = []
    for block in blocks():
        if is_python(block):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#\s.*$", "", line).strip().rstrip("&").strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def parse(module: str, args: list[str]) -> None:
    parser = importlib.import_module(module).build_parser()
    if "--help" in args:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--help"])
        assert exit_.value.code == 0
        return
    parser.parse_args(args)


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
    elif program == "curl":
        assert re.search(r"localhost:\d+/", " ".join(args))
    else:
        raise AssertionError(f"the README shows a command this test cannot check: {words}")


@pytest.mark.parametrize("command", shell_commands())
def test_readme_command_is_accepted(command: str) -> None:
    check(shlex.split(command))


@pytest.mark.parametrize("block", [b for b in blocks() if is_python(b)])
def test_readme_python_compiles(block: str) -> None:
    compile(block, "README.md", "exec")


def test_a_bad_flag_would_be_caught() -> None:
    with pytest.raises(SystemExit):
        check(["memsvc", "--no-such-flag"])
    with pytest.raises(AssertionError):
        check(["make", "no-such-target"])


def test_the_readme_names_the_compose_version_the_compose_files_need() -> None:
    """docker-compose 1.x refuses docker/compose.yaml (its top-level ``name``, ``restart``
    under ``depends_on``, which Docker Compose 2.17.0 introduced): the README must say so."""
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    depends = [
        condition
        for service in compose["services"].values()
        for condition in (service.get("depends_on") or {}).values()
    ]
    assert "name" in compose and any("restart" in condition for condition in depends)
    assert re.search(r"Docker Compose v?2\.17\.0 or later", README), "no minimum Compose version"


def test_the_readme_does_not_call_the_openai_endpoints_missing() -> None:
    """They are served (and documented in "HTTP API")."""
    assert "/v1/chat/completions" in README
    stale = re.search(r"OpenAI-compatible endpoints[^.]*\bnot\s+there\s+yet", README)
    assert stale is None, stale.group(0)
