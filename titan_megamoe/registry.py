"""Registers with TorchTitan 0.2.2 what a TOML can name: the ``mega_moe`` model converter, the
shipped dataset (``titan_megamoe.data``) and the reduced-depth flavors
(``titan_megamoe.models``). Runs on import and is idempotent.

The torchao grouped-MM converters' registry entries are wrapped so that they stand
aside when ``mega_moe`` is in the same ``model.converters`` list
(``converter.GroupedMMDefersToMegaMoE``).
"""

from titan_megamoe import titan_version

titan_version.require("0.2", __name__)

from torchtitan.protocols import model_converter

import titan_megamoe.data  # noqa: F401  (registers the dataset on import)
import titan_megamoe.models  # noqa: F401  (registers the flavors on import)
from titan_megamoe.converter import CONVERTER_NAME, GroupedMMDefersToMegaMoE, MegaMoEConverter
from titan_megamoe.precision import GROUPED_MM_FLOAT8, GROUPED_MM_MX


def register() -> None:
    """Register the ``mega_moe`` converter and wrap the grouped-MM ones (once)."""
    registry = model_converter._registry_model_converter_cls
    if CONVERTER_NAME in registry:
        return
    model_converter.register_model_converter(MegaMoEConverter, CONVERTER_NAME)
    for name in (GROUPED_MM_FLOAT8, GROUPED_MM_MX):
        stock_cls = registry[name]
        registry[name] = type(
            f"{stock_cls.__name__}DefersToMegaMoE", (GroupedMMDefersToMegaMoE,), {"stock_cls": stock_cls}
        )


register()
