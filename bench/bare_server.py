"""A bare asyncua server for baselines: the same security policy as the appliance, one Echo(Float[]) method, no
appliance code in the path. Run as a separate process: python bench/bare_server.py PORT CERT.der KEY.pem"""
from __future__ import annotations

import asyncio
import logging
import sys

from asyncua import Server, ua


async def main(port: int, cert: str, key: str) -> None:
    logging.getLogger("asyncua").setLevel(logging.WARNING)
    server = Server()
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{port}")
    await server.load_certificate(cert)
    await server.load_private_key(key)
    server.set_security_policy([ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt])
    idx = await server.register_namespace("urn:bench:bare")
    obj = await server.nodes.objects.add_object(idx, "Bench")
    arg = ua.Argument()
    arg.Name, arg.DataType, arg.ValueRank, arg.ArrayDimensions = "Input", ua.NodeId(ua.ObjectIds.Float), 1, [0]

    async def echo(parent, value):
        return [ua.Variant(value.Value, ua.VariantType.Float)]

    await obj.add_method(idx, "Echo", echo, [arg], [arg])
    async with server:
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
