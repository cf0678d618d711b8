"""Part 12 push certificate management behind namespace 0's ServerConfiguration object (i=12637): its properties,
CreateSigningRequest, UpdateCertificate, ApplyChanges, CancelChanges, GetRejectedList, GetCertificates (1.05; added
to the address space here, asyncua's namespace 0 predates it), and the
DefaultApplicationGroup's TrustList (i=12642) as a file (trust_list_file.py).

Every method runs through MethodHandlers.wrap (the `security_admin` right, rate limit, audit, status codes) and
answers only over SignAndEncrypt. asyncua's Call runs the callback of whatever method node is named, with the
ObjectId first: the callbacks are linked to the instance's method nodes and to the type's (FileType,
TrustListType, ServerConfigurationType), as UaExpert and UaGDS call them, and answer BadMethodInvalid for any other
object. The certificate files are certs/server_certificate.py's and certs/trust_list_update.py's, in the same
pki/ folders the CLI and the channel's certificate check use.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from asyncua import Server, ua

from certs.pki import PKI
from certs.server_certificate import CertificateRefused, ServerCertificateStore
from certs.trust_list_update import ALL, TrustListFolders
from certs.x509io import CertificateFormatError, parse_certificates, thumbprint, to_der

from core.certificate_management import (CERTIFICATE_TYPE, DEFAULT_GROUP, SERVER_CONFIGURATION, TRUST_LIST,
                                         server_identity)

from .asyncua_internals import (channel_security_mode, close_channels_later, external_sessions, open_channels,
                                present_certificate)
from .methods import CallContext, MethodHandlers, MethodStatus
from .trust_list_file import MAX_TRUST_LIST_SIZE, READ, TrustListFile

log = logging.getLogger(__name__)

O = ua.ObjectIds
ACCEPTED_TYPES = (ua.NodeId(), CERTIFICATE_TYPE, ua.NodeId(O.ApplicationCertificateType))
CLOSE_CHANNELS_AFTER_S = 1.0  # a GDS needs about a second between the ApplyChanges answer and the channels' close
RIGHT = "security_admin"
MAX_REJECTED = 256
INTEGERS = (ua.VariantType.SByte, ua.VariantType.Byte, ua.VariantType.Int16, ua.VariantType.UInt16,
            ua.VariantType.Int32, ua.VariantType.UInt32, ua.VariantType.Int64, ua.VariantType.UInt64)


def _method_ids(prefix: str, names: tuple[str, ...]) -> list[tuple[str, ua.NodeId]]:
    return [(n, ua.NodeId(getattr(O, f"{prefix}_{n}"))) for n in names]


CONFIGURATION_METHODS = ("CreateSigningRequest", "UpdateCertificate", "ApplyChanges", "CancelChanges",
                         "GetRejectedList")
FILE_METHODS = ("Open", "Close", "Read", "Write", "GetPosition", "SetPosition")
TRUST_LIST_METHODS = ("OpenWithMasks", "CloseAndUpdate", "AddCertificate", "RemoveCertificate")
TRUST_LIST_PREFIX = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList"
# method name -> every method node it answers on: the instance's, then the type's
METHOD_NODES: dict[str, list[ua.NodeId]] = {}
for _prefix, _names in (("ServerConfiguration", CONFIGURATION_METHODS), ("ServerConfigurationType",
                                                                          CONFIGURATION_METHODS),
                        (TRUST_LIST_PREFIX, FILE_METHODS + TRUST_LIST_METHODS), ("FileType", FILE_METHODS),
                        ("TrustListType", TRUST_LIST_METHODS)):
    for _name, _node in _method_ids(_prefix, _names):
        METHOD_NODES.setdefault(_name, []).append(_node)
# (name, input count) of each method
# GetCertificates (Part 12 1.05) is not in asyncua's namespace 0: start() adds it, on the instance and the type
GET_CERTIFICATES_NODES = (ua.NodeId(O.ServerConfiguration_GetCertificates),
                          ua.NodeId(O.ServerConfigurationType_GetCertificates))
METHOD_NODES["GetCertificates"] = list(GET_CERTIFICATES_NODES)
ARGUMENT_COUNTS = {"GetCertificates": 1,
                   "CreateSigningRequest": 5, "UpdateCertificate": 6, "ApplyChanges": 0, "CancelChanges": 0,
                   "GetRejectedList": 0, "Open": 1, "Close": 1, "Read": 2, "Write": 2, "GetPosition": 1,
                   "SetPosition": 2, "OpenWithMasks": 1, "CloseAndUpdate": 1, "AddCertificate": 2,
                   "RemoveCertificate": 2}


class ServerConfiguration:
    def __init__(self, config, pki: PKI, handlers: MethodHandlers,
                 certificate_changed: Callable[[], None] = lambda: None,
                 emit_event: Callable[[str, int], None] = lambda message, severity: None):
        self.config = config
        self.identity = server_identity(config)
        self.store = ServerCertificateStore(pki.layout.pki_dir)
        self.rejected_dir = pki.layout.rejected
        self.handlers = handlers
        self.certificate_changed = certificate_changed  # the expiry metric and alarm follow the new certificate
        self.emit_event = emit_event  # a server event (message, severity) for what a GDS should be told
        self.server: Server | None = None
        self.trust_list = TrustListFile(TrustListFolders(pki.layout.pki_dir), self._live_sessions)
        self._lock = asyncio.Lock()  # one change of the certificate files at a time
        self._last_refusal = ""

    def _live_sessions(self) -> set[str]:
        return {s.key for s in external_sessions(self.server)} if self.server is not None else set()

    async def start(self, server: Server) -> None:
        """After the server started: present the installed certificate with its chain, fill in the properties,
        link the methods."""
        self.server = server
        present_certificate(server, self.store.certificate(), self.store.private_key(), self.store.issuers())
        values = [
            (O.ServerConfiguration_ServerCapabilities, ["DA", "AC"], ua.VariantType.String),
            (O.ServerConfiguration_SupportedPrivateKeyFormats, ["PEM", "PFX"], ua.VariantType.String),
            (O.ServerConfiguration_MaxTrustListSize, MAX_TRUST_LIST_SIZE, ua.VariantType.UInt32),
            (O.ServerConfiguration_MulticastDnsEnabled, False, ua.VariantType.Boolean),
            (O.ServerConfiguration_HasSecureElement, False, ua.VariantType.Boolean),
            (O.ServerConfiguration_ApplicationUri, self.config.server.application_uri, ua.VariantType.String),
            (O.ServerConfiguration_ProductUri, server.product_uri, ua.VariantType.String),
            (O.ServerConfiguration_ApplicationType, ua.ApplicationType.Server, None),
            (O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_CertificateTypes, [CERTIFICATE_TYPE],
             ua.VariantType.NodeId),
            (O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_Writable, True,
             ua.VariantType.Boolean),
            (O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_UserWritable, True,
             ua.VariantType.Boolean),
        ]
        for node, value, vtype in values:
            await server.get_node(ua.NodeId(node)).write_value(ua.Variant(value, vtype) if vtype else value)
        await self._trust_list_variables()
        await _add_get_certificates(server)
        bodies = {
            "GetCertificates": self._get_certificates,
            "CreateSigningRequest": self._create_signing_request, "UpdateCertificate": self._update_certificate,
            "ApplyChanges": self._apply_changes, "CancelChanges": self._cancel_changes,
            "GetRejectedList": self._get_rejected_list, "Open": self._open, "Close": self._close, "Read": self._read,
            "Write": self._write, "GetPosition": self._get_position, "SetPosition": self._set_position,
            "OpenWithMasks": self._open_with_masks, "CloseAndUpdate": self._close_and_update,
            "AddCertificate": self._add_certificate, "RemoveCertificate": self._remove_certificate,
        }
        for name, body in bodies.items():
            target = SERVER_CONFIGURATION if name in (*CONFIGURATION_METHODS, "GetCertificates") else TRUST_LIST
            label = name if target == SERVER_CONFIGURATION else f"TrustList.{name}"
            callback = self.handlers.wrap(label, "", RIGHT, ARGUMENT_COUNTS[name], self._guarded(target, body))
            for node in METHOD_NODES[name]:
                server.link_method(server.get_node(node), callback)

    def _guarded(self, target: ua.NodeId, body):
        """The object must be this one (a type's method names no object of its own), the channel SignAndEncrypt."""
        async def guarded(ctx: CallContext, args: tuple):
            if ctx.parent != target:
                raise MethodStatus("BadMethodInvalid")
            mode = channel_security_mode(self.server, ctx.session)
            if mode != ua.MessageSecurityMode.SignAndEncrypt:
                raise MethodStatus("BadSecurityModeInsufficient")
            return await body(ctx, args)
        return guarded

    # -- ServerConfiguration ------------------------------------------------------------------------------------
    async def _create_signing_request(self, ctx: CallContext, args: tuple):
        _certificate_group(args[0], 0), _certificate_type(args[1], 1)
        subject, regenerate, nonce = _string(args[2], 2), _boolean(args[3], 3), _bytes(args[4], 4)
        before = self._thumbprint()
        async with self._lock:
            request = await asyncio.to_thread(self._refusing, self.store.signing_request, subject, regenerate, nonce)
        ctx.detail = f"server certificate {before}; CSR for {'a new key' if regenerate else 'the key in use'}"
        return [ua.Variant(request, ua.VariantType.ByteString)]

    async def _update_certificate(self, ctx: CallContext, args: tuple):
        _certificate_group(args[0], 0), _certificate_type(args[1], 1)
        cert, issuers = _bytes(args[2], 2), _bytes_list(args[3], 3)
        key_format, key = _string(args[4], 4), _bytes(args[5], 5)
        before = self._thumbprint()
        ctx.detail = f"server certificate {before}; offered {_thumbprint_of(cert)}"
        async with self._lock:
            try:
                staged = await asyncio.to_thread(self._refusing, self.store.stage, self.identity, cert, issuers,
                                                 key_format, key)
            except MethodStatus:
                ctx.detail += f"; refused: {self._last_refusal}"  # the reason, for the GDS's operator
                raise
        ctx.detail = (f"server certificate {before}; staged {staged.thumbprint} (issuers "
                      f"{', '.join(thumbprint(to_der(c)) for c in staged.issuers) or 'none'}"
                      f"{', new private key' if staged.new_key else ''}) until ApplyChanges")
        return [ua.Variant(True, ua.VariantType.Boolean)]  # applied by ApplyChanges, which closes the channels

    async def _apply_changes(self, ctx: CallContext, args: tuple):
        before = self._thumbprint()
        async with self._lock:
            staged = await asyncio.to_thread(self.store.install_staged)
            if staged is None:
                ctx.detail = f"server certificate {before}; nothing staged"
                return []
            present_certificate(self.server, staged.cert, self.store.private_key(), staged.issuers)
        channels = open_channels(self.server)
        close_channels_later(self.server, channels, CLOSE_CHANNELS_AFTER_S)
        ctx.detail = (f"server certificate {before} -> {staged.thumbprint}; {len(channels)} channels closed in "
                      f"{CLOSE_CHANNELS_AFTER_S:g} s")
        log.warning("server certificate replaced (%s -> %s) through ApplyChanges: existing channels close in %g s",
                    before, staged.thumbprint, CLOSE_CHANNELS_AFTER_S)
        try:
            self.certificate_changed()
        except Exception:  # noqa: BLE001 - the certificate is in use already; the metric's failure is logged
            log.exception("updating the certificate's expiry after ApplyChanges failed")
        return []

    async def _cancel_changes(self, ctx: CallContext, args: tuple):
        async with self._lock:
            had = await asyncio.to_thread(self.store.discard)
        outcome = "staged certificate and requested key discarded" if had else "nothing staged"
        ctx.detail = f"server certificate {self._thumbprint()}; {outcome}"
        return []

    async def _get_certificates(self, ctx: CallContext, args: tuple):
        """Part 12 1.05: the certificate types and certificates of a group; here one group, one RSA-SHA256
        certificate (the one the channels present, leaf only)."""
        _certificate_group(args[0], 0)
        der = await asyncio.to_thread(lambda: to_der(self.store.certificate()))
        ctx.detail = f"server certificate {thumbprint(der)}"
        return [ua.Variant([CERTIFICATE_TYPE], ua.VariantType.NodeId, is_array=True),
                ua.Variant([der], ua.VariantType.ByteString, is_array=True)]

    async def _get_rejected_list(self, ctx: CallContext, args: tuple):
        found = []
        for path in sorted(self.rejected_dir.glob("*"))[:MAX_REJECTED] if self.rejected_dir.is_dir() else []:
            try:
                found.append(parse_certificates(path.read_bytes())[0][0])
            except (OSError, CertificateFormatError):
                continue
        ctx.detail = f"{len(found)} rejected certificates"
        return [ua.Variant(found, ua.VariantType.ByteString, is_array=True)]

    # -- the TrustList file -------------------------------------------------------------------------------------
    async def _open(self, ctx: CallContext, args: tuple):
        mode = _integer(args[0], 0, 0, 255)
        async with self._lock:  # not while an update switches the folders: the list read is the old or the new
            handle = self.trust_list.open(ctx.session.key, mode)
        ctx.detail = f"handle {handle} mode {mode}"
        await self._trust_list_variables()
        return [ua.Variant(handle, ua.VariantType.UInt32)]

    async def _open_with_masks(self, ctx: CallContext, args: tuple):
        masks = _integer(args[0], 0, 0, 0xFFFFFFFF)
        if masks & ~ALL:
            raise MethodStatus("BadInvalidArgument")
        async with self._lock:
            handle = self.trust_list.open(ctx.session.key, READ, masks)
        ctx.detail = f"handle {handle} masks {masks}"
        await self._trust_list_variables()
        return [ua.Variant(handle, ua.VariantType.UInt32)]

    async def _close(self, ctx: CallContext, args: tuple):
        self.trust_list.close(ctx.session.key, _handle(args[0]))
        await self._trust_list_variables()
        return []

    async def _read(self, ctx: CallContext, args: tuple):
        data = self.trust_list.read(ctx.session.key, _handle(args[0]), _integer(args[1], 1, -(2 ** 31), 2 ** 31 - 1))
        return [ua.Variant(data, ua.VariantType.ByteString)]

    async def _write(self, ctx: CallContext, args: tuple):
        self.trust_list.write(ctx.session.key, _handle(args[0]), _bytes(args[1], 1))
        return []

    async def _get_position(self, ctx: CallContext, args: tuple):
        return [ua.Variant(self.trust_list.get_position(ctx.session.key, _handle(args[0])), ua.VariantType.UInt64)]

    async def _set_position(self, ctx: CallContext, args: tuple):
        self.trust_list.set_position(ctx.session.key, _handle(args[0]), _integer(args[1], 1, 0, 2 ** 64 - 1))
        return []

    async def _close_and_update(self, ctx: CallContext, args: tuple):
        async with self._lock:
            try:
                before = await asyncio.to_thread(self.trust_list.folders.thumbprints)
                content = await self.trust_list.close_and_update(ctx.session.key, _handle(args[0]))
                after = await asyncio.to_thread(self.trust_list.folders.thumbprints)
                missing = await asyncio.to_thread(self.trust_list.folders.cas_without_crl)
            finally:
                await self._trust_list_variables()
        ctx.detail = (f"lists {content.specified}; trusted {_listed(before['trusted'])} -> "
                      f"{_listed(after['trusted'])}; issuers {_listed(before['issuers'])} -> "
                      f"{_listed(after['issuers'])}")
        if missing and self.config.security.require_crl:
            # Good all the same (the list is what the GDS wrote), but the GDS and the plant are told
            warning = (f"CAs without a CRL: {', '.join(missing)}: the certificates they issued are refused "
                       "(BadCertificateRevocationUnknown) until their CRLs are added (security.require_crl)")
            ctx.detail += f"; {warning}"
            log.warning("trust list updated through CloseAndUpdate: %s", warning)
            self.emit_event(f"Trust list updated: {warning}", 700)
        return [ua.Variant(False, ua.VariantType.Boolean)]  # in effect at once: the next CreateSession sees it

    async def _add_certificate(self, ctx: CallContext, args: tuple):
        der, trusted = _bytes(args[0], 0), _boolean(args[1], 1)
        ctx.detail = f"add {_thumbprint_of(der)} to {'trusted' if trusted else 'issuers'}"
        async with self._lock:
            await self.trust_list.add_certificate(der, trusted)
        await self._trust_list_variables()
        return []

    async def _remove_certificate(self, ctx: CallContext, args: tuple):
        thumb, trusted = _string(args[0], 0), _boolean(args[1], 1)
        ctx.detail = f"remove {thumb[:64]} from {'trusted' if trusted else 'issuers'}"
        async with self._lock:
            await self.trust_list.remove_certificate(thumb, trusted)
        await self._trust_list_variables()
        return []

    # -- helpers ------------------------------------------------------------------------------------------------
    def _refusing(self, fn, *args):
        try:
            return fn(*args)
        except CertificateRefused as refused:
            log.warning("certificate management refused: %s", refused.reason)
            self._last_refusal = refused.reason  # read right after, under self._lock
            raise MethodStatus(refused.status) from None

    def _thumbprint(self) -> str:
        try:
            return thumbprint(to_der(self.store.certificate()))
        except (OSError, ValueError):
            return "none"

    async def _trust_list_variables(self) -> None:
        node = self.server.get_node
        prefix = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_"
        await node(ua.NodeId(getattr(O, prefix + "Size"))).write_value(
            ua.Variant(await asyncio.to_thread(self.trust_list.size), ua.VariantType.UInt64))
        await node(ua.NodeId(getattr(O, prefix + "OpenCount"))).write_value(
            ua.Variant(len(self.trust_list.handles), ua.VariantType.UInt16))
        await node(ua.NodeId(getattr(O, prefix + "LastUpdateTime"))).write_value(
            ua.Variant(self.trust_list.last_update, ua.VariantType.DateTime))


async def _add_get_certificates(server: Server) -> None:
    """ServerConfiguration.GetCertificates and ServerConfigurationType's, with their argument descriptions."""
    def argument(name: str, data_type: int, array: bool, text: str) -> ua.Argument:
        return ua.Argument(Name=name, DataType=ua.NodeId(data_type), ValueRank=1 if array else -1,
                           ArrayDimensions=[0] if array else [], Description=ua.LocalizedText(text))
    inputs = [argument("CertificateGroupId", O.NodeId, False, "the certificate group (null: the default group)")]
    outputs = [argument("CertificateTypeIds", O.NodeId, True, "the type of each certificate"),
               argument("Certificates", O.ByteString, True, "the group's certificates, DER")]
    for parent, node in zip((SERVER_CONFIGURATION, ua.NodeId(O.ServerConfigurationType)), GET_CERTIFICATES_NODES):
        try:
            await server.get_node(node).read_browse_name()
            continue  # a newer namespace 0 has it already
        except ua.UaStatusCodeError:
            pass
        await server.get_node(parent).add_method(node, ua.QualifiedName("GetCertificates", 0),
                                                 lambda parent, *args: [], inputs, outputs)


def _listed(thumbs: list[str]) -> str:
    return "[" + ", ".join(thumbs) + "]"


def _thumbprint_of(der: bytes) -> str:
    try:
        return thumbprint(parse_certificates(bytes(der))[0][0])
    except (CertificateFormatError, TypeError):
        return "unparseable"


def _value(arg, index: int, types: tuple, array: bool = False):
    if not isinstance(arg, ua.Variant) or arg.VariantType not in types:
        raise MethodStatus("BadTypeMismatch")
    if (isinstance(arg.Value, list) or arg.is_array) != array:
        raise MethodStatus("BadTypeMismatch")
    return arg.Value


def _string(arg, index: int) -> str:
    return _value(arg, index, (ua.VariantType.String,)) or ""


def _boolean(arg, index: int) -> bool:
    return bool(_value(arg, index, (ua.VariantType.Boolean,)))


def _bytes(arg, index: int) -> bytes:
    return bytes(_value(arg, index, (ua.VariantType.ByteString,)) or b"")


def _bytes_list(arg, index: int) -> list[bytes]:
    if isinstance(arg, ua.Variant) and arg.VariantType == ua.VariantType.ByteString and arg.Value is None:
        return []
    return [bytes(v or b"") for v in _value(arg, index, (ua.VariantType.ByteString,), array=True) or []]


def _integer(arg, index: int, low: int, high: int) -> int:
    value = _value(arg, index, INTEGERS)
    if not low <= value <= high:
        raise MethodStatus("BadInvalidArgument")
    return int(value)


def _handle(arg) -> int:
    return _integer(arg, 0, 0, 0xFFFFFFFF)


def _certificate_group(arg, index: int) -> None:
    group = _value(arg, index, (ua.VariantType.NodeId,))
    if group not in (ua.NodeId(), DEFAULT_GROUP):
        raise MethodStatus("BadInvalidArgument")


def _certificate_type(arg, index: int) -> None:
    if _value(arg, index, (ua.VariantType.NodeId,)) not in ACCEPTED_TYPES:
        raise MethodStatus("BadInvalidArgument")
