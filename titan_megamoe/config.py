"""The ``[mega_moe]`` TOML section.

TorchTitan merges this module's ``JobConfig`` into its own when a TOML says

    [job]
    custom_config_module = "titan_megamoe.config"

Importing the module also registers what a TOML can then name: the ``mega_moe``
model converter, the shipped dataset and the extra model flavors.
"""

from dataclasses import dataclass, field

from titan_megamoe.precision import PRECISION_CHOICES

BACKEND_CHOICES = ("auto", "fused", "reference")
GEMM1_ACTIVATION_CHOICES = ("recompute", "save")


def _check_choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"[{section}] {name} = {value!r} is not valid; allowed values: "
            + ", ".join(repr(a) for a in allowed)
        )


@dataclass
class MegaMoE:
    precision: str = "auto"
    """Numeric format of the routed-expert GEMMs: auto | bf16 | fp8 | fp8_bwd | mxfp8.
    ``auto`` follows the torchao grouped-MM converter in ``model.converters``
    (none -> bf16, quantize.grouped_mm.float8 -> fp8, quantize.grouped_mm.mx -> mxfp8).
    ``fp8_bwd`` keeps the forward in bf16 and runs the backward GEMMs in blockwise fp8."""

    backend: str = "auto"
    """Implementation of the operator: auto | fused | reference.
    ``reference`` is pure PyTorch (any device, torch.distributed all-to-all);
    ``fused`` is the overlapping Triton kernel on SM90 GPUs; ``auto`` picks the
    fastest one available and logs the choice."""

    capacity_tokens_per_rank: int = 0
    """Largest token count one rank may feed one MoE layer; the fused backend sizes its
    symmetric buffers from it, and refuses a call with more.
    0 = local batch size x sequence length."""

    comm_sms: int = 0
    """Programs of the fused forward that dispatch rows to their owners before joining the
    first expert GEMM (0 = the backend's default, 32)."""

    gemm1_activations: str = "recompute"
    """Fused backend: what the backward does for the first expert GEMM.
    ``recompute``: runs it again from the received rows (keeps nothing per layer).
    ``save``: the forward keeps its pre-activations, receive rows x 2 x moe_inter_dim in
    bf16 per layer (the log states the size; 0.77 GiB for Qwen3-30B-A3B at 16,384
    tokens, EP 2), and the backward skips a quarter of its GEMM work. Under full activation
    checkpointing only the layer being recomputed holds them."""

    def __post_init__(self):
        _check_choice("mega_moe", "precision", self.precision, PRECISION_CHOICES)
        _check_choice("mega_moe", "backend", self.backend, BACKEND_CHOICES)
        _check_choice(
            "mega_moe", "gemm1_activations", self.gemm1_activations, GEMM1_ACTIVATION_CHOICES
        )
        for name in ("capacity_tokens_per_rank", "comm_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"[mega_moe] {name} = {value!r} is not valid; expected an integer >= 0"
                )


@dataclass
class JobConfig:
    mega_moe: MegaMoE = field(default_factory=MegaMoE)


def _register() -> None:
    # Imported for their registrations: converter "mega_moe", dataset, model flavors.
    import titan_megamoe.converter  # noqa: F401
    import titan_megamoe.data  # noqa: F401
    import titan_megamoe.models  # noqa: F401


_register()
