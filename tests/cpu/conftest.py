from torchtitan_series import skipped_unless_series


def pytest_pycollect_makemodule(module_path, parent):
    return skipped_unless_series("0.2", module_path, parent)
