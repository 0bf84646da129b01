"""The layers of docs/architecture.md hold: every import points down, and the map names every module.

A newcomer reads the folders bottom-up (common -> envs, memory, modeling -> rollout, rewards -> training
-> sft, eval -> memexrl); an import that points back up (a lower folder reaching for a higher one, or two
folders of one layer leaning on each other) would make that reading wrong, so it fails here with the
file, the line and the two layers. Function-level imports count too: they are still dependencies.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top; a package may import its own modules and any package of a lower layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("common",),                         # leaf: errors, config, trajectory and engine types, atomic writes, jsonl
    ("envs", "memory", "modeling"),      # the world, the Memex tools, the model substrate
    ("rollout", "rewards"),              # the agent loop + engines; R of a finished trajectory
    ("training",),                       # GRPO with segments
    ("sft", "eval"),                     # warm start; ALFWorld / LME-V2 evaluation and benches
    ("memexrl",),                        # the application: CLI, demo, plots, plans
    ("launch",),                         # scripts
)
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def python_files() -> list[Path]:
    return sorted(p for pkg in LAYER_OF for p in (ROOT / pkg).rglob("*.py"))


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import of one of our packages in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in LAYER_OF]
    return found


def test_every_import_points_down():
    wrong = []
    for path in python_files():
        own = path.relative_to(ROOT).parts[0]
        for line, target in imported_packages(path):
            if target != own and LAYER_OF[target] >= LAYER_OF[own]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (layer {LAYER_OF[target]}) "
                             f"from layer {LAYER_OF[own]}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_the_leaf_imports_nothing_of_ours():
    leaf = [(p, line, t) for p in (ROOT / "common").rglob("*.py") for line, t in imported_packages(p) if t != "common"]
    assert not leaf


def test_architecture_map_names_every_module_and_only_those():
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = "|".join(LAYER_OF)
    named = set(re.findall(rf"`((?:{packages})/[\w/]+\.py)`", text))
    modules = {str(p.relative_to(ROOT)) for p in python_files() if p.name != "__init__.py"}
    assert not modules - named, f"docs/architecture.md does not name: {sorted(modules - named)}"
    assert not named - modules, f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
