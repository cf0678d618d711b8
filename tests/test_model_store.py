"""Model versions on disk: deploy, rollback, list, pruning, an atomic `current` under concurrent readers, a start
whose `current` points nowhere, and the CLI verbs (audited)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from appliance.cli import main
from core.config import ConfigError, load_config
from appliance.model_store import ModelStore, ModelStoreError
from loader.file_digest import content_digest
from models.te_classifier import ONNX_PATH


def version_dir(tmp_path: Path, name: str, payload: str) -> Path:
    folder = tmp_path / "src" / name
    folder.mkdir(parents=True)
    shutil.copy(ONNX_PATH, folder / "model.onnx")
    (folder / "labels.txt").write_text(payload)
    return folder


def test_deploy_copies_a_version_and_switches_current_rollback_goes_back_and_forth(tmp_path):
    store = ModelStore(tmp_path / "state")
    a, b = version_dir(tmp_path, "a", "x\n"), version_dir(tmp_path, "b", "y\n")
    v1 = store.deploy("te", a)
    assert v1 == content_digest(a)[:12] and store.current_version("te") == v1
    assert (store.current_path("te") / "model.onnx").read_bytes() == ONNX_PATH.read_bytes()
    assert os.readlink(store.model_dir("te") / "current") == v1  # relative: the state dir may move
    v2 = store.deploy("te", b, version="2024.06")
    assert v2 == "2024.06" and store.current_version("te") == "2024.06"
    assert (store.current_path("te") / "labels.txt").read_text() == "y\n"
    assert store.rollback("te") == v1 and store.current_version("te") == v1
    assert store.rollback("te") == "2024.06"  # rollback of a rollback goes forward again
    listed = {v.version: v for v in store.versions("te")}
    assert listed["2024.06"].serving and listed[v1].previous and listed[v1].digest == content_digest(a)
    assert [v.version for v in store.versions("te")] == [v1, "2024.06"]  # oldest first


def test_deploying_the_same_content_again_reuses_its_version_and_a_label_cannot_change_content(tmp_path):
    store = ModelStore(tmp_path / "state")
    a, b = version_dir(tmp_path, "a", "x\n"), version_dir(tmp_path, "b", "y\n")
    v1 = store.deploy("te", a)
    assert store.deploy("te", a) == v1 and len(store.versions("te")) == 1
    store.deploy("te", a, version="v1")
    with pytest.raises(ModelStoreError, match="already exists with other content"):
        store.deploy("te", b, version="v1")
    with pytest.raises(ModelStoreError, match="version 'current'"):
        store.deploy("te", b, version="current")
    with pytest.raises(ModelStoreError, match="no such file"):
        store.deploy("te", tmp_path / "nope")
    assert not [p for p in store.model_dir("te").iterdir() if p.name.startswith(".")]  # no staging left over


def test_a_single_file_can_be_deployed(tmp_path):
    store = ModelStore(tmp_path / "state")
    version = store.deploy("te", ONNX_PATH)
    assert (store.current_path("te") / ONNX_PATH.name).is_file() and version == content_digest(ONNX_PATH)[:12]
    # One digest: a deployed file's version is the one its worker reports without a label (the file's sha256),
    # and a folder holding only that file gets the same.
    assert version == hashlib.sha256(ONNX_PATH.read_bytes()).hexdigest()[:12]
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(ONNX_PATH, folder / "renamed.onnx")
    assert store.add("te2", folder)[0] == version


def test_old_versions_beyond_keep_are_deleted_but_never_current_or_previous(tmp_path):
    store = ModelStore(tmp_path / "state")
    for i in range(5):
        store.deploy("te", version_dir(tmp_path, f"v{i}", f"{i}\n"), version=f"v{i}", keep=3)
    assert [v.version for v in store.versions("te")] == ["v2", "v3", "v4"]
    assert set(json.loads((store.model_dir("te") / "manifest.json").read_text())) == {"v2", "v3", "v4"}
    store.rollback("te")  # v3 serves, v4 previous
    store.deploy("te", version_dir(tmp_path, "v5", "5\n"), version="v5", keep=2)
    assert [v.version for v in store.versions("te")] == ["v3", "v5"]


def test_readers_never_see_current_missing_while_versions_switch(tmp_path):
    store = ModelStore(tmp_path / "state")
    store.deploy("te", version_dir(tmp_path, "a", "a\n"), version="a")
    store.deploy("te", version_dir(tmp_path, "b", "b\n"), version="b")
    labels = store.model_dir("te") / "current" / "labels.txt"
    seen, failures, stop = set(), [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                seen.add(labels.read_text())
            except OSError as e:
                failures.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(300):
            store.rollback("te")
    finally:
        stop.set()
        reader.join()
    assert failures == [] and seen == {"a\n", "b\n"}


def test_a_current_that_points_nowhere_is_refused_with_what_to_do(tmp_path):
    state = tmp_path / "state"
    store = ModelStore(state)
    with pytest.raises(ModelStoreError, match=r"no version deployed .* `appliance models deploy te DIR`"):
        store.current_version("te")
    v = store.deploy("te", version_dir(tmp_path, "a", "a\n"))
    (tmp_path / "a.yaml").write_text(f"models:\n  te: {{kind: tensor, path: {state}/models/te/current/model.onnx}}\n")
    assert load_config(tmp_path / "a.yaml").models["te"].resolved_path.is_file()
    shutil.rmtree(store.model_dir("te") / v)
    with pytest.raises(ModelStoreError, match=f"points to '{v}', which does not exist"):
        store.current_version("te")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "a.yaml")
    (error,) = info.value.errors
    assert f"models.te.path: {state}/models/te/current is a symbolic link to '{v}', which does not exist" in error
    with pytest.raises(ModelStoreError, match="no previous version"):
        store.rollback("te")


def test_the_cli_deploys_lists_and_rolls_back_and_audits_it(tmp_path, capsys):
    state = tmp_path / "state"
    config = tmp_path / "a.yaml"
    config.write_text(f"server: {{state_dir: {state}}}\nmodels:\n"
                      f"  te: {{kind: tensor, path: builtin:te-classifier, keep_versions: 3}}\n")
    a, b = version_dir(tmp_path, "a", "a\n"), version_dir(tmp_path, "b", "b\n")
    assert main(["models", "deploy", "te", str(a), "--config", str(config)]) == 0
    assert main(["models", "deploy", "te", str(b), "--version", "v2", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "te: version v2 serves from" in out
    # the appliance never ran here: nothing to reload (tests/test_ua_model_versions.py reloads a running one)
    assert "not reloaded: the appliance has no PKI yet (never started)" in out
    assert main(["models", "list", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "te: 2 version(s)"
    assert lines[1].startswith("  v2 ") and lines[1].endswith("* serving")
    assert lines[2].startswith(f"  {content_digest(a)[:12]} ") and lines[2].endswith("previous")
    assert f"sha256:{content_digest(b)[:16]}" in lines[1]
    assert main(["models", "rollback", "te", "--config", str(config)]) == 0
    assert ModelStore(state).current_version("te") == content_digest(a)[:12]
    assert main(["models", "deploy", "other", str(a), "--config", str(config)]) == 2
    assert "no model 'other'" in capsys.readouterr().err
    assert main(["models", "deploy", "te", str(tmp_path / "missing"), "--config", str(config)]) == 2
    records = [json.loads(line) for line in (state / "audit" / "admin.jsonl").read_text().splitlines()]
    assert [(r["action"], r["status"]) for r in records] == [
        ("models deploy", "Good"), ("models deploy", "Good"), ("models rollback", "Good"), ("models deploy", "Bad")]
    assert main(["audit", "verify", "--config", str(config)]) == 0


def test_a_candidate_is_checked_beside_current_and_withdrawn_without_a_trace(tmp_path):
    from appliance.model_specs import model_spec
    state = tmp_path / "state"
    store = ModelStore(state)
    store.deploy("te", version_dir(tmp_path, "a", "a\n"), version="v1")
    version, created = store.add("te", version_dir(tmp_path, "b", "b\n"), version="v2")
    assert (version, created) == ("v2", True) and store.serving_version("te") == "v1"  # added, not switched
    store.propose("te", "v2")
    assert store.candidate_version("te") == "v2" and store.serving_version("te") == "v1"
    # a worker loads a version's own folder, not through `current`: a restart loads what it served
    assert store.served_path("te", "tensor") == store.model_dir("te") / "v1" / "model.onnx"
    assert store.version_path("te", "v2", "tensor") == store.model_dir("te") / "v2" / "model.onnx"
    # what a start loads (current) and what a reload of the running appliance loads (the candidate)
    (tmp_path / "a.yaml").write_text(f"server: {{state_dir: {state}}}\nmodels:\n"
                                     "  te: {kind: tensor, path: builtin:te-classifier}\n")
    config = load_config(tmp_path / "a.yaml")
    m = config.models["te"]
    assert model_spec(m, config.engine, "cpu", state).version_label == "v1"
    assert model_spec(m, config.engine, "cpu", state, candidate=True).path == str(store.model_dir("te") / "v2" /
                                                                                     "model.onnx")
    assert store.prune("te", keep=1) == [] and len(store.versions("te")) == 2  # never the candidate
    assert [v.version for v in store.versions("te") if v.candidate] == ["v2"]
    store.withdraw("te", "v2", remove=True)
    assert store.candidate_version("te") is None and [v.version for v in store.versions("te")] == ["v1"]
    assert set(json.loads((store.model_dir("te") / "manifest.json").read_text())) == {"v1"}
    assert model_spec(m, config.engine, "cpu", state, candidate=True).version_label == "v1"
    # content already there under its name is not created again, and not removed when withdrawn
    assert store.add("te", version_dir(tmp_path, "a2", "a\n"), version="v1") == ("v1", False)
    store.withdraw("te", "v1", remove=True)  # never the current version
    assert store.serving_version("te") == "v1" and (store.model_dir("te") / "v1").is_dir()
    # a first version withdrawn leaves no folder behind: the configured path serves on
    store.add("other", version_dir(tmp_path, "c", "c\n"), version="x")
    store.propose("other", "x")
    store.withdraw("other", "x", remove=True)
    assert not store.model_dir("other").exists()
    # switched in: current, previous and no candidate
    store.add("te", version_dir(tmp_path, "d", "d\n"), version="v3")
    store.propose("te", "v3")
    store.switch("te", "v3", keep=5)
    assert (store.serving_version("te"), store.previous_version("te"), store.candidate_version("te")) == \
        ("v3", "v1", None)


def test_a_refused_model_shows_its_reason_without_paths_to_monitoring(tmp_path):
    """/readyz and the status page name why a model is Failed, never a path of the box (the log has it all)."""
    import shutil
    import urllib.error
    import urllib.request

    from harness import RunningAppliance
    from onnx_models import affine_model
    state = tmp_path / "state"
    store = ModelStore(state)
    model = affine_model(tmp_path / "affine.onnx")
    source = tmp_path / "v1"
    source.mkdir()
    shutil.copy(model, source / "affine.onnx")
    store.deploy("affine", source, version="v1")
    shutil.rmtree(store.model_dir("affine") / "v1")  # `current` now points nowhere: the model is refused
    app = RunningAppliance(state, {"affine": {"kind": "tensor", "path": str(model)}})
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(app.metrics_url + "/readyz", timeout=10)
        body = info.value.read().decode()
        page = urllib.request.urlopen(app.metrics_url + "/", timeout=10).read().decode()
        assert "model affine is Failed" in body and "current" in body, body
        for text in (body, page):
            assert str(tmp_path) not in text and "/models/" not in text, text
    finally:
        app.stop()
