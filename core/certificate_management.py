"""Part 12 certificate management as both sides name it: the server (uaserver/server_configuration.py) offers
ServerConfiguration, and `appliance certs csr | install-server` (appliance/cli/certs_push.py) calls it as a client,
or does the same checks on the pki/ files when no appliance runs. The NodeIds and what a new server certificate must
name are declared here once."""
from __future__ import annotations

import socket
from urllib.parse import urlparse

from asyncua import ua

from certs.server_certificate import ServerIdentity, required_names

O = ua.ObjectIds
SERVER_CONFIGURATION = ua.NodeId(O.ServerConfiguration)
TRUST_LIST = ua.NodeId(O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
DEFAULT_GROUP = ua.NodeId(O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
CERTIFICATE_TYPE = ua.NodeId(O.RsaSha256ApplicationCertificateType)


def server_identity(config) -> ServerIdentity:
    """What a new server certificate must name: the ApplicationUri and the hosts clients dial (the endpoint's host,
    the advertised host, the YAML's dns_names and ip_addresses); a server on 0.0.0.0 with none of them: the
    host's own name."""
    srv = config.server
    names = required_names([urlparse(srv.endpoint).hostname or "", srv.advertised_host or "",
                            *srv.dns_names, *srv.ip_addresses])
    return ServerIdentity(srv.application_uri, names, (socket.gethostname(), socket.getfqdn()))
