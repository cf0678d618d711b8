"""The import rules of the developers' guide, read from the source (ast), so a new module is held to them at once:
models/ and kernels/ import nothing from appliance/ or uaserver/, and no import cycle joins appliance/ modules,
counting every import that runs (module level and inside functions; `if TYPE_CHECKING:` blocks never run)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that the file imports (relative imports resolved; `from pkg import sub` names the
    submodule, `from pkg import name` the package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                found.add(f"{base}.{alias.name}")
            elif base in known:
                found.add(base)
    return found - {name}


def top_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_models_and_kernels_import_nothing_from_appliance_or_uaserver():
    offenders = []
    for package in ("models", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            bad = top_packages(path) & {"appliance", "uaserver"}
            if bad:
                offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offenders, "offline tools belong in tools/, engine code takes plain values: " + "; ".join(offenders)


def test_no_import_cycle_among_appliance_modules():
    files = {module_name(p): p for p in (ROOT / "appliance").rglob("*.py")}
    graph = {name: imported_modules(path, set(files)) for name, path in files.items()}
    assert graph["appliance.model_deploy"] >= {"appliance.model_store"}  # the graph is read: a known edge is in it
    found = cycles(graph)
    assert not found, "import cycles (a function-level import does not hide one): " + "; ".join(
        " -> ".join(c) for c in found)


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function():
    tree = ast.parse("import os\n\ndef f():\n    from . import b\n\nif TYPE_CHECKING:\n    from . import c\n")
    assert [type(n).__name__ for n in runtime_imports(tree)] == ["Import", "ImportFrom"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


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
