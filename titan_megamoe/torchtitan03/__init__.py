"""The adapter of TorchTitan 0.3.0.

A config function (``config_registry.py`` style) adds the converter to a model's
converters, after any torchao grouped-experts converter::

    from titan_megamoe.torchtitan03 import MegaMoEConverter

    model_spec = model_registry(
        "30B-A3B",
        converters=[MegaMoEConverter.Config(precision="auto", backend="auto")],
    )

The Config takes the keys of TorchTitan 0.2.2's ``[mega_moe]`` section. Importing this
package also registers the shipped dataset (``titan_megamoe.data``) and the qwen3
reduced-depth flavors (``titan_megamoe.torchtitan03.flavors``);
``titan_megamoe.torchtitan03.config_registry`` holds ready configs.
"""

from titan_megamoe import titan_version

titan_version.require("0.3", __name__)

import titan_megamoe.data  # noqa: F401  (registers the dataset on import)
from titan_megamoe.torchtitan03 import flavors  # noqa: F401  (registers the flavors on import)
from titan_megamoe.torchtitan03.converter import MegaMoEConverter
from titan_megamoe.torchtitan03.routed_experts import MegaGroupedExperts, MegaRoutedExperts

__all__ = ["MegaGroupedExperts", "MegaMoEConverter", "MegaRoutedExperts"]
