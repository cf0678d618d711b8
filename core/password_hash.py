"""A password as it is stored: scrypt (created by default, `scrypt$n=16384,r=8,p=1$<salt b64>$<hash b64>`) or
argon2id (`$argon2id$...`, verified when argon2-cffi is installed). The accounts (appliance/users.py) verify with it
and the configuration check (core/config/rules.py) recognises a hash with the same parser, so a YAML hash that
would never verify is refused at load, not met as a dead account."""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets

log = logging.getLogger("appliance.users")

MAX_PASSWORD_CHARS = 1024  # bounds the hashing work one login attempt can cause
SCRYPT_N, SCRYPT_R, SCRYPT_P = 16384, 8, 1
_SCRYPT_SALT_BYTES, _SCRYPT_KEY_BYTES = 16, 32
_SCRYPT_MAX_N = 1 << 20  # a stored hash may not ask for more than ~1 GiB of scrypt work


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int, dklen: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, dklen=dklen,
                          maxmem=128 * n * r * p + (1 << 20))


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(_SCRYPT_SALT_BYTES)
    key = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P, _SCRYPT_KEY_BYTES)
    return f"scrypt$n={SCRYPT_N},r={SCRYPT_R},p={SCRYPT_P}${_b64(salt)}${_b64(key)}"


def _parse_scrypt(stored: str) -> tuple[int, int, int, bytes, bytes]:
    scheme, params, salt_b64, key_b64 = stored.split("$")
    if scheme != "scrypt":
        raise ValueError("not scrypt")
    values = dict(item.split("=", 1) for item in params.split(","))
    n, r, p = int(values["n"]), int(values["r"]), int(values["p"])
    if set(values) != {"n", "r", "p"} or n < 2 or n & (n - 1) or n > _SCRYPT_MAX_N or not (1 <= r <= 32) \
            or not (1 <= p <= 16):
        raise ValueError("scrypt parameters out of range")
    salt, key = base64.b64decode(salt_b64, validate=True), base64.b64decode(key_b64, validate=True)
    if not salt or len(key) < 16:
        raise ValueError("scrypt salt or key too short")
    return n, r, p, salt, key


def is_password_hash(stored: str) -> bool:
    """True when `stored` is a hash this module can verify (for the configuration checker)."""
    if not isinstance(stored, str):
        return False
    if stored.startswith(("$argon2id$", "$argon2i$", "$argon2d$")):
        return True
    try:
        _parse_scrypt(stored)
        return True
    except (ValueError, KeyError):
        return False


def verify_password(password: str, stored: str) -> bool:
    """Constant-time check of `password` against a stored scrypt or argon2id hash; False for anything malformed."""
    if not isinstance(password, str) or len(password) > MAX_PASSWORD_CHARS:
        return False
    if stored.startswith("$argon2"):
        try:
            from argon2 import PasswordHasher  # optional: only needed when a YAML lists argon2 hashes
            from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
        except ImportError:
            log.error("an argon2 password hash is configured but argon2-cffi is not installed")
            return False
        try:
            return PasswordHasher().verify(stored, password)  # argon2-cffi compares in constant time
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False
    try:
        n, r, p, salt, key = _parse_scrypt(stored)
    except (ValueError, KeyError):
        return False
    return hmac.compare_digest(_scrypt(password, salt, n, r, p, len(key)), key)
