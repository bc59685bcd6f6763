"""The ``stock`` backend on TorchTitan 0.3.0: its own routed experts, with the torchao
grouped-experts converters for the quantized precisions (``ops.BACKENDS["stock"]`` asks
the installed TorchTitan's module, ``titan_version.stock_path``)."""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from torchtitan.components.quantization import float8, mx

from titan_megamoe.precision import GROUPED_MM_FLOAT8, GROUPED_MM_MX, Precision


@dataclass(frozen=True)
class TorchaoGroupedExperts:
    """One of TorchTitan 0.3.0's torchao grouped-experts converters."""

    converter: str
    """Its class name, as a config lists it."""
    grouped_mm: str
    """TorchTitan 0.2.2's name for the same recipe (``precision.precision_from_recipe``)."""
    experts_classes: Callable[[], Iterable[type]]
    """The quantized experts classes it has made so far."""
    min_capability: tuple[int, int]
    """The CUDA capability TorchTitan's converter demands."""

    def made(self, experts_config) -> bool:
        """Whether ``experts_config`` is the config of experts this converter quantized."""
        return any(type(experts_config) is cls.Config for cls in self.experts_classes())


FLOAT8 = TorchaoGroupedExperts("Float8GroupedExpertsConverter", GROUPED_MM_FLOAT8,
                               lambda: float8._float8_experts_cache.values(), (8, 9))
MXFP8 = TorchaoGroupedExperts("MXFP8GroupedExpertsConverter", GROUPED_MM_MX,
                              lambda: mx._mxfp8_experts_cache.values(), (10, 0))
TORCHAO_GROUPED_EXPERTS = (FLOAT8, MXFP8)

STOCK_RECIPES: dict[str, TorchaoGroupedExperts | None] = {"bf16": None, "fp8": FLOAT8, "mxfp8": MXFP8}
"""Precision -> the torchao converter through which stock TorchTitan 0.3.0 runs it (None:
its own grouped GEMMs). Other precisions have no stock path."""


def unsupported_reason(device: torch.device, dtype: torch.dtype, precision: Precision,
                       ep_within_node: bool) -> str | None:
    """None where TorchTitan 0.3.0's own routed experts run ``precision`` for experts computing
    in ``dtype`` on ``device``, else why not (the ``stock`` backend's check, ``ops.BACKENDS``).
    The all-to-all goes through the process group's own backend: ``ep_within_node`` does
    not matter."""
    if precision.name not in STOCK_RECIPES:
        return (f"precision {precision.name!r} has no stock recipe in TorchTitan 0.3.0 (its grouped-experts "
                f"converters run {', '.join(p for p, e in STOCK_RECIPES.items() if e)})")
    if not dtype.is_floating_point:
        return f"expert inputs must be floating point; got {dtype}"
    recipe = STOCK_RECIPES[precision.name]
    if recipe is None:
        return None
    if device.type != "cuda":
        return (f"precision {precision.name!r} runs in stock TorchTitan through torchao's {recipe.converter}, "
                f"which needs CUDA; this device is {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < recipe.min_capability:
        return (f"precision {precision.name!r} runs in stock TorchTitan through torchao's {recipe.converter}, "
                f"which needs SM{''.join(map(str, recipe.min_capability))} or later; this GPU is "
                f"SM{''.join(map(str, capability))}")
    return None




def auto_note(precision: Precision) -> str | None:
    """Nothing to add to ``auto``'s reason for taking this path: it runs stock's own recipes."""
    return None
