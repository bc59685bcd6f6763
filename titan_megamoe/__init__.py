"""titan-megamoe: a fused, communication-overlapping expert-parallel MoE operator for TorchTitan.

Data flows one way: TOML (``[mega_moe]``, ``titan_megamoe.config``) -> converter
(``titan_megamoe.converter``) -> layer (``titan_megamoe.layer``) -> operator
(``titan_megamoe.ops``, one ``titan_megamoe.settings.OperatorSettings``) -> backends
(``titan_megamoe.reference``, ``titan_megamoe.fused``) or TorchTitan's own path
(``titan_megamoe.stock``).

TorchTitan loads the package through ``[job] custom_config_module =
"titan_megamoe.config"``, and that import is the only hook it offers: so when TorchTitan
is already loaded, importing the package registers the ``mega_moe`` converter, the
dataset and the flavors with it (``titan_megamoe.registry``). Otherwise it registers
nothing, so that ``from titan_megamoe.ops import mega_moe`` in a program without
TorchTitan imports neither TorchTitan nor Triton.
"""

import sys

if "torchtitan" in sys.modules:
    from titan_megamoe import registry  # noqa: F401
