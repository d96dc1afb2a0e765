"""CURVE on the client socket: the key files, and the ZAP handler that admits listed clients.

- ``load_server_keys``: the daemon's keypair from a secret certificate (``NAME.key_secret`` as
  ``zmq.auth.create_certificates`` writes it); refused unless the file is a regular file of
  ours (or root's) that no other user may read.
- ``load_client_keys``: the public keys of every ``*.key`` certificate in a directory that only
  we (or root) may change.
- ``start_client_auth``: the ZAP handler, a thread on the context of the client ROUTER.

NOTE: libzmq 4.3 runs ZAP for a CURVE server socket whenever a handler is bound on its
context (``inproc://zeromq.zap.01``), with no ``zap_domain`` needed; with no handler bound it
admits every client keypair. So the handler must be running before the socket is bound, and
may stop only after the socket is closed.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("outrider.curve")

SECRET_KEY_FLAG = "--curve-secret-key-file"
CLIENT_KEYS_FLAG = "--curve-client-keys"


class CurveKeyError(ValueError):
    """A key file or directory that must not be used; the message names the flag and path."""


def load_server_keys(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret), Z85-encoded, from a secret certificate private to this user."""
    where = f"{SECRET_KEY_FLAG} {path}"
    st = _stat(where, path)
    if not stat.S_ISREG(st.st_mode):
        raise CurveKeyError(f"{where}: not a regular file")
    _check_owner(where, st)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise CurveKeyError(
            f"{where}: mode {mode:04o} lets other users at the secret key; chmod 600 it"
        )
    public, secret = _read_certificate(where, path)
    if secret is None:
        raise CurveKeyError(f"{where}: no secret-key in it (a public certificate?)")
    if not (_is_key(public) and _is_key(secret)) or zmq.curve_public(secret) != public:
        raise CurveKeyError(f"{where}: not a valid CURVE keypair")
    return public, secret


def load_client_keys(directory: str | os.PathLike[str]) -> tuple[bytes, ...]:
    """The Z85 public keys of every ``*.key`` certificate in ``directory``. The directory and
    its certificates must be ours (or root's) and writable by no one else; every certificate
    must parse and hold a public key only; at least one is needed."""
    where = f"{CLIENT_KEYS_FLAG} {directory}"
    st = _stat(where, directory)
    if not stat.S_ISDIR(st.st_mode):
        raise CurveKeyError(f"{where}: not a directory")
    _check_owner(where, st)
    _check_not_writable_by_others(where, st)
    keys: dict[bytes, None] = {}
    for file in sorted(Path(directory).glob("*.key")):
        file_where = f"{CLIENT_KEYS_FLAG} {file}"
        file_st = _stat(file_where, file)
        if not stat.S_ISREG(file_st.st_mode):
            raise CurveKeyError(f"{file_where}: not a regular file")
        _check_owner(file_where, file_st)
        _check_not_writable_by_others(file_where, file_st)
        public, secret = _read_certificate(file_where, file)
        if secret is not None:
            raise CurveKeyError(
                f"{file_where}: holds a secret key; only public certificates belong here"
            )
        if not _is_key(public):
            raise CurveKeyError(f"{file_where}: public-key is not a Z85-encoded CURVE key")
        keys[public] = None
    if not keys:
        raise CurveKeyError(
            f"{where}: no *.key public certificates (zmq.auth.create_certificates writes them)"
        )
    return tuple(keys)


def start_client_auth(
    ctx: zmq.Context[Any], allowed_keys: Collection[bytes]
) -> ThreadAuthenticator:
    """Start answering ZAP requests for the sockets of ``ctx`` (a ``zmq.asyncio.Context``
    works too), in a thread of its own so that a busy event loop never stalls a handshake: a
    CURVE client gets in only if its Z85 public key is in ``allowed_keys``.

    Call before binding the CURVE server socket; call ``.stop()`` on the result after closing
    that socket and before terminating ``ctx`` (the handler's sockets would keep the
    termination waiting).
    """
    sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
    auth = ThreadAuthenticator(sync_ctx, log=logging.getLogger("outrider.curve.zap"))
    auth.configure_curve_callback("*", _AllowList(allowed_keys))
    auth.start()
    return auth


class _AllowList:
    """pyzmq's credentials provider: ``callback(domain, key)`` with a Z85 public key."""

    def __init__(self, keys: Collection[bytes]) -> None:
        self._keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        log.warning("refused a CURVE client: public key %s is not listed", key.decode())
        return False


def _stat(where: str, path: str | os.PathLike[str]) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise CurveKeyError(f"{where}: no such file or directory") from None
    except OSError as exc:
        raise CurveKeyError(f"{where}: {exc.strerror}") from None


def _check_owner(where: str, st: os.stat_result) -> None:
    if st.st_uid not in (os.geteuid(), 0):
        raise CurveKeyError(f"{where}: owned by uid {st.st_uid}, not by this user or root")


def _check_not_writable_by_others(where: str, st: os.stat_result) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise CurveKeyError(
            f"{where}: mode {mode:04o} lets other users change the allowed keys; chmod go-w it"
        )


def _read_certificate(where: str, path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except OSError as exc:
        raise CurveKeyError(f"{where}: {exc.strerror or exc}") from None
    except ValueError:
        raise CurveKeyError(f"{where}: no public-key in it (not a zmq.auth certificate)") from None


def _is_key(z85_key: bytes) -> bool:
    """Whether ``z85_key`` is 40 Z85 characters encoding 32 bytes."""
    if len(z85_key) != 40:
        return False
    try:
        return len(z85.decode(z85_key)) == 32
    except (ValueError, KeyError, struct.error):
        return False
