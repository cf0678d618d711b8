"""A/B variants: the YAML rules, a stable split of callers by a hash of their identity (1,000 identities within 3
points of the weights, sticky), per-variant metrics, and Admin/PromoteVariant (and `appliance models promote`)
switching all traffic at once, audited; on a real server with real certificates over SignAndEncrypt."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from asyncua import ua

from appliance.client import connect
from core.config import ConfigError, load_config_text
from appliance.variants import bucket, choose
from attack_tools import SAMPLE, close, start_appliance
from onnx_models import affine_model
from uaclient import call, floats, run, status_name

ROOT = Path(__file__).resolve().parent.parent
S = ua.VariantType.String


def test_a_split_of_1000_identities_follows_the_weights_and_is_sticky():
    weights = {"canary": 10.0, "candidate": 30.0}
    identities = [f"{i:040x}/x509:{(i * 7919):040x}" for i in range(1000)]
    first = [choose(who, "te-classifier", weights) for who in identities]
    shares = Counter(first)
    assert abs(shares["canary"] / 10 - 10) <= 3 and abs(shares["candidate"] / 10 - 30) <= 3
    assert abs(shares["main"] / 10 - 60) <= 3, shares
    assert first == [choose(who, "te-classifier", dict(weights)) for who in identities]  # sticky
    assert all(0 <= bucket(who, "m") < 100 for who in identities[:50])
    other = [choose(who, "other-model", weights) for who in identities]  # another model splits independently
    assert other != first


def test_variant_settings_are_checked_with_file_line_and_key(tmp_path):
    model = affine_model(tmp_path / "m.onnx")
    text = f"""models:
  m:
    kind: tensor
    path: {model}
    variants:
      b: {{path: {model}, weight: 70}}
      c: {{path: {model}, weight: 40}}
"""
    with pytest.raises(ConfigError) as e:
        load_config_text(text, "a.yaml", tmp_path)
    assert "a.yaml:6: models.m.variants: the variants' weights add up to 110" in str(e.value)
    bad = text.replace("weight: 40", "weight: -1").replace(f"path: {model}, weight: 70", "path: gone.onnx, weight: 5")
    with pytest.raises(ConfigError) as e:
        load_config_text(bad, "a.yaml", tmp_path)
    assert "a.yaml:6: models.m.variants.b.path: no such file" in str(e.value)
    assert "a.yaml:7: models.m.variants.c.weight: expected a number in [0, 100], got -1" in str(e.value)
    ok = load_config_text(text.replace("weight: 40", "weight: 30"), "a.yaml", tmp_path)
    assert {n: v.weight for n, v in ok.models["m"].variants.items()} == {"b": 70, "c": 30}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tmp_path_factory.mktemp("variants")
    b = affine_model(folder / "affine-b.onnx", scale=3.0)
    a = start_appliance(folder, version="v-main", variants={"b": {"path": str(b), "weight": 50, "version": "v-b"}})
    # Certificates are fresh each run, so their arms are random: issue callers until both arms have two.
    a.callers = [a.operator]
    while len(a.callers) < 6 or min(arms(a.callers).count("v-b"), arms(a.callers).count("v-main")) < 2:
        assert len(a.callers) < 40, "forty identities all hashed into one arm of a 50/50 split"
        a.callers.append(a.issue(f"plc{len(a.callers) + 1}", "operator"))
    a.engineer = a.issue("eng", "engineer")
    yield a
    a.stop()


def identity_of(cert: Path) -> str:
    import hashlib
    thumb = hashlib.sha1(cert.read_bytes()).hexdigest()
    return f"{thumb}/x509:{thumb}"


def arms(callers) -> list[str]:
    """The version each caller must meet under the configured 50/50 split."""
    return ["v-b" if choose(identity_of(c), "affine", {"b": 50}) == "b" else "v-main" for c, _ in callers]


async def versions(app) -> list[str]:
    out = []
    for cert, key in app.callers:
        client = await connect(app.endpoint, cert, key)
        try:
            seen = set()
            for _ in range(2):
                r = await call(client, "affine", "Infer", [floats(SAMPLE)])
                assert status_name(r) == "Good"
                seen.add(r.OutputArguments[1].Value)
            assert len(seen) == 1  # sticky within and across calls
            out.append(seen.pop())
        finally:
            await close(client)
    return out


def test_callers_meet_their_variant_and_promote_switches_all_at_once(app):
    expected = arms(app.callers)
    assert set(expected) == {"v-b", "v-main"}  # both arms are exercised
    assert run(versions(app)) == expected

    async def promote(creds, variant):
        client = await connect(app.endpoint, *creds)
        try:
            return status_name(await call(client, "", "PromoteVariant", [ua.Variant("affine", S),
                                                                          ua.Variant(variant, S)]))
        finally:
            await close(client)

    assert run(promote(app.operator, "b")) == "BadUserAccessDenied"
    assert run(promote(app.engineer, "nope")) == "BadInvalidArgument"
    assert run(promote(app.engineer, "b")) == "Good"
    assert run(versions(app)) == ["v-b"] * len(app.callers)
    assert json.loads((app.state_dir / "variants.json").read_text()) == {"affine": "b"}
    assert run(promote(app.engineer, "main")) == "Good"
    assert run(versions(app)) == ["v-main"] * len(app.callers)
    p = subprocess.run([sys.executable, "-m", "appliance", "models", "promote", "affine", "", "--config",
                        str(app.config_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "configured split" in p.stdout, p.stdout + p.stderr
    assert run(versions(app)) == expected

    text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10).read().decode()
    assert 'appliance_requests_total{method="Infer",model="affine",status="Good",variant="b"}' in text
    assert 'appliance_requests_total{method="Infer",model="affine",status="Good",variant="main"}' in text

    audit = app.state_dir / "audit" / "audit.jsonl"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        promotes = [json.loads(l) for l in audit.read_text().splitlines() if '"promote"' in l]
        if len(promotes) >= 5:
            break
        time.sleep(0.05)
    assert [(r["status"], r["detail"]) for r in promotes if r["status"] == "Good"][:2] == [
        ("Good", "all traffic of affine to variant b"), ("Good", "all traffic of affine to variant main")]
    assert any(r["status"] == "BadUserAccessDenied" for r in promotes if r["event"] in ("promote", "role_denied")) \
        or any(json.loads(l)["action"] == "PromoteVariant" and json.loads(l)["event"] == "role_denied"
               for l in audit.read_text().splitlines())
    admin = [json.loads(l) for l in (audit.with_name("admin.jsonl")).read_text().splitlines()]
    assert any(r["event"] == "promote" and r["status"] == "Good" for r in admin)
