"""memsvc.curve: a stack's key folder, the four CURVE flags every service takes, bad keys."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys

import pytest
import zmq.auth

from memsvc.core.errors import InvalidArgumentError
from memsvc.curve import CurveServerKeys, KeyFolder, add_curve_arguments, curve_from_args
from tests.procs import REPO, SMALL_POOL

SERVICES = ("memsvc", "model_svc", "scheduler_svc", "scheduler_svc.pd.router")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_curve_arguments(parser, connects_to="the servers")
    return parser.parse_args(argv)


def test_a_key_folder_is_created_private_once_and_then_reused(tmp_path) -> None:
    folder = KeyFolder.ensure(tmp_path / "keys")
    assert mode(folder.path) == 0o700 and mode(folder.clients) == 0o700
    assert mode(folder.server_secret) == 0o600 and mode(folder.client_secret) == 0o600
    assert sorted(p.name for p in folder.path.iterdir()) == [
        "client.key",
        "client.key_secret",
        "clients",
        "server.key",
        "server.key_secret",
    ]
    assert [p.name for p in folder.clients.iterdir()] == ["client.key"]
    again = KeyFolder.ensure(folder.path)
    assert again.client_keys() == folder.client_keys()  # the same keys, not new ones
    client, server = folder.client_keys(), folder.server_keys()
    assert client.server_public_key == server.public_key
    assert "secret" not in repr(client) + repr(server)  # secrets stay out of logs


def test_an_incomplete_key_folder_is_refused(tmp_path) -> None:
    folder = KeyFolder.ensure(tmp_path / "keys")
    folder.client_secret.unlink()
    with pytest.raises(InvalidArgumentError, match=r"lacks client\.key_secret"):
        KeyFolder.ensure(folder.path)
    with pytest.raises(InvalidArgumentError, match="lacks"):
        KeyFolder.existing(tmp_path / "nothing-here")


def test_the_flags_go_in_pairs_and_bad_files_are_named(tmp_path) -> None:
    folder = KeyFolder.ensure(tmp_path / "keys")
    assert curve_from_args(parse()).server is None
    keys = curve_from_args(parse(*folder.service_args()))
    assert keys.server == folder.server_keys() and keys.client == folder.client_keys()
    with pytest.raises(InvalidArgumentError, match="--curve-secret-key and --curve-clients"):
        curve_from_args(parse("--curve-secret-key", str(folder.server_secret)))
    with pytest.raises(InvalidArgumentError, match="--curve-client-key and --curve-server-key"):
        curve_from_args(parse("--curve-server-key", str(folder.server_public)))
    with pytest.raises(InvalidArgumentError, match="holds no secret key"):
        CurveServerKeys.from_files(folder.server_public, folder.clients)
    with pytest.raises(InvalidArgumentError, match="is no folder"):
        CurveServerKeys.from_files(folder.server_secret, folder.server_public)
    (tmp_path / "junk.key").write_text("not a certificate\n")
    with pytest.raises(InvalidArgumentError, match="cannot read the CURVE certificate"):
        CurveServerKeys.from_files(tmp_path / "junk.key", folder.clients)
    _, other = zmq.auth.create_certificates(tmp_path, "other")
    assert curve_from_args(parse("--curve-secret-key", other, "--curve-clients", str(tmp_path)))


def test_every_service_takes_the_four_flags() -> None:
    for module in SERVICES:
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        ).stdout
        for flag in ("--curve-secret-key", "--curve-clients", "--curve-client-key"):
            assert flag in out, (module, flag)
        assert "--curve-server-key" in out, module


def test_memsvc_with_half_a_client_pair_says_so(tmp_path) -> None:
    folder = KeyFolder.ensure(tmp_path / "keys")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "memsvc",
            *SMALL_POOL,
            "--curve-client-key",
            str(folder.client_secret),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--curve-client-key and --curve-server-key go together" in done.stderr


# -- a key folder someone else could have written (issue 26, item 10) ------------------------

OTHER_UID = 65534  # nobody: "another user" for a test that runs as root or as anyone


def plant_key(folder: KeyFolder, name: str = "evil.key") -> str:
    """Another user's client key in the accepted folder."""
    planted = folder.path / "planted"
    planted.mkdir()
    public, _ = zmq.auth.create_certificates(planted, "evil")
    os.replace(public, folder.clients / name)
    return name


def as_other_user(path) -> None:
    os.chown(path, OTHER_UID, OTHER_UID)


def chmod(mode: int, path):
    os.chmod(path, mode)
    return path


def chown(path):
    as_other_user(path)
    return path


# What another user did to a folder -> the path the refusal must name.
TAMPERED = {
    "folder world-writable": lambda f: chmod(0o777, f.path),
    "clients world-writable": lambda f: chmod(0o777, f.clients),
    "clients group-writable": lambda f: chmod(0o770, f.clients),
    "folder of another uid": lambda f: chown(f.path),
    "planted client key": lambda f: chown(f.clients / plant_key(f)),
    "server secret of another uid": lambda f: chown(f.server_secret),
    "server public group-writable": lambda f: chmod(0o664, f.server_public),
    "client secret world-writable": lambda f: chmod(0o606, f.client_secret),
    "accepted key world-writable": lambda f: chmod(0o666, f.clients / "client.key"),
}


@pytest.mark.parametrize("tamper", TAMPERED)
def test_a_key_folder_others_could_write_is_refused_naming_the_file(tmp_path, tamper) -> None:
    folder = KeyFolder.ensure(tmp_path / "keys")
    path = TAMPERED[tamper](folder)
    for load in (KeyFolder.ensure, KeyFolder.existing):
        with pytest.raises(InvalidArgumentError, match="refusing to trust") as err:
            load(folder.path)
        assert f"{path} is " in str(err.value)


def test_a_prepared_world_writable_folder_gets_no_keys(tmp_path) -> None:
    """The reproducer: ``mkdir -m777 K K/clients``, another uid adds ``evil.key``."""
    keys = tmp_path / "K"
    keys.mkdir()
    (keys / "clients").mkdir()
    os.chmod(keys, 0o777)
    os.chmod(keys / "clients", 0o777)
    evil, _ = zmq.auth.create_certificates(tmp_path, "evil")
    os.replace(evil, keys / "clients" / "evil.key")
    as_other_user(keys / "clients" / "evil.key")
    with pytest.raises(InvalidArgumentError, match=r"/K is group- or world-writable"):
        KeyFolder.ensure(keys)
    assert not (keys / "server.key_secret").exists()  # nothing was written into it


def kvstack_cli(*args: str) -> subprocess.CompletedProcess:
    """``kvstack ARGS`` expected to give up at once; a stack it starts anyway is stopped."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstack.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.terminate()  # it started a stack with the planted keys: stop it, then fail
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("command", ["serve", "up"])
def test_the_clis_refuse_a_planted_key_with_exit_2(tmp_path, command) -> None:
    folder = KeyFolder.ensure(tmp_path / "keys")
    as_other_user(folder.clients / plant_key(folder))
    extra = ["--port", "0"] if command == "serve" else ["--run-dir", str(tmp_path / "run")]
    done = kvstack_cli(command, "--curve-dir", str(folder.path), *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{folder.clients / 'evil.key'} is owned by uid {OTHER_UID}" in done.stderr


def test_keys_created_under_a_loose_umask_are_trusted(tmp_path) -> None:
    old = os.umask(0o002)
    try:
        folder = KeyFolder.ensure(tmp_path / "keys")
    finally:
        os.umask(old)
    assert mode(folder.server_public) == 0o644 and mode(folder.clients / "client.key") == 0o644
    KeyFolder.existing(folder.path)
