"""``kvstack serve`` / ``kvstack up`` take the services' tuning flags and forward them.

Every forwarded flag must exist, with the same choices, on the service it
goes to; a flag the user did not set is not forwarded (the service keeps its
default); ``--help`` groups them; an unknown flag is refused in the
subcommand's own usage. One process test starts a tiny-model stack with
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
from kvstack.stack import service_flags
from kvstack.stack.service_flags import ALL_FLAGS, MEMSVC, ROUTER, SCHEDULER
from kvstack.stack.spec import build_process_list
from kvstack.up import cli as up_cli

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


@pytest.mark.parametrize("flag", ALL_FLAGS, ids=lambda f: f.name)
def test_every_forwarded_flag_exists_on_its_service_with_the_same_choices(flag) -> None:
    action = option(service_parsers()[flag.service], flag.name)
    assert action is not None, f"{flag.service} has no {flag.name}"
    if flag.choices is not None:
        assert set(flag.choices) == set(action.choices), flag.name
    assert flag.switch == (action.nargs == 0), flag.name


def test_transfer_flags_match_memsvcs() -> None:
    memsvc = service_parsers()[MEMSVC]
    parser = argparse.ArgumentParser()
    service_flags.add_service_flags(parser)
    for name in ("--transfer-backend", "--transfer-timeout"):
        ours, theirs = option(parser, name), option(memsvc, name)
        assert theirs is not None and ours.choices == theirs.choices, name


def serve_args(argv: list[str]) -> argparse.Namespace:
    return cli.parse_args(["serve", *argv])


def test_serve_forwards_what_the_user_set_and_nothing_else(checkpoint) -> None:
    from kvstack.serve import cli as serve_cli

    args = serve_args(["--checkpoint", str(checkpoint), *TUNED])
    model = serve_cli._stack_model(args)
    pool = serve_cli._pool(args, model)
    scheduler = serve_cli._scheduler(args, model)
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
    assert service_flags.service_argv(args, ROUTER) == ["--stall-timeout", "9.0"]
    assert "--served-model-name" in scheduler  # the metrics' model_name label
    # unset: not forwarded, so the services keep their own defaults
    bare = serve_args(["--checkpoint", str(checkpoint)])
    for service in (MEMSVC, SCHEDULER, ROUTER):
        assert service_flags.service_argv(bare, service) == []
    assert service_flags.transfer_options(bare) == {}


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
        "--enable-priority-scheduling": "scheduling (scheduler_svc)",
        "--retract-mode": "retract (scheduler_svc; --retract-decode-steps: memsvc)",
        "--retract-cooldown-steps": "retract (scheduler_svc; --retract-decode-steps: memsvc)",
        "--hicache-storage-backend": "hierarchical cache (memsvc)",
        "--num-reserved-decode-tokens": "PD disaggregation (--mode pd)",
        "--transfer-backend": "PD disaggregation (--mode pd)",
        "--curve-dir": "security",
    }
    if command == "serve":
        where["--port"] = "HTTP"
    for flag, title in where.items():
        assert f"  {flag} " in sections[title] or f"  {flag}\n" in sections[title], (flag, title)
    titles = [title for title, _ in service_flags.FLAG_GROUPS] + [service_flags.PD_GROUP]
    for title in titles:  # an unset flag says whose default applies
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
    assert service_flags.service_argv(args, SCHEDULER) == ["--num-reserved-decode-tokens", "64"]


def cmdline(pid: int) -> str:
    return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))


def test_started_services_run_with_the_flags(launcher, checkpoint) -> None:
    from kvstack.serve import cli as serve_cli
    from scheduler_svc.client import GenerateClient

    argv = ["--checkpoint", str(checkpoint), "--page-size", "4", "--num-pages", "128"]
    args = serve_args([*argv, *TUNED[:13], "--served-model-name", "smol"])
    backend = serve_cli.start_stack(launcher, "normal", args)
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
