"""The one asyncua version the appliance's reaches into asyncua's private parts were written for. Those live in two
fences, each checking this at import: uaserver/asyncua_internals/ (the server) and appliance/sources/
asyncua_internals.py (the sources client's receive limits); nothing else touches asyncua's internals
(tests/test_asyncua_internals.py)."""
from __future__ import annotations

import importlib.metadata

ASYNCUA_VERSION = "2.1.0"


class AsyncuaVersionError(ImportError):
    """The installed asyncua is not the version the appliance's asyncua internals were written for."""


def check_asyncua_version(installed: str | None = None) -> None:
    """Raise AsyncuaVersionError unless asyncua ASYNCUA_VERSION is installed (or `installed` is it, for tests)."""
    if installed is None:
        try:
            installed = importlib.metadata.version("asyncua")
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
    if installed != ASYNCUA_VERSION:
        raise AsyncuaVersionError(
            f"the appliance's OPC UA server and sources client were written for asyncua {ASYNCUA_VERSION}, but asyncua {installed} is "
            f"installed: install asyncua=={ASYNCUA_VERSION} (`pip install asyncua=={ASYNCUA_VERSION}`), or review "
            "uaserver/asyncua_internals/ and appliance/sources/asyncua_internals.py against the new version and "
            "change ASYNCUA_VERSION in core/asyncua_version.py")
