"""The fleet manifests (deploy/k8s) are valid Kubernetes 1.37 resources (kubernetes-validate, strict), the
ConfigMap carries a configuration the appliance accepts, and the probes use the contract's endpoints."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from appliance.config import load_config_text

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_configmap_holds_a_valid_appliance_configuration():
    cm = yaml.safe_load((K8S / "configmap.yaml").read_text())
    cfg = load_config_text(cm["data"]["appliance.yaml"], source="configmap.yaml")
    assert cfg.server.endpoint.endswith(":4840") and cfg.metrics.port == 9464


def test_daemonset_uses_host_network_probes_and_scrape_annotations():
    ds = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    spec = ds["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert spec["hostNetwork"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {"namespace.yaml", "configmap.yaml", "daemonset.yaml"}
