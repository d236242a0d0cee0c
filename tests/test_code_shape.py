"""Code shape the project promises: no function in src over 80 lines (a long function hides a second one)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "archscale"
MAX_LINES = 80


def long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_in_src_is_over_80_lines():
    assert long_functions(SRC, MAX_LINES) == []


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert [f.split()[1] for f in long_functions(tmp_path, MAX_LINES)] == ["long"]
