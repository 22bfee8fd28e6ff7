"""Which endpoints a stream hub may listen on, and how it binds them safely.

Activations are as sensitive as the prompts they came from, so a hub listens on loopback or a Unix socket unless
CURVE encryption and a client allowlist are configured:

* ``ipc://<path>``: the socket's directory must be ours and writable by nobody else (it is created ``0700`` when
  missing) and the socket file is made ``0600``, so only our user can connect. Linux abstract sockets
  (``ipc://@name``) have no permissions at all and are refused without CURVE.
* ``tcp://<host>:<port>``, loopback included: needs CURVE. Every local user can connect to a loopback port, so an
  unauthenticated loopback socket would hand activations and commands to any of them; ``ipc://`` is the
  same-user channel.

Port ``0`` (or ``*``) binds a free port; :attr:`Binding.endpoint` says which.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass
import zmq
import zmq.auth.thread
import zmq.utils.z85
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(?P<port>\d{1,5}|\*)")
Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key, Z85-encoded


class CurveKeys(BaseModel):
    """The server's CURVE key pair and the public keys of the clients it lets in (all Z85, 40 characters).

    ``client_names`` binds names to keys: a client key listed there may use only those monitor / subscriber names,
    and a name listed under some key only with that key. Keys not listed may use any name not bound to another.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    server_secret: str
    server_public: str
    client_public_keys: tuple[str, ...]
    client_names: dict[str, tuple[str, ...]] = {}

    def name_allowed(self, client_key: str, name: str) -> bool:
        """Whether the client authenticated with ``client_key`` (Z85) may use ``name``."""
        own = self.client_names.get(client_key)
        if own is not None:
            return name in own
        return not any(name in names for names in self.client_names.values())

    @field_validator("server_secret", "server_public")
    @classmethod
    def _key(cls, value: str) -> str:
        return _check_z85(value)

    @field_validator("client_public_keys")
    @classmethod
    def _keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one client public key is needed (CURVE without an allowlist lets anyone in)")
        return tuple(_check_z85(k) for k in value)

    @model_validator(mode="after")
    def _named_keys(self) -> "CurveKeys":
        for key in self.client_names:
            if key not in self.client_public_keys:
                raise ValueError(f"client_names[{key!r}]: not one of client_public_keys")
        return self


def _check_z85(key: str) -> str:
    if len(key) != Z85_KEY_CHARS:
        raise ValueError(f"a Z85 CURVE key has {Z85_KEY_CHARS} characters, got {len(key)}")
    try:
        zmq.utils.z85.decode(key)
    except Exception as exc:  # z85 raises several types for bad characters
        raise ValueError(f"not a Z85 key: {exc}") from None
    return key


def check_endpoint(endpoint: str, curve: bool, field: str = "endpoint") -> None:
    """Refuse ``endpoint`` unless it is a Unix socket, or ``curve`` is on (then any TCP host).

    Raises:
        ValueError: ``"<field>: ..."`` saying why.
    """
    if not isinstance(endpoint, str):
        raise ValueError(f"{field}: expected a string, got {type(endpoint).__name__}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            raise ValueError(f"{field}: {endpoint!r} names no socket path")
        if path.startswith("@") and not curve:
            raise ValueError(f"{field}: {endpoint!r} is an abstract socket, which any local user can connect to; "
                             f"use a path, or CURVE keys")
        return
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise ValueError(f"{field}: {endpoint!r} is not ipc://<path> or tcp://<host>:<port>")
    port = match["port"]
    if port != "*" and int(port) > 65535:
        raise ValueError(f"{field}: port {port} is out of range")
    if not curve:
        where = "on loopback, which every local user can reach" if match["host"] in LOOPBACK_HOSTS else \
            "beyond loopback"
        raise ValueError(f"{field}: {endpoint!r} listens {where}: activations and commands would be open to whoever "
                         f"connects. Use ipc://<path> (this user only; MonitorConfig.private() makes one), or "
                         f"configure CURVE keys (MonitorConfig.curve) with an allowlist of client keys")


@dataclass(frozen=True)
class Binding:
    """What :func:`bind` set up: the actual endpoint, the authenticator thread to stop with the socket, and (ipc) the
    socket file it made."""

    endpoint: str
    authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
    socket_file: tuple[str, int] | None = None  # (path, inode) of the ipc socket file bind made

    def close(self) -> None:
        """Stop the CURVE authenticator (if any) and remove the ipc socket file; call after closing the socket.

        libzmq leaves the file behind, and a client connecting to it then waits out its timeout instead of failing
        at once (a metrics scrape of an engine that is gone). The file is removed only while it is still the one
        bind made: a later server may have bound the same path since."""
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.socket_file is not None:
            path, inode = self.socket_file
            try:
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
            except OSError:
                pass

    stop = close  # the name ThreadAuthenticator uses, for callers that keep the binding as "the authenticator"


class _Allowlist:
    """ZAP credentials provider: lets in exactly the configured client public keys."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = frozenset(k.encode() for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


def bind(sock: zmq.Socket, endpoint: str, curve: CurveKeys | None) -> Binding:
    """Bind ``sock`` to ``endpoint`` after :func:`check_endpoint`, with CURVE when ``curve`` is given.

    ``ipc``: the parent directory is created ``0700`` if missing, refused if someone else owns it or others may
    write to it, and the socket file is made ``0600``. ``tcp`` port ``0``/``*``: a free port is chosen.
    With ``curve``, a ZAP authenticator thread on the socket's context admits only ``curve.client_public_keys``;
    it lives on the returned :class:`Binding` (stop it with ``Binding.close()`` after closing the socket).
    """
    check_endpoint(endpoint, curve is not None)
    authenticator = None
    socket_file = None
    if curve is not None:
        # The authenticator must run before the bind, or the first handshakes would go unchecked.
        authenticator = zmq.auth.thread.ThreadAuthenticator(sock.context)
        authenticator.start()
        authenticator.configure_curve_callback("*", _Allowlist(curve.client_public_keys))
        sock.curve_secretkey = curve.server_secret.encode()
        sock.curve_publickey = curve.server_public.encode()
        sock.curve_server = True
    try:
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            if not path.startswith("@"):
                _prepare_ipc_dir(os.path.dirname(os.path.abspath(path)))
            sock.bind(endpoint)
            if not path.startswith("@"):
                os.chmod(path, 0o600)
                socket_file = (path, os.stat(path).st_ino)
        else:
            if "[" in endpoint:
                sock.ipv6 = True
            sock.bind(re.sub(r":0$", ":*", endpoint))
        actual = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException:
        if authenticator is not None:
            authenticator.stop()
        raise
    return Binding(actual, authenticator, socket_file)


def _prepare_ipc_dir(directory: str) -> None:
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # makedirs' mode is filtered by the umask
    st = os.stat(directory)
    # Whoever may write to the directory can swap our socket for theirs, or connect in the moment between bind()
    # and chmod(): so the directory must be ours and closed to group and others.
    if st.st_uid != os.geteuid():
        raise ValueError(f"endpoint: socket directory {directory} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"endpoint: socket directory {directory} is writable by group or others "
                         f"(mode {stat.S_IMODE(st.st_mode):o}); use a private directory (0700)")


def connect_curve(sock: zmq.Socket, server_public: str, client_secret: str, client_public: str) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_public`` (Z85); call before connect."""
    sock.curve_serverkey = _check_z85(server_public).encode()
    sock.curve_secretkey = _check_z85(client_secret).encode()
    sock.curve_publickey = _check_z85(client_public).encode()


def default_endpoint(name: str) -> str:
    """A fresh private Unix socket: ``ipc://<new 0700 temp dir>/<name>``."""
    directory = tempfile.mkdtemp(prefix="dynsteer-")  # mkdtemp creates it 0700
    return f"ipc://{os.path.join(directory, name)}"


def connect_options(sock: zmq.Socket, endpoint: str) -> None:
    """Socket options a client needs before connecting to ``endpoint`` (IPv6 for bracketed hosts)."""
    if endpoint.startswith("tcp://["):
        sock.ipv6 = True


__all__ = ["Binding", "CurveKeys", "bind", "check_endpoint", "connect_curve", "connect_options",
                      "default_endpoint"]
