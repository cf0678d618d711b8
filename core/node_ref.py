"""How the YAML names a source's node: by NodeId with its namespace given by URI (`nsu=URI;s=Name`, `nsu=URI;i=42`,
`nsu=URI;g=GUID`, `nsu=URI;b=BASE64`), or by a browse path from Objects whose elements are `nsu=URI;BrowseName`.
Never by namespace index: a PLC that is reloaded may number its namespaces anew, so the index is looked up in the
server's NamespaceArray after every (re)connect. Pure parsing here; the source client resolves (client.py).
"""
from __future__ import annotations

import base64
import re
import uuid
from dataclasses import dataclass

_ID_KINDS = {"s": "string", "i": "numeric", "g": "guid", "b": "opaque"}
_NODE = re.compile(r"nsu=(?P<uri>[^;]+);(?P<kind>[sigb])=(?P<ident>.+)", re.S)
_ELEMENT = re.compile(r"nsu=(?P<uri>[^;]+);(?P<name>[^/]+)", re.S)


class NodeRefError(ValueError):
    """A node reference the YAML cannot use; the message says what a valid one looks like."""


@dataclass(frozen=True)
class NodeRef:
    """A NodeId by namespace URI (path empty), or a browse path from Objects ((uri, BrowseName) per element)."""
    uri: str = ""
    kind: str = ""  # s | i | g | b
    identifier: str = ""
    path: tuple[tuple[str, str], ...] = ()

    @property
    def is_path(self) -> bool:
        return bool(self.path)

    def __str__(self) -> str:
        if self.path:
            return "/".join(f"nsu={u};{n}" for u, n in self.path)
        return f"nsu={self.uri};{self.kind}={self.identifier}"


def parse_node_id(text: str) -> NodeRef:
    if not isinstance(text, str) or not text:
        raise NodeRefError("expected a NodeId such as 'nsu=urn:plant:line1;s=Line1.Temperature'")
    if re.match(r"\s*ns=\d", text):
        raise NodeRefError(f"{text!r} names the namespace by index, which changes when the server is reloaded: "
                           "write the namespace URI instead ('nsu=URI;s=...')")
    m = _NODE.fullmatch(text.strip())
    if m is None:
        raise NodeRefError(f"expected a NodeId 'nsu=URI;s=NAME' (or ;i=NUMBER, ;g=GUID, ;b=BASE64), got {text!r}")
    kind, ident = m["kind"], m["ident"]
    try:
        if kind == "i" and not 0 <= int(ident) < 2**32:
            raise ValueError
        if kind == "g":
            uuid.UUID(ident)
        if kind == "b":
            base64.b64decode(ident, validate=True)
    except ValueError:
        raise NodeRefError(f"{text!r}: the identifier is not a valid {_ID_KINDS[kind]} identifier") from None
    return NodeRef(uri=m["uri"], kind=kind, identifier=ident)


def parse_browse_path(elements: list[str]) -> NodeRef:
    if not isinstance(elements, list) or not elements:
        raise NodeRefError("expected a browse path from Objects: a list of 'nsu=URI;BrowseName' elements")
    path = []
    for element in elements:
        m = _ELEMENT.fullmatch(element.strip()) if isinstance(element, str) else None
        if m is None:
            raise NodeRefError(f"browse path element {element!r}: expected 'nsu=URI;BrowseName' (the namespace by "
                               "URI, never by index)")
        path.append((m["uri"], m["name"]))
    return NodeRef(path=tuple(path))
