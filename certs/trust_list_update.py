"""The trust list as Part 12 sees it (trusted certificates and CRLs, issuer certificates and CRLs), read from and
written to the same pki/ folders the CLI and the channel's certificate check use.

A replacement is checked whole before any file moves. Each affected folder is then built beside the live one
(`.trusted.new`, files and folder fsynced), and a journal naming those folders (`pki/.trust-update.json`) is
written and fsynced: that is the commit point. Then each live folder is renamed to `.NAME.old` and the new one
into its place, the journal removed and the old folders deleted. A crash (power cut, kill -9) at any step leaves
either no journal (the old list is live: the staged folders are deleted at the next start) or the journal (the
next start, `recover()`, finishes the switch): the old list or the new one, never neither, never a mix. While the
journal exists the validator keeps the list it had (certs/store.py), so a running server sees the switch whole.
A rename that fails after the commit is undone in the same way (the new folder back to `.NAME.new`, the old
one back in place), so the list stays the old one. Masks are Part 12's TrustListMasks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .layout import PkiLayout
from .store import is_ca, load_snapshot
from .records import PKIError
from .x509io import (MALFORMED, CertificateFormatError, normalize_thumbprint, parse_certificates, parse_crl,
                     safe_file_stem, thumbprint, write_atomic)

log = logging.getLogger("appliance.certs")

TRUSTED_CERTIFICATES, TRUSTED_CRLS, ISSUER_CERTIFICATES, ISSUER_CRLS = 1, 2, 4, 8
ALL = 15
MAX_ENTRIES = 1000  # per list: bounds what one CloseAndUpdate makes the appliance parse and write


class TrustListRefused(PKIError):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class TrustListContent:
    """DER blobs, as TrustListDataType carries them; specified: which lists this content stands for."""

    specified: int = ALL
    trusted_certificates: list[bytes] = field(default_factory=list)
    trusted_crls: list[bytes] = field(default_factory=list)
    issuer_certificates: list[bytes] = field(default_factory=list)
    issuer_crls: list[bytes] = field(default_factory=list)

    def masked(self, masks: int) -> "TrustListContent":
        """Only the lists in masks (OpenWithMasks)."""
        return TrustListContent(
            masks & ALL,
            self.trusted_certificates if masks & TRUSTED_CERTIFICATES else [],
            self.trusted_crls if masks & TRUSTED_CRLS else [],
            self.issuer_certificates if masks & ISSUER_CERTIFICATES else [],
            self.issuer_crls if masks & ISSUER_CRLS else [])


@dataclass
class _Entry:
    der: bytes
    path: Path | None  # the file it is stored in, if it is stored
    subject: x509.Name | None = None  # a certificate's subject, or a CRL's issuer


class TrustListFolders:
    def __init__(self, pki_dir: Path):
        self.layout = PkiLayout(Path(pki_dir))

    # -- reading -------------------------------------------------------------------------------------------------
    def read(self) -> TrustListContent:
        trusted = self._certificates(self.layout.trusted)
        crls = self._crls()
        trusted_names = {e.subject for e in trusted}
        return TrustListContent(
            ALL, [e.der for e in trusted], [e.der for e in crls if e.subject in trusted_names],
            [e.der for e in self._certificates(self.layout.issuers)],
            [e.der for e in crls if e.subject not in trusted_names])

    def cas_without_crl(self) -> list[str]:
        """The subjects of the trusted and issuer CA certificates no CRL in crl/ is issued by."""
        return [c.cert.subject.rfc4514_string() for c in load_snapshot(self.layout).cas_without_crl()]

    def thumbprints(self) -> dict[str, list[str]]:
        """For the audit trail: thumbprints of the trusted and issuer certificates."""
        return {"trusted": sorted(thumbprint(e.der) for e in self._certificates(self.layout.trusted)),
                "issuers": sorted(thumbprint(e.der) for e in self._certificates(self.layout.issuers))}

    @staticmethod
    def _files(folder: Path) -> list[Path]:
        try:
            return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def _certificates(self, folder: Path) -> list[_Entry]:
        out = []
        for path in self._files(folder):
            try:
                out += [_Entry(der, path, cert.subject) for der, cert in parse_certificates(path.read_bytes())]
            except (OSError, CertificateFormatError):
                continue  # not a certificate: no part of the trust list (`certs list` names it)
        return out

    def _crls(self) -> list[_Entry]:
        out = []
        for path in self._files(self.layout.crl):
            try:
                data = path.read_bytes()
                crl = parse_crl(data)
                out.append(_Entry(_crl_der(crl), path, crl.issuer))
            except (OSError, CertificateFormatError):
                continue
        return out

    # -- CloseAndUpdate ------------------------------------------------------------------------------------------
    def replace(self, new: TrustListContent) -> None:
        """Replace the lists named in new.specified; the others stay. All or nothing."""
        specified = new.specified & ALL
        trusted = _parse_certificates(new.trusted_certificates, "trusted certificate")
        issuers = _parse_certificates(new.issuer_certificates, "issuer certificate")
        if specified & ISSUER_CERTIFICATES and not all(is_ca(x509.load_der_x509_certificate(e.der)) for e in issuers):
            raise TrustListRefused("BadCertificateInvalid", "an issuer certificate must be a CA certificate")
        trusted_crls = _parse_crls(new.trusted_crls)
        issuer_crls = _parse_crls(new.issuer_crls)
        plan: dict[Path, list[_Entry]] = {}
        if specified & TRUSTED_CERTIFICATES:
            plan[self.layout.trusted] = trusted
        if specified & ISSUER_CERTIFICATES:
            plan[self.layout.issuers] = issuers
        if specified & (TRUSTED_CRLS | ISSUER_CRLS):
            current = self._crls()
            names = {e.subject for e in self._certificates(self.layout.trusted)}
            keep_trusted = [e for e in current if e.subject in names]
            keep_issuer = [e for e in current if e.subject not in names]
            plan[self.layout.crl] = ((trusted_crls if specified & TRUSTED_CRLS else keep_trusted)
                                     + (issuer_crls if specified & ISSUER_CRLS else keep_issuer))
        self._swap_in(plan)

    @property
    def journal(self) -> Path:
        return journal_path(self.layout)

    def _swap_in(self, plan: dict[Path, list[_Entry]]) -> None:
        recover(self.layout)  # an earlier update cut short is finished (or dropped) first
        staged: dict[Path, Path] = {}
        try:
            for folder, entries in plan.items():
                shutil.rmtree(_old(folder), ignore_errors=True)
                staged[folder] = self._build(folder, entries)
                _fsync_dir(staged[folder])
            _fsync_dir(self.layout.pki_dir)
        except OSError as exc:
            for folder in plan:  # the one being built too
                shutil.rmtree(_new(folder), ignore_errors=True)
            raise TrustListRefused("BadInternalError", f"the trust list could not be staged: {exc.strerror}") from None
        names = [folder.name for folder in staged]
        try:
            # the commit point: from here on the next start finishes the switch
            write_atomic(self.journal, json.dumps({"folders": names}).encode(), 0o600)
            _fsync_dir(self.layout.pki_dir)
        except OSError as exc:
            for tmp in staged.values():
                shutil.rmtree(tmp, ignore_errors=True)
            raise TrustListRefused("BadInternalError", f"the trust list could not be staged: {exc.strerror}") from None
        try:
            _switch(self.layout, names)
        except OSError as exc:
            _undo(self.layout, names)
            raise TrustListRefused("BadInternalError",
                                   f"the trust list could not be replaced: {exc.strerror}") from None
        _finish(self.layout, names)

    def _build(self, folder: Path, entries: list[_Entry]) -> Path:
        """The new folder beside the live one: kept files linked (same names, so `certs revoke NAME` still finds
        them), new entries written, files that hold no certificate or CRL carried over as they are."""
        tmp = folder.with_name(f".{folder.name}.new")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        wanted = {e.der for e in entries}
        is_crl = folder == self.layout.crl
        current = self._crls() if is_crl else self._certificates(folder)
        stored_ders: dict[Path, set[bytes]] = {}
        for e in current:
            stored_ders.setdefault(e.path, set()).add(e.der)
        placed: set[bytes] = set()
        for path in self._files(folder):
            ders = stored_ders.get(path)
            if ders is None or ders <= wanted:  # not a certificate (left as it is), or every entry in it stays
                _link_or_copy(path, tmp / path.name)
                placed |= ders or set()
        for e in entries:
            if e.der in placed:
                continue
            placed.add(e.der)
            write_atomic(tmp / _file_name(tmp, e, is_crl), e.der, 0o644)
        return tmp

    # -- AddCertificate / RemoveCertificate ----------------------------------------------------------------------
    def add_certificate(self, der: bytes, trusted: bool) -> Path:
        entry = _parse_certificates([der], "certificate")[0]
        cert = x509.load_der_x509_certificate(entry.der)
        if not trusted and not _is_ca(cert):
            raise TrustListRefused("BadCertificateInvalid", "an issuer certificate must be a CA certificate")
        folder = self.layout.trusted if trusted else self.layout.issuers
        existing = next((e.path for e in self._certificates(folder) if e.der == entry.der), None)
        if existing is not None:
            return existing
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / _file_name(folder, entry, False)
        write_atomic(target, entry.der, 0o644)
        return target

    def remove_certificate(self, thumb: str, trusted: bool) -> list[Path]:
        """Remove the certificate (and, for a CA, its CRLs); the files touched."""
        wanted = normalize_thumbprint(thumb or "")
        if wanted is None:
            raise TrustListRefused("BadInvalidArgument", "the thumbprint is not 40 hexadecimal digits")
        folder = self.layout.trusted if trusted else self.layout.issuers
        found = [e for e in self._certificates(folder) if thumbprint(e.der) == wanted]
        if not found:
            raise TrustListRefused("BadInvalidArgument", "no such certificate in that list")
        touched = []
        for e in found:
            rest = [d for d, _ in parse_certificates(e.path.read_bytes()) if thumbprint(d) != wanted]
            if rest:
                write_atomic(e.path, b"".join(rest), 0o644)
            else:
                e.path.unlink(missing_ok=True)
            touched.append(e.path)
            cert = x509.load_der_x509_certificate(e.der)
            if _is_ca(cert):
                for crl in self._crls():
                    if crl.subject == cert.subject:
                        crl.path.unlink(missing_ok=True)
                        touched.append(crl.path)
        return touched


def _crl_der(crl: x509.CertificateRevocationList) -> bytes:
    return crl.public_bytes(serialization.Encoding.DER)


def _parse_certificates(ders: list[bytes], what: str) -> list[_Entry]:
    if len(ders) > MAX_ENTRIES:
        raise TrustListRefused("BadInvalidArgument", f"more than {MAX_ENTRIES} entries in one list")
    out = []
    for der in ders:
        try:
            parts = parse_certificates(bytes(der or b""))
            if len(parts) != 1:
                raise CertificateFormatError("one certificate per entry")
            cert = parts[0][1]
            cert.extensions  # parsed lazily: malformed extensions raise here
            cert.not_valid_after_utc
        except (CertificateFormatError, *MALFORMED):
            raise TrustListRefused("BadCertificateInvalid", f"a {what} is not a DER X.509 certificate") from None
        out.append(_Entry(parts[0][0], None, cert.subject))
    return out


def _parse_crls(ders: list[bytes]) -> list[_Entry]:
    if len(ders) > MAX_ENTRIES:
        raise TrustListRefused("BadInvalidArgument", f"more than {MAX_ENTRIES} entries in one list")
    out = []
    for der in ders:
        try:
            crl = parse_crl(bytes(der or b""))
            issuer = crl.issuer
        except (CertificateFormatError, ValueError, TypeError):
            raise TrustListRefused("BadCertificateInvalid", "a CRL is not a DER X.509 CRL") from None
        out.append(_Entry(_crl_der(crl), None, issuer))
    return out


def _file_name(folder: Path, entry: _Entry, is_crl: bool) -> str:
    digest = hashlib.sha1(entry.der).hexdigest()
    cn = ""
    if entry.subject is not None:
        attrs = entry.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        cn = str(attrs[0].value) if attrs else ""
    stem = f"{safe_file_stem(cn or 'cert', 48)}_{digest[:8]}"
    return f"{stem}.crl.der" if is_crl else f"{stem}.der"


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (x509.ExtensionNotFound, ValueError):
        return False


# -- the folder switch and its recovery -------------------------------------------------------------------------
SWITCHED = ("trusted", "issuers", "crl")


def journal_path(layout: PkiLayout) -> Path:
    return layout.trust_journal


def _new(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.new")


def _old(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.old")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _switch(layout: PkiLayout, names: list[str]) -> None:
    """Each named folder: live -> .NAME.old, .NAME.new -> live. Idempotent from any point it was cut at."""
    for name in names:
        folder = layout.pki_dir / name
        if not _new(folder).exists():
            continue  # switched already
        if folder.exists():
            shutil.rmtree(_old(folder), ignore_errors=True)  # a leftover: the live folder holds the old list
            os.rename(folder, _old(folder))
        os.rename(_new(folder), folder)
    _fsync_dir(layout.pki_dir)


def _undo(layout: PkiLayout, names: list[str]) -> None:
    """A rename failed after the commit: each switched folder back (new -> .NAME.new, .NAME.old -> live) so the
    state is that of before the switch, then the journal and the staged folders go. A crash in here leaves the
    journal, and the next start finishes the switch instead: the new list, whole."""
    try:
        for name in reversed(names):
            folder = layout.pki_dir / name
            if _old(folder).exists():
                if folder.exists():
                    shutil.rmtree(_new(folder), ignore_errors=True)
                    os.rename(folder, _new(folder))
                os.rename(_old(folder), folder)
        _fsync_dir(layout.pki_dir)
        journal_path(layout).unlink(missing_ok=True)
        _fsync_dir(layout.pki_dir)
    except OSError as exc:  # the journal stays: the next start finishes the switch
        log.error("undoing a failed trust list switch failed too (%s): the next start completes it", exc.strerror)
        return
    for name in names:
        shutil.rmtree(_new(layout.pki_dir / name), ignore_errors=True)


def _finish(layout: PkiLayout, names: list[str]) -> None:
    journal_path(layout).unlink(missing_ok=True)
    _fsync_dir(layout.pki_dir)
    for name in names:
        shutil.rmtree(_old(layout.pki_dir / name), ignore_errors=True)


def recover(layout: PkiLayout) -> str | None:
    """At start (and before each update): a switch cut short by a crash is finished (journal present) or its
    staging dropped (no journal). Returns what was done, for the log, or None."""
    journal = journal_path(layout)
    for torn in layout.pki_dir.glob(f".{journal.name}.*.tmp"):  # a journal cut before its rename: never committed
        torn.unlink(missing_ok=True)
    try:
        names = [n for n in json.loads(journal.read_text())["folders"] if n in SWITCHED]
    except FileNotFoundError:
        names = None
    except (OSError, ValueError, KeyError, TypeError):
        names = None  # a journal torn before its rename cannot exist (written atomically); unreadable: dropped
        log.error("the trust list journal %s is unreadable: the update it stood for is dropped", journal.name)
        journal.unlink(missing_ok=True)
    if names is not None:
        _switch(layout, names)
        _finish(layout, names)
        log.warning("finished a trust list update cut short (%s): the new list is in place", ", ".join(names))
        return "finished"
    done = None
    for name in SWITCHED:
        folder = layout.pki_dir / name
        if _new(folder).exists():
            shutil.rmtree(_new(folder), ignore_errors=True)  # staged, never committed: the old list stays
            done = "dropped"
        if _old(folder).exists():
            if not folder.exists():
                os.rename(_old(folder), folder)  # an old-style swap cut between its renames: the old list back
                done = "restored"
            else:
                shutil.rmtree(_old(folder), ignore_errors=True)
    if done:
        log.warning("a trust list update cut short before its commit was dropped: the previous list is in place")
    return done
