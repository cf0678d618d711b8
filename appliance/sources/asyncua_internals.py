"""The decode limits of the appliance's own OPC UA client (the sources' client process): asyncua's client replaces
the limits it announced in Hello with whatever the server acknowledges, so a hostile server could acknowledge
"no limit" and send a message as large as it likes. After the connection is up, the connection's limits are set back
to ours (TransportLimits of UASocketProtocol._connection), a chunk announcing more than a chunk may hold is refused
from its header before its body is buffered (UASocketProtocol._process_received_data), and `on_violation(reason)`
hears of every refusal (the socket is closed by asyncua then, or here).

The sources client's fence around asyncua's private parts (the server's is uaserver/asyncua_internals/): written for
core/asyncua_version.py's ASYNCUA_VERSION and refusing to load with another."""
from __future__ import annotations

from collections.abc import Callable

from core.asyncua_version import check_asyncua_version

check_asyncua_version()

CHUNK_BYTES = 65535  # the ReceiveBufferSize asyncua's client announces in Hello


def limit_client_receive(client, max_message_size: int, max_chunk_count: int,
                         on_violation: Callable[[str], None]) -> None:
    protocol = client.uaclient.protocol
    if protocol is None:
        return
    limits = protocol._connection._limits
    limits.max_message_size = max_message_size
    limits.max_chunk_count = max_chunk_count
    limits.max_recv_buffer = CHUNK_BYTES
    size_ok, count_ok = limits.is_msg_size_within_limit, limits.is_chunk_count_within_limit

    def message_size_ok(size: int) -> bool:
        if size_ok(size):
            return True
        on_violation(f"the source sent a message of more than {max_message_size} bytes (max_message_size)")
        return False

    def chunk_count_ok(count: int) -> bool:
        if count_ok(count):
            return True
        on_violation(f"the source sent a message of more than {max_chunk_count} chunks (max_chunk_count)")
        return False
    limits.is_msg_size_within_limit = message_size_ok
    limits.is_chunk_count_within_limit = chunk_count_ok
    process = protocol._process_received_data

    def checked(data: bytes) -> None:
        if len(data) >= 8:
            announced = int.from_bytes(data[4:8], "little")
            if announced > CHUNK_BYTES + 8 or announced > max_message_size + 8:
                on_violation(f"the source announced a chunk of {announced} bytes (at most {CHUNK_BYTES})")
                protocol.receive_buffer = None
                protocol.disconnect_socket()
                return
        process(data)
    protocol._process_received_data = checked
