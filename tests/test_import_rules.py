"""The import rules of the developers' guide, read from the source (ast, by tools/import_graph.py), so a new module is
held to them at once, counting every import that runs (module level and inside functions; `if TYPE_CHECKING:` blocks
never run):
- core/ (what both rooms share) imports nothing of appliance/ or uaserver/;
- uaserver/ (the OPC UA server) imports nothing of appliance/: the daemon builds what the server uses and hands it in;
- appliance/ imports nothing of uaserver/ but where it constructs the server (ALLOWED below, each with its reason);
  the CLI is a client (asyncua's client and core's contract), the log filter and the workers know nothing of OPC UA;
- models/ and kernels/ import nothing from appliance/, uaserver/ or core/;
- no import cycle joins appliance/ modules."""
from __future__ import annotations

import ast
from pathlib import Path

from tools.import_graph import ROOT, cycles, imported_modules, imported_packages, module_name, package_edges, \
    runtime_imports

# appliance/ modules that may import uaserver/, and why
ALLOWED = {
    "appliance/daemon.py": "the composition root: it constructs the OPC UA server and hands it its services",
    "appliance/nodeset_export.py": "the NodeSet2 file is the server's own address space, built by the server's own "
                                   "code without listening, so that the export and the running box cannot differ",
}


def offending(edges: dict[tuple[str, str], list[str]], importer: str, imported: str,
              allowed: dict[str, str] | None = None) -> list[str]:
    return [w for w in edges.get((importer, imported), []) if w.rsplit(":", 1)[0] not in (allowed or {})]


def test_core_imports_neither_room():
    edges = package_edges()
    bad = offending(edges, "core", "appliance") + offending(edges, "core", "uaserver")
    assert not bad, "core/ is beneath appliance/ and uaserver/: " + ", ".join(bad)


def test_uaserver_imports_nothing_of_appliance():
    bad = offending(package_edges(), "uaserver", "appliance")
    assert not bad, ("the daemon builds what the server uses and hands it in (core/services.py): "
                     + ", ".join(bad))


def test_appliance_imports_uaserver_only_where_it_constructs_the_server():
    edges = package_edges()
    assert edges[("appliance", "uaserver")], "the daemon constructs the server: the graph is read"
    bad = offending(edges, "appliance", "uaserver", ALLOWED)
    assert not bad, "appliance/ reaches uaserver/ only to construct it (ALLOWED): " + ", ".join(bad)
    for path in ALLOWED:
        assert (ROOT / path).exists(), f"ALLOWED names {path}, which does not exist"


def test_models_and_kernels_import_nothing_from_the_appliance():
    edges = package_edges()
    bad = [w for lower in ("models", "kernels") for upper in ("appliance", "uaserver", "core")
           for w in edges.get((lower, upper), [])]
    assert not bad, "offline tools belong in tools/, engine code takes plain values: " + ", ".join(bad)


def test_no_import_cycle_among_appliance_modules():
    files = {module_name(p): p for p in (ROOT / "appliance").rglob("*.py")}
    graph = {name: imported_modules(path, set(files)) for name, path in files.items()}
    assert graph["appliance.model_deploy"] >= {"appliance.model_store"}  # the graph is read: a known edge is in it
    found = cycles(graph)
    assert not found, "import cycles (a function-level import does not hide one): " + "; ".join(
        " -> ".join(c) for c in found)


def test_the_reader_sees_imports_hidden_in_functions(tmp_path):
    tree = ast.parse("import os\n\ndef f():\n    from . import b\n\nif TYPE_CHECKING:\n    from . import c\n")
    assert [type(n).__name__ for n in runtime_imports(tree)] == ["Import", "ImportFrom"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    relative = ROOT / "uaserver" / "server.py"  # `from .alarms import ...` is uaserver's own
    assert "uaserver" in {top for top, _ in imported_packages(relative)}
    hidden = tmp_path / "hidden.py"
    hidden.write_text("def f():\n    from appliance.jobs import JobStore\n    import uaserver.server\n")
    assert [top for top, _ in imported_packages(hidden)] == ["appliance", "uaserver"]


def test_the_graph_counts_statements_per_file():
    edges = package_edges()
    assert all(":" in w for where in edges.values() for w in where)
    assert sum(len(w) for (a, b), w in edges.items() if a == "appliance" and b == "core") > 10
    assert Path(ROOT / "tools" / "import_graph.py").exists()
