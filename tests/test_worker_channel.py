"""The serve <-> worker connection (appliance/workers/protocol.Channel) over a real socket pair: messages decoded as
their bytes arrive, whatever the pieces the kernel hands over, and a broken stream ends the connection with a
reason instead of hanging or delivering garbage."""
from __future__ import annotations

import asyncio
import socket
import struct

import msgspec
import pytest

from appliance.workers import protocol as p


async def _pair() -> tuple[p.Channel, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    return await p.Channel.open(ours, p.FromWorker), theirs


def _frame(message) -> bytes:
    body = msgspec.msgpack.encode(message)
    return struct.pack(">I", len(body)) + body


async def _collect(channel: p.Channel, want: int, timeout: float = 5.0) -> list:
    got: list = []
    done = asyncio.get_running_loop().create_future()

    def handler(message) -> None:
        got.append(message)
        if len(got) == want and not done.done():
            done.set_result(None)
    channel.listen(handler)
    await asyncio.wait_for(done, timeout)
    return got


def test_messages_split_anywhere_arrive_whole_and_in_order():
    async def main():
        channel, peer = await _pair()
        big = p.InferDone(id=1, data=bytes(range(256)) * 4096, version="v1")  # 1 MiB: many reads
        stream = _frame(big) + b"".join(_frame(p.Done(id=i, value=str(i))) for i in range(2, 50))
        loop = asyncio.get_running_loop()
        collecting = asyncio.ensure_future(_collect(channel, 49))
        for start in range(0, len(stream), 7777):  # pieces that cut lengths and bodies alike
            await loop.sock_sendall(peer, stream[start:start + 7777])
            await asyncio.sleep(0)
        got = await collecting
        assert got[0] == big
        assert [m.id for m in got[1:]] == list(range(2, 50))
        peer.close()
        channel.close()
    asyncio.run(main())


def test_receive_before_listen_then_listen_gets_the_rest():
    async def main():
        channel, peer = await _pair()
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(peer, _frame(p.Done(id=1)) + _frame(p.Done(id=2)) + _frame(p.Done(id=3)))
        first = await asyncio.wait_for(channel.receive(), 5)
        assert first.id == 1
        await asyncio.sleep(0.05)  # 2 and 3 decoded meanwhile: kept for the handler
        got = await _collect(channel, 2)
        assert [m.id for m in got] == [2, 3]
        peer.close()
        channel.close()
    asyncio.run(main())


@pytest.mark.parametrize("garbage, reason", [
    (struct.pack(">I", p.MAX_MESSAGE_BYTES + 1) + b"x", "bytes announced"),
    (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "undecodable"),
])
def test_a_broken_stream_ends_the_connection_with_its_reason(garbage, reason):
    async def main():
        channel, peer = await _pair()
        ended = asyncio.get_running_loop().create_future()
        got: list = []
        channel.listen(got.append, ended.set_result)
        await asyncio.get_running_loop().sock_sendall(peer, _frame(p.Done(id=1)) + garbage + _frame(p.Done(id=2)))
        why = await asyncio.wait_for(ended, 5)
        assert reason in why and reason in channel.closed_reason
        assert [m.id for m in got] == [1]  # nothing after the break is delivered
        with pytest.raises(ConnectionResetError):
            channel.send(p.Ping(seq=1))
        peer.close()
    asyncio.run(main())


def test_the_peer_going_away_is_seen_by_receive_and_listen():
    async def main():
        channel, peer = await _pair()
        peer.close()
        with pytest.raises(EOFError):
            await asyncio.wait_for(channel.receive(), 5)
        ended: list[str] = []
        channel.listen(lambda m: None, ended.append)  # a listener that comes late still hears of the end
        assert ended and "closed" in ended[0]
    asyncio.run(main())


def test_sends_of_one_loop_turn_leave_together_and_drain_waits():
    async def main():
        channel, peer = await _pair()
        loop = asyncio.get_running_loop()
        for i in range(100):
            channel.send(p.Ping(seq=i))
        await channel.drain()
        data = b""
        while len(data) < 100 * len(_frame(p.Ping(seq=0))):
            data += await asyncio.wait_for(loop.sock_recv(peer, 1 << 16), 5)
        decoder = msgspec.msgpack.Decoder(p.ToWorker)
        seqs, offset = [], 0
        while offset < len(data):
            (n,) = struct.unpack_from(">I", data, offset)
            seqs.append(decoder.decode(data[offset + 4:offset + 4 + n]).seq)
            offset += 4 + n
        assert seqs == list(range(100))
        peer.close()
        channel.close()
    asyncio.run(main())
