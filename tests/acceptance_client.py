"""The plant's side of the acceptance test (scripts/acceptance.sh): run by the installed appliance's own Python inside
the booted container, with the project's own client code (appliance.client: SignAndEncrypt, a client certificate
as X509 identity). Prints one JSON object.

    python acceptance_client.py calls ENDPOINT CERT KEY        Infer, Generate, each model's Backend and State
    python acceptance_client.py burst ENDPOINT CERT KEY        two Infer calls back to back: their status names
    python acceptance_client.py query PROMETHEUS_URL EXPR      a Prometheus instant query's result
    python acceptance_client.py kernels PID                    the kernel libraries PID and its children map
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.parse
import urllib.request

from asyncua import ua

from appliance.client import call_method, connect, model_node

MODELS = ("te-classifier", "assistant")


async def infer(client, n: int = 1) -> list[ua.CallMethodResult]:
    node, ns = await model_node(client, "te-classifier")
    shape = await (await node.get_child(f"{ns}:InputShape")).read_value()
    size = 1
    for d in shape:
        size *= int(d)
    method = await node.get_child(f"{ns}:Infer")
    return [await call_method(client, node, method, [ua.Variant([0.5] * size, ua.VariantType.Float)])
            for _ in range(n)]


async def calls(endpoint: str, cert: str, key: str) -> dict:
    client = await connect(endpoint, cert, key)
    try:
        out = {"mode": client.security_policy.Mode.name, "policy": client.security_policy.URI.split("#")[-1]}
        for name in MODELS:
            node, ns = await model_node(client, name)
            for var in ("Backend", "State", "Version"):
                out[f"{name}/{var}"] = await (await node.get_child(f"{ns}:{var}")).read_value()
        (result,) = await infer(client)
        out["infer"] = {"status": result.StatusCode.name, "outputs": len(result.OutputArguments[0].Value or [])}
        node, ns = await model_node(client, "assistant")
        method = await node.get_child(f"{ns}:Generate")
        result = await call_method(client, node, method, [
            ua.Variant("What is a centrifugal pump?", ua.VariantType.String), ua.Variant(16, ua.VariantType.UInt32),
            ua.Variant(0.0, ua.VariantType.Float)])
        values = [a.Value for a in result.OutputArguments]
        out["generate"] = {"status": result.StatusCode.name, "text": values[0] if values else "",
                           "tokens": values[1] if values else 0}
        return out
    finally:
        await client.disconnect()


async def burst(endpoint: str, cert: str, key: str) -> dict:
    client = await connect(endpoint, cert, key)
    try:
        return {"statuses": [r.StatusCode.name for r in await infer(client, 2)]}
    finally:
        await client.disconnect()


def query(url: str, expr: str) -> dict:
    body = urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
    return json.loads(body.read())


def kernels(pid: str) -> dict:
    """The shared libraries of our quantized kernels (kernels/cpu) mapped by the service's processes."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[entry] = f.read().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue  # ended meanwhile
    family, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    libs = set()
    for p in family:
        try:
            with open(f"/proc/{p}/maps") as f:
                libs |= {line.split()[-1] for line in f if line.rstrip().endswith(".so") and "/kernels/" in line}
        except OSError:
            continue
    return {"pids": sorted(family, key=int), "libs": sorted(libs)}


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "query":
        result = query(*args)
    elif command == "kernels":
        result = kernels(*args)
    else:
        result = asyncio.run(asyncio.wait_for({"calls": calls, "burst": burst}[command](*args), 120))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
