"""Reduced-depth Qwen3 MoE flavors of TorchTitan 0.3.0, for training A/B runs on one or two GPUs.

Each flavor is its base flavor's config with only its first transformer blocks: every
layer keeps its shapes (dimensions, heads, experts, top-k, vocabulary) and its
initialization, so per-layer step time and MoE behaviour match the full model while
parameters and optimizer state fit with FSDP + EP = 2 at 16,384-token sequences.
Importing this module registers them with ``torchtitan.models.qwen3``;
``model_registry("30B-A3B-4L", ...)`` then builds one.
"""

import functools

from torchtitan.models.qwen3 import qwen3_configs

REDUCED_DEPTH_FLAVORS: dict[str, tuple[str, int]] = {
    "30B-A3B-4L": ("30B-A3B", 4),
    "30B-A3B-12L": ("30B-A3B", 12),
    "235B-A22B-2L": ("235B-A22B", 2),
}
"""Flavor name -> (base flavor, number of transformer blocks)."""


def reduced_depth(base_name: str, n_layers: int, **kwargs):
    """The config of qwen3 flavor ``base_name`` cut to its first ``n_layers`` blocks
    (``kwargs``: what ``model_registry`` passes a flavor function)."""
    config = qwen3_configs[base_name](**kwargs)
    config.layers = config.layers[:n_layers]
    return config


def register_reduced_depth_flavors() -> None:
    """Add ``REDUCED_DEPTH_FLAVORS`` to qwen3's flavors (idempotent)."""
    for name, (base_name, n_layers) in REDUCED_DEPTH_FLAVORS.items():
        qwen3_configs[name] = functools.partial(reduced_depth, base_name, n_layers)


register_reduced_depth_flavors()
