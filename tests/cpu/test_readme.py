"""The README as a new user on a CPU machine reads it: the Python example runs as written
(``auto`` takes the reference), the Quick start installs torch's CPU build first, the
requirements say training needs NVIDIA GPUs, and Troubleshooting quotes TorchTitan's
message as printed."""

import re
from pathlib import Path

import pytest

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


def _section(title: str) -> str:
    return README.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_quick_start_installs_torch_cpu_before_the_project():
    """On a machine without a GPU the CPU build of torch goes in first: installed after
    the project, pip would already have pulled a CUDA build."""
    lines = _section("Quick start").splitlines()
    torch_cpu = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    project = next(i for i, line in enumerate(lines) if line.startswith("pip install -e "))
    assert torch_cpu < project


def test_requirements_say_training_needs_nvidia_gpus():
    (row,) = [line for line in _section("Requirements").splitlines() if line.startswith("| training |")]
    assert "NVIDIA GPUs" in row and "a CPU runs only the tests" in row


def test_troubleshooting_quotes_torchtitans_message_as_printed(tmp_path):
    """A TOML with ``[mega_moe]`` but without the config module: the README quotes the
    first line of what TorchTitan raises, as it prints it."""
    from torchtitan.config import ConfigManager

    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nconverters = ["mega_moe"]\n\n[mega_moe]\nprecision = "bf16"\n')
    with pytest.raises(ValueError) as info:
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    printed = str(info.value).splitlines()[0].removesuffix(".")
    assert printed.startswith("Invalid field names in ") and "{'mega_moe'}" in printed, printed
    assert f"| `{printed}`" in _section("Troubleshooting")
