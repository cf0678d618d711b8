"""Reading, writing and naming certificates: DER or PEM, single or concatenated chains."""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

MAX_CERT_BYTES = 64 * 1024  # no real certificate comes near; bounds what an attacker can make us parse
PEM_MARK = b"-----BEGIN"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class CertificateFormatError(ValueError):
    """Bytes that are not a certificate (or a chain of them), or not a CRL."""


# What cryptography raises for malformed input (found by mutating certificates and CRLs byte by byte): ValueError
# for most, InvalidVersion from the loaders, DuplicateExtension and UnsupportedGeneralNameType when a certificate's
# extensions are read (they are parsed lazily, so a certificate that loads may still raise later),
# UnsupportedAlgorithm for a key or signature algorithm it does not know, TypeError for input that is not bytes.
MALFORMED = (ValueError, TypeError, x509.InvalidVersion, x509.DuplicateExtension, x509.UnsupportedGeneralNameType,
             UnsupportedAlgorithm)


def thumbprint(cert_der: bytes | None) -> str:
    """OPC UA's certificate thumbprint: SHA-1 of the DER, 40 lower-case hex digits ("" for no certificate)."""
    return hashlib.sha1(cert_der).hexdigest() if cert_der else ""


def normalize_thumbprint(text: str) -> str | None:
    """A thumbprint as written by a person (colons, spaces, either case) as 40 lower-case hex digits, or None if
    `text` is not one."""
    hex_digits = re.sub(r"[\s:]", "", text).lower()
    return hex_digits if re.fullmatch(r"[0-9a-f]{40}", hex_digits) else None


def split_der_chain(data: bytes) -> list[bytes]:
    """Split concatenated DER certificates (OPC UA sends a chain this way) into single DER blobs."""
    parts: list[bytes] = []
    pos = 0
    while pos < len(data):
        if data[pos] != 0x30 or pos + 2 > len(data):
            raise CertificateFormatError("not a DER SEQUENCE")
        first = data[pos + 1]
        if first < 0x80:
            length, header = first, 2
        else:
            count = first & 0x7F
            if count == 0 or count > 4 or pos + 2 + count > len(data):
                raise CertificateFormatError("bad DER length")
            length = int.from_bytes(data[pos + 2 : pos + 2 + count], "big")
            header = 2 + count
        end = pos + header + length
        if end > len(data):
            raise CertificateFormatError("truncated DER")
        parts.append(data[pos:end])
        pos = end
    if not parts:
        raise CertificateFormatError("empty")
    return parts


def parse_certificates(data: bytes) -> list[tuple[bytes, x509.Certificate]]:
    """PEM (one or more blocks) or DER (one or a concatenated chain) -> [(der, certificate)], leaf first."""
    if len(data) > MAX_CERT_BYTES * 8:
        raise CertificateFormatError("too large")
    try:
        if data.lstrip().startswith(PEM_MARK):
            certs = x509.load_pem_x509_certificates(data)
            return [(c.public_bytes(serialization.Encoding.DER), c) for c in certs]
        return [(der, x509.load_der_x509_certificate(der)) for der in split_der_chain(data)]
    except CertificateFormatError:
        raise
    except MALFORMED as exc:
        raise CertificateFormatError(str(exc) or type(exc).__name__) from exc


def read_certificate_file(path: Path) -> list[tuple[bytes, x509.Certificate]]:
    return parse_certificates(Path(path).read_bytes())


def parse_crl(data: bytes) -> x509.CertificateRevocationList:
    """PEM or DER; CertificateFormatError (a ValueError) for anything else, whatever cryptography raised."""
    try:
        if data.lstrip().startswith(PEM_MARK):
            return x509.load_pem_x509_crl(data)
        return x509.load_der_x509_crl(data)
    except MALFORMED as exc:
        raise CertificateFormatError(f"not a CRL: {str(exc) or type(exc).__name__}") from exc


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file; mode is set before the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:  # re-raised: whatever stopped the write (interrupt included), no temporary file stays
        try:
            os.unlink(tmp)
        except FileNotFoundError:  # renamed already: nothing left to remove
            pass
        raise


def safe_file_stem(text: str, limit: int = 64) -> str:
    stem = _UNSAFE.sub("_", text).strip("._")
    return stem[:limit] or "cert"


def common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def san_uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)]


def to_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def to_der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)
