"""Which TorchTitan is installed, and which of the package's adapters serves it.

The operator, its settings and the kernels know nothing of TorchTitan; each TorchTitan
release that changed the surface the package plugs into has an adapter of its own
(``ADAPTERS``). An adapter module calls :func:`require` before importing TorchTitan, so
that a missing or different TorchTitan is one sentence naming what to install rather
than an ImportError from deep inside TorchTitan.

Needs neither torch nor TorchTitan.
"""

import importlib
from importlib import metadata

ADAPTERS: dict[str, str] = {
    "0.2": "titan_megamoe.registry",
    "0.3": "titan_megamoe.torchtitan03",
}
"""TorchTitan series (major.minor) -> the module that plugs the operator into it."""

STOCK_PATHS: dict[str, str] = {
    "0.2": "titan_megamoe.stock",
    "0.3": "titan_megamoe.torchtitan03.stock",
}
"""TorchTitan series -> the module that says where its own path (the ``stock`` backend)
runs: ``unsupported_reason(device, dtype, precision, ep_within_node)`` and
``auto_note(precision)``."""

RELEASES: dict[str, str] = {"0.2": "0.2.2", "0.3": "0.3.0"}
"""TorchTitan series -> the release each adapter is tested with."""

EXTRAS: dict[str, str] = {"0.2": "torchtitan022", "0.3": "torchtitan030"}
"""TorchTitan series -> the ``pyproject.toml`` extra that installs it with its torchao."""

LATEST = "0.3"
"""The series of TorchTitan's current release."""


def installed() -> str | None:
    """The installed TorchTitan's version, or None."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def series(version: str) -> str:
    """``"0.3"`` for ``"0.3.0"`` (major.minor)."""
    return ".".join(version.split(".")[:2])


def _install_hint(wanted: str) -> str:
    return f"pip install 'titan-megamoe[{EXTRAS[wanted]}]' (TorchTitan {RELEASES[wanted]} with its torchao)"


def installed_series() -> str:
    """The series of the installed TorchTitan; ImportError naming the supported ones if it
    is missing or has no adapter."""
    version = installed()
    supported = ", ".join(f"{RELEASES[s]} ({EXTRAS[s]})" for s in ADAPTERS)
    if version is None:
        raise ImportError(
            f"titan_megamoe plugs into TorchTitan, which is not installed; install one of {supported}, "
            f"e.g. {_install_hint(LATEST)}"
        )
    if series(version) not in ADAPTERS:
        raise ImportError(
            f"titan_megamoe has no adapter for TorchTitan {version}; supported: {supported}"
        )
    return series(version)


def require(wanted: str, adapter: str) -> None:
    """Raise ImportError unless the installed TorchTitan is of series ``wanted``, the one
    ``adapter`` (a module name) serves, naming what to install or import instead."""
    version = installed()
    if version is None:
        raise ImportError(f"{adapter} serves TorchTitan {RELEASES[wanted]}, which is not installed: "
                          f"{_install_hint(wanted)}")
    have = series(version)
    if have != wanted:
        other = f"use {ADAPTERS[have]} with it, or " if have in ADAPTERS else ""
        raise ImportError(f"{adapter} serves TorchTitan {RELEASES[wanted]}, but TorchTitan {version} is "
                          f"installed: {other}{_install_hint(wanted)}")


def stock_path():
    """The installed TorchTitan's ``STOCK_PATHS`` module (ImportError as ``installed_series``)."""
    return importlib.import_module(STOCK_PATHS[installed_series()])
