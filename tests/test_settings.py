"""Settings as data (:mod:`memsvc.settings`): one declaration per flag, on a config's field.

The helper on its own (groups, switches, parts, GB scales, env defaults, argv
back), ``--config FILE`` on a service, the enums that replaced the string
lists, the storage backend registry, and the victim order's exhaustiveness.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from enum import StrEnum

import pytest

from memsvc import settings
from memsvc.settings import SettingsError, add_arguments, from_args, parse_args, to_argv


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    size_bytes: int = field(
        default=0, metadata={"flag": "--size", "help": "in GB", "type": float, "scale": 1e9}
    )
    colour: Colour = field(default=Colour.RED, metadata={"help": "which"})


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str = field(metadata={"help": "required: no default"})
    count: int = field(default=3, metadata={"help": "how many", "group": "numbers"})
    ratio: float | None = field(default=None, metadata={"help": "a float", "group": "numbers"})
    fast: bool = field(default=False, metadata={"help": "a switch"})
    steps: int = field(default=20, metadata={"help": "from the env", "env": "KVSTACK_TEST_STEPS"})
    inner: Inner | None = field(
        default=None,
        metadata={"part": Inner, "switch": "--enable-inner", "help": "the part", "group": "in"},
    )
    not_a_flag: int = 5


def parser_for(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    settings.add_config_argument(parser)
    add_arguments(parser, cls)
    return parser


def test_flags_come_from_the_fields() -> None:
    parser = parser_for(Outer)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    assert actions["--name"].required and actions["--count"].type is int
    assert actions["--fast"].nargs == 0 and actions["--enable-inner"].nargs == 0
    assert actions["--colour"].choices == ("red", "blue")
    assert actions["--size"].type is float and actions["--size"].default == 0
    assert "--not-a-flag" not in actions
    titles = [g.title for g in parser._action_groups]
    assert titles.index("numbers") < titles.index("in")
    assert "how many (default: 3)" in " ".join(parser.format_help().split())


def test_config_built_from_args_and_back_to_argv() -> None:
    parser = parser_for(Outer)
    assert from_args(Outer, parser.parse_args(["--name", "n"])) == Outer(name="n")
    argv = ["--name", "n", "--count", "4", "--fast", "--enable-inner", "--size", "1.5"]
    argv += ["--colour", "blue"]
    config = from_args(Outer, parser.parse_args(argv))
    assert config.inner == Inner(size_bytes=1_500_000_000, colour=Colour.BLUE)
    assert isinstance(config.inner.colour, Colour) and config.count == 4 and config.fast
    given = {"count": 4, "fast": True, "enable_inner": True, "size": 1.5, "colour": "blue"}
    back = to_argv(Outer, given)
    assert back == ["--count", "4", "--fast", "--enable-inner", "--size", "1.5", "--colour", "blue"]
    assert from_args(Outer, parser.parse_args(["--name", "n", *back])) == config
    assert to_argv(Outer, {"fast": False, "ratio": None}) == []


def test_an_environment_variable_gives_a_default(monkeypatch) -> None:
    monkeypatch.setenv("KVSTACK_TEST_STEPS", "7")
    assert from_args(Outer, parser_for(Outer).parse_args(["--name", "n"])).steps == 7


def test_unknown_metadata_is_a_declaration_bug() -> None:
    @dataclass
    class Typo:
        x: int = field(default=1, metadata={"help": "h", "choises": (1, 2)})

    with pytest.raises(SettingsError, match=r"Typo.x: unknown flag metadata \['choises'\]"):
        settings.flags(Typo)


def test_config_file_gives_defaults_and_the_command_line_wins(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: from-file\ncount: 9\nenable_inner: true\nsize: 2\nratio: null\n")
    parser = parser_for(Outer)
    config = from_args(Outer, parse_args(parser, ["--count", "1", "--config", str(path)]))
    assert (config.name, config.count, config.ratio) == ("from-file", 1, None)
    assert config.inner == Inner(size_bytes=2_000_000_000)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("colour: green\n", "key 'colour': invalid choice: 'green' (choose from red, blue)"),
        ("count: [1, 2]\n", "key 'count': expected one int value"),
        ("--count: 2\n", "unknown key '--count'"),
        ("help: true\n", "unknown key 'help'"),
        ("name: [\n", "not valid YAML"),
    ],
)
def test_a_bad_config_file_names_the_key(text, error, tmp_path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(parser_for(Outer), ["--config", str(path)])
    assert exit_info.value.code == 2
    assert f"--config {path}: {error}" in capsys.readouterr().err


def test_a_missing_config_file_is_an_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(parser_for(Outer), ["--config", str(tmp_path / "none.yaml")])
    assert "No such file" in capsys.readouterr().err


def test_a_service_takes_its_required_flags_from_a_config_file(tmp_path) -> None:
    import memsvc.__main__ as memsvc_main
    from memsvc.config import MemsvcConfig

    path = tmp_path / "memsvc.yaml"
    path.write_text(
        "num-layers: 2\nnum_kv_heads: 2\nhead-dim: 8\npage-size: 4\n"
        "enable-hierarchical-cache: true\nhicache-write-policy: write_back\npd-role: decode\n"
    )
    args = parse_args(memsvc_main.build_parser(), ["--config", str(path), "--page-size", "8"])
    config = from_args(MemsvcConfig, args)
    assert (config.layout.num_layers, config.layout.page_size) == (2, 8)
    assert config.layout.dtype == "float32" and config.layout.num_pages == 1024  # memsvc's
    assert config.hicache.write_policy == "write_back"
    assert config.hicache.storage_role == "decode"  # from --pd-role
    out = subprocess.run(
        [sys.executable, "-m", "memsvc", "--config", str(path), "--max-lease", "soon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--max-lease: invalid float value: 'soon'" in out.stderr


def test_each_scheduler_choice_is_one_enum() -> None:
    from scheduler_svc.core import config as core

    for name, kind in core.ENUM_FIELDS.items():
        field_ = next(f for f in dataclasses.fields(core.SchedulerConfig) if f.name == name)
        assert isinstance(field_.default, kind), name
        made = core.SchedulerConfig(
            page_size=4, max_running_requests=2, **{name: kind(field_.default).value}
        )
        assert type(getattr(made, name)) is kind, name  # a plain string becomes the member
    assert core.RETRACT_MODES == ("recompute", "offload", "auto")
    assert core.RETRACTION_POLICIES == ("length", "priority", "cost")


def test_every_retraction_policy_has_its_own_victim_order() -> None:
    from scheduler_svc.core import policy
    from scheduler_svc.core.config import RetractionPolicy, SchedulerConfig

    assert set(policy._ORDERS) == set(RetractionPolicy)
    assert len(set(policy._ORDERS.values())) == len(RetractionPolicy)
    config = SchedulerConfig(page_size=4, max_running_requests=2)
    object.__setattr__(config, "retraction_policy", "forgotten")  # not a policy at all
    with pytest.raises(KeyError):  # fails loudly, not "behaves as priority"
        policy.retraction_order([], config)


def test_a_policy_without_an_order_fails_at_import(monkeypatch) -> None:
    import importlib

    from scheduler_svc.core import config as core
    from scheduler_svc.core import policy

    class MorePolicies(StrEnum):
        LENGTH = "length"
        PRIORITY = "priority"
        COST = "cost"
        NEWEST = "newest"

    monkeypatch.setattr(core, "RetractionPolicy", MorePolicies)
    with pytest.raises(TypeError, match="no victim order for"):
        importlib.reload(policy)
    monkeypatch.undo()
    importlib.reload(policy)


def test_storage_backends_are_one_registry() -> None:
    import memsvc.__main__ as memsvc_main
    from memsvc.core.hicache_config import HiCacheConfig
    from memsvc.core.storage import STORAGE_BACKENDS, StorageBackendName

    assert set(STORAGE_BACKENDS) == set(StorageBackendName)
    action = memsvc_main.build_parser()._option_string_actions["--hicache-storage-backend"]
    assert action.choices == tuple(b.value for b in StorageBackendName)
    config = HiCacheConfig(storage_backend="file")
    assert config.storage_backend is StorageBackendName.FILE
    with pytest.raises(ValueError, match="unknown storage backend 'tape'"):
        HiCacheConfig(storage_backend="tape")


def test_a_storage_tier_is_made_from_the_hicache_config(tmp_path) -> None:
    from memsvc.core.hicache_config import HiCacheConfig
    from memsvc.core.storage import FileStorage, create_storage

    config = HiCacheConfig(storage_backend="file", storage_dir=str(tmp_path), storage_role="decode")
    storage = create_storage(config, page_bytes=64)
    try:
        assert isinstance(storage, FileStorage)
        (sub,) = tmp_path.iterdir()
        assert sub.name.startswith("decode-")
    finally:
        storage.close()


def test_transfer_backend_is_one_enum() -> None:
    from memsvc.transfer import TRANSFER_BACKENDS
    from memsvc.transfer_backend import TransferBackend

    assert TRANSFER_BACKENDS == ("nixl", "zmq")
    assert TransferBackend.ZMQ.resolve() is TransferBackend.ZMQ
    assert TransferBackend.AUTO.resolve() in (TransferBackend.NIXL, TransferBackend.ZMQ)


def test_an_abbreviated_config_flag_is_read_too(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("count: 9\n")
    for config in (["--conf", str(path)], [f"--config={path}"]):
        args = parse_args(parser_for(Outer), ["--name", "n", *config, "--fast"])
        assert from_args(Outer, args).count == 9
