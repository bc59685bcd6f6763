"""Reduced-depth Qwen3 MoE flavors of TorchTitan 0.2.2, for training A/B runs on one or two GPUs.

Each flavor keeps every layer shape of its base flavor (dimensions, heads, experts,
top-k, vocabulary) and only has fewer transformer blocks, so per-layer step time and
MoE behaviour match the full model while parameters and optimizer state fit with
FSDP + EP=2 at 16,384-token sequences. Importing this module registers them; a TOML
then says e.g. ``[model] flavor = "30B-A3B-4L"``.
"""

from titan_megamoe import titan_version

titan_version.require("0.2", __name__)

from dataclasses import replace

from torchtitan.models.qwen3 import qwen3_args

REDUCED_DEPTH_FLAVORS: dict[str, tuple[str, int]] = {
    "30B-A3B-4L": ("30B-A3B", 4),
    "30B-A3B-12L": ("30B-A3B", 12),
    "235B-A22B-2L": ("235B-A22B", 2),
}
"""Flavor name -> (base flavor, number of transformer blocks)."""

MIN_MAX_SEQ_LEN = 16384
"""Smallest ``max_seq_len`` a reduced flavor gets; TorchTitan lists 235B-A22B with 4,096."""


def register_reduced_depth_flavors() -> None:
    for name, (base_name, n_layers) in REDUCED_DEPTH_FLAVORS.items():
        base = qwen3_args[base_name]
        qwen3_args[name] = replace(
            base,
            n_layers=n_layers,
            max_seq_len=max(base.max_seq_len, MIN_MAX_SEQ_LEN),
            # Own copy: TorchTitan mutates moe_args per job, which must not leak into the base.
            moe_args=replace(base.moe_args),
        )


register_reduced_depth_flavors()
