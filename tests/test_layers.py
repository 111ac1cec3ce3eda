"""The layers: imports run downward only (runtime.core <- backends <- runtime.model <- runtime.engine <- runtime.app
<- containers), no import circles, no source file over 600 lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_layers import find_cycle, import_edges, layer_violations

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def test_project_imports_run_downward():
    problems = layer_violations(import_edges(ROOT))
    assert not problems, "imports that point up a layer:\n" + "\n".join(problems)


def test_project_has_no_import_circle():
    cycle = find_cycle(import_edges(ROOT))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_project_has_no_import_circle_through_type_checking_imports():
    """An import under ``if TYPE_CHECKING:`` does not run, but the two modules still depend on each other."""
    cycle = find_cycle(import_edges(ROOT, type_checking=True))
    assert cycle is None, "import circle (counting TYPE_CHECKING imports): " + " -> ".join(cycle)


def test_no_source_file_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for p in sorted(ROOT.glob("**/*.py")) if ".venv" not in p.parts and not p.parts[len(ROOT.parts)].startswith(".")
            for n in [p.read_text().count("\n")] if n > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split them by what they hold):\n" + "\n".join(long)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, src in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    for pkg in ("runtime", "runtime/core", "runtime/model", "backends", "bench"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def test_checker_reports_a_circle_with_its_modules(tmp_path):
    root = _tree(tmp_path, {
        "runtime/model/a.py": "from runtime.model.b import x\n",
        "runtime/model/b.py": "def f():\n    from runtime.model import a  # a lazy import closes the circle too\n",
    })
    cycle = find_cycle(import_edges(root))
    assert cycle is not None and {"runtime.model.a", "runtime.model.b"} <= set(cycle)


def test_checker_reports_an_upward_import_with_the_pair(tmp_path):
    root = _tree(tmp_path, {
        "runtime/core/batch.py": "import torch\n",
        "backends/base.py": "from runtime.core.batch import x\n",
        "runtime/core/bad.py": "from backends.base import y\n",
    })
    problems = layer_violations(import_edges(root))
    assert len(problems) == 1 and problems[0].startswith("runtime.core.bad imports backends.base")


def test_checker_ignores_type_checking_imports(tmp_path):
    root = _tree(tmp_path, {
        "runtime/core/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from backends.base import y\n",
        "backends/base.py": "y = 1\n",
    })
    assert layer_violations(import_edges(root)) == []


def test_checker_reports_a_circle_closed_by_a_type_checking_import(tmp_path):
    root = _tree(tmp_path, {
        "runtime/model/a.py": "from runtime.model.b import x\n",
        "runtime/model/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.model.a import y\n",
    })
    assert find_cycle(import_edges(root)) is None
    cycle = find_cycle(import_edges(root, type_checking=True))
    assert cycle is not None and {"runtime.model.a", "runtime.model.b"} <= set(cycle)


@pytest.mark.parametrize("module,layer", [("runtime.core.batch", "runtime.core"), ("runtime.__main__", "runtime"),
                                          ("backends.kernels.mla_decode.mla_decode", "backends"),
                                          ("containers", "containers")])
def test_layer_of(module, layer):
    from import_layers import layer_of
    assert layer_of(module) == layer
