"""The fleet manifests (deploy/k8s): the base and the GPU overlay rendered by kustomize (`kubectl kustomize`, the
renderer Flux and Argo CD embed) are valid Kubernetes 1.37 resources (kubernetes-validate, strict); the generated
ConfigMap carries a configuration the appliance accepts and a changed YAML changes the DaemonSet's pod template (so a
GitOps apply rolls it); the state hostPath is made the service user's before the appliance starts; probes use the
contract's endpoints; the GPU overlay asks for a GPU; a fleet applies the base and the GPU overlay side by side
(different DaemonSet names and selectors, each on its own nodes: one appliance per node)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from core.config import load_config_text

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl (with its built-in kustomize) is not installed; "
                                       "scripts/setup-system.sh installs it")


def render(directory: Path) -> dict[str, dict]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out.stdout)}


def pod(docs: dict) -> dict:
    return docs["DaemonSet"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("directory", ["base", "overlays/gpu"])
def test_rendered_manifests_are_valid(directory):
    docs = render(K8S / directory)
    assert set(docs) == {"Namespace", "ConfigMap", "DaemonSet"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "opcua-appliance"


def test_the_daemonset_mounts_the_generated_configmap_and_it_is_a_valid_configuration():
    docs = render(K8S / "base")
    name = docs["ConfigMap"]["metadata"]["name"]
    assert name.startswith("appliance-config-")  # kustomize's content hash
    volumes = {v["name"]: v for v in pod(docs)["volumes"]}
    assert volumes["config"]["configMap"]["name"] == name
    cfg = load_config_text(docs["ConfigMap"]["data"]["appliance.yaml"], source="appliance.yaml")
    assert cfg.server.endpoint.endswith(":4840") and cfg.metrics.port == 9464
    assert str(cfg.server.state_dir) == "/var/lib/appliance"


def test_a_changed_yaml_rolls_the_daemonset(tmp_path):
    before = render(K8S / "base")
    copy = tmp_path / "base"
    shutil.copytree(K8S / "base", copy)
    (copy / "appliance.yaml").write_text((copy / "appliance.yaml").read_text().replace("format: json",
                                                                                      "format: text"))
    after = render(copy)
    assert after["ConfigMap"]["metadata"]["name"] != before["ConfigMap"]["metadata"]["name"]
    # a new pod template: the DaemonSet's rolling update replaces the pods, one node at a time
    assert after["DaemonSet"]["spec"]["template"] != before["DaemonSet"]["spec"]["template"]
    assert before["DaemonSet"]["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_the_state_directory_is_the_service_users_before_the_appliance_starts():
    spec = pod(render(K8S / "base"))
    state = next(v for v in spec["volumes"] if v["name"] == "state")
    assert state["hostPath"] == {"path": "/var/lib/appliance", "type": "DirectoryOrCreate"}  # kubelet: root, 0755
    (init,) = spec["initContainers"]
    (app,) = spec["containers"]
    assert init["image"] == app["image"]  # the same /etc/passwd: `appliance` is the uid the appliance runs as
    assert init["command"][-1] == "chown appliance:appliance /var/lib/appliance && chmod 0750 /var/lib/appliance"
    assert {"name": "state", "mountPath": "/var/lib/appliance"} in init["volumeMounts"]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    # the appliance runs as the image's user (its uid from the package's sysusers), never as root, no fixed uid
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "runAsUser" not in spec["securityContext"] and "runAsUser" not in app["securityContext"]
    assert app["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_host_network_probes_and_scrape_annotations():
    docs = render(K8S / "base")
    spec, container = pod(docs), pod(docs)["containers"][0]
    assert spec["hostNetwork"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert docs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9464"


def test_the_gpu_overlay_asks_for_a_gpu_and_keeps_the_rest():
    base, gpu = render(K8S / "base"), render(K8S / "overlays" / "gpu")
    container = pod(gpu)["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "16Gi"}
    assert pod(gpu)["nodeSelector"] == {"opcua-appliance": "true", "nvidia.com/gpu.present": "true"}
    for key in ("initContainers", "securityContext", "hostNetwork"):
        assert pod(gpu)[key] == pod(base)[key], key
    # the same volumes, the config one naming the overlay's own (suffixed) ConfigMap
    assert [v for v in pod(gpu)["volumes"] if v["name"] != "config"] == \
        [v for v in pod(base)["volumes"] if v["name"] != "config"]
    assert {"name": "config", "configMap": {"name": gpu["ConfigMap"]["metadata"]["name"]}} in pod(gpu)["volumes"]
    assert gpu["ConfigMap"]["data"] == base["ConfigMap"]["data"]


def node_matches(spec: dict, labels: dict[str, str]) -> bool:
    """Whether the scheduler may place this pod spec on a node with these labels: its nodeSelector and its required
    node affinity (the operators the manifests use), as the Kubernetes scheduler reads them."""
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    operators = {"In": lambda k, vs: k in labels and labels[k] in vs,
                 "NotIn": lambda k, vs: k not in labels or labels[k] not in vs,
                 "Exists": lambda k, vs: k in labels, "DoesNotExist": lambda k, vs: k not in labels}
    return any(all(operators[e["operator"]](e["key"], e.get("values", [])) for e in term["matchExpressions"])
               for term in required["nodeSelectorTerms"])


def test_a_fleet_applies_the_base_and_the_gpu_overlay_side_by_side():
    base, gpu = render(K8S / "base"), render(K8S / "overlays" / "gpu")
    # applied together, no object of one overwrites a different object of the other (the shared Namespace is equal)
    for kind in base:
        same_name = base[kind]["metadata"]["name"] == gpu[kind]["metadata"]["name"]
        assert not same_name or base[kind] == gpu[kind], kind
    assert base["DaemonSet"]["metadata"]["name"] == "opcua-appliance"
    assert gpu["DaemonSet"]["metadata"]["name"] == "opcua-appliance-gpu"
    # neither DaemonSet's selector takes the other's pods (a DaemonSet controller fights over pods it selects)
    for one, other in ((base, gpu), (gpu, base)):
        selector = one["DaemonSet"]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= one["DaemonSet"]["spec"]["template"]["metadata"]["labels"].items()
        assert not selector.items() <= other["DaemonSet"]["spec"]["template"]["metadata"]["labels"].items()
    # each appliance node gets exactly one of them (both bind the host's ports 4840 and 9464); others get none
    nodes = {"cpu": {"opcua-appliance": "true"},
             "gpu": {"opcua-appliance": "true", "nvidia.com/gpu.present": "true"},
             "gpu-label-false": {"opcua-appliance": "true", "nvidia.com/gpu.present": "false"},
             "not-an-appliance": {"nvidia.com/gpu.present": "true"}}
    placed = {name: [d["DaemonSet"]["metadata"]["name"] for d in (base, gpu) if node_matches(pod(d), labels)]
              for name, labels in nodes.items()}
    assert placed == {"cpu": ["opcua-appliance"], "gpu": ["opcua-appliance-gpu"],
                      "gpu-label-false": ["opcua-appliance"], "not-an-appliance": []}
