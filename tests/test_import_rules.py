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
    runtime_imports, top_packages

# appliance/ modules that may import uaserver/, and why
ALLOWED = {
    "appliance/daemon.py": "the composition root: it constructs the OPC UA server and hands it its services",
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


# ---- models/ only computes (issue 48, item 3): files, processes and timing of the machine live in loader/ ----
MODEL_CODE_FORBIDDEN_MODULES = {"subprocess", "multiprocessing", "tempfile", "shutil", "loader", "appliance",
                                "uaserver"}
MODEL_CODE_FORBIDDEN_CALLS = {"os.fork", "os.pipe", "os.write", "os.replace", "os.rename", "os.remove",
                              "os.unlink", "os.makedirs", "os.mkdir", "time.perf_counter", "time.process_time",
                              "time.perf_counter_ns"}
MODEL_CODE_FORBIDDEN_METHODS = {"write_text", "write_bytes", "mkdir", "unlink", "touch", "rename", "replace_file"}


def model_code_offences(source: str) -> list[str]:
    """What in `source` writes a file, starts a process or times the machine (read-only access stays allowed: a
    model's tokenizer files are read where the model is built)."""
    found = []
    tree = ast.parse(source)
    for node in runtime_imports(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        found += [f"line {node.lineno} imports {n}" for n in names
                  if n.split(".")[0] in MODEL_CODE_FORBIDDEN_MODULES]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in MODEL_CODE_FORBIDDEN_CALLS:
            found.append(f"line {node.lineno} calls {name}")
        elif isinstance(node.func, ast.Attribute) and node.func.attr in MODEL_CODE_FORBIDDEN_METHODS:
            found.append(f"line {node.lineno} calls .{node.func.attr}()")
        elif name in ("open", "io.open", "os.open") or (isinstance(node.func, ast.Attribute)
                                                           and node.func.attr == "open"):
            modes = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg in ("mode", "flags")]
            if any(not isinstance(m, ast.Constant) or set(str(m.value)) & set("wax+") for m in modes):
                found.append(f"line {node.lineno} opens a file to write")
    return found


def test_models_hold_model_code_only():
    offenders = [f"{path.relative_to(ROOT)} {offence}" for path in sorted((ROOT / "models").rglob("*.py"))
                 for offence in model_code_offences(path.read_text(encoding="utf-8"))]
    assert not offenders, "file writes, processes and timing belong in loader/: " + "; ".join(offenders)


def test_the_model_code_rule_sees_writes_processes_and_timing():
    source = ("import subprocess\nimport time\nfrom pathlib import Path\n\ndef f(p):\n    from loader import weights\n"
              "    Path(p).write_text('x')\n    open(p, 'wb')\n    open(p)\n    os.fork()\n    time.perf_counter()\n"
              "    time.monotonic()\n")
    assert [o.split(" ", 2)[2] for o in model_code_offences(source)] == [
        "imports subprocess", "imports loader", "calls .write_text()", "opens a file to write", "calls os.fork",
        "calls time.perf_counter"]


def test_loader_imports_nothing_from_appliance_or_uaserver():
    offenders = [f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}"
                 for path in sorted((ROOT / "loader").rglob("*.py"))
                 if (bad := top_packages(path) & {"appliance", "uaserver"})]
    assert not offenders, "loader/ sits beneath the appliance: " + "; ".join(offenders)


def test_the_engine_paths_stand_apart():
    """appliance/engine/ holds two paths (tensor/, llm/) that share only the modules beside them (model status,
    liveness, metrics): neither path imports the other, and the shared modules import neither."""
    files = {module_name(p): p for p in (ROOT / "appliance" / "engine").rglob("*.py")}
    offenders = []
    for name, path in sorted(files.items()):
        path_of = name.split(".")[2] if name.count(".") >= 3 else None  # "tensor" | "llm" | None (shared)
        for target in sorted(imported_modules(path, set(files))):
            target_path = target.split(".")[2] if target.count(".") >= 3 else None
            if target_path is not None and target_path != path_of:
                offenders.append(f"{name} imports {target}")
    assert {"appliance.engine.tensor.service", "appliance.engine.llm.service"} <= set(files)  # the tree is read
    assert not offenders, "the tensor and the language-model paths meet only in the shared modules: " + "; ".join(
        offenders)


def test_a_worker_enters_each_engine_path_through_its_service():
    engine = {module_name(p) for p in (ROOT / "appliance" / "engine").rglob("*.py")}
    entered = {target for path in (ROOT / "appliance" / "workers").rglob("*.py")
               for target in imported_modules(path, engine) if target.count(".") >= 3}
    assert entered == {"appliance.engine.tensor.service", "appliance.engine.llm.service"}, sorted(entered)
