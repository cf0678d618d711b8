"""`appliance call MODEL (--input CSV|JSON | --prompt TEXT)`: call a model as a PLC would, for commissioning.

Over OPC UA (SignAndEncrypt, appliance.client) with --cert/--key, or on the box itself with an operator certificate
the local CA issues once (state_dir/clients/commissioning.der), recorded in the administrative audit trail.
"""
from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import socket
from pathlib import Path

from models.te_classifier import MODEL_DIR

from .common import audit_implicit_certificate, fail, load_config_arg

# One held-out window of the demo's TE data, so commissioning needs no data of its own (README, step 4)
EXAMPLE_WINDOW = MODEL_DIR / "example-window.csv"


def register(sub) -> None:
    s = sub.add_parser("call", help="call a model as a PLC would (commissioning)")
    s.add_argument("model")
    s.add_argument("--config")
    s.add_argument("--cert")
    s.add_argument("--key")
    s.add_argument("--endpoint")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--input", help="CSV or JSON floats: a file or inline text")
    g.add_argument("--example", action="store_true",
                   help="send the demo classifier's sample window (a Tennessee Eastman fault-1 window, "
                        "20 x 52 values, shipped as " + EXAMPLE_WINDOW.name + ")")
    g.add_argument("--prompt")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--timeout", type=float, default=30.0)
    s.set_defaults(func=run_call)


def parse_floats(text: str) -> list[float]:
    """JSON (a list, nested lists are flattened) or CSV (a header row of names and '#' comment lines skipped)."""
    text = text.strip()
    if text.startswith("["):
        data = json.loads(text)

        def flat(x):
            if isinstance(x, list):
                for y in x:
                    yield from flat(y)
            elif isinstance(x, (int, float)) and not isinstance(x, bool):
                yield float(x)
            else:
                raise ValueError(f"not a number: {x!r}")
        return list(flat(data))
    values: list[float] = []
    header_allowed = True
    for row_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in row if c.strip()]
        if not cells or cells[0].startswith("#"):
            continue
        try:
            values.extend(float(c) for c in cells)
        except ValueError:
            if header_allowed:
                header_allowed = False
                continue  # a header: the first row that is not a comment
            raise ValueError(f"line {row_no}: not a number in {row!r}") from None
        header_allowed = False
    return values


def looks_like_path(text: str) -> bool:
    """A value no inline numbers can be: it names a folder or a file extension (window.csv, ./w, data/x.json)."""
    text = text.strip()
    return "/" in text or bool(re.fullmatch(r"[^\s,;\[\]]+\.[A-Za-z]\w*", text))


def commissioning_identity(state_dir: Path):
    """On the appliance itself: an operator certificate for commissioning, issued once by the local CA."""
    out = state_dir / "clients"
    cert, key = out / "commissioning.der", out / "commissioning.key.pem"
    if cert.exists() and key.exists():
        return cert, key
    from certs.pki import PKI
    pki = PKI(state_dir)
    if not pki.exists():
        return None, None
    pki.issue("commissioning", "operator", out, socket.gethostname())
    return cert, key


def run_call(args) -> int:
    config = load_config_arg(args.config)
    state_dir = Path(config.server.state_dir)
    if args.cert and args.key:
        cert, key = Path(args.cert), Path(args.key)
    elif args.cert or args.key:
        return fail("give both --cert and --key")
    else:
        existed = (state_dir / "clients" / "commissioning.der").exists()
        cert, key = commissioning_identity(state_dir)
        if cert is None:
            return fail("no client certificate: give --cert and --key (make them with "
                        "`appliance certs issue NAME --role operator`)")
        if not existed:
            audit_implicit_certificate(config, "call", "commissioning", "operator", cert)
    port = config.server.port
    endpoint = args.endpoint or f"opc.tcp://127.0.0.1:{port}"
    if args.example:
        args.input = str(EXAMPLE_WINDOW)
    if args.input is None and args.prompt is None:
        return fail("give --input (CSV or JSON, a file or inline), --example or --prompt TEXT")
    values: list[float] = []
    if args.input is not None:
        source = Path(args.input)
        try:
            is_file = source.is_file()
        except OSError:  # inline values longer than a file name can be
            is_file = False
        if not is_file and looks_like_path(args.input):
            return fail(f"{args.input}: no such file (--input takes a CSV or JSON file, or the numbers inline)")
        try:
            text = source.read_text() if is_file else args.input
            values = parse_floats(text)
        except (ValueError, OSError) as e:
            return fail(f"{source if is_file else '--input'}: {e}")
    return asyncio.run(_call(args, endpoint, cert, key, values))


async def _call(args, endpoint: str, cert: Path, key: Path, values: list[float]) -> int:
    """Infer with `values` (--input) or Generate (--prompt); prints the status and every output argument."""
    from asyncua import ua

    from ..client import call_method, connect, model_node
    try:
        client = await connect(endpoint, cert, key, timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 - any failure to connect is one line naming the endpoint, no stack trace
        return fail(f"cannot connect to {endpoint}: {type(e).__name__}: {e}")
    try:
        model, ns = await model_node(client, args.model)
        if args.input is not None:
            method = await model.get_child(f"{ns}:Infer")
            res = await call_method(client, model, method, [ua.Variant(values, ua.VariantType.Float)])
        else:
            method = await model.get_child(f"{ns}:Generate")
            res = await call_method(client, model, method, [
                ua.Variant(args.prompt, ua.VariantType.String),
                ua.Variant(args.max_tokens, ua.VariantType.UInt32),
                ua.Variant(args.temperature, ua.VariantType.Float)])
        status = res.StatusCode
        print(f"status: {status.name}")
        if not status.is_good():
            bad = [f"argument {i}: {s.name}" for i, s in enumerate(res.InputArgumentResults) if not s.is_good()]
            if bad:
                print("  " + "; ".join(bad))
            return 1
        names = (["Output", "ModelVersion"] if args.input is not None else
                 ["Text", "TokenCount", "FinishReason", "ContextTokens", "ContextLost", "ModelVersion"])
        for name, var in zip(names, res.OutputArguments):
            value = var.Value
            if name == "Output":
                value = "[" + ", ".join(f"{v:.6g}" for v in value) + "]"
            print(f"{name}: {value}")
        return 0
    except ua.UaStatusCodeError as e:
        return fail(f"{args.model}: {e}")
    finally:
        await client.disconnect()
