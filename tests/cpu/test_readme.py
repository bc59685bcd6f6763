"""The README's Python example runs as written (on the CPU: ``auto`` takes the reference)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_python_operator_example_runs():
    section = README.read_text().split("## The Python operator", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    y, x, w1, counts = scope["y"], scope["x"], scope["w1"], scope["tokens_per_expert"]
    assert y.shape == x.shape and y.isfinite().all()
    assert int(counts.sum()) == x.shape[0] * scope["top_k"]
    assert w1.grad is not None and w1.grad.isfinite().all()
