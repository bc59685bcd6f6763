"""The ``[mega_moe]`` TOML section: its schema and the checks of its values.

TorchTitan merges this module's ``JobConfig`` into its own when a TOML says

    [job]
    custom_config_module = "titan_megamoe.config"

Each key is the name of the ``titan_megamoe.settings.OperatorSettings`` field it sets.
Importing this module runs the package's ``__init__`` first, which registers the
converter, dataset and flavors with the TorchTitan already loaded
(``titan_megamoe.registry`` for 0.2.2); the module itself needs neither TorchTitan nor
torch.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from titan_megamoe.precision import PRECISION_CHOICES
from titan_megamoe.settings import DEFAULT_RECEIVE_LOAD, DEFAULT_SAVE_GEMM1_LOAD, DEFAULT_TIMEOUT_S

BACKEND_CHOICES = ("auto", "fused", "stock", "reference")
"""What ``[mega_moe] backend`` accepts."""


def _invalid(section: str, name: str, value, expected: str) -> ValueError:
    return ValueError(f"{section} {name} = {value!r} is not valid; {expected}")


def _check_choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _invalid(section, name, value, "allowed values: " + ", ".join(repr(a) for a in allowed))


@dataclass(kw_only=True)
class MegaMoE:
    """The settings of the ``mega_moe`` converter. TorchTitan 0.2.2 reads them from the
    ``[mega_moe]`` TOML section; TorchTitan 0.3.0's ``MegaMoEConverter.Config``
    (``titan_megamoe.torchtitan03``) has the same fields."""

    SETTINGS_NAME: ClassVar[str] = "[mega_moe]"
    """How errors and the log name where the settings were written."""

    precision: str = "auto"
    """Numeric format of the routed-expert GEMMs: auto | bf16 | fp8 | fp8_bwd |
    fp8_wgrad_bf16 | mxfp8 | mxfp8_wgrad_bf16. ``auto`` follows the torchao grouped-MM
    converter in ``model.converters`` (none -> bf16, quantize.grouped_mm.float8 -> fp8,
    quantize.grouped_mm.mx -> mxfp8, or mxfp8_wgrad_bf16 for the recipe
    mxfp8_rceil_wgrad_with_hp). ``fp8_bwd`` keeps the forward in bf16 and runs the
    backward GEMMs in blockwise fp8; ``fp8_wgrad_bf16`` is fp8 with the weight gradients
    in bf16, computed from the e4m3 rows the GEMMs read (the link stays fp8);
    ``mxfp8_wgrad_bf16`` is mxfp8 with the weight gradients in bf16 from unquantized rows
    (what TorchTitan 0.2.2's recipe_name check cannot select)."""

    backend: str = "auto"
    """What runs the routed experts: auto | fused | stock | reference.
    ``fused``: the overlapping Triton kernels (SM90+ GPUs, EP group within one node).
    ``stock``: TorchTitan's own all-to-all and grouped GEMMs.
    ``reference``: pure PyTorch, the numerical specification (slow; only when asked for).
    ``auto``: ``fused`` where it can run, else ``stock``; the log says which and why."""

    capacity_tokens_per_rank: int = 0
    """Fused backend: most tokens one rank may feed one MoE layer; the symmetric buffers
    are sized for it and a call with more is refused. 0 = local batch size x seq_len."""

    comm_sms: int = 0
    """Fused backend: programs that dispatch rows to their owners before joining the
    first expert GEMM (0 = the backend's default)."""

    reserved_sms: int = 0
    """Fused backend: SMs of each GPU that its persistent kernels leave free. They
    otherwise hold every SM until their last tile, so a collective launched on another
    stream meanwhile (FSDP's prefetched all-gather, a gradient reduce-scatter) waits
    for them; NCCL's kernels need as many SMs as it runs channels (NCCL_MAX_NCHANNELS
    caps them)."""

    save_gemm1: bool = False
    """Fused backend: the forward keeps GEMM1's pre-activations for the backward
    (receive rows x 2 x moe_inter_dim in bf16 per layer, logged; 0.77 GiB for
    Qwen3-30B-A3B at 16,384 tokens, EP 2), which spares the backward a quarter of its
    GEMM work; false recomputes GEMM1 instead. Under full activation checkpointing only
    the layer being recomputed holds them."""

    save_gemm1_load: float = DEFAULT_SAVE_GEMM1_LOAD
    """Fused backend, with ``save_gemm1``: how many rows a layer keeps, as a multiple of
    the rows a rank receives on average (the call's tokens x top-k); rows past it, when the
    routing loads a rank more, are recomputed by the backward (every row any routing can
    bring is about EP x the mean: 1.25 keeps 0.48 GiB per layer for Qwen3-30B-A3B at
    16,384 tokens at EP 2, 0.47 at EP 8, where saving every row would keep 0.77 and 3.0)."""

    receive_load: float = DEFAULT_RECEIVE_LOAD
    """Fused backend: the buffers that hold a row per row a rank receives (the expert
    inputs, the output gradients, GEMM1's output) hold a window of this multiple of the
    rows a rank receives on average (tokens x top-k), at most every row any routing can
    bring (EP x the mean: above EP 2 at the default 2); 0 = that most. A routing that
    brings a rank more runs the rows past the window in further rounds through the same
    buffers, at the same results (no row is ever dropped, the host waits for nothing), and
    every rank grows the window for later calls (logged). The operator's buffers at
    Qwen3-30B-A3B, 16,384 tokens, EP 8, bf16: 10.0 GiB at 0, 2.9 at 2, 2.0 at 1.25."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Fused backend: wall-clock limit, in seconds, of any wait on a peer rank; past it
    every rank of the group raises instead of hanging."""

    def __post_init__(self):
        section = self.SETTINGS_NAME
        _check_choice(section, "precision", self.precision, PRECISION_CHOICES)
        _check_choice(section, "backend", self.backend, BACKEND_CHOICES)
        for name in ("capacity_tokens_per_rank", "comm_sms", "reserved_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _invalid(section, name, value, "expected an integer >= 0")
        if not isinstance(self.save_gemm1, bool):
            raise _invalid(section, "save_gemm1", self.save_gemm1, "expected true or false")
        if isinstance(self.save_gemm1_load, bool) or not isinstance(self.save_gemm1_load, (int, float)) or not (
                self.save_gemm1_load > 0):
            raise _invalid(section, "save_gemm1_load", self.save_gemm1_load,
                           "expected a multiple of the mean load > 0")
        if isinstance(self.receive_load, bool) or not isinstance(self.receive_load, (int, float)) or not (
                self.receive_load >= 0):
            raise _invalid(section, "receive_load", self.receive_load,
                           "expected a multiple of the mean load > 0, or 0 for every row any routing can bring")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise _invalid(section, "timeout_s", self.timeout_s, "expected seconds > 0")


@dataclass
class JobConfig:
    mega_moe: MegaMoE = field(default_factory=MegaMoE)
