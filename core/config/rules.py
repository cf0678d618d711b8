"""The rule library: how one YAML value node becomes one setting, or one recorded problem.

A rule has `expect` (what a valid value is, in words) and `parse(node, ctx, path)` (the value, or INVALID once the
problem is recorded). schema.py attaches one to every key with `setting(default, rule)` or `required(rule)`.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from certs.x509io import normalize_thumbprint

from ..password_hash import is_password_hash
from .yaml_walk import (
    INVALID, Context, as_mapping, did_you_mean, key_path, mapping_items, node_kind, parse_fields, shown,
)

DNS_NAME = re.compile(r"(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
_RDN = re.compile(r"[A-Za-z][A-Za-z0-9.-]*\s*=.+", re.S)

# a name of a model, variant, task, mailbox or source: it becomes a BrowseName and a PLC identifier
MODEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


# ----------------------------------------------------------------------------------------------------------------
# Value predicates


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))  # .inf and .nan are never valid settings


def is_host(v: str) -> bool:
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return bool(DNS_NAME.fullmatch(v))


def subject_key(subject: str) -> frozenset[str]:
    """A certificate subject as a set of "TYPE=value" parts, so that "CN=a, O=b" and RFC 4514 "O=b,CN=a" match."""
    parts = re.split(r"(?<!\\),", subject)
    key = set()
    for part in parts:
        attr, _, value = part.partition("=")
        key.add(f"{attr.strip().upper()}={value.strip()}")
    return frozenset(key)


# ----------------------------------------------------------------------------------------------------------------
# Scalar rules


@dataclass(frozen=True)
class Scalar:
    """A scalar setting: `check(value, expect)` returns None when the value is acceptable, else what is wrong."""

    expect: str
    check: Callable[[Any, str], str | None]
    convert: Callable[[Any, Context], Any] = lambda value, ctx: value
    nullable: bool = False

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        if not isinstance(node, ScalarNode):
            ctx.error(node, path, f"expected {self.expect}, got {node_kind(node)}")
            return INVALID
        value = ctx.scalar(node)
        if value is None and self.nullable:
            return None
        problem = self.check(value, self.expect)
        if problem is not None:
            ctx.error(node, path, problem)
            return INVALID
        return self.convert(value, ctx)


def _rule(expect: str, ok: Callable[[Any], bool], **kw: Any) -> Scalar:
    return Scalar(expect, lambda v, exp: None if ok(v) else f"expected {exp}, got {shown(v)}", **kw)


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> tuple[str, Callable[[Any], bool]]:
    if lo is not None and hi is not None:
        text = f" in {'(' if lo_open else '['}{lo}, {hi}]"
    elif lo is not None:
        text = f" {'>' if lo_open else '>='} {lo}"
    elif hi is not None:
        text = f" <= {hi}"
    else:
        text = ""

    def within(v: float) -> bool:
        above = lo is None or (v > lo if lo_open else v >= lo)
        return above and (hi is None or v <= hi)

    return text, within


def integer(lo: int | None = None, hi: int | None = None) -> Scalar:
    text, within = _bounds(lo, hi)
    return _rule(f"an integer{text}", lambda v: _is_int(v) and within(v))


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Scalar:
    text, within = _bounds(lo, hi, lo_open)
    return _rule(f"a number{text}", lambda v: _is_number(v) and within(v), convert=lambda v, ctx: float(v))


def boolean() -> Scalar:
    return _rule("true or false", lambda v: isinstance(v, bool))


def text(expect: str = "a non-empty string", ok: Callable[[str], bool] = bool, max_len: int = 4096) -> Scalar:
    def check(v: Any, exp: str) -> str | None:
        if not isinstance(v, str):
            quote = " (quote it)" if v is not None else ""
            return f"expected {exp}, got {shown(v)}{quote}"
        if not ok(v) or len(v) > max_len:
            return f"expected {exp}, got {shown(v)}"
        return None

    return Scalar(expect, check)


def choice(*options: str, case_insensitive: bool = False) -> Scalar:
    expect = "one of " + ", ".join(options)

    def check(v: Any, exp: str) -> str | None:
        if isinstance(v, str) and (v in options or (case_insensitive and v.upper() in options)):
            return None
        hint = did_you_mean(v, options) if isinstance(v, str) else ""
        return f"expected {exp}, got {shown(v)}" + (f"; {hint.strip()}" if hint else "")

    convert = (lambda v, ctx: v.upper()) if case_insensitive else (lambda v, ctx: v)
    return Scalar(expect, check, convert)


def optional(rule: Scalar) -> Scalar:
    return dataclasses.replace(rule, expect=f"{rule.expect} or null", nullable=True)


def resolve_path(value: str, ctx: Context) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (ctx.base_dir / path).resolve()


def path_rule() -> Scalar:
    return dataclasses.replace(text("a path"), convert=resolve_path)


def opc_tcp_url(v: Any):
    """v split as an opc.tcp URL with a host and a port in 1-65535 (urllib's SplitResult), or None."""
    if not isinstance(v, str):
        return None
    try:
        url = urlsplit(v)
        port = url.port
    except ValueError:
        return None
    if url.scheme != "opc.tcp" or not url.hostname or port is None or not 1 <= port <= 65535:
        return None
    return url


def endpoint_check(v: Any, expect: str) -> str | None:
    url = opc_tcp_url(v)
    if url is None:
        return f"expected {expect}, got {shown(v)}"
    if url.path not in ("", "/") or url.query or url.fragment or url.username:
        return f"expected {expect} without a path, query or user, got {shown(v)}"
    if not is_host(url.hostname):
        return f"expected {expect} whose host is a DNS name or IP address, got {shown(v)}"
    return None


def split_listen(v: str) -> tuple[str, int] | None:
    host, sep, port = v.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or not is_host(host):
        return None
    return host, int(port)


def listen_check(v: Any, expect: str) -> str | None:
    return None if isinstance(v, str) and split_listen(v) else f"expected {expect}, got {shown(v)}"


def password_hash_check(v: Any, expect: str) -> str | None:
    if isinstance(v, str) and is_password_hash(v):  # the same parser that verifies logins: no silent dead account
        return None
    # the value is never echoed: it may be a plaintext password pasted by mistake
    return f"expected {expect}, got a value that is neither (not shown)"


def ip_check(v: Any, expect: str) -> str | None:
    try:
        ipaddress.ip_address(v if isinstance(v, str) else "")
        return None
    except ValueError:
        return f"expected {expect}, got {shown(v)}"


def uri_check(v: Any, expect: str) -> str | None:
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S+", v):
        return None
    return f"expected {expect}, got {shown(v)}"


def class_check(v: Any, expect: str) -> str | None:
    ok = (_is_int(v) and v >= 0) or (isinstance(v, str) and v.strip() != "")
    return None if ok else f"expected {expect}, got {shown(v)}"


# ----------------------------------------------------------------------------------------------------------------
# Lists, nested sections and special mappings


@dataclass(frozen=True)
class ListOf:
    """A YAML list whose items all follow `item`; null means an empty list unless `non_empty`."""

    item: Scalar
    items: str  # what the items are, plural, e.g. "IP addresses"
    non_empty: bool = False

    @property
    def expect(self) -> str:
        return f"a {'non-empty ' if self.non_empty else ''}list of {self.items}"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            if self.non_empty:
                ctx.error(node, path, f"expected {self.expect}, got null")
                return INVALID
            return []
        if not isinstance(node, SequenceNode):
            got = shown(ctx.scalar(node)) if isinstance(node, ScalarNode) else "a mapping"
            ctx.error(node, path, f"expected {self.expect}, got {got}")
            return INVALID
        if self.non_empty and not node.value:
            ctx.error(node, path, f"expected {self.expect}, got an empty list")
            return INVALID
        items, ok, seen = [], True, {}
        for i, child in enumerate(node.value):
            value = self.item.parse(child, ctx, f"{path}[{i}]")
            if value is INVALID:
                ok = False
            elif value in seen:
                ctx.error(child, f"{path}[{i}]", f"{shown(value)} is listed twice (first on line {seen[value]})")
                ok = False
            else:
                seen[value] = child.start_mark.line + 1
                items.append(value)
        if not ok:
            ctx.bad.add(path)
            return INVALID
        return items


def setting(default: Any, rule: Any) -> Any:
    """A dataclass field that is a YAML key with a default; list defaults are copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": rule})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


def required(rule: Any) -> Any:
    return field(metadata={"rule": rule})


@dataclass(frozen=True)
class Section:
    """A nested mapping read into the dataclass `cls` (every key checked by its own rule); null when `nullable`."""

    cls: type
    nullable: bool = False

    @property
    def expect(self) -> str:
        keys = ", ".join(f.name for f in dataclasses.fields(self.cls) if "rule" in f.metadata)
        return f"a mapping with keys {keys}" + (" or null" if self.nullable else "")

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        if self.nullable and isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            return None
        parsed = parse_fields(self.cls, node, ctx, path)
        return self.cls(**parsed.values) if parsed.complete and path not in ctx.bad else INVALID


@dataclass(frozen=True)
class NestedSection:
    """A nested mapping always read into `cls` (security.limits): its valid keys are kept even when the mapping
    itself had a problem (unlike Section, which then rejects the whole section)."""

    cls: type

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        parsed = parse_fields(self.cls, node, ctx, path)
        return self.cls(**parsed.values) if parsed.complete else INVALID


_LABEL = text("a label of 1-64 printable characters", lambda v: v.isprintable() and bool(v.strip()), max_len=64)


@dataclass(frozen=True)
class LabelsRule:
    """`labels`: an inline list of class names, or the name of a text file (one label a line) beside the model;
    the file is read once the model's path is known (see _check_labels)."""

    expect: str = "a list of class labels, or a file name (one label a line, beside the model)"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            return None
        if isinstance(node, SequenceNode):
            return ListOf(_LABEL, "class labels (1-64 printable characters each)", non_empty=True).parse(
                node, ctx, path)
        return dataclasses.replace(text(self.expect), expect=self.expect).parse(node, ctx, path)


@dataclass(frozen=True)
class RoleGrant:
    """A role given to a certificate by `security.certificate_roles`; a subject mapping may name the thumbprint of
    the CA that must have issued the certificate (`issuer`)."""

    role: str
    issuer: str | None = None


@dataclass(frozen=True)
class CertificateRoles:
    """`certificate_roles`: certificate thumbprint (40 hex digits, colons allowed) -> one of `roles`, or subject ->
    a role, or subject -> {role: ROLE, issuer: THUMBPRINT of the issuing CA}; one certificate written two ways is
    an error. Parsed to key -> RoleGrant; a subject mapping's key node is kept in ctx.nodes for the check against
    the trust list (checks.check_certificate_roles)."""

    roles: tuple[str, ...]
    expect: str = "a mapping of certificate thumbprint or subject to role"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        mapping = as_mapping(node, ctx, path, self.expect)
        roles: dict[str, str] = {}
        first_line: dict[object, int] = {}  # certificate identity -> line, to catch one certificate written two ways
        for key, key_node, value_node in (mapping_items(mapping, ctx, path, "certificate") if mapping else []):
            entry_path = key_path(path, key)
            normal = normalize_thumbprint(key)
            identity: object = normal
            if normal is None:
                if not all(_RDN.fullmatch(p.strip()) for p in re.split(r"(?<!\\),", key)):
                    ctx.error(key_node, entry_path, "expected a SHA-1 thumbprint (40 hex digits, colons allowed) or a "
                              f"certificate subject such as 'CN=plc-01,O=Plant', got {shown(key)}")
                    continue
                normal, identity = key.strip(), subject_key(key)
            if identity in first_line:
                ctx.error(key_node, entry_path, f"the same certificate is mapped twice (first on line "
                          f"{first_line[identity]})")
                continue
            first_line[identity] = key_node.start_mark.line + 1
            ctx.nodes[entry_path] = key_node
            if isinstance(value_node, MappingNode):
                grant = self._bound(value_node, ctx, entry_path, subject=normalize_thumbprint(key) is None)
            else:
                role = choice(*self.roles).parse(value_node, ctx, entry_path)
                grant = INVALID if role is INVALID else RoleGrant(role)
            if grant is not INVALID:
                roles[normal] = grant
        return roles

    def _bound(self, node: MappingNode, ctx: Context, path: str, subject: bool) -> Any:
        """{role: ROLE, issuer: THUMBPRINT}: a subject bound to the CA that issued the certificate."""
        if not subject:
            ctx.error(node, path, "a thumbprint names one certificate already: map it to a role, without issuer")
            return INVALID
        role, issuer = INVALID, None
        seen = set()
        for key, key_node, value_node in mapping_items(node, ctx, path, "key"):
            sub = key_path(path, key)
            seen.add(key)
            if key == "role":
                role = choice(*self.roles).parse(value_node, ctx, sub)
            elif key == "issuer":
                text_ = ctx.scalar(value_node) if isinstance(value_node, ScalarNode) else None
                issuer = normalize_thumbprint(str(text_)) if text_ is not None else None
                if issuer is None:
                    ctx.error(value_node, sub, "expected the SHA-1 thumbprint (40 hex digits, colons allowed) of the "
                              f"CA that issues this subject's certificate, got {shown(text_)}")
                    return INVALID
            else:
                ctx.error(key_node, sub, f"unknown key '{key}'; valid keys: role, issuer")
                return INVALID
        if "role" not in seen:
            ctx.error(node, path, "a role is required ({role: ROLE, issuer: CA_THUMBPRINT})")
            return INVALID
        return INVALID if role is INVALID else RoleGrant(role, issuer)
