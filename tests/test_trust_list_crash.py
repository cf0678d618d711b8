"""The trust list update (CloseAndUpdate's file work) as a power cut meets it: the process stops dead after each
file-system step of the switch (every rename, unlink, link, mkdir, chmod and fsync, counted one by one), the next
start recovers, and the trust list is then the old one or the new one, whole: never neither, never a mix. A
failure that is not a crash rolls back to the old list. A replaced issuers list holds CA certificates only."""
from __future__ import annotations

import os
import shutil
import socket

import pytest

from certs.pki import PKI
from certs.trust_list_update import ALL, TrustListContent, TrustListFolders, TrustListRefused
from certificates import make_test_certificate, make_test_crl

MUTATIONS = ("rename", "replace", "unlink", "rmdir", "link", "mkdir", "chmod", "fsync")


class PowerCut(BaseException):
    """Not an OSError: nothing in the code under test handles it, as nothing runs after a power cut."""


class CutAfter:
    """Lets `steps` file-system mutations through; then the power is gone: this and every later one raises."""

    def __init__(self, monkeypatch, steps: int):
        self.steps, self.done, self.cut = steps, 0, False
        for name in MUTATIONS:
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, real):
        def mutation(*args, **kwargs):
            if self.cut or self.done >= self.steps:
                self.cut = True
                raise PowerCut()
            self.done += 1
            return real(*args, **kwargs)
        return mutation


def _as_sets(content: TrustListContent) -> tuple:
    return tuple(frozenset(x) for x in (content.trusted_certificates, content.trusted_crls,
                                        content.issuer_certificates, content.issuer_crls))


@pytest.fixture(scope="module")
def lists(tmp_path_factory):
    """A box with its CA, two issued clients and a plant root; the new list: the plant's CA, an intermediate in
    issuers, their CRLs, one client less."""
    base = tmp_path_factory.mktemp("trust_crash")
    pki = PKI(base / "state")
    pki.init(f"urn:{socket.gethostname()}:appliance", ["localhost"], ["127.0.0.1"])
    for name in ("plc1", "plc2"):
        pki.issue(name, "operator", base / "clients", "host")
    root = make_test_certificate("Plant Root", is_ca=True, path_length=1, application_uri=None)
    inter = make_test_certificate("Plant Issuing", issuer=root, is_ca=True, path_length=0, application_uri=None)
    folders = TrustListFolders(pki.layout.pki_dir)
    old = folders.read()
    new = TrustListContent(
        ALL, [c for c in old.trusted_certificates if c != (base / "clients" / "plc2.der").read_bytes()]
        + [root.cert_der], old.trusted_crls + [make_test_crl(root, [])], [inter.cert_der], [make_test_crl(inter, [])])
    return pki.layout.pki_dir, old, new, inter


def _fresh(pristine, tmp_path):
    work = tmp_path / "pki"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work, symlinks=True)
    return work


def _leftovers(pki_dir) -> list[str]:
    return sorted(p.name for p in pki_dir.iterdir() if p.name.startswith("."))


def test_a_power_cut_at_every_step_leaves_the_old_or_the_new_list(lists, tmp_path, monkeypatch):
    pristine, old, new, _ = lists
    outcomes = []
    steps = 0
    while True:
        work = _fresh(pristine, tmp_path)
        with monkeypatch.context() as patch:
            cut = CutAfter(patch, steps)
            try:
                TrustListFolders(work).replace(new)
            except PowerCut:
                pass
        # the next start: what `appliance serve` runs on its PKI before it serves
        PKI(work.parent).ensure(f"urn:{socket.gethostname()}:appliance", ["localhost"], ["127.0.0.1"])
        found = _as_sets(TrustListFolders(work).read())
        assert found in (_as_sets(old), _as_sets(new)), f"after {steps} steps: neither the old nor the new list"
        assert _leftovers(work) == [], f"after {steps} steps: {_leftovers(work)} left behind"
        outcomes.append("new" if found == _as_sets(new) else "old")
        if not cut.cut:
            break  # the update ran to its end
        steps += 1
    assert steps > 20  # every step of the staging, the commit and the switch was cut once
    assert outcomes[0] == "old" and outcomes[-1] == "new"
    # once committed, always the new list: the switch is one decision, not one per folder
    first_new = outcomes.index("new")
    assert outcomes[first_new:] == ["new"] * (len(outcomes) - first_new)


def test_a_failing_rename_rolls_back_to_the_old_list(lists, tmp_path, monkeypatch):
    pristine, old, new, _ = lists
    work = _fresh(pristine, tmp_path)
    real_rename = os.rename
    failed = []

    def rename(src, dst, *args, **kwargs):
        # the new crl/ into place, the last rename of the switch (the other folders are switched): fails once
        if os.fspath(src) == os.fspath(work / ".crl.new") and not failed:
            failed.append(dst)
            raise OSError(5, "Input/output error")
        return real_rename(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(TrustListRefused) as refused:
        TrustListFolders(work).replace(new)
    monkeypatch.undo()
    assert failed and refused.value.status == "BadInternalError" and str(work) not in refused.value.reason
    assert _as_sets(TrustListFolders(work).read()) == _as_sets(old)
    assert _leftovers(work) == []


def test_a_full_disk_while_staging_leaves_the_old_list(lists, tmp_path, monkeypatch):
    pristine, old, new, _ = lists
    work = _fresh(pristine, tmp_path)

    def fsync(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(TrustListRefused) as refused:
        TrustListFolders(work).replace(new)
    monkeypatch.undo()
    assert refused.value.status == "BadInternalError"
    assert _as_sets(TrustListFolders(work).read()) == _as_sets(old)
    assert _leftovers(work) == []


def test_issuers_of_a_replaced_list_must_be_cas(lists, tmp_path):
    pristine, old, new, inter = lists
    work = _fresh(pristine, tmp_path)
    leaf = make_test_certificate("not-a-ca", issuer=inter, application_uri=None)
    bad = TrustListContent(ALL, new.trusted_certificates, new.trusted_crls, [inter.cert_der, leaf.cert_der],
                           new.issuer_crls)
    with pytest.raises(TrustListRefused) as refused:
        TrustListFolders(work).replace(bad)
    assert refused.value.status == "BadCertificateInvalid" and "CA" in refused.value.reason
    assert _as_sets(TrustListFolders(work).read()) == _as_sets(old)
