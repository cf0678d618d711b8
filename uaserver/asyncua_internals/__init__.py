"""Everything of the appliance that reaches into asyncua's private parts, in this one package.

Written for asyncua ASYNCUA_VERSION exactly (core/asyncua_version.py): importing this package with another version
installed raises AsyncuaVersionError naming both, so that an upgrade of asyncua is this package and the sources
client's one module (appliance/sources/asyncua_internals.py) to review (and `pyproject.toml` pins it).

What is here, module by module, and which asyncua internals each relies on:
1. decoding: the decoder's nesting limit (patches asyncua.ua.ua_binary's decoders and their caches), and the Call
   service's own codec (a Call request's header and parameters and its answer, byte for byte as asyncua's generic
   codec writes them, from ua_binary's Primitives and node id codecs).
2. sessions: ApplianceSession, a subclass of asyncua.server.internal_session.InternalSession (re-registers its ids
   with the InternalServer, wraps activate_session, close_session and write).
3. processor: the hardened per-connection processor, a subclass of UaProcessor overriding _process_message (reads
   _connection, session).
4. listening: subclasses of OPCUAProtocol and BinaryServer (data_received, connection_made, _make_protocol; reading
   _buffer, _limits); AppServer, asyncua's Server.start re-done (_setup_server_nodes, _policies,
   _get_bind_socket_info, bserver) to listen through the hardened BinaryServer and present the certificate chain;
   every accepted connection's socket (transport extra info) gets keepalive and TCP_USER_TIMEOUT (dead peers);
   configure_limits and install_session_factory set InternalServer attributes (certificate_validator,
   create_session, max_connections, pending activation and session timeouts, discovery matching).
5. channel: what processor and listening share (the guard built from the configuration, the errors a peer can cause
   and their status codes), and install_message_hmac, which replaces asyncua.crypto.uacrypto.hmac_sha256 and
   security_policies.VerifierHMac256.verify.
6. nodes: write_together sets several Value attributes in the address space (AddressSpace._nodes, AttributeValue)
   before any data-change callback runs, so the changes land in one publish of every subscription;
   external_sessions reads the server's registry of client sessions (InternalServer._external_sessions);
   subscription_of the subscription service's (SubscriptionService.subscriptions, .session_id); monitored_item_of
   and trigger_for_monitored_item (ConditionRefresh2) a subscription's MonitoredItemService (_monitored_items,
   trigger_event with a monitored item id); instantiate_many
   copies an instantiated object from its NodeData (AddressSpace._nodes) through the InternalServer's own session
   (AddNodes). A session outlives its connection until its timeout (UaProcessor._should_close_session_on_transport_loss,
   close).
7. certificates: present_certificate swaps the server certificate and key for new channels (InternalServer.certificate,
   private_key, endpoints; each SecurityPolicyFactory of Server._policies); open_channels, close_channels_later and
   channel_security_mode read the binary server's connections (BinaryServer.clients, their processor's
   _connection.security_policy); trust_list_to_binary / _from_binary encode the TrustList file with ua_binary's
   struct codec.
8. session_table: room in the session table (orphaned sessions closed to make room for new ones), reading
   InternalServer._external_sessions and InternalSession.state (SessionState).

The package's modules import asyncua's internals only after the version check below has passed.
"""
from __future__ import annotations

from core.asyncua_version import check_asyncua_version

# Before anything of asyncua's internals is imported: a moved or renamed module should not be the first error seen.
check_asyncua_version()

from .channel import SIGNATURE_ERRORS, ChannelGuard, install_message_hmac, leaf_certificate  # noqa: E402
from .decoding import (  # noqa: E402
    DEFAULT_MAX_NESTING_DEPTH, NestingTooDeep, call_parameters_from_binary, install_nesting_limit, max_nesting_depth,
    request_header_from_binary, response_to_binary)
from .listening import (  # noqa: E402
    AppServer, HardenedBinaryServer, HardenedProtocol, advertise_host, configure_limits, install_session_factory,
    listening_port)
from .nodes import (  # noqa: E402
    external_sessions, instantiate_many, monitored_item_of, subscription_of, trigger_for_monitored_item, write_together)
from .processor import HardenedProcessor  # noqa: E402
from .certificates import (  # noqa: E402
    channel_security_mode, close_channels_later, open_channels, present_certificate, trust_list_from_binary,
    trust_list_to_binary)
from .sessions import MIN_PUBLISHING_INTERVAL_MS, ApplianceSession  # noqa: E402

__all__ = [
    "SIGNATURE_ERRORS", "ChannelGuard", "install_message_hmac", "leaf_certificate",
    "DEFAULT_MAX_NESTING_DEPTH", "NestingTooDeep", "call_parameters_from_binary", "install_nesting_limit",
    "max_nesting_depth", "request_header_from_binary", "response_to_binary",
    "AppServer", "HardenedBinaryServer", "HardenedProtocol", "advertise_host", "configure_limits",
    "install_session_factory", "listening_port",
    "external_sessions", "instantiate_many", "monitored_item_of", "subscription_of", "trigger_for_monitored_item",
    "write_together",
    "HardenedProcessor", "MIN_PUBLISHING_INTERVAL_MS", "ApplianceSession",
    "channel_security_mode", "close_channels_later", "open_channels", "present_certificate",
    "trust_list_from_binary", "trust_list_to_binary",
]
