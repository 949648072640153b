"""The packages' layers: what each may import when it is imported, and that every module can be
the first one a program imports (no import loop bites any order)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "lora", "engine", "spec", "playground", "bench")
# What each layer must not import at import time (module level, outside TYPE_CHECKING), by
# directory, the most specific one deciding: kernels know nothing of the engine; lora sits below
# the engine (its model config is a type only); the engine's core (everything in engine/ but its
# entry points) imports neither its entry points (the offline LLM, the async engine, the OpenAI
# server, the replicas) nor speculation nor the playground nor the benchmarks; the entry points
# serve the playground, never the reverse.
FORBIDDEN = {
    "kernels": {"engine", "lora", "spec", "playground", "bench"},
    "lora": {"engine", "spec", "playground", "bench"},
    "engine": {"engine.entrypoints", "spec", "playground", "bench"},
    "engine/entrypoints": {"playground", "bench"},
    "spec": {"engine.entrypoints", "playground", "bench"},
    "playground": {"bench"},
}


def import_time_imports(tree: ast.Module) -> list[str]:
    """Modules a module imports when it is imported: module-level statements, including those
    inside if/try blocks, but not under `if TYPE_CHECKING:` nor in functions."""
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append(node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


# The engine package's face (`from engine import LLM, SamplingParams`) names its entry points.
FACES = {"engine/__init__.py": "engine/entrypoints"}


def layer(path: Path) -> str:
    """The most specific FORBIDDEN key holding this file."""
    rel = path.relative_to(ROOT).as_posix()
    if rel in FACES:
        return FACES[rel]
    return max((key for key in FORBIDDEN if rel.startswith(key + "/")), key=len)


def forbidden(imported: str, rules: set[str]) -> bool:
    return any(imported == rule or imported.startswith(rule + ".") for rule in rules)


@pytest.mark.parametrize("layer_dir", sorted(FORBIDDEN))
def test_layers_import_only_the_layers_below(layer_dir):
    bad = []
    for path in modules(layer_dir):
        if layer(path) != layer_dir:
            continue
        for imported in set(import_time_imports(ast.parse(path.read_text()))):
            if forbidden(imported, FORBIDDEN[layer_dir]):
                bad.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not bad


def test_the_core_is_not_the_entry_points():
    """The rule above tells the engine's core from its entry points by directory: a core module
    that imports the offline LLM is caught, an entry point that does is not."""
    core, entry = ROOT / "engine/scheduler.py", ROOT / "engine/entrypoints/async_engine.py"
    assert layer(core) == "engine" and layer(entry) == "engine/entrypoints"
    assert forbidden("engine.entrypoints.llm", FORBIDDEN[layer(core)])
    assert not forbidden("engine.entrypoints.llm", FORBIDDEN[layer(entry)])
    assert not forbidden("engine.entrypointsx", FORBIDDEN[layer(core)])


def test_the_check_sees_a_forbidden_import():
    """The AST walk finds imports where they bite (module level, in if/try) and skips those
    that do not (TYPE_CHECKING, functions)."""
    src = (
        "import spec.x\nif TYPE_CHECKING:\n    import bench\ntry:\n    from playground import a\n"
        "except ImportError:\n    pass\ndef f():\n    import lora\n"
    )
    assert import_time_imports(ast.parse(src)) == ["spec.x", "playground"]


def test_speculation_is_loaded_by_the_engine_only_when_it_is_built():
    """The one import of spec/ the engine's core runs (in functions too; type-only imports
    aside): LLMEngine builds its speculation in __init__."""
    sites = []
    for path in modules("engine"):
        if layer(path) != "engine":
            continue
        tree = ast.parse(path.read_text())
        type_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            module = getattr(node, "module", None) or ""
            runs = isinstance(node, ast.ImportFrom) and id(node) not in type_only
            if runs and module.startswith("spec"):
                sites.append((path.name, module))
    assert sites == [("llm_engine.py", "spec.speculation")]


def test_every_module_imports_first():
    """Each module imported first in a fresh interpreter: an import loop between packages
    fails here for the order that exposes it."""
    names = []
    for package in PACKAGES:
        for path in modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    # One interpreter: before each module, every module of ours is forgotten (third-party ones
    # stay loaded, so each import runs only our code). Only a loop fails the test; other
    # errors (a missing optional dependency, say llama.cpp's bindings) are not its subject.
    script = f"""
import importlib, sys
ours = {PACKAGES!r}
for name in {names!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if "partially initialized" in str(exc) or "circular" in str(exc):
            print(f"{{name}}: {{exc}}")
    except Exception:
        pass
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""
