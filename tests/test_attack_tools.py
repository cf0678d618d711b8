"""The attack tests' judge of a refusal (attack_tools.refusal) refuses to call a crash a refusal: a refused TCP connect
(no server listens) and a close after which the server answers no one fail the test; a status code, and a close by a
server that still answers a legitimate client, are refusals. Real sockets on loopback."""
from __future__ import annotations

import asyncio

import pytest
from asyncua import ua

from attack_tools import refusal, status_of
from ports import free_ports


async def read_from(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await reader.readexactly(8)  # the server closes first: IncompleteReadError
    finally:
        writer.close()


def test_a_refused_connect_is_a_dead_server_not_a_refusal():
    port, = free_ports(1)  # nothing listens there: what a crashed server leaves
    with pytest.raises(AssertionError, match="no server listens"):
        asyncio.run(refusal(asyncio.open_connection("127.0.0.1", port)))


def test_a_close_counts_only_when_the_server_still_answers_a_legitimate_client():
    async def go():
        async def slam(reader, writer):  # a server that closes every connection at once
            writer.close()
        server = await asyncio.start_server(slam, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def legit():  # the legitimate client: here, a connect that is accepted
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
        exc = await refusal(read_from(port), alive=legit)
        assert status_of(exc) == "ConnectionClosed"
        with pytest.raises(AssertionError, match="pass alive="):
            await refusal(read_from(port))
        # the server dies after closing this connection: the legitimate client meets nobody, so it was a crash
        server.close()
        await server.wait_closed()

        async def dead_after_close():
            reader, writer = await asyncio.open_connection("127.0.0.1", other_port)
            other.close()
            try:
                await reader.readexactly(8)
            finally:
                writer.close()
        other = await asyncio.start_server(slam, "127.0.0.1", 0)
        other_port = other.sockets[0].getsockname()[1]

        async def legit_other():
            _, writer = await asyncio.open_connection("127.0.0.1", other_port)
            writer.close()
        with pytest.raises(AssertionError, match="the server crashed"):
            await refusal(dead_after_close(), alive=legit_other)
    asyncio.run(go())


def test_a_status_code_is_a_refusal():
    async def refused():
        raise ua.UaStatusCodeError(ua.StatusCodes.BadUserAccessDenied)
    assert status_of(asyncio.run(refusal(refused()))) == "BadUserAccessDenied"
