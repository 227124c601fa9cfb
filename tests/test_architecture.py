"""Imports inside keras_orbax run one way, from the verbs down to the dependencies' private symbols.

The layers (docs/architecture.md), bottom to top; a module may import modules of its own
subpackage and of lower layers only, never a sibling of its layer. Every import counts: relative or
absolute, at module level, inside a function, or under `if TYPE_CHECKING:`. `keras_orbax.errors`
imports nothing of ours, and every module may import it. The checker reads sources with `ast`
alone, so it runs without importing JAX.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "keras_orbax"
SRC = f"{PACKAGE}._src"

LAYERS: dict[str, int] = {
    "compat": 0,
    "runtime": 1,
    "storage": 2,
    "format": 3,
    "model": 4,
    "read": 5,
    "sources": 6,
    "write": 6,
    "export": 6,
    "restore": 7,
    "tools": 8,
    "training": 8,
}
PUBLIC_LAYER = max(LAYERS.values()) + 1
# The public surface, above everything: re-exports, the console script, the exception types.
PUBLIC = {PACKAGE, f"{PACKAGE}.cli", f"{PACKAGE}.__main__", f"{PACKAGE}.errors"}
# Modules that import nothing of ours, so that any module may import them.
LEAVES = {f"{PACKAGE}.errors", SRC}

PUBLIC_NAMES = [
    "CheckpointInfo",
    "DiffResult",
    "ModelCheckpoint",
    "RestoreResult",
    "VerifyResult",
    "convert",
    "deferred_init",
    "diff",
    "errors",
    "export_to_transformers",
    "from_preset",
    "get_layout_map",
    "inspect",
    "load_model",
    "restore_sharded",
    "save",
    "save_to_preset",
    "save_weights",
    "verify",
]


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. keras_orbax._src.read.coalesce
    is_package: bool  # an __init__.py
    source: str


def module_of(path: str, source: str) -> Module:
    """The module a file path (relative to the repository root, `/`-separated) defines."""
    parts = path.removesuffix(".py").split("/")
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return Module(".".join(parts), is_package, source)


def layer(name: str) -> tuple[str, int] | None:
    """(unit, layer) of a module of ours: its subpackage under _src, or the public surface."""
    if name in PUBLIC:
        return "public", PUBLIC_LAYER
    parts = name.split(".")
    if parts[:2] == [PACKAGE, "_src"] and len(parts) > 2 and parts[2] in LAYERS:
        return parts[2], LAYERS[parts[2]]
    return None


def _imported(module: Module, known: set[str]) -> Iterator[tuple[str, int]]:
    """(target module, line) of every import in `module` that names a module of ours."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(ast.parse(module.source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            for alias in node.names:
                # `from a import b` imports module a.b where there is one, else a name from a.
                submodule = f"{origin}.{alias.name}"
                yield (submodule if submodule in known else origin), node.lineno


def _describe(name: str) -> str:
    unit = layer(name)
    return "no layer" if unit is None else f"layer {unit[1]} {unit[0]}"


def bad_imports(sources: Mapping[str, str]) -> list[str]:
    """Every import against the direction or between siblings, one line each.

    Args:
        sources: File path relative to the repository root (`keras_orbax/_src/read/coalesce.py`)
            to its text.
    """
    modules = [module_of(path, text) for path, text in sorted(sources.items())]
    known = {m.name for m in modules}
    found = []
    for module in modules:
        for target, line in _imported(module, known):
            if target != PACKAGE and not target.startswith(f"{PACKAGE}."):
                continue
            if _allowed(module.name, target):
                continue
            found.append(
                f"{module.name} -> {target} ({_describe(module.name)} -> {_describe(target)}), "
                f"line {line}"
            )
    return found


def _allowed(importer: str, target: str) -> bool:
    if importer in LEAVES:
        return False  # a leaf imports nothing of ours
    if target in LEAVES:
        return True
    source_unit, target_unit = layer(importer), layer(target)
    if source_unit is None or target_unit is None:
        return False  # a module outside the table: placed by `misplaced_modules`
    if source_unit[0] == target_unit[0]:
        return True  # its own subpackage (the public surface counts as one)
    return target_unit[1] < source_unit[1]


def misplaced_modules(paths: list[str]) -> list[str]:
    """Modules outside the layers, and layers without a subpackage, one line each."""
    found = []
    for path in sorted(paths):
        name = module_of(path, "").name
        parts = name.split(".")
        if name in PUBLIC or name == SRC:
            continue
        if parts[:2] != [PACKAGE, "_src"]:
            found.append(f"{path}: not part of the public surface; put it under {SRC}/<layer>/")
        elif len(parts) == 3 and path.endswith(f"_src/{parts[2]}.py"):
            found.append(f"{path}: a module directly under {SRC}; put it in a subpackage")
        elif parts[2] not in LAYERS:
            found.append(f"{path}: subpackage {parts[2]!r} is not in LAYERS; give it a layer")
    packages = {module_of(path, "").name for path in paths if path.endswith("/__init__.py")}
    for unit in sorted(LAYERS):
        if f"{SRC}.{unit}" not in packages:
            found.append(f"{SRC}.{unit}: in LAYERS but has no __init__.py")
    return found


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for path in sorted((ROOT / PACKAGE).rglob("*.py"))
    }


def test_imports_run_one_way():
    found = bad_imports(package_sources())
    assert not found, "imports against the layers (docs/architecture.md):\n" + "\n".join(found)


def test_every_module_has_a_layer():
    found = misplaced_modules(list(package_sources()))
    assert not found, "\n".join(found)


def test_public_names():
    import keras_orbax

    assert sorted(keras_orbax.__all__) == PUBLIC_NAMES
    assert len(keras_orbax.__all__) == len(set(keras_orbax.__all__))


def test_errors_defines_only_exception_types():
    import keras_orbax.errors

    tree = ast.parse((ROOT / PACKAGE / "errors.py").read_text())
    others = [
        f"line {node.lineno}: {type(node).__name__}"
        for node in tree.body[1:]  # after the docstring
        if not isinstance(node, ast.ClassDef | ast.Import | ast.ImportFrom)
    ]
    assert isinstance(tree.body[0], ast.Expr), "errors.py starts with its docstring"
    assert not others, others
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert classes
    for name in classes:
        assert issubclass(getattr(keras_orbax.errors, name), BaseException), name


# The checker on tiny synthetic packages: each bad arrow must be reported, each good one not.
_BASE = {
    "keras_orbax/__init__.py": "from keras_orbax._src.tools import diff\n",
    "keras_orbax/errors.py": "class E(Exception): ...\n",
    "keras_orbax/_src/__init__.py": "",
    "keras_orbax/_src/compat/__init__.py": "",
    "keras_orbax/_src/compat/keras_compat.py": "import keras\n",
    "keras_orbax/_src/read/__init__.py": "",
    "keras_orbax/_src/read/coalesce.py": "from keras_orbax._src.compat import keras_compat\n",
    "keras_orbax/_src/sources/__init__.py": "",
    "keras_orbax/_src/sources/base.py": "from keras_orbax.errors import E\n",
    "keras_orbax/_src/write/__init__.py": "",
    "keras_orbax/_src/write/step_writer.py": "from ..read import coalesce\n",
    "keras_orbax/_src/tools/__init__.py": "",
    "keras_orbax/_src/tools/diff.py": "from . import helpers\nfrom keras_orbax._src.sources import base\n",
    "keras_orbax/_src/tools/helpers.py": "",
}


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        (
            "keras_orbax/_src/read/coalesce.py",
            "from keras_orbax._src.sources.base import Source\n",
            "keras_orbax._src.read.coalesce -> keras_orbax._src.sources.base "
            "(layer 5 read -> layer 6 sources), line 1",
        ),
        (
            "keras_orbax/_src/read/coalesce.py",
            "def f():\n    from ..tools import diff\n",
            "keras_orbax._src.read.coalesce -> keras_orbax._src.tools.diff "
            "(layer 5 read -> layer 8 tools), line 2",
        ),
        (
            "keras_orbax/_src/compat/keras_compat.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    import keras_orbax._src.read.coalesce\n",
            "keras_orbax._src.compat.keras_compat -> keras_orbax._src.read.coalesce "
            "(layer 0 compat -> layer 5 read), line 3",
        ),
        (
            "keras_orbax/_src/write/step_writer.py",
            "from keras_orbax._src.sources import base\n",
            "keras_orbax._src.write.step_writer -> keras_orbax._src.sources.base "
            "(layer 6 write -> layer 6 sources), line 1",
        ),
        (
            "keras_orbax/_src/sources/base.py",
            "from keras_orbax import save\n",
            "keras_orbax._src.sources.base -> keras_orbax (layer 6 sources -> layer 9 public), "
            "line 1",
        ),
        (
            "keras_orbax/errors.py",
            "from keras_orbax._src.compat import keras_compat\n",
            "keras_orbax.errors -> keras_orbax._src.compat.keras_compat "
            "(layer 9 public -> layer 0 compat), line 1",
        ),
    ],
    ids=["up", "relative-in-function", "type-checking", "siblings", "public", "errors-leaf"],
)
def test_checker_reports_a_bad_arrow(path, source, expected):
    assert bad_imports(_BASE) == []
    assert bad_imports({**_BASE, path: source}) == [expected]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("keras_orbax/_src/helpers.py", "a module directly under"),
        ("keras_orbax/_src/misc/__init__.py", "subpackage 'misc' is not in LAYERS"),
        ("keras_orbax/_helpers.py", "not part of the public surface"),
    ],
)
def test_checker_reports_a_misplaced_module(path, expected):
    paths = [*_BASE, *(f"keras_orbax/_src/{unit}/__init__.py" for unit in LAYERS)]
    assert misplaced_modules(paths) == []
    (found,) = misplaced_modules([*paths, path])
    assert expected in found


def test_checker_reports_a_layer_without_subpackage():
    assert misplaced_modules(list(_BASE)) == [
        f"{SRC}.{unit}: in LAYERS but has no __init__.py"
        for unit in sorted(set(LAYERS) - {"compat", "read", "sources", "write", "tools"})
    ]
