"""How the operator runs: one object from the converter (or the caller of ``mega_moe``)
to the backends and, as constexprs, to the kernels.

Each knob has one name all the way down: the ``[mega_moe]`` TOML key, the field here,
the backends' reads of it (``settings.save_gemm1`` in the fused backend becomes the
kernels' ``SAVE_GEMM1``). The custom ops carry it as one string (``encode`` /
``decode``), which ``torch.compile`` and activation checkpointing pass through as a
constant.
"""

import dataclasses
import functools
from dataclasses import dataclass

from titan_megamoe.precision import Precision, get_precision

DEFAULT_TIMEOUT_S = 300.0
"""How long any wait of the fused kernels on a peer may last before every rank of the
group fails (long enough for a peer that is compiling or loading data)."""

DEFAULT_SAVE_GEMM1_LOAD = 1.25
"""``save_gemm1_load``'s default: routings that load a rank up to a quarter above the mean
recompute nothing."""

DEFAULT_RECEIVE_LOAD = 2.0
"""``receive_load``'s default: at EP <= 2 every row any routing can bring (never grown);
above, twice the mean (at EP 8, a quarter of what any routing can bring)."""


@dataclass(frozen=True)
class OperatorSettings:
    """How one MoE layer runs the operator (resolved once, by the converter)."""

    precision: Precision = dataclasses.field(default_factory=lambda: get_precision("bf16"))
    """Formats of the three GEMM families (``titan_megamoe.precision``)."""
    backend: str = "fused"
    """A backend name (``ops.BACKENDS``), or ``auto`` where ``ops.mega_moe`` resolves it
    for the inputs' device (``ops.resolve_operator_backend``) before its custom ops, which
    carry resolved names only."""
    capacity_tokens_per_rank: int = 0
    """Fused: most tokens any rank of the EP group passes one call; sizes the symmetric
    buffers. Required when EP > 1; 0 (one rank) = the call's token count."""
    comm_sms: int = 0
    """Fused: programs that dispatch rows before joining the first GEMM (0: the default)."""
    reserved_sms: int = 0
    """Fused: SMs of each GPU the persistent kernels leave free for kernels of other
    streams, such as FSDP's all-gathers and reduce-scatters (0: one program on every SM)."""
    save_gemm1: bool = False
    """Fused: the forward keeps GEMM1's pre-activations, in the activations' dtype, for
    the backward (else the backward recomputes GEMM1). The reference recomputes them and
    rounds them to that dtype, so that both backends compute the same gradients."""
    save_gemm1_load: float = DEFAULT_SAVE_GEMM1_LOAD
    """Fused, with ``save_gemm1``: the saved pre-activations hold the rows a rank receives
    up to this multiple of the mean (the call's tokens x top-k rows, plus half an
    alignment's padding per local expert), at most every row any routing can bring
    (about EP x the mean); the backward recomputes GEMM1 for the rows past them. Sizes
    what each layer keeps."""
    receive_load: float = DEFAULT_RECEIVE_LOAD
    """Fused: the buffers with a row per received row (the receive buffers of the expert
    inputs and of the output gradients, ``h``, the backward's per-row buffers) hold a
    window of this multiple of the rows a rank receives on average (tokens x top-k), at
    most every row any routing can bring (EP x the mean); 0 = that most. A call whose
    routing brings a rank more runs those rows in further rounds through the same buffers
    (no row is dropped, the host waits for nothing), and the window grows for later calls
    (collectively, logged; ``kernels.buffers``)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Fused: wall-clock limit of any wait on a peer; past it every rank raises."""

    def __post_init__(self):
        if isinstance(self.precision, str):
            object.__setattr__(self, "precision", get_precision(self.precision))
        for name in ("capacity_tokens_per_rank", "comm_sms", "reserved_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} = {value!r} is not valid; expected an integer >= 0")
        if isinstance(self.save_gemm1_load, bool) or not self.save_gemm1_load > 0:
            raise ValueError(f"save_gemm1_load = {self.save_gemm1_load!r} is not valid; expected a multiple of "
                             "the mean load > 0")
        if isinstance(self.receive_load, bool) or not self.receive_load >= 0:
            raise ValueError(f"receive_load = {self.receive_load!r} is not valid; expected a multiple of the "
                             "mean load > 0, or 0 for every row any routing can bring")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s = {self.timeout_s!r} is not valid; expected seconds > 0")
        # Encoded here, once: the object is frozen, and ``mega_moe`` passes the string at every call.
        object.__setattr__(self, "_encoded", self._encode())

    def encode(self) -> str:
        """One string holding every field (what the custom ops carry)."""
        return self._encoded

    def _encode(self) -> str:
        fields = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Precision):
                value = value.name
            elif isinstance(value, bool):
                value = int(value)
            fields.append(f"{f.name}={value}")
        return ";".join(fields)

    @classmethod
    @functools.cache
    def decode(cls, encoded: str) -> "OperatorSettings":
        """Inverse of :meth:`encode`. Cached: each custom-op call decodes its settings, and
        the objects are frozen, so every call with one string can share one."""
        raw = dict(item.split("=", 1) for item in encoded.split(";"))
        types = {"capacity_tokens_per_rank": int, "comm_sms": int, "reserved_sms": int, "timeout_s": float,
                 "save_gemm1_load": float, "receive_load": float,
                 "save_gemm1": lambda v: bool(int(v)), "precision": get_precision, "backend": str}
        return cls(**{name: types[name](value) for name, value in raw.items()})

    def replace(self, **changes) -> "OperatorSettings":
        return dataclasses.replace(self, **changes)
