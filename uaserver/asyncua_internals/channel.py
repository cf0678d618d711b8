"""What the processor and the transport share: the guard built from the configuration, the errors a peer can cause
and the status each gets, and the messages' HMAC (items 3 and 7)."""
from __future__ import annotations

import hmac
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from asyncua import ua
from asyncua.common.utils import NotEnoughData
from asyncua.crypto import security_policies, uacrypto
from asyncua.ua.ua_binary import uatcp_to_binary
from cryptography.exceptions import InvalidSignature

from .decoding import DEFAULT_MAX_NESTING_DEPTH

log = logging.getLogger(__name__)


# What asyncua's decoding and security layers raise for bytes a peer made up (seen in tests/test_attacks_*.py:
# UaError and its status-code subclasses, NotEnoughData, struct.error, ValueError; a failed signature from the
# channel's crypto; RecursionError past Python's own limit). Logged in one line; anything else with its traceback.
# A failed signature is either exception: `cryptography`'s (asymmetric, OpenSecureChannel) or the one asyncua's
# uacrypto defines for itself and raises for a message's HMAC.
SIGNATURE_ERRORS = (InvalidSignature, uacrypto.InvalidSignature)
PEER_ERRORS = (ua.UaError, NotEnoughData, struct.error, ValueError, *SIGNATURE_ERRORS, RecursionError)


def leaf_certificate(der_chain: bytes | None) -> bytes | None:
    """The first certificate of a DER chain (a ByteString may carry the whole chain)."""
    if not der_chain:
        return None
    if len(der_chain) < 4 or der_chain[0] != 0x30:
        return der_chain
    # DER SEQUENCE length: short form, or long form with 1..4 length bytes.
    first = der_chain[1]
    if first < 0x80:
        end = 2 + first
    else:
        n = first & 0x7F
        end = 2 + n + int.from_bytes(der_chain[2:2 + n], "big")
    return der_chain[:end]


@dataclass
class ChannelGuard:
    """What the processor enforces; built once by the server from the configuration."""

    allowed: frozenset  # {(policy URI, MessageSecurityMode)}
    # validate(cert_der, client_application_uri) -> OPC UA status name, "Good" when accepted
    validate_client_certificate: Callable[[bytes, str | None], str]
    max_sessions: int
    max_requests_per_session: int
    sessions: Callable[[], int]  # open external sessions now
    max_nesting_depth: int = DEFAULT_MAX_NESTING_DEPTH
    max_array_length: int | None = None  # bounds the elements a Variant's ArrayDimensions may declare
    # Check passwords in a worker thread (False: on the event loop, as asyncua would; kept for measurements).
    offload_password_check: bool = True
    # audit(event, session=..., status=..., detail=..., **fields): logins, refused certificates, sessions
    audit: Callable[..., None] | None = None
    # a peer that vanished without FIN or RST is seen as gone within this many seconds (None: TCP's own minutes)
    dead_peer_timeout_s: int | None = None
    # sessions one client identity may hold before its oldest one without a live channel is closed to make room
    max_sessions_per_client: int | None = None

    def record(self, event: str, **fields) -> None:
        if self.audit is not None:
            try:
                self.audit(event, **fields)
            except Exception:  # noqa: BLE001 - auditing never breaks the protocol
                log.exception("audit of %s failed", event)


def error_message(status: int, reason: str) -> bytes:
    """A UA TCP ErrorMessage (Part 6, 7.1.2.5): the server's last word before it closes a connection."""
    return uatcp_to_binary(ua.MessageType.Error, ua.ErrorMessage(ua.StatusCode(status), reason))


def transport_status(exc: BaseException) -> int:
    """The status code for an error the transport layer raised; never reveals more than its name."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    if isinstance(exc, SIGNATURE_ERRORS):
        return ua.StatusCodes.BadSecurityChecksFailed
    if isinstance(exc, ua.UaError) and "No matching policy" in str(exc):
        return ua.StatusCodes.BadSecurityPolicyRejected
    return ua.StatusCodes.BadDecodingError




# ==============================================================================================================
# The messages' HMAC
#
# On a Sign or SignAndEncrypt channel every message is signed and verified with HMAC-SHA256 over its whole body.
# asyncua builds a `cryptography` HMAC object (and looks up its default backend) for each, ~4 % of serve's Python
# samples per Infer in bench/ua_overhead.py's profile, and compares a received signature with `!=`, which returns at
# the first differing byte (a timing oracle on the expected signature). The standard library's one-shot
# `hmac.digest` (OpenSSL, in C) gives the same bytes; `hmac.compare_digest` compares in constant time. The key
# derivation (uacrypto.p_sha256) calls the same module function, so it gets the one-shot digest too.
# FOR THE WHOLE PROCESS, like the nesting limit: clients in the same process sign with it as well (same bytes).

def _hmac_sha256(key: bytes, message) -> bytes:
    return hmac.digest(key, message, "sha256")


def _verify_hmac256(verifier, data, signature) -> None:
    if not hmac.compare_digest(hmac.digest(verifier.key, data, "sha256"), bytes(signature)):
        raise uacrypto.InvalidSignature


def install_message_hmac() -> None:
    """Sign and verify every channel's messages with the standard library's HMAC (see above). Idempotent."""
    uacrypto.hmac_sha256 = _hmac_sha256
    security_policies.VerifierHMac256.verify = _verify_hmac256
