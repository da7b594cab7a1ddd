"""Which requests are handed to the verifier (mirror) or recorded (capture).

With a request id the decision is a *keyed* hash of the id (blake2b with a secret key), so a
client cannot pick ids that avoid the mirror, or push every request into it: without the key
the decision looks random. Every process that holds the same key decides alike, so replicas
given the same key pick the same requests, and a capture rate at or below the mirror rate
captures only mirrored requests. Without a request id the decision is a random draw.

The key, in order: ``server.sampling_key_file`` (a file, e.g. a mounted Secret; surrounding
whitespace ignored), the environment variable ``GUARD_SAMPLING_KEY``, or else a random key made
when the server starts. A random key still agrees between a serving process and its verifier
(passed on through the environment, ``GUARD_SAMPLING_KEY_RESOLVED``, which is internal), but
not between replicas or across restarts: give replicas one key when they must agree. Key
material must hold at least 16 bytes; it is hashed into blake2b's 32-byte key.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets

from guard.errors import GuardError

ENV = "GUARD_SAMPLING_KEY"
_RESOLVED_ENV = "GUARD_SAMPLING_KEY_RESOLVED"  # serving process -> verifier (hex of the key)
MIN_KEY_BYTES = 16
_key: bytes | None = None


def derive(material: bytes) -> bytes:
    if len(material) < MIN_KEY_BYTES:
        raise GuardError(f"sampling key: {len(material)} bytes; at least {MIN_KEY_BYTES} needed")
    return hashlib.blake2b(material, digest_size=32, person=b"guard-sampling").digest()


def configure(key_file: str | None) -> str:
    """In the serving process at start: pick the key (file, environment, random), use it here
    and hand it to child processes (the verifier). Returns where it came from: ``file``,
    ``env`` or ``random``."""
    global _key
    if key_file:
        try:
            material = open(key_file, "rb").read().strip()
        except OSError as exc:
            raise GuardError(f"server.sampling_key_file: cannot read {key_file}: "
                             f"{exc.strerror or exc}") from None
        source = "file"
    elif os.environ.get(ENV, "").strip():
        material, source = os.environ[ENV].strip().encode(), "env"
    else:
        material, source = secrets.token_bytes(32), "random"
    try:
        _key = derive(material)
    except GuardError as exc:
        where = "server.sampling_key_file" if source == "file" else ENV
        raise GuardError(f"{where}: {exc}") from None
    os.environ[_RESOLVED_ENV] = _key.hex()
    return source


def key() -> bytes:
    """The key in use; a process that was not configured (the verifier) takes its parent's."""
    global _key
    if _key is None:
        resolved = os.environ.get(_RESOLVED_ENV, "")
        if resolved:
            _key = bytes.fromhex(resolved)
        elif os.environ.get(ENV, "").strip():
            _key = derive(os.environ[ENV].strip().encode())
        else:
            _key = derive(secrets.token_bytes(32))
    return _key


def draw(request_id: str) -> float:
    """The request's position in [0, 1): a keyed hash of its id."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, key=key()).digest()
    return int.from_bytes(digest, "big") / 2**64


def sampled(request_id: str, rate: float) -> bool:
    """Should this request be taken? Deterministic in ``request_id`` (and the key) when one is
    given."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    if request_id:
        return draw(request_id) < rate
    return random.random() < rate
