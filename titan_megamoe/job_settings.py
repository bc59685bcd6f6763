"""From the user's ``mega_moe`` settings and the facts of one training job to the
``OperatorSettings`` every converted layer runs with: what the TorchTitan adapters share.

Each adapter reads :class:`JobFacts` from its TorchTitan's job configuration, and the
precision the torchao grouped-GEMM converter of the job stands for
(``precision.precision_from_recipe``). :func:`resolve` then picks the precision, resolves
the backend for the device and the dtype the experts compute in, fills in the defaults
that depend on the job, and logs one line saying what it chose and why;
:func:`refuse_unservable` raises the adapter's list of what the job must change.

Needs no TorchTitan.
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_megamoe import fused_support
from titan_megamoe.config import MegaMoE
from titan_megamoe.ops import resolve_backend
from titan_megamoe.precision import get_precision
from titan_megamoe.settings import OperatorSettings

logger = logging.getLogger(__name__)

FUSED_ONLY_SETTINGS = ("capacity_tokens_per_rank", "comm_sms", "reserved_sms", "save_gemm1", "save_gemm1_load",
                       "receive_load", "timeout_s")
"""Settings that only the fused backend reads."""


@dataclass(frozen=True)
class JobFacts:
    """What the settings depend on in one training job, as each adapter reads it."""

    tokens_per_rank: int
    """Tokens one rank passes one MoE layer per call (``capacity_tokens_per_rank``'s
    default): the local batch times the sequence, over the degrees that shard tokens."""
    expert_dtype: torch.dtype
    """The dtype the routed experts compute in (FSDP2's mixed-precision parameter dtype
    where it wraps them, else float32)."""
    device: torch.device
    """The device type the job trains on."""
    ep_within_node: bool
    """Each EP group is GPUs of one node (``ep_within_node``)."""


@dataclass(frozen=True)
class ResolvedSettings:
    """What every converted layer of a job runs with."""

    settings: OperatorSettings
    auto_backend: bool
    """``settings.backend`` was chosen by ``backend = "auto"`` (the layer may then run
    ``stock`` for a call the fused backend cannot serve; ``expert_calls``)."""


def ep_within_node(ep_degree: int) -> bool:
    """Whether each EP group is GPUs of one node. TorchTitan builds EP from the innermost
    mesh dimensions, so its groups are runs of consecutive ranks of length ``ep_degree``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ep_degree))
    return ep_degree <= local and local % ep_degree == 0


def refuse_unservable(problems: list[str]) -> None:
    """Raise ValueError listing ``problems`` (each names a setting and what to change)."""
    if problems:
        raise ValueError("mega_moe cannot serve this job:\n  " + "\n  ".join(problems))


def _note_fused_only_settings(section: MegaMoE, backend: str) -> None:
    if backend == "fused":
        return
    defaults = type(section)()
    changed = [f"{k} = {getattr(section, k)!r}" for k in FUSED_ONLY_SETTINGS
               if getattr(section, k) != getattr(defaults, k)]
    if changed:
        logger.warning(
            f"mega_moe: {', '.join(changed)} only affect the fused backend; backend "
            f"'{backend}' ignores them"
        )


def _unquantized_gemms(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """For the log: the dtype the GEMMs of an unquantized precision multiply in on
    ``backend``, for experts computing in ``dtype`` (not bf16) that the fused kernels take
    no copies of (``fused_support.operand_cast``)."""
    if backend != "stock":
        return f"the {backend} backend's GEMMs run in {dtype}"
    if device.type == "cuda":
        # TorchTitan's grouped-MM expert function casts tokens and weights to bf16,
        # whatever the parameters' dtype.
        return "TorchTitan's grouped GEMMs run on torch.bfloat16 copies"
    return f"TorchTitan's own expert function picks the GEMMs' dtype on {device.type}"


def resolve(section: MegaMoE, auto_precision: Callable[[], tuple[str, str]], facts: JobFacts) -> ResolvedSettings:
    """The settings of every converted layer of the job, logged in one line.

    ``section`` holds the user's settings; ``auto_precision()`` returns ``(precision name,
    what it was mapped from)`` for ``precision = "auto"`` (called only then). Raises
    where the backend asked for cannot run (``ops.resolve_backend``).
    """
    if section.precision == "auto":
        precision_name, source = auto_precision()
    else:
        precision_name, source = section.precision, f"{section.SETTINGS_NAME} precision"
    precision = get_precision(precision_name)
    dtype = facts.expert_dtype
    cast = (fused_support.operand_cast(facts.device, dtype, precision)
            if section.backend in ("auto", "fused") else None)
    backend, why = resolve_backend(section.backend, facts.device, cast.tokens if cast else dtype, precision,
                                   facts.ep_within_node)
    computes = str(dtype)
    if cast is not None and backend == "fused":
        computes += f"; {cast.describe(dtype)}"
    elif not precision.quantized and dtype != torch.bfloat16:
        # 'bf16' names the unquantized format, not a dtype: say which dtype its GEMMs multiply in.
        gemms = _unquantized_gemms(backend, facts.device, dtype)
        computes += f"; precision {precision_name!r} is unquantized: {gemms}"
    settings = OperatorSettings(
        precision=precision,
        backend=backend,
        capacity_tokens_per_rank=section.capacity_tokens_per_rank or facts.tokens_per_rank,
        comm_sms=section.comm_sms,
        reserved_sms=section.reserved_sms,
        save_gemm1=section.save_gemm1,
        save_gemm1_load=float(section.save_gemm1_load),
        receive_load=float(section.receive_load),
        timeout_s=float(section.timeout_s),
    )
    logger.info(
        f"mega_moe: routed experts run precision '{precision_name}' (from {source}) "
        f"on backend '{backend}' ({why}; experts compute in {computes})"
    )
    _note_fused_only_settings(section, backend)
    return ResolvedSettings(settings, auto_backend=section.backend == "auto")
