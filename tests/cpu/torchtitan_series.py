"""Test directories written against one TorchTitan release: their ``conftest.py`` reports
each of their test modules as skipped, without importing it, where another TorchTitan is
installed (tests/cpu: 0.2.2; tests/cpu_torchtitan03: 0.3.0).

    def pytest_pycollect_makemodule(module_path, parent):
        return skipped_unless_series("0.2", module_path, parent)
"""

import pytest

from titan_megamoe import titan_version


class _OtherTorchTitan(pytest.Module):
    """A test module reported as skipped instead of imported."""

    reason: str

    def collect(self):
        pytest.skip(self.reason, allow_module_level=True)


def skipped_unless_series(series: str, module_path, parent) -> pytest.Module | None:
    """A collector that skips the module at ``module_path`` unless the installed TorchTitan
    is of ``series``; None (collect it as usual) if it is."""
    installed = titan_version.installed()
    if installed is not None and titan_version.series(installed) == series:
        return None
    module = _OtherTorchTitan.from_parent(parent, path=module_path)
    module.reason = f"written for TorchTitan {titan_version.RELEASES[series]}; installed: {installed or 'none'}"
    return module
