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
