"""``kvstack serve`` / ``kvstack up`` take the services' tuning flags and forward them.

Each flag is declared once, on its service's config class; ``serve`` and ``up``
build theirs from those classes. So every forwarded flag is accepted by both
commands, what they forward parses on the service to the config the user asked
for, a flag the user did not set is not forwarded (the service keeps its
default), ``--config FILE`` works and loses to the command line, and an unknown
flag or key is refused clearly. One process test starts a tiny-model stack with
``kvstack serve``'s flags and asks the scheduler what it runs with.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstack import cli
from kvstack.stack import forward
from kvstack.stack.forward import CONFIGS, MEMSVC, ROUTER, SCHEDULER, forwarded
from kvstack.stack.spec import build_process_list
from kvstack.up import cli as up_cli
from memsvc.settings import Flag, from_args

TUNED = [
    "--num-reserved-decode-tokens", "64",
    "--retract-mode", "offload",
    "--retraction-policy", "cost",
    "--retract-cooldown-steps", "3",
    "--enable-priority-scheduling",
    "--host-store-bytes", "65536",
    "--retract-decode-steps", "7",
    "--enable-hierarchical-cache",
    "--hicache-size", "2",
    "--hicache-write-policy", "write_back",
    "--stall-timeout", "9",
]  # fmt: skip
# What each service needs besides the forwarded flags (its layout, its peers).
REQUIRED = {
    # (--hicache-storage-keep needs a model digest, which kvstack's launcher passes)
    MEMSVC: [
        "--num-layers",
        "2",
        "--num-kv-heads",
        "2",
        "--head-dim",
        "8",
        "--model-digest",
        "e" * 64,
    ],
    SCHEDULER: ["--memsvc", "ipc:///m", "--worker", "ipc:///w"],
    ROUTER: ["--prefill", "ipc:///p", "--decode", "ipc:///d"],
}


def service_parsers() -> dict[str, argparse.ArgumentParser]:
    import memsvc.__main__ as memsvc_main
    import scheduler_svc.__main__ as scheduler_main
    from scheduler_svc.pd import router

    return {
        MEMSVC: memsvc_main.build_parser(),
        SCHEDULER: scheduler_main.build_parser(),
        ROUTER: router.build_parser(),
    }


def option(parser: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    return parser._option_string_actions.get(name)


def every_flag() -> list[tuple[str, Flag]]:
    return [(service, flag) for service in CONFIGS for flag in forwarded(service)]


def not_default(flag: Flag) -> list[str]:
    """``flag`` set to a value that is not its default, as argv."""
    if flag.switch:
        return [flag.name]
    if flag.name == "--hicache-storage-backend":
        return [flag.name, "file"]  # one --hicache-storage-keep keeps (a directory)
    if flag.name == "--kv-events-config":
        return [flag.name, '{"publisher": "zmq", "endpoint": "ipc:///srv/kv-events"}']  # JSON
    if flag.choices:
        return [flag.name, next(c for c in reversed(flag.choices) if c != flag.default)]
    if flag.kind is float:
        return [flag.name, "2.5"]
    if flag.kind is int:
        return [flag.name, str((flag.default or 0) + 7)]
    return [flag.name, "/srv/somewhere"]


def test_serve_and_up_take_flags_from_the_services_own_declarations() -> None:
    flags = every_flag()
    dests = [flag.dest for _, flag in flags]
    assert len(dests) == len(set(dests)), "a flag forwarded to two services"
    for service in (MEMSVC, SCHEDULER, ROUTER):
        assert forwarded(service), service
    assert "--max-running-requests" in {f.name for f in forwarded(MEMSVC)}
    assert "--max-running-requests" not in {f.name for f in forwarded(SCHEDULER)}
    parsers = service_parsers()
    for command in ("serve", "up"):
        ours = cli.build_parser([command]).subcommands[command]
        for service, flag in flags:
            mine, theirs = option(ours, flag.name), option(parsers[service], flag.name)
            assert mine is not None and theirs is not None, (command, flag.name)
            assert mine.choices == theirs.choices and mine.type is theirs.type, flag.name
            assert (mine.nargs == 0) == (theirs.nargs == 0) == flag.switch, flag.name
            assert mine.default is argparse.SUPPRESS, flag.name  # unset: not forwarded


@pytest.mark.parametrize("service", [MEMSVC, SCHEDULER, ROUTER])
def test_forwarded_argv_parses_back_to_the_same_config(service) -> None:
    """Every forwarded flag of ``service`` set through serve arrives with its value."""
    argv = [part for flag in forwarded(service) for part in not_default(flag)]
    args = cli.parse_args(["serve", *argv])
    sent = forward.service_argv(args, service)
    if service == MEMSVC:
        for name in ("--transfer-backend", "--transfer-timeout"):  # through the launcher
            assert name not in sent
            sent += not_default(next(f for f in forwarded(MEMSVC) if f.name == name))
    parser = service_parsers()[service]
    theirs = parser.parse_args([*REQUIRED[service], *sent])
    ours = parser.parse_args([*REQUIRED[service], *argv])
    config = from_args(CONFIGS[service], theirs)
    assert config == from_args(CONFIGS[service], ours)
    assert config != from_args(CONFIGS[service], parser.parse_args(REQUIRED[service]))
    assert sorted(sent) == sorted(argv)


def test_a_forwarded_gb_flag_keeps_its_bytes() -> None:
    args = cli.parse_args(["serve", "--enable-hierarchical-cache", "--hicache-size", "1.5"])
    sent = forward.service_argv(args, MEMSVC)
    parsed = service_parsers()[MEMSVC].parse_args([*REQUIRED[MEMSVC], *sent])
    assert from_args(CONFIGS[MEMSVC], parsed).hicache.size_bytes == 1_500_000_000


def serve_args(argv: list[str]) -> argparse.Namespace:
    return cli.parse_args(["serve", *argv])


def test_serve_forwards_what_the_user_set_and_nothing_else(checkpoint) -> None:
    from kvstack.serve import backends

    args = serve_args(["--checkpoint", str(checkpoint), *TUNED])
    model = backends._stack_model(args)
    pool = backends._pool(args, model)
    scheduler = backends._scheduler(args, model)
    pool_text, scheduler_text = " ".join(pool), " ".join(scheduler)
    for pair in ["--host-store-bytes 65536", "--retract-decode-steps 7", "--hicache-size 2"]:
        assert pair in pool_text and pair not in scheduler_text, pair
    for pair in ["--enable-hierarchical-cache", "--hicache-write-policy write_back"]:
        assert pair in pool_text, pair
    for pair in [
        "--num-reserved-decode-tokens 64",
        "--retract-mode offload",
        "--retraction-policy cost",
        "--retract-cooldown-steps 3",
        "--enable-priority-scheduling",
    ]:
        assert pair in scheduler_text and pair not in pool_text, pair
    assert forward.service_argv(args, ROUTER) == ["--stall-timeout", "9.0"]
    assert "--served-model-name" in scheduler  # the metrics' model_name label
    # unset: not forwarded, so the services keep their own defaults
    bare = serve_args(["--checkpoint", str(checkpoint)])
    for service in (MEMSVC, SCHEDULER, ROUTER):
        assert forward.service_argv(bare, service) == []
    assert forward.transfer_options(bare) == {}


def test_up_builds_a_pd_stack_with_each_flag_on_its_process(checkpoint, tmp_path) -> None:
    argv = ["--mode", "pd", "--checkpoint", str(checkpoint), "--page-size", "4", *TUNED]
    args = cli.parse_args(["up", *argv, "--transfer-backend", "zmq", "--transfer-timeout", "2"])
    specs = {s.name: s for s in build_process_list("pd", tmp_path, up_cli.options_from_args(args))}
    for node in ("p", "d"):
        memsvc = " ".join(specs[f"memsvc-{node}"].command)
        assert "--host-store-bytes 65536" in memsvc and "--hicache-size 2" in memsvc
        assert "--transfer-backend zmq" in memsvc and "--transfer-timeout 2.0" in memsvc
        scheduler = " ".join(specs[f"scheduler-{node}"].command)
        assert "--num-reserved-decode-tokens 64" in scheduler
        assert "--retract-mode offload" in scheduler
        assert f"--served-model-name {checkpoint}" in scheduler
    assert "--stall-timeout 9.0" in " ".join(specs["router"].command)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_config_file_sets_flags_and_loses_to_the_command_line(tmp_path) -> None:
    config = write(
        tmp_path / "stack.yaml",
        "retract_mode: offload\n"  # underscores
        "retract-cooldown-steps: 3\n"  # or dashes
        "enable-hierarchical-cache: true\n"
        "hicache-size: 2\n"
        "port: 31000\n"
        "stall-timeout: 4\n",
    )
    args = serve_args(["--config", str(config), "--stall-timeout", "9"])
    assert args.port == 31000
    scheduler = forward.service_argv(args, SCHEDULER)
    assert scheduler == ["--retract-mode", "offload", "--retract-cooldown-steps", "3"]
    assert forward.service_argv(args, MEMSVC) == [
        "--enable-hierarchical-cache",
        "--hicache-size",
        "2.0",
    ]
    assert forward.service_argv(args, ROUTER) == ["--stall-timeout", "9.0"]  # the flag wins
    before = serve_args(["--stall-timeout", "9", "--config", str(config)])  # in either order
    assert forward.service_argv(before, ROUTER) == ["--stall-timeout", "9.0"]
    shared = write(tmp_path / "up.yaml", config.read_text().replace("port: 31000\n", ""))
    up = cli.parse_args(["up", "--config", str(shared)])
    assert forward.service_argv(up, SCHEDULER) == scheduler
    with pytest.raises(SystemExit):  # up serves no HTTP: no --port
        cli.parse_args(["up", "--config", str(config)])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("retract-modes: offload\n", "unknown key 'retract-modes' (there is no --retract-modes"),
        ("retract-mode: sometimes\n", "key 'retract-mode': invalid choice: 'sometimes'"),
        ("retract-cooldown-steps: soon\n", "key 'retract-cooldown-steps': invalid int value"),
        ("enable-hierarchical-cache: 3\n", "key 'enable-hierarchical-cache': expected true or"),
        ("- a list\n", "must be a mapping of flag names to values"),
        (
            "num-pages: 100\nmax-total-tokens: 4096\n",
            "keys max-total-tokens and num-pages cannot both be set",
        ),
    ],
)
@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_bad_config_file_is_refused_naming_the_key(command, text, error, tmp_path, capsys):
    config = write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvstack {command} ")
    assert f"error: --config {config}: {error}" in err


def test_a_capacity_flag_on_the_command_line_replaces_the_files_other_one(tmp_path) -> None:
    """--max-total-tokens and --num-pages exclude each other; the command line's one wins."""
    config = write(tmp_path / "stack.yaml", "num-pages: 100\n")
    assert serve_args(["--config", str(config)]).num_pages == 100
    args = serve_args(["--config", str(config), "--max-total-tokens", "4096"])
    assert (args.max_total_tokens, args.num_pages) == (4096, None)
    args = serve_args(["--max-total", "4096", "--config", str(config)])  # abbreviated too
    assert (args.max_total_tokens, args.num_pages) == (4096, None)


def test_serve_waits_for_each_service_as_long_as_up_does() -> None:
    """--ready-timeout: one flag, one default and one meaning for both commands."""

    def ready_timeout(command: str) -> argparse.Action | None:
        return option(cli.build_parser([command]).subcommands[command], "--ready-timeout")

    serve, up = ready_timeout("serve"), ready_timeout("up")
    assert serve is not None, "kvstack serve has no --ready-timeout"
    assert (serve.default, serve.type, serve.help) == (up.default, up.type, up.help)
    assert serve_args(["--ready-timeout", "300"]).ready_timeout == 300


def help_sections(command: str, capsys) -> dict[str, str]:
    """``kvstack COMMAND --help``: each section's title -> its text."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    sections: dict[str, str] = {}
    title = None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


@pytest.mark.parametrize("command", ["serve", "up"])
def test_help_groups_the_flags(command, capsys) -> None:
    sections = help_sections(command, capsys)
    where = {
        "--max-total-tokens": "model and KV pool (SGLang's flag names)",
        "--served-model-name": "model and KV pool (SGLang's flag names)",
        "--host-store-bytes": "KV pool and host store (memsvc)",
        "--retract-decode-steps": "KV pool and host store (memsvc)",
        "--enable-priority-scheduling": "scheduling and retract (scheduler_svc)",
        "--retract-mode": "scheduling and retract (scheduler_svc)",
        "--retract-cooldown-steps": "scheduling and retract (scheduler_svc)",
        "--memsvc-timeout": "fault tolerance (scheduler_svc)",
        "--hicache-storage-backend": "hierarchical cache (memsvc)",
        "--transfer-backend": "PD disaggregation (--mode pd)",
        "--stall-timeout": "PD disaggregation (--mode pd)",
        "--curve-dir": "security",
        "--config": "options",
    }
    if command == "serve":
        where["--port"] = "HTTP"
    for flag, title in where.items():
        assert f"  {flag} " in sections[title] or f"  {flag}\n" in sections[title], (flag, title)
    for title in set(forward.GROUPS.values()):  # an unset flag says whose default applies
        assert "(default: None)" not in sections[title], title


@pytest.mark.parametrize("command", ["serve", "up"])
def test_an_unknown_flag_prints_the_subcommands_usage(command, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--num-reserved-decode-tokenz", "64"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvstack {command} ")
    assert f"kvstack {command}: error: unrecognized arguments: --num-reserved-decode-tokenz" in err


def test_the_issues_reproducer_parses() -> None:
    args = serve_args(["--num-reserved-decode-tokens", "64"])
    assert forward.service_argv(args, SCHEDULER) == ["--num-reserved-decode-tokens", "64"]


def cmdline(pid: int) -> str:
    return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))


def test_started_services_run_with_the_flags(launcher, checkpoint) -> None:
    from kvstack.serve.backends import start_stack
    from scheduler_svc.client import GenerateClient

    argv = ["--checkpoint", str(checkpoint), "--page-size", "4", "--num-pages", "128"]
    args = serve_args([*argv, *TUNED[:13], "--served-model-name", "smol"])
    backend = start_stack(launcher, "normal", args)
    info = GenerateClient(backend.scheduler, timeout_s=10).info()
    assert info["retract_mode"] == "offload" and info["retraction_policy"] == "cost"
    assert "--num-reserved-decode-tokens 64" in cmdline(backend.pids["scheduler_svc"])
    assert "--host-store-bytes 65536" in cmdline(backend.pids["memsvc"])
    assert "--retract-decode-steps 7" in cmdline(backend.pids["memsvc"])
    text = urllib.request.urlopen(backend.metrics["scheduler"], timeout=10).read().decode()
    (running,) = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sglang:num_running_reqs"
    ]
    assert running.labels["model_name"] == "smol" and running.labels["priority"] == ""
    assert json.dumps(info)  # the info reply (with the engine's new stats) is plain data
