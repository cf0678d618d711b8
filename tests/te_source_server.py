"""A plant's OPC UA server for the sources tests: an asyncua server (its own process, so a test can kill and restart
it) that replays a Tennessee Eastman held-out run (bibmon's dNN_te.dat, read by models.te_classifier) row by row at
an accelerated rate: 52 variables `nsu=urn:te-plant;s=TE.<name>` under Objects/Plant (XMEAS1..41, XMV1..11), all of
one row written with one SourceTimestamp, over SignAndEncrypt (Basic256Sha256) with the certificate it is given;
TE.AiClass (Int32) and TE.AiConfidence (Float) are writable, for the appliance's write-back.

    python tests/te_source_server.py --port P --cert C.der --key K.pem --fault 2 --start-row 100 --rows 200
        --interval 0.05 [--bad-rows A:B] [--hostile oversized|silent]

It prints "listening" once it accepts connections, then waits for a line "go" on stdin before it replays (the test
says go once the appliance is subscribed), prints "row N" after each row and "done N" after the last (it keeps
serving, without new rows, until killed). --bad-rows A:B gives XMEAS1 the status BadSensorFailure in rows A..B-1.
Hostile modes: `oversized` serves an array of 300,000 doubles (2.4 MB) in TE.Big (more than the decode limits the
tests configure); `silent` accepts TCP connections and never answers a byte; `flood` writes TE.Flood as fast as it
can for --rows seconds once "go" is read (a publish flood).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

URI = "urn:te-plant"
NAMES = [f"XMEAS{i}" for i in range(1, 42)] + [f"XMV{i}" for i in range(1, 12)]


async def silent(port: int) -> None:
    async def hold(reader, writer):
        await asyncio.sleep(3600)
    server = await asyncio.start_server(hold, "127.0.0.1", port)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


async def serve(args) -> None:
    from asyncua import Server, ua
    from models.te_classifier import load_te_rows

    rows = load_te_rows(args.fault, test=True)
    server = Server()
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{args.port}")
    server.set_server_name("TE plant")
    await server.set_application_uri(args.application_uri)
    await server.load_certificate(args.cert)
    await server.load_private_key(args.key)
    server.set_security_policy([ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt])
    ns = await server.register_namespace(URI)
    plant = await server.nodes.objects.add_object(ua.NodeId("TE.Plant", ns), ua.QualifiedName("Plant", ns))
    nodes = []
    for i, name in enumerate(NAMES):
        nodes.append(await plant.add_variable(ua.NodeId(f"TE.{name}", ns), ua.QualifiedName(name, ns),
                                              float(rows[args.start_row][i])))
    for name, value, vtype in (("AiClass", -1, ua.VariantType.Int32), ("AiConfidence", 0.0, ua.VariantType.Float)):
        result = await plant.add_variable(ua.NodeId(f"TE.{name}", ns), ua.QualifiedName(name, ns),
                                          ua.Variant(value, vtype))
        await result.set_writable()  # where the appliance writes its result back (the YAML's write_back)
    flood = await plant.add_variable(ua.NodeId("TE.Flood", ns), ua.QualifiedName("Flood", ns), 0.0)
    await plant.add_variable(ua.NodeId("TE.Big", ns), ua.QualifiedName("Big", ns),
                                   [1.0] * 300_000 if args.hostile == "oversized" else [0.0])
    first = datetime.now(timezone.utc)  # the initial values: one row, with one SourceTimestamp
    for i, node in enumerate(nodes):
        await server.write_attribute_value(node.nodeid, ua.DataValue(
            ua.Variant(float(rows[args.start_row][i]), ua.VariantType.Double), SourceTimestamp=first,
            ServerTimestamp=first))
    async with server:
        print("listening", flush=True)
        loop = asyncio.get_running_loop()
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            return
        if args.hostile == "flood":  # TE.Flood written as fast as this process can, for --rows seconds
            end, n = time.monotonic() + args.rows, 0
            while time.monotonic() < end:
                n += 1
                await server.write_attribute_value(flood.nodeid, ua.DataValue(ua.Variant(float(n),
                                                                                         ua.VariantType.Double)))
                if n % 50 == 0:
                    await asyncio.sleep(0)
            print(f"done {n}", flush=True)
            await asyncio.Event().wait()
        bad = tuple(int(x) for x in args.bad_rows.split(":")) if args.bad_rows else (-1, -1)
        end = min(len(rows), args.start_row + args.rows)
        next_at = time.monotonic()
        for r in range(args.start_row, end):
            now = datetime.now(timezone.utc)
            for i, node in enumerate(nodes):
                status = ua.StatusCodes.BadSensorFailure if (i == 0 and bad[0] <= r < bad[1]) else ua.StatusCodes.Good
                dv = ua.DataValue(ua.Variant(float(rows[r][i]), ua.VariantType.Double), ua.StatusCode(status),
                                  SourceTimestamp=now, ServerTimestamp=now)
                await server.write_attribute_value(node.nodeid, dv)
            print(f"row {r}", flush=True)
            next_at += args.interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        print(f"done {end - 1}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--application-uri", default="urn:te-plant:server")
    p.add_argument("--fault", type=int, default=2)
    p.add_argument("--start-row", type=int, default=0)
    p.add_argument("--rows", type=int, default=960)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--bad-rows", default="")
    p.add_argument("--hostile", default="", choices=("", "oversized", "silent", "flood"))
    args = p.parse_args()
    asyncio.run(silent(args.port) if args.hostile == "silent" else serve(args))


if __name__ == "__main__":
    main()
