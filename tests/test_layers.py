"""The package's layers: no module imports a layer above its own (docs/design.md has the map).

Every import in jaxserve/ counts, those inside functions too: a lazy import up a layer is still a
dependency on it. Only the standard library and ast: no JAX.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxserve"

# Lowest first; a module may import its own layer and those before it.
LAYERS = (
    ("base", ("jaxserve.errors", "jaxserve.dims")),
    ("models", ("jaxserve.models",)),
    ("checkpoint", ("jaxserve.checkpoint",)),
    ("heads", ("jaxserve.heads",)),
    ("runtime", ("jaxserve.runtime",)),
    ("scheduling", ("jaxserve.scheduling",)),
    ("view", ("jaxserve.view",)),
    ("encoder", ("jaxserve.encoder",)),
    ("offline", ("jaxserve.offline",)),
    ("http", ("jaxserve.http",)),
    ("integrations", ("jaxserve.integrations",)),
    ("cli", ("jaxserve.cli",)),
)
ROOT_NAMES = {"Encoder": "jaxserve.encoder"}  # what `from jaxserve import NAME` reaches (else the base: __version__)


def rank(module: str) -> int:
    """The layer of a dotted module name inside jaxserve."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    if module == "jaxserve":
        return 0
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/design.md's map")


def imported(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every jaxserve module `source` (the text of `module`, a package's __init__ if
    `is_package`) imports."""
    found = []
    package = module if is_package else module.rpartition(".")[0]  # what a relative import starts from
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "jaxserve"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "jaxserve":
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                if base == "jaxserve":
                    name = ROOT_NAMES.get(alias.name, name if (PACKAGE / alias.name).exists() else "jaxserve")
                elif not (PACKAGE.parent / (name.replace(".", "/") + ".py")).exists() and \
                        not (PACKAGE.parent / name.replace(".", "/")).is_dir():
                    name = base
                found.append((node.lineno, name))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    mine = rank(module)
    return [f"{module}:{line} imports {target} ({LAYERS[rank(target)][0]}, above {LAYERS[mine][0]})"
            for line, target in imported(source, module, is_package) if rank(target) > mine]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def test_no_import_runs_up_a_layer():
    found = []
    for name, path in modules():
        if name == "jaxserve":  # the package's lazy `Encoder` is the one name it re-exports
            continue
        found += violations(path.read_text(), name, is_package=path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_every_module_has_a_layer():
    for name, _ in modules():
        rank(name)


@pytest.mark.parametrize("source, module", [
    ("from jaxserve.http.api import ApiError\n", "jaxserve.scheduling.batcher"),
    ("def f():\n    from jaxserve import Encoder\n", "jaxserve.runtime.engine"),
    ("from jaxserve.runtime import engine\n", "jaxserve.models.bert"),
    ("import jaxserve.cli\n", "jaxserve.integrations.ray_serve"),
    ("from ..runtime import startup\n", "jaxserve.checkpoint.loader"),
])
def test_the_guard_catches_an_upward_import(source, module):
    assert violations(source, module)


def test_a_packages_relative_imports_start_from_the_package():
    """In scheduling/__init__.py, `from .pipeline import Pipeline` is scheduling's own; `from ..http import api`
    is above it."""
    assert imported("from .pipeline import Pipeline\n", "jaxserve.scheduling", is_package=True) == [
        (1, "jaxserve.scheduling.pipeline")]
    assert violations("from ..http import api\n", "jaxserve.scheduling", is_package=True)


@pytest.mark.parametrize("source, module", [
    ("from jaxserve.runtime.buckets import Bucket\n", "jaxserve.scheduling.batcher"),
    ("from jaxserve.scheduling import pipeline\n", "jaxserve.scheduling.explain"),
    ("from jaxserve.errors import InputError\n", "jaxserve.models.bert"),
])
def test_the_guard_allows_downward_and_sideways_imports(source, module):
    assert not violations(source, module)


# The pure modules (docs/design.md): bucket math, planning, batching, the job layout, request validation.
PURE = ("jaxserve.dims", "jaxserve.runtime.buckets", "jaxserve.runtime.derivation", "jaxserve.runtime.output_chunks",
        "jaxserve.scheduling.planner", "jaxserve.scheduling.batcher", "jaxserve.scheduling.jobs",
        "jaxserve.scheduling.host_cost", "jaxserve.http.api", "jaxserve.http.classes")
# What a front-end process of `serve --workers N` imports: the whole HTTP layer and the model's host side
FRONT_END = ("jaxserve.view", "jaxserve.http.server", "jaxserve.http.workers", "jaxserve.scheduling.link",
             "jaxserve.http.routes.openai", "jaxserve.http.routes.tei", "jaxserve.http.routes.cohere",
             "jaxserve.http.routes.ops")


@pytest.mark.parametrize("modules", [PURE, FRONT_END], ids=["pure", "front-end"])
def test_these_modules_import_no_jax(modules):
    """In a fresh interpreter: importing them (and `import jaxserve`) loads neither JAX nor flax."""
    code = ("import sys; import jaxserve; " + "; ".join(f"import {m}" for m in modules)
            + "; print(sorted(m for m in ('jax', 'flax', 'jaxlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"
