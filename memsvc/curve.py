"""CURVE for every kvstack socket: key files, their flags, socket setup, a stack's key folder.

Every kvstack service (memsvc, model_svc, scheduler_svc, the PD router) takes
the same four flags (:func:`add_curve_arguments`)::

    --curve-secret-key FILE   certificate (public + secret key) of the sockets it binds
    --curve-clients DIR       public certificates (*.key) of the clients those accept
    --curve-client-key FILE   certificate (public + secret key) its own connections present
    --curve-server-key FILE   public certificate of the servers it connects to

Certificates are the files ``zmq.auth.create_certificates`` writes. A server
socket with CURVE completes the handshake only with a client that knows the
server's public key, and then asks the context's ZAP handler
(:func:`start_authenticator`) whether the client's public key is in DIR. A
peer without keys, or with a key not in DIR, is dropped during the handshake:
none of its messages reach the service and nothing comes back. The ZAP
handler reports an accepted client's public key (z85) as the ``User-Id`` of
each message it sends (:func:`peer_key`), which the PD transfer listener binds
its rooms to.

:class:`KeyFolder` is one stack's keys in one folder, the layout
``kvstack up`` / ``kvstack serve --curve-dir`` create and wire::

    DIR/server.key          the servers' public certificate (every client pins it)
    DIR/server.key_secret   the certificate every listening socket serves with
    DIR/client.key          the clients' public certificate
    DIR/client.key_secret   the certificate every connecting socket presents
    DIR/clients/client.key  the accepted client keys (--curve-clients; add more here)

A key folder is trusted only if no other user could have written it: the
folder, ``clients/``, the four key files and every file in ``clients/`` must
be owned by the running user and writable by neither group nor others
(:func:`check_private`); otherwise another user could plant a client key, or
a server key pair of their own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from memsvc.core.errors import InvalidArgumentError

ZAP_DOMAIN = "*"  # every socket of a context shares its ZAP handler and its client keys


def _load(path: str | os.PathLike, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read the CURVE certificate {path}: {exc}") from None
    if secret and secret_key is None:
        raise InvalidArgumentError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret_key


@dataclass(frozen=True)
class CurveServerKeys:
    """A listening socket's CURVE: its key pair and the folder of client certificates it accepts."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    authorized_clients_dir: str

    @classmethod
    def from_files(
        cls, secret_key_file: str | os.PathLike, authorized_clients_dir: str | os.PathLike
    ) -> CurveServerKeys:
        public, secret = _load(secret_key_file, secret=True)
        if not os.path.isdir(authorized_clients_dir):
            raise InvalidArgumentError(f"--curve-clients {authorized_clients_dir} is no folder")
        return cls(public, secret, str(authorized_clients_dir))


@dataclass(frozen=True)
class CurveClientKeys:
    """A connecting socket's CURVE: the server's public key, and its own key pair."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)

    @classmethod
    def from_files(
        cls, server_cert: str | os.PathLike, client_cert: str | os.PathLike
    ) -> CurveClientKeys:
        """The server's public certificate and this client's secret certificate."""
        server_public, _ = _load(server_cert, secret=False)
        public, secret = _load(client_cert, secret=True)
        return cls(server_public, public, secret)


@dataclass(frozen=True)
class CurveKeys:
    """One process's CURVE: ``server`` for the sockets it binds, ``client`` for those it connects.

    Either may be None (that side in plain text).
    """

    server: CurveServerKeys | None = None
    client: CurveClientKeys | None = None


# -- flags -----------------------------------------------------------------------------------


def add_curve_arguments(parser: argparse.ArgumentParser, *, connects_to: str) -> None:
    """The four CURVE flags; ``connects_to`` names the servers ``--curve-server-key`` is for."""
    group = parser.add_argument_group(
        "CURVE (encryption and client keys on every ZMQ socket; docs/security.md)"
    )
    group.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="certificate with the secret key (zmq.auth format) the sockets this process "
        "binds serve with; turns CURVE on for them (with --curve-clients)",
    )
    group.add_argument(
        "--curve-clients",
        default=None,
        metavar="DIR",
        help="folder of the public certificates (*.key) of the clients accepted (with "
        "--curve-secret-key); any other peer is dropped during the handshake",
    )
    group.add_argument(
        "--curve-client-key",
        default=None,
        metavar="FILE",
        help="certificate with the secret key this process presents when it connects to "
        f"{connects_to} (with --curve-server-key)",
    )
    group.add_argument(
        "--curve-server-key",
        default=None,
        metavar="FILE",
        help=f"public certificate of {connects_to} (with --curve-client-key)",
    )


def curve_from_args(args: argparse.Namespace) -> CurveKeys:
    """The keys the four flags name, read now (a bad file is an InvalidArgumentError)."""
    pairs = (
        ("--curve-secret-key", args.curve_secret_key, "--curve-clients", args.curve_clients),
        ("--curve-client-key", args.curve_client_key, "--curve-server-key", args.curve_server_key),
    )
    for first, a, second, b in pairs:
        if bool(a) != bool(b):
            raise InvalidArgumentError(f"{first} and {second} go together")
    server = (
        CurveServerKeys.from_files(args.curve_secret_key, args.curve_clients)
        if args.curve_secret_key
        else None
    )
    client = (
        CurveClientKeys.from_files(args.curve_server_key, args.curve_client_key)
        if args.curve_client_key
        else None
    )
    return CurveKeys(server, client)


# -- sockets ---------------------------------------------------------------------------------


def start_authenticator(ctx: zmq.Context, keys: CurveServerKeys) -> ThreadAuthenticator:
    """Start the ZAP handler of ``ctx`` (sync or asyncio) accepting ``keys``' client folder.

    One per context, started before its CURVE server sockets bind; ``stop()``
    it before the context is terminated.
    """
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=keys.authorized_clients_dir)
    return auth


def make_server(sock: zmq.Socket, keys: CurveServerKeys) -> None:
    """Make ``sock`` (not yet bound) a CURVE server (its context needs a ZAP handler)."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True


def secure_server(
    ctx: zmq.Context, sock: zmq.Socket, keys: CurveServerKeys | None
) -> ThreadAuthenticator | None:
    """:func:`make_server` and :func:`start_authenticator` for ``sock``; None: plain, no handler.

    The caller stops the handler it gets after closing the context's sockets.
    """
    if keys is None:
        return None
    auth = start_authenticator(ctx, keys)
    make_server(sock, keys)
    return auth


def make_client(sock: zmq.Socket, keys: CurveClientKeys | None) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of ``keys``' server; None: plain."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public_key
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key


def peer_key(frame: zmq.Frame) -> str | None:
    """The z85 public key of the CURVE client that sent ``frame`` (None: not CURVE)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


# -- one stack's keys ------------------------------------------------------------------------


def check_private(path: Path) -> None:
    """Refuse ``path`` (a key file or folder) if another user could have written it."""
    info = path.stat()  # follows a link: what counts is the file the keys are read from
    uid = os.geteuid()
    if info.st_uid != uid:
        why = f"is owned by uid {info.st_uid}, not by this user (uid {uid})"
    elif info.st_mode & 0o022:
        why = f"is group- or world-writable (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return
    raise InvalidArgumentError(
        f"CURVE key folder: {path} {why}; refusing to trust keys another user could have "
        "written (the folder, clients/ and every key file must be yours, chmod go-w)"
    )


@dataclass(frozen=True)
class KeyFolder:
    """One stack's CURVE keys in one folder (the layout in the module docstring)."""

    path: Path

    @property
    def server_public(self) -> Path:
        return self.path / "server.key"

    @property
    def server_secret(self) -> Path:
        return self.path / "server.key_secret"

    @property
    def client_public(self) -> Path:
        return self.path / "client.key"

    @property
    def client_secret(self) -> Path:
        return self.path / "client.key_secret"

    @property
    def clients(self) -> Path:
        return self.path / "clients"

    def _files(self) -> tuple[Path, ...]:
        return (self.server_public, self.server_secret, self.client_public, self.client_secret)

    @classmethod
    def ensure(cls, path: str | os.PathLike) -> KeyFolder:
        """The keys in ``path``, created there first if it holds none."""
        folder = cls(Path(path).resolve())
        if folder.path.exists():
            check_private(folder.path)  # before writing keys into it
        if not any(f.exists() for f in folder._files()):
            folder._create()
        return folder.check()

    @classmethod
    def existing(cls, path: str | os.PathLike) -> KeyFolder:
        """The keys already in ``path`` (an InvalidArgumentError if any is missing)."""
        return cls(Path(path).resolve()).check()

    def check(self) -> KeyFolder:
        """Every file there, readable and only ours (an InvalidArgumentError says what is not)."""
        missing = [f.name for f in (*self._files(), self.clients) if not f.exists()]
        if missing:
            raise InvalidArgumentError(
                f"CURVE key folder {self.path} lacks {', '.join(missing)} (remove the folder's "
                "key files to have new ones created, or complete it)"
            )
        accepted = sorted(self.clients.iterdir()) if self.clients.is_dir() else []
        for path in (self.path, self.clients, *self._files(), *accepted):
            check_private(path)
        self.server_keys()
        self.client_keys()
        return self

    def _create(self) -> None:
        """New server and client key pairs; secrets 0600 in 0700 folders from the start."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Written into a fresh private folder (mkdtemp: 0700), then moved in: a secret
        # file is never readable by others, even for a moment, whatever the umask.
        staging = Path(tempfile.mkdtemp(prefix=".new-keys-", dir=self.path))
        try:
            for name in ("server", "client"):
                public, secret = zmq.auth.create_certificates(staging, name)
                os.chmod(public, 0o644)  # not group-writable under umask 002 (check_private)
                os.chmod(secret, 0o600)
            self.clients.mkdir(mode=0o700, exist_ok=True)
            shutil.copy(staging / "client.key", self.clients / "client.key")
            for file in self._files():
                os.replace(staging / file.name, file)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def server_keys(self) -> CurveServerKeys:
        return CurveServerKeys.from_files(self.server_secret, self.clients)

    def client_keys(self) -> CurveClientKeys:
        return CurveClientKeys.from_files(self.server_public, self.client_secret)

    def service_args(self) -> list[str]:
        """The four flags every service of the stack gets (each uses the ones it needs)."""
        return [
            "--curve-secret-key",
            str(self.server_secret),
            "--curve-clients",
            str(self.clients),
            "--curve-client-key",
            str(self.client_secret),
            "--curve-server-key",
            str(self.server_public),
        ]
