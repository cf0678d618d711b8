"""The manual covers what the code offers, read from the code itself so nothing new goes undocumented: every YAML key
of the schema, every verb of the `appliance` command, every node and method argument a running appliance's address
space shows (browsed by a real client); every repository path and link the docs name exists; and
docs/configuration.md is what the schema generates."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from asyncua import ua

from appliance.cli import build_parser
from core.config.docs import all_keys, render
from harness import RunningAppliance
from uaclient import run, session

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "urn:opcua-inference-appliance"
# docs/notes-*.md are design notes as they were written: they name files of their time, some since deleted.
MANUAL = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("notes-"))]
TOP_DIRS = ("core", "appliance", "uaserver", "models", "kernels", "certs", "tests", "bench", "scripts", "image",
            "deploy", "systemd", "docs", "tools")


def manual_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in MANUAL)


def mentioned(word: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_the_manual_is_the_readme_and_one_file_per_task():
    names = {p.name for p in MANUAL}
    assert names >= {"README.md", "clients.md", "plc.md", "operations.md", "security.md", "models.md",
                     "configuration.md", "benchmarks.md", "development.md"}
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160  # a front door, not the whole manual


def test_configuration_md_is_what_the_schema_generates():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render(), ("docs/configuration.md differs from the schema: run "
                                   "`python -m core.config.docs > docs/configuration.md`")


def test_every_yaml_key_of_the_schema_is_in_the_docs():
    text = manual_text()
    keys = all_keys()
    assert {"server.endpoint", "engine.max_batch_size", "models.NAME.drift.window"} <= {k.path for k in keys}
    missing = [k.path for k in keys if f"`{k.path}`" not in text]
    assert not missing, f"YAML keys not in the docs: {missing}"


def cli_verbs(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every verb path of the argparse tree: ("serve",), ("certs", "issue"), ..."""
    verbs: list[tuple[str, ...]] = []
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                verbs.append(prefix + (name,))
                verbs.extend(cli_verbs(sub, prefix + (name,)))
    return verbs


def test_every_cli_verb_is_in_the_docs():
    text = manual_text()
    verbs = cli_verbs(build_parser())
    assert ("certs", "issue") in verbs and ("models", "deploy") in verbs and ("serve",) in verbs
    missing = []
    for verb in verbs:
        group, rest = verb[0], verb[1:]
        # `appliance GROUP ... SUB` within the few lines a synopsis takes (`appliance certs init | issue ...`)
        spans = [text[m.start():m.start() + 400] for m in re.finditer(rf"appliance {re.escape(group)}(?![\w-])", text)]
        if not spans or not all(any(mentioned(word, span) for span in spans) for word in rest):
            missing.append(" ".join(verb))
    assert not missing, f"CLI verbs not in the docs: {missing}"


def named_paths(text: str) -> set[str]:
    found = set()
    for m in re.finditer(rf"(?<![\w/.<>$-])((?:{'|'.join(TOP_DIRS)})/[\w./*-]*)", text):
        path = m.group(1).rstrip(".")
        if path.endswith("/."):
            path = path[:-2]
        found.add(path)
    return found


def source_file_names() -> set[str]:
    return {p.name for p in ROOT.rglob("*") if p.is_file() and not {".git", "node_modules"} & set(p.parts)}


def named_source_files(text: str) -> set[str]:
    """Source files named by their own name, with or without a folder (`cpu_quant.py`, `cpu/quant_avx2.c`), as the
    layout lists them; llama.cpp is a project, not a file."""
    names = set(re.findall(r"(?<![\w<>.*-])([A-Za-z_][\w-]*\.(?:py|c|cpp|h|sh))(?![\w-])", text))
    return names - {"llama.cpp"}


def test_every_path_the_docs_name_exists():
    missing = []
    sources = source_file_names()
    for doc in MANUAL:
        text = doc.read_text(encoding="utf-8")
        for path in named_paths(text):
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{doc.name}: {path}")
        missing += [f"{doc.name}: {name}" for name in sorted(named_source_files(text) - sources)]
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links, relative to the doc
            if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
                missing.append(f"{doc.name}: link {target}")
    assert not missing, f"the docs name paths that do not exist: {missing}"


def test_the_path_finder_reads_what_the_docs_write():
    assert named_paths("see `models/te_classifier/README.md`, tests/test_x.py. and <state_dir>/models/NAME") == {
        "models/te_classifier/README.md", "tests/test_x.py"}
    layout = "kernels/  a reference decode step; cpu/quant_matmul.c and cpu_quant.py, quant_<isa>.c"
    assert named_source_files(layout) == {"quant_matmul.c", "cpu_quant.py"}
    assert "quant_matmul.c" not in source_file_names()  # the stale entry the layout once had is caught


# ---- the address space, browsed on a running appliance -------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    models = {
        "te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": "labels.txt", "alarm_classes": [1],
               "alarm_sources": {"line3": "line3"}, "drift": {"window": 100}},
        "chat": {"kind": "generative", "path": "builtin:smollm2"},
    }
    mailboxes = {"line3": {"model": "te"}, "ask": {"model": "chat"}}
    a = RunningAppliance(tmp_path_factory.mktemp("docs") / "state", models, {"mailboxes": mailboxes},
                         wait_ready=False)  # the nodes exist from the start; the models need not load
    a.monitor = a.issue("reader", "monitor")
    a.instance_names = {"te", "chat", "line3", "ask", "default"} | {
        line.strip() for line in (ROOT / "models" / "te_classifier" / "labels.txt").read_text().splitlines()}
    yield a
    a.stop()


async def appliance_names(client) -> set[str]:
    """The BrowseNames in the appliance's namespace under Objects/Appliance and among the ObjectTypes, and the
    names of every method's arguments."""
    ns = await client.get_namespace_index(NAMESPACE)
    names: set[str] = set()
    seen: set = set()

    async def walk(node, refs) -> None:
        for child in await node.get_children(refs=refs):
            if child.nodeid in seen:
                continue
            seen.add(child.nodeid)
            name = await child.read_browse_name()
            if name.NamespaceIndex == ns:
                names.add(name.Name)
                if await child.read_node_class() == ua.NodeClass.Method:
                    for prop in await child.get_properties():
                        if (await prop.read_browse_name()).Name in ("InputArguments", "OutputArguments"):
                            names.update(arg.Name for arg in await prop.read_value())
            await walk(child, refs)

    appliance = await client.nodes.objects.get_child([f"{ns}:Appliance"])
    await walk(appliance, ua.ObjectIds.HierarchicalReferences)
    await walk(client.nodes.base_object_type, ua.ObjectIds.HasSubtype)  # the appliance's ObjectTypes, if any
    types = [n for n in seen if n.NamespaceIndex == ns]
    for node in types:  # the types' own variables and methods
        await walk(client.get_node(node), ua.ObjectIds.HierarchicalReferences)
    return names


def test_every_node_and_method_argument_of_the_address_space_is_in_the_docs(app):
    async def go():
        async with session(app, *app.monitor) as client:
            return await appliance_names(client)

    names = run(go())
    assert {"State", "Heartbeat", "Infer", "Generate", "Mailboxes", "Request", "JobId", "ReloadModel"} <= names
    names = {n for n in names if n not in app.instance_names and " " not in n}
    text = manual_text()
    missing = sorted(n for n in names if not mentioned(n, text))
    assert not missing, f"address-space names not in the docs (docs/clients.md): {missing}"
