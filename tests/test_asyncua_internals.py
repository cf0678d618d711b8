"""asyncua's private parts live in two fences only: the package uaserver/asyncua_internals/ (the server) and the
module appliance/sources/asyncua_internals.py (the sources client's receive limits); each refuses to load with
another asyncua version than the one they were written for (core/asyncua_version.py), so an upgrade is those two to
review."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from core.asyncua_version import ASYNCUA_VERSION, AsyncuaVersionError, check_asyncua_version
from uaserver import asyncua_internals

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_ASYNCUA = {"asyncua", "asyncua.crypto", "asyncua.crypto.permission_rules", "asyncua.server.user_managers",
                  # the client side's public modules: a struct's decoder, subscription events, the NodeSet2 exporter
                  "asyncua.ua.ua_binary", "asyncua.common.subscription", "asyncua.common.xmlexporter"}


def test_the_installed_version_is_the_one_it_was_written_for():
    import importlib.metadata
    assert importlib.metadata.version("asyncua") == ASYNCUA_VERSION == "2.1.0"
    check_asyncua_version()


def test_another_version_is_refused_with_a_clear_error():
    with pytest.raises(AsyncuaVersionError) as info:
        check_asyncua_version("2.2.0")
    message = str(info.value)
    assert "written for asyncua 2.1.0" in message and "asyncua 2.2.0 is installed" in message
    assert "pip install asyncua==2.1.0" in message and "uaserver/asyncua_internals/" in message
    assert "appliance/sources/asyncua_internals.py" in message


@pytest.mark.parametrize("module", ["uaserver.server", "appliance.sources.asyncua_internals"])
def test_importing_with_another_version_installed_fails_at_import(module):
    code = ("import importlib.metadata as m\n"
            "real = m.version\n"
            "m.version = lambda name: '2.3.1' if name == 'asyncua' else real(name)\n"
            f"import {module}\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "AsyncuaVersionError" in result.stderr and "asyncua 2.3.1 is installed" in result.stderr


FENCES = (ROOT / "uaserver" / "asyncua_internals", ROOT / "appliance" / "sources" / "asyncua_internals.py")


def test_no_other_module_reaches_into_asyncua():
    """Outside the two fences: only asyncua's public API (no asyncua.server internals, no underscored attributes of
    asyncua objects)."""
    for path in sorted(p for top in ("core", "uaserver", "appliance", "certs") for p in (ROOT / top).rglob("*.py")):
        if any(path == fence or fence in path.parents for fence in FENCES):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("asyncua"):
                assert node.module in PUBLIC_ASYNCUA, f"{path.name}: from {node.module} import ..."
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue  # the module's own private attributes
                assert node.attr not in asyncua_private_names(), f"{path.name}:{node.lineno}: .{node.attr}"
            if isinstance(node, ast.Attribute) and node.attr in ("iserver", "bserver", "aspace"):
                raise AssertionError(f"{path.name}:{node.lineno}: .{node.attr} (asyncua's internal server)")


def asyncua_private_names() -> set[str]:
    """Underscored names that asyncua's Server, InternalServer, AddressSpace and sessions define."""
    import asyncua.server.address_space as aspace
    import asyncua.server.internal_server as internal
    import asyncua.server.internal_session as session
    import asyncua.server.server as server
    names = set()
    for module in (aspace, internal, session, server):
        for value in vars(module).values():
            if isinstance(value, type):
                names |= {n for n in vars(value) if n.startswith("_") and not n.startswith("__")}
        names |= {n for n in Path(module.__file__).read_text().split() if n.startswith("self._")}
    return {n.removeprefix("self.").split("(")[0].split(".")[0].rstrip(":,=)") for n in names}


def test_the_internals_module_holds_what_it_says():
    for name in ("HardenedProcessor", "HardenedBinaryServer", "ApplianceSession", "AppServer", "install_nesting_limit",
                 "write_together", "external_sessions", "instantiate_many", "subscription_of", "configure_limits"):
        assert hasattr(asyncua_internals, name), name


def test_message_hmac_gives_asyncua_s_bytes_and_compares_in_constant_time():
    """The standard library's HMAC installed for channel messages (asyncua_internals.install_message_hmac) signs
    exactly as asyncua's cryptography-based function did, over bytes, bytearray and memoryview alike, and its
    verifier accepts only the right signature (hmac.compare_digest)."""
    import os

    from asyncua.crypto import security_policies, uacrypto
    from cryptography.hazmat.primitives import hashes, hmac as crypto_hmac

    def reference(key, message):
        h = crypto_hmac.HMAC(key, hashes.SHA256())
        h.update(bytes(message))
        return h.finalize()

    asyncua_internals.install_message_hmac()
    key = os.urandom(32)
    for size in (0, 1, 31, 32, 1000, 65536):
        message = os.urandom(size)
        for form in (message, bytearray(message), memoryview(message)):
            assert uacrypto.hmac_sha256(key, form) == reference(key, message)
        verifier = security_policies.VerifierHMac256(key)
        verifier.verify(message, reference(key, message))
        wrong = bytearray(reference(key, message))
        wrong[-1] ^= 1
        for bad in (bytes(wrong), reference(key, message)[:-1], b""):
            with pytest.raises(uacrypto.InvalidSignature):
                verifier.verify(message, bad)
