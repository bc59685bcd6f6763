"""The kernels' sources: calls between jit functions name their compile-time arguments.

Two constexpr parameters passed by position in the wrong order compile whenever their
types agree (a tile height for another, ``False, 0`` for two flags), so a call passes at
most one constexpr by position."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "titan_megamoe" / "kernels"
PACKAGE = "titan_megamoe.kernels"


def _jit_functions(tree: ast.Module) -> dict[str, tuple[list[str], set[str]]]:
    """Each jit function of a module: its parameters and which of them are constexpr."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).split("(")[0].endswith(".jit")
                                                     for d in node.decorator_list):
            params = [a.arg for a in node.args.args]
            constexpr = {a.arg for a in node.args.args
                         if a.annotation is not None and ast.unparse(a.annotation).endswith("constexpr")}
            found[node.name] = (params, constexpr)
    return found


def _module_name(path: Path) -> str:
    return ".".join([PACKAGE, *path.relative_to(KERNELS).with_suffix("").parts])


def test_jit_calls_pass_constexprs_by_name():
    trees = {_module_name(p): ast.parse(p.read_text()) for p in KERNELS.rglob("*.py")}
    defined = {name: _jit_functions(tree) for name, tree in trees.items()}
    calls = 0
    offenders = []
    for module, tree in trees.items():
        visible = dict(defined[module])
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module in defined:
                visible.update({a.asname or a.name: defined[node.module][a.name]
                                for a in node.names if a.name in defined[node.module]})
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in visible:
                calls += 1
                params, constexpr = visible[node.func.id]
                positional = [p for p in params[:len(node.args)] if p in constexpr]
                if len(positional) >= 2:
                    offenders.append(f"{module}:{node.lineno} {node.func.id}({', '.join(positional)})")
    assert calls > 100, f"found {calls} calls between jit functions: the scan no longer sees the kernels"
    assert not offenders, "constexprs passed by position: " + "; ".join(offenders)
