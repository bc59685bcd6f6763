"""titan-megamoe: a fused, communication-overlapping expert-parallel MoE operator for TorchTitan.

Data flows one way: TOML (``[mega_moe]``, ``titan_megamoe.config``) -> converter
(``titan_megamoe.converter``) -> layer (``titan_megamoe.layer``) -> operator
(``titan_megamoe.ops``) -> backends (``titan_megamoe.reference``, ``titan_megamoe.kernels``).
"""
