"""Building the appliance CA, its server certificate and client certificates (SHA-256, RSA)."""
from __future__ import annotations

import ipaddress
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ORGANIZATION = "OPC UA Inference Appliance"
SERVER_KEY_BITS = 2048
CA_KEY_BITS = 3072
BACKDATE = timedelta(minutes=5)  # tolerate small clock differences between the appliance and its PLCs

# OPC UA Part 6 key usage for application instance certificates.
APPLICATION_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=True,  # nonRepudiation
    key_encipherment=True,
    data_encipherment=True,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)
CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def new_rsa_key(bits: int) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def private_key_pem(key: rsa.RSAPrivateKey, password: str | None = None) -> bytes:
    """PKCS#8 PEM, encrypted with the password when one is given."""
    encryption = (
        serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _name(common_name: str, domain_component: str | None = None) -> x509.Name:
    attrs = [
        x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
    ]
    if domain_component:
        attrs.append(x509.NameAttribute(NameOID.DOMAIN_COMPONENT, domain_component[:63]))
    return x509.Name(attrs)


def build_ca(key: rsa.RSAPrivateKey, common_name: str, days: int, now: datetime) -> x509.Certificate:
    name = _name(common_name)
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        # path length 0: the appliance CA signs end-entity certificates only
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


def _leaf(
    key: rsa.RSAPrivateKey,
    subject: x509.Name,
    san: list[x509.GeneralName],
    eku: list[x509.ObjectIdentifier],
    ca_cert: x509.Certificate,
    ca_key: rsa.RSAPrivateKey,
    days: int,
    now: datetime,
) -> x509.Certificate:
    public = key.public_key()
    # never outlive the CA: a chain with an expired issuer fails anyway, and clearly is better
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(APPLICATION_KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )


def build_server_cert(
    key: rsa.RSAPrivateKey,
    ca_cert: x509.Certificate,
    ca_key: rsa.RSAPrivateKey,
    application_uri: str,
    hostnames: list[str],
    ips: list[str],
    common_name: str,
    days: int,
    now: datetime,
) -> x509.Certificate:
    san: list[x509.GeneralName] = [x509.UniformResourceIdentifier(application_uri)]
    san += [x509.DNSName(h) for h in hostnames]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    subject = _name(common_name, hostnames[0] if hostnames else None)
    eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _leaf(key, subject, san, eku, ca_cert, ca_key, days, now)


def build_client_cert(
    key: rsa.RSAPrivateKey,
    ca_cert: x509.Certificate,
    ca_key: rsa.RSAPrivateKey,
    name: str,
    application_uri: str,
    days: int,
    now: datetime,
) -> x509.Certificate:
    san: list[x509.GeneralName] = [x509.UniformResourceIdentifier(application_uri)]
    # clientAuth for the application/user role; serverAuth too, since some client stacks insist on it
    eku = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    return _leaf(key, _name(name), san, eku, ca_cert, ca_key, days, now)
