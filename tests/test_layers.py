"""The layering rules of DESIGN section 2, checked on every import of the source tree (``ast``, imports
inside functions included), and the checker itself shown to catch a forbidden import."""

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

# Layer -> the layers it may import (itself always), or single modules of a layer where only those are
# allowed. Most specific prefix first: a module belongs to the first layer whose prefix it starts with. The
# README's layout table states the same rules (tested below).
LAYERS: dict[str, tuple[str, ...]] = {
    "pipecast.v1": (),
    "pipecast.core": ("pipecast.v1",),
    "packager": ("pipecast.core", "pipecast.v1"),
    "control_plane": ("packager", "pipecast.core", "pipecast.v1"),
    "pipecast": ("control_plane", "packager", "pipecast.core", "pipecast.v1"),
    # The vLLM plugin runs in vLLM's environment: of the runtime, only the agent's light local client.
    "vllm_plugin": ("packager", "pipecast.core", "pipecast.v1", "pipecast.agent.local_client"),
    "benchmarks": ("pipecast", "control_plane", "packager", "pipecast.core", "pipecast.v1"),
    "tests": ("benchmarks", "vllm_plugin", "pipecast", "control_plane", "packager", "pipecast.core",
              "pipecast.v1"),
}
# Third-party modules a layer must not import at module import time (DESIGN 2: the packager loads without
# torch; the control plane never touches weight bytes, so it needs neither torch nor safetensors at all).
FORBIDDEN_AT_IMPORT: dict[str, tuple[str, ...]] = {
    "packager": ("torch", "transformers"),
    "control_plane": ("torch", "transformers", "safetensors"),
    "pipecast.core": ("torch", "transformers", "grpc"),
}
# The vLLM plugin never imports transformers: vLLM pins its own version, not pipecast's.
FORBIDDEN_ANYWHERE: dict[str, tuple[str, ...]] = {"control_plane": ("torch", "transformers", "safetensors"),
                                                  "vllm_plugin": ("transformers",)}
SOURCE_DIRS = ("pipecast", "packager", "control_plane", "vllm_plugin", "benchmarks", "tests")


@dataclass(frozen=True)
class Import:
    """One import statement: which module imports what, where, and whether at module import time."""

    module: str
    target: str
    path: Path
    line: int
    top_level: bool


def layer_of(module: str) -> str | None:
    """The layer ``module`` belongs to (None: not the project's)."""
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(root: Path, path: Path) -> Iterator[Import]:
    """Every import in ``path`` (a file under ``root``), resolved to absolute module names."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, top_level: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, path, child.lineno, top_level)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                # `from pkg import name`: name may be a submodule (pipecast.core), so pkg.name is the target.
                for alias in child.names:
                    yield Import(module, f"{target}.{alias.name}", path, child.lineno, top_level)
            elif isinstance(child, ast.If) and _type_checking_only(child):
                continue  # annotations only: never executed
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            else:
                yield from walk(child, top_level)

    yield from walk(ast.parse(path.read_text(), str(path)), True)


def allowed(own: str, target: str) -> bool:
    """Whether layer ``own`` may import the module ``target``: a module of no layer, of its own, of a layer it
    may import, or one of the single modules it may."""
    theirs = layer_of(target)
    return theirs in (None, own) or theirs in LAYERS[own] or any(
        name not in LAYERS and (target == name or target.startswith(name + ".")) for name in LAYERS[own])


def violations(root: Path, dirs: tuple[str, ...] = SOURCE_DIRS) -> list[str]:
    """Every import under ``root`` that breaks a rule above, as 'path:line: module imports target (why)'."""
    found = []
    for top in dirs:
        for path in sorted((root / top).rglob("*.py")):
            for imp in imports_of(root, path):
                where = f"{path.relative_to(root)}:{imp.line}: {imp.module} imports {imp.target}"
                own = layer_of(imp.module)
                if own is None:
                    continue
                if not allowed(own, imp.target):
                    found.append(f"{where} (layer {own} may import only {', '.join(LAYERS[own]) or 'itself'})")
                third_party = imp.target.split(".")[0]
                if third_party in FORBIDDEN_ANYWHERE.get(own, ()):
                    found.append(f"{where} ({own} must never import {third_party})")
                elif imp.top_level and third_party in FORBIDDEN_AT_IMPORT.get(own, ()):
                    found.append(f"{where} ({own} must not import {third_party} at module import time)")
    return found


def import_cycles(root: Path, dirs: tuple[str, ...] = SOURCE_DIRS) -> list[list[str]]:
    """Cycles among modules through module-level imports (a cycle makes import order matter)."""
    modules = {module_name(root, p): p for top in dirs for p in (root / top).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for imp in imports_of(root, path):
            target = imp.target
            while target and target not in modules:  # `from a.b import name`: the module is a.b
                target = target.rpartition(".")[0]
            # A package's __init__ importing its own submodules is how packages re-export: not a cycle.
            if imp.top_level and target and target != module and not target.startswith(module + "."):
                graph[module].add(target)
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return cycles


def test_every_import_keeps_the_layering():
    assert violations(REPO) == []


def test_no_module_level_import_cycles():
    assert import_cycles(REPO) == []


def test_proto_holds_no_logic():
    assert sorted(p.suffix for p in (REPO / "proto").rglob("*") if p.is_file()) == [".proto", ".proto"]


@pytest.fixture
def tree(tmp_path):
    """A small source tree that keeps every rule; tests add one bad import to it."""
    files = {
        "pipecast/__init__.py": "",
        "pipecast/core/__init__.py": "",
        "pipecast/core/errors.py": "class PipecastError(Exception):\n    pass\n",
        "pipecast/agent.py": ("from control_plane.client import Client\n"
                              "from pipecast.core.errors import PipecastError\n"),
        "packager/__init__.py": "",
        "packager/pack.py": "from pipecast.core import errors\n\ndef f():\n    import torch\n",
        "control_plane/__init__.py": "",
        "control_plane/client.py": "from packager import pack\n\nclass Client:\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


DIRS = ("pipecast", "packager", "control_plane")


def test_the_checker_accepts_a_tree_that_keeps_the_rules(tree):
    assert violations(tree, DIRS) == [] and import_cycles(tree, DIRS) == []


@pytest.mark.parametrize("path, line, why", [
    ("pipecast/core/errors.py", "from pipecast.agent import x", "layer pipecast.core may import only pipecast.v1"),
    ("packager/pack.py", "from pipecast import agent", "layer packager may import only"),
    ("packager/pack.py", "from control_plane.client import Client", "layer packager may import only"),
    ("control_plane/client.py", "from ..pipecast.agent import x", "layer control_plane may import only"),
    ("control_plane/client.py", "def f():\n    from pipecast.agent import x", "layer control_plane may import"),
    ("pipecast/agent.py", "def f():\n    import benchmarks.demo", "layer pipecast may import only"),
    ("packager/pack.py", "import torch", "packager must not import torch at module import time"),
    ("control_plane/client.py", "def f():\n    import safetensors", "control_plane must never import safetensors"),
])
def test_the_checker_finds_a_forbidden_import(tree, path, line, why):
    with (tree / path).open("a") as f:
        f.write("\n" + line + "\n")
    found = violations(tree, DIRS)
    assert len(found) == 1 and why in found[0] and found[0].startswith(path), found


def test_the_vllm_plugin_may_import_the_agents_local_client_and_no_other_runtime_module(tree):
    plugin = tree / "vllm_plugin" / "pipecast_vllm" / "loader.py"
    plugin.parent.mkdir(parents=True)
    plugin.write_text("from pipecast.agent.local_client import LocalAgentClient\nfrom packager import pack\n")
    dirs = (*DIRS, "vllm_plugin")
    assert violations(tree, dirs) == []
    plugin.write_text("from pipecast.agent.store import BlockStore\n\ndef f():\n    import transformers\n")
    assert violations(tree, dirs) == [
        "vllm_plugin/pipecast_vllm/loader.py:1: vllm_plugin.pipecast_vllm.loader imports "
        "pipecast.agent.store.BlockStore (layer vllm_plugin may import only packager, pipecast.core, pipecast.v1, "
        "pipecast.agent.local_client)",
        "vllm_plugin/pipecast_vllm/loader.py:4: vllm_plugin.pipecast_vllm.loader imports transformers "
        "(vllm_plugin must never import transformers)"]


def test_the_checker_finds_a_cycle_and_ignores_function_level_imports(tree):
    (tree / "packager/a.py").write_text("from packager import b\n")
    (tree / "packager/b.py").write_text("def f():\n    from packager import a\n")
    assert import_cycles(tree, DIRS) == []
    (tree / "packager/b.py").write_text("from packager.a import x\n")
    assert import_cycles(tree, DIRS) == [["packager.a", "packager.b", "packager.a"]]


def test_the_readme_states_the_same_rules():
    """Each layer's row of the README's layout table ends with `may import: ...` listing LAYERS exactly."""
    rows = dict(re.findall(r"^\| `([\w./]+)/` \|.*\| may import: ([^|]*?) \|$", (REPO / "README.md").read_text(),
                           re.MULTILINE))
    stated = {folder.replace("/", "."): tuple(sorted(re.findall(r"`([\w./]+)`", text)))
              for folder, text in rows.items()}
    expected = {layer: tuple(sorted(allowed)) for layer, allowed in LAYERS.items()}
    assert stated == expected
