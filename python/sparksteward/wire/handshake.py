"""The handshake of wire version 2: both sides prove the per-application secret, which never crosses
the socket, and derive the session key.

::

    server -> client   {"v": 2, "op": "challenge", "nonce": Ns}
    client -> server   {"v": 2, "op": "auth", "nonce": Nc, "body_macs": [...],
                        "mac": HMAC(secret, "client proof" | body_macs | Ns | Nc)}
    server -> client   {"ok": true, "body_mac": m, "mac": HMAC(secret, "server proof" | m | Ns | Nc)}

The server compares the client's proof, the client compares the server's, both in constant time;
a peer without the secret is refused either way with :class:`AuthenticationError`. The client offers
the body MACs it can compute and the server picks one (:mod:`sparksteward.wire.body`); both proofs
cover the offer and the choice. Both sides then derive the session key
``K = HMAC(secret, "session key" | Ns | Nc)`` (distinct labels; nonces of 32 random bytes from each
side, so a key is never reused across connections).

:func:`client_handshake` and :func:`server_handshake` run the exchange over a
:class:`~sparksteward.wire.connection.Connection`, which calls them from :meth:`Connection.connect`
and :meth:`Connection.answer_handshake`.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol

from sparksteward.errors import AgentUnavailableError, AuthenticationError, ProtocolError, StewardError

__all__ = ["NONCE_SIZE", "WIRE_VERSION", "client_handshake", "server_handshake", "session_key"]

WIRE_VERSION = 2
NONCE_SIZE = 32
_CLIENT_PROOF = b"sparksteward wire v2 client proof\0"
_SERVER_PROOF = b"sparksteward wire v2 server proof\0"
_SESSION_KEY = b"sparksteward wire v2 session key\0"


class _Handshaking(Protocol):
    """What the handshake needs of a connection (:class:`~sparksteward.wire.connection.Connection`):
    frames each way under a deadline, the reply check, and the session it starts at the end."""

    sock: socket.socket
    peer: str
    _deadline: float | None

    def send(self, msg: dict[str, Any]) -> None: ...

    def recv(self) -> dict[str, Any]: ...

    def _check(self, reply: dict[str, Any]) -> dict[str, Any]: ...

    def _start_session(self, secret: str, server_nonce: bytes, client_nonce: bytes, body_mac: str) -> None: ...


def _derive(secret: str, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(secret.encode(), label + server_nonce + client_nonce, "sha256")


def _nonce(value: object, peer: str) -> bytes:
    try:
        nonce = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_SIZE:
        raise ProtocolError(f"peer {peer} sent no valid {NONCE_SIZE}-byte nonce in its handshake")
    return nonce


def _offer_text(offer: list[str]) -> bytes:
    return ",".join(offer).encode()


def session_key(secret: str, server_nonce: bytes, client_nonce: bytes) -> Any:
    """An HMAC-SHA256 object keyed with the session key of these nonces, for the connection to copy
    per frame or body."""
    key = hmac.new(_derive(secret, _SESSION_KEY, server_nonce, client_nonce), digestmod="sha256")
    # OpenSSL's HMAC object itself when hmac wraps one: copy, update and digest in C, six Python
    # calls fewer for each frame and small body
    return getattr(key, "_hmac", None) or key


def client_handshake(conn: _Handshaking, secret: str, timeout: float, body_macs: Sequence[str]) -> None:
    """The client side, on a connection just opened to the agent at ``conn.peer``, within ``timeout``
    seconds: offer ``body_macs`` (preferred first), check the server's proof, start the session. On
    failure the socket is closed and AuthenticationError, ProtocolError or AgentUnavailableError raised."""
    endpoint = conn.peer
    conn._deadline = time.monotonic() + timeout
    try:
        challenge = conn.recv()
        if challenge.get("op") != "challenge" or challenge.get("v") != WIRE_VERSION:
            raise ProtocolError(
                f"the agent at {endpoint} speaks wire version {challenge.get('v')!r}, this client "
                f"{WIRE_VERSION}: use the same spark-steward version on the driver, executors and clients")
        server_nonce = _nonce(challenge.get("nonce"), endpoint)
        client_nonce = secrets.token_bytes(NONCE_SIZE)
        offer = list(body_macs)
        conn.send({"v": WIRE_VERSION, "op": "auth", "nonce": client_nonce.hex(), "body_macs": offer,
                   "mac": _derive(secret, _CLIENT_PROOF + _offer_text(offer), server_nonce, client_nonce).hex()})
        reply = conn._check(conn.recv())
        proof, body_mac = reply.get("mac"), reply.get("body_mac")
        body_mac = body_mac if body_mac in offer else offer[-1]  # a bad choice fails the proof below
        expected = _derive(secret, _SERVER_PROOF + body_mac.encode(), server_nonce, client_nonce).hex()
        if (not isinstance(proof, str) or reply.get("body_mac") not in offer
                or not hmac.compare_digest(proof.encode(), expected.encode())):
            raise AuthenticationError(
                f"the peer at {endpoint} did not prove that it knows the application secret, so it is "
                f"not this application's agent (a wrong endpoint or an impostor); refusing to use it")
        conn._start_session(secret, server_nonce, client_nonce, body_mac)
    except (OSError, ValueError) as exc:
        conn.sock.close()
        if isinstance(exc, StewardError):
            raise
        raise AgentUnavailableError(f"handshake with the agent at {endpoint} failed: {exc}") from exc


def server_handshake(conn: _Handshaking, secret: str, timeout: float, body_macs: Sequence[str]) -> None:
    """The server side, within ``timeout`` seconds: challenge, check the client's proof, pick the
    first of ``body_macs`` the client offers, prove the secret back, start the session. Raises
    AuthenticationError or ProtocolError for the caller to send back; OSError when the peer is too
    slow or gone."""
    conn._deadline = time.monotonic() + timeout
    server_nonce = secrets.token_bytes(NONCE_SIZE)
    conn.send({"v": WIRE_VERSION, "op": "challenge", "nonce": server_nonce.hex()})
    msg = conn.recv()
    mac = msg.get("mac")
    if msg.get("op") != "auth" or msg.get("v") != WIRE_VERSION or not isinstance(mac, str):
        raise ProtocolError(f"peer {conn.peer} sent no wire-version-{WIRE_VERSION} auth message; "
                            f"use the same spark-steward version everywhere")
    client_nonce = _nonce(msg.get("nonce"), conn.peer)
    offer = msg.get("body_macs")
    if not isinstance(offer, list) or not all(isinstance(m, str) for m in offer) or len(offer) > 8:
        raise ProtocolError(f"peer {conn.peer} sent no list of body MACs in its handshake")
    expected = _derive(secret, _CLIENT_PROOF + _offer_text(offer), server_nonce, client_nonce).hex()
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        raise AuthenticationError("authentication failed: the peer does not know this application's secret")
    body_mac = next((m for m in body_macs if m in offer), None)
    if body_mac is None:
        raise ProtocolError(f"peer {conn.peer} offers body MACs {offer}; this agent knows {list(body_macs)}")
    conn.send({"ok": True, "body_mac": body_mac,
               "mac": _derive(secret, _SERVER_PROOF + body_mac.encode(), server_nonce, client_nonce).hex()})
    conn._start_session(secret, server_nonce, client_nonce, body_mac)
