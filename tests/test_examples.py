"""examples/: every k31c name they import exists (the examples are not otherwise run by the suite,
so a moved function would break them unseen), and the fast one runs end to end."""
import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_k31c_import_of_an_example_resolves(example):
    tree = ast.parse(example.read_text())
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] == "k31c" for alias in node.names]
    assert imported, f"{example.name} imports nothing from k31c"
    missing = [f"{m}.{n}" for m, n in imported if not hasattr(importlib.import_module(m), n)]
    assert not missing, f"{example.name} imports names that do not exist: {missing}"


def test_generate_example_runs(tmp_path):
    """examples/generate_tiny.py on a fresh $K31C_HOME: the tiny model made, 32 tokens out."""
    env = {**os.environ, "K31C_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(EXAMPLES[0].parent / "generate_tiny.py"), "Hi"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    greedy = next(line for line in out.stdout.splitlines() if line.startswith("greedy token ids:"))
    assert len(ast.literal_eval(greedy.split(":", 1)[1].strip())) == 32
