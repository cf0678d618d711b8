"""Checking what goes into a certificate's SubjectAltName: ApplicationUri, host names, IP addresses."""
from __future__ import annotations

import ipaddress
import re
import socket

from .records import PKIError

HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def check_identity(application_uri: str, hostnames: list[str], ips: list[str]) -> tuple[str, list[str], list[str]]:
    """Validated SubjectAltName contents; localhost and 127.0.0.1 are always added."""
    if not application_uri or ":" not in application_uri or any(c.isspace() for c in application_uri):
        raise PKIError(f"bad ApplicationUri {application_uri!r}: expected a URI such as urn:HOST:appliance")
    hosts: list[str] = []
    # no names given (the demo): the machine's own name, which PLCs on the same network resolve
    default = [socket.gethostname()] if HOSTNAME.fullmatch(socket.gethostname()) else []
    for host in (list(hostnames) or default) + ["localhost"]:
        if not HOSTNAME.fullmatch(host or ""):
            raise PKIError(f"bad host name {host!r}")
        if host not in hosts:
            hosts.append(host)
    addrs: list[str] = []
    for ip in list(ips) + ["127.0.0.1"]:
        try:
            text = str(ipaddress.ip_address(ip))
        except ValueError:
            raise PKIError(f"bad IP address {ip!r}") from None
        if text not in addrs:
            addrs.append(text)
    return application_uri, hosts, addrs
