"""A PLC for tests/test_ua_dead_peer.py, run inside the test's network namespace (`ip netns exec`): it connects over
SignAndEncrypt, has one short Generate answered (its session's conversation, which holds a KV slot), says so on
stdout, then asks for a long Generate whose answer it never gets: the test cuts its link meanwhile.

    python tests/netns_plc.py ENDPOINT CERT KEY SESSION_TIMEOUT_MS
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from asyncua import ua

from appliance.client import connect
from uaclient import call, status_name

V = ua.VariantType


def generate_args(prompt: str, max_tokens: int) -> list[ua.Variant]:
    return [ua.Variant(prompt, V.String), ua.Variant(max_tokens, V.UInt32), ua.Variant(0.0, V.Float)]


async def main(endpoint: str, cert: str, key: str, session_timeout_ms: int) -> None:
    client = await connect(endpoint, Path(cert), Path(key), session_timeout_ms=session_timeout_ms)
    first = await call(client, "chat", "Generate", generate_args("Valve 3", 5))
    print(json.dumps({"first": status_name(first)}), flush=True)
    long = await call(client, "chat", "Generate", generate_args("The pump", 12000))
    print(json.dumps({"long": status_name(long)}), flush=True)  # only if the link was never cut


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
