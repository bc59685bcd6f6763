"""One ``OperatorSettings`` from the caller to the backends: through the custom ops
(eager and compiled), backend resolution (a layer's, and the operator's own ``auto``),
the checks ``mega_moe`` makes of it and what its errors advise, and what importing the
package loads."""

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from problems import make_problem, make_weights
from ranks import run_ranks
from titan_megamoe import fused_support, ops
from titan_megamoe.ops import mega_moe, resolve_backend
from titan_megamoe.precision import get_precision
from titan_megamoe.settings import OperatorSettings

SETTINGS = OperatorSettings(
    precision="fp8_bwd", backend="reference", capacity_tokens_per_rank=123, comm_sms=7, reserved_sms=3,
    save_gemm1=True, save_gemm1_load=0.75, receive_load=0.5, timeout_s=12.5,
)
"""Every field away from its default."""


def _settings_of(args) -> OperatorSettings:
    """The settings among a backend call's arguments (``ops.OpImpl``)."""
    return next(a for a in args if isinstance(a, OperatorSettings))


@pytest.mark.parametrize("compiled", [False, True])
def test_settings_reach_the_backend_unchanged(compiled, monkeypatch):
    seen = []
    reference = ops.BACKENDS["reference"]

    def recording(kind):
        def call(*args):
            seen.append((kind, _settings_of(args)))
            return getattr(reference.op, kind)(*args)
        return call

    op = ops.OpImpl(*(recording(kind) for kind in ("forward", "backward", "saved_shapes")))
    monkeypatch.setitem(ops.BACKENDS, "reference", dataclasses.replace(reference, op=op))

    x, idx, w = make_problem(11, "random", seed=0)
    w1, w2, w3 = make_weights()

    def layer(x_, w1_):
        return mega_moe(x_, idx, w, w1_, w2, w3, None, score_before_experts=False, settings=SETTINGS)[0]

    fn = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    x.requires_grad_(True)
    w1.requires_grad_(True)
    fn(x, w1).square().sum().backward()
    kinds = [kind for kind, _ in seen]
    assert [k for k in kinds if k != "saved_shapes"] == ["forward", "backward"]
    # Tracing runs the fake implementation, which asks for the saved shapes.
    assert ("saved_shapes" in kinds) == compiled
    assert all(settings == SETTINGS for _, settings in seen)
    assert x.grad is not None and w1.grad is not None


# --------------------------------------------------------------------------------------
# Resolving a backend.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fused_reason, stock_reason, expected",
    [(None, None, "fused"), ("test: no GPU", None, "stock"), ("test: no GPU", "test: no stock", None)],
)
def test_auto_takes_fused_else_stock_never_reference(fused_reason, stock_reason, expected, monkeypatch):
    from titan_megamoe import stock

    asked = []

    def fused_check(*args):
        asked.append(args)
        return fused_reason

    monkeypatch.setattr(fused_support, "unsupported_reason", fused_check)
    monkeypatch.setattr(fused_support, "arch", lambda device: ("sm90", "a test GPU"))
    monkeypatch.setattr(stock, "unsupported_reason", lambda *_: stock_reason)
    where = (torch.device("cuda"), torch.bfloat16, get_precision("bf16"), False)
    if expected is None:
        with pytest.raises(NotImplementedError, match="backend = 'auto' found no backend that can run here: "
                                                      "fused: test: no GPU; stock: test: no stock"):
            resolve_backend("auto", *where)
        return
    backend, why = resolve_backend("auto", *where)
    assert asked == [where]
    assert backend == expected
    assert why == ("auto" if expected == "fused" else "auto; skipped fused: test: no GPU")


def test_auto_gives_fused_only_precisions_measured_faster(monkeypatch):
    from titan_megamoe import stock

    monkeypatch.setattr(fused_support, "unsupported_reason", lambda *_: None)
    monkeypatch.setattr(fused_support, "arch", lambda device: ("sm90", "a test GPU"))
    monkeypatch.setattr(stock, "unsupported_reason", lambda *_: None)
    monkeypatch.setitem(fused_support.AUTO_PRECISIONS, "sm90", ("bf16",))
    where = (torch.device("cuda"), torch.bfloat16)
    assert resolve_backend("auto", *where, get_precision("bf16")) == ("fused", "auto")
    assert resolve_backend("auto", *where, get_precision("fp8")) == (
        "stock", "auto; skipped fused: its sm90 fp8 kernels are not yet measured faster than stock "
                 "(backend = 'fused' runs them)")
    assert resolve_backend("fused", *where, get_precision("fp8")) == ("fused", "asked for")


def test_auto_runs_fp8_bwd_fused_on_sm90_else_stock_saying_it_is_slower(monkeypatch):
    """fp8_bwd's fused layer (our bf16 forward, our fp8 backward) is faster than stock bf16
    on Hopper, where stock's own fp8_bwd path is twice as slow: ``auto`` runs it fused
    there. Where the fused kernels do not run it (sm100, not measured), ``auto`` runs
    stock's path, the only stock one in that format, and its reason says it is slower than
    stock bf16 and what trains faster."""
    from titan_megamoe import stock

    monkeypatch.setattr(fused_support, "unsupported_reason", lambda *_: None)
    monkeypatch.setattr(stock, "unsupported_reason", lambda *_: None)
    where = (torch.device("cuda"), torch.bfloat16, get_precision("fp8_bwd"))
    monkeypatch.setattr(fused_support, "arch", lambda device: ("sm90", "a test GPU"))
    assert resolve_backend("auto", *where) == ("fused", "auto")
    monkeypatch.setattr(fused_support, "arch", lambda device: ("sm100", "a test GPU"))
    backend, why = resolve_backend("auto", *where)
    assert backend == "stock"
    assert why.startswith("auto; skipped fused: its sm100 fp8_bwd kernels are not yet measured faster than stock")
    assert ("; stock TorchTitan has no fp8_bwd recipe: this path runs its bf16 forward and torchao's fp8 rowwise "
            "backward uncompiled, measured slower than stock bf16 (7.25 / 35.06 against 7.21 / 18.31 ms") in why
    assert why.endswith("precision bf16 trains faster")
    # Stock paths a stock TorchTitan job runs itself carry no note.
    for name in ("bf16", "fp8"):
        assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, get_precision(name)) == (
            "stock", f"auto; skipped fused: its sm100 {name} kernels are not yet measured faster than stock "
                     "(backend = 'fused' runs them)")


def test_the_log_says_how_the_fused_gemms_multiply():
    describe = fused_support.describe_mma
    assert describe("sm90", get_precision("bf16")) == "bf16 MMA"
    assert describe("sm90", get_precision("fp8")) == "fp8 MMA, scales promoted per 128-element block"
    assert describe("sm90", get_precision("mxfp8")).startswith(
        "MX MMA emulated: Hopper has none, so the operands are held in bf16 rounded to MX")
    assert "weight gradients by torch's bf16 grouped GEMM" in describe("sm90", get_precision("mxfp8"))
    assert "weight gradients" not in describe("sm90", get_precision("mxfp8_wgrad_bf16"))
    assert describe("sm100", get_precision("mxfp8")) == "native MX MMA (block-scaled tcgen05)"
    fp8_mma = fused_support.runs_fp8_mma
    assert [fp8_mma("sm90", get_precision(p)) for p in ("bf16", "fp8", "fp8_bwd", "mxfp8")] == [
        False, True, True, False]
    assert fp8_mma("sm100", get_precision("mxfp8"))


@pytest.mark.parametrize(
    "backend, device, dtype, precision, says",
    [("reference", "cpu", torch.float32, "bf16",
      "experts compute in torch.float32; precision 'bf16' is unquantized: the reference backend's GEMMs run in "
      "torch.float32)"),
     # Fused refuses these experts here, and stock runs them: TorchTitan's GEMMs take bf16 copies.
     ("auto", "cuda", torch.float32, "bf16",
      "on backend 'stock' (auto; skipped fused: the tile table has no row for a test GPU; it has: sm100, sm90 "
      "(H100/H200, B200); experts compute in torch.float32; precision 'bf16' is unquantized: TorchTitan's grouped "
      "GEMMs run on torch.bfloat16 copies)"),
     ("stock", "cpu", torch.float32, "bf16",
      "precision 'bf16' is unquantized: TorchTitan's own expert function picks the GEMMs' dtype on cpu)"),
     # Where the dtype is bf16, or the precision names quantized formats, the name says what runs.
     ("reference", "cpu", torch.bfloat16, "bf16", "(asked for; experts compute in torch.bfloat16)"),
     ("reference", "cpu", torch.float32, "fp8", "(asked for; experts compute in torch.float32)")],
)
def test_the_job_log_says_which_dtype_unquantized_gemms_run_in(backend, device, dtype, precision, says,
                                                                monkeypatch, caplog):
    """The job's log line for experts that compute in float32: precision 'bf16' names the
    unquantized format, so the line says the dtype the GEMMs run in on the backend chosen."""
    from titan_megamoe import job_settings
    from titan_megamoe.config import MegaMoE

    monkeypatch.setattr(fused_support, "arch", lambda device: (None, "a test GPU"))
    facts = job_settings.JobFacts(tokens_per_rank=64, expert_dtype=dtype, device=torch.device(device),
                                  ep_within_node=True)
    with caplog.at_level("INFO", logger="titan_megamoe.job_settings"):
        job_settings.resolve(MegaMoE(precision=precision, backend=backend), lambda: ("bf16", "no converter"), facts)
    (line,) = [r.getMessage() for r in caplog.records if "routed experts run" in r.getMessage()]
    assert says in line, line
    assert line.count("is unquantized") == (precision == "bf16" and dtype == torch.float32), line


def test_named_backend_runs_or_says_why(monkeypatch):
    monkeypatch.setattr(fused_support, "unsupported_reason", lambda *_: "test: no GPU")
    where = (torch.device("cpu"), torch.float32, get_precision("bf16"))
    with pytest.raises(NotImplementedError, match=r"\[mega_moe\] backend = 'fused' cannot run here: test: no GPU"):
        resolve_backend("fused", *where)
    assert resolve_backend("reference", *where) == ("reference", "asked for")
    with pytest.raises(ValueError, match="backend = 'fast' is unknown; known backends: 'auto', 'fused', 'stock', "
                                         "'reference'"):
        resolve_backend("fast", *where)


def test_config_and_operator_name_the_same_backends():
    from titan_megamoe.config import BACKEND_CHOICES

    assert BACKEND_CHOICES == ("auto", *ops.BACKENDS)


# --------------------------------------------------------------------------------------
# The public operator with backend "auto", and what its errors point to.
# --------------------------------------------------------------------------------------


def _recording_backends(monkeypatch, fused_runs: bool) -> list[str]:
    """The backends the custom ops are handed, in call order; ``fused`` (which cannot run
    on this CPU) computes as the reference and runs where ``fused_runs`` says."""
    seen = []
    reference = ops.BACKENDS["reference"]

    def recording(kind):
        def call(*args):
            if kind == "forward":
                seen.append(_settings_of(args).backend)
            return getattr(reference.op, kind)(*args)
        return call

    op = ops.OpImpl(*(recording(kind) for kind in ("forward", "backward", "saved_shapes")))
    monkeypatch.setitem(ops.BACKENDS, "reference", dataclasses.replace(reference, op=op))
    monkeypatch.setitem(ops.BACKENDS, "fused", dataclasses.replace(ops.BACKENDS["fused"], op=op))
    monkeypatch.setattr(fused_support, "unsupported_reason",
                        lambda *_: None if fused_runs else "test: no fused kernels here")
    monkeypatch.setattr(ops, "_AUTO_SETTINGS", {})
    monkeypatch.setattr(ops, "_logged_auto", set())
    return seen


@pytest.mark.parametrize("fused_runs", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_operator_resolves_auto_for_the_inputs_device(fused_runs, compiled, monkeypatch, caplog):
    """``backend="auto"``: the op runs ``fused`` where it can run the inputs, else
    ``reference``; the custom ops only see the resolved name (eager and compiled), the
    result is the reference's, and the choice is logged once with its reason."""
    seen = _recording_backends(monkeypatch, fused_runs)
    x, idx, w = make_problem(11, "random", seed=0)
    w1, w2, w3 = make_weights()
    auto = OperatorSettings(backend="auto", precision="bf16")

    def layer(x_):
        return mega_moe(x_, idx, w, w1, w2, w3, None, score_before_experts=False, settings=auto)[0]

    # The resolution is a constant of the compiled graph: another test's graph would hold its own.
    torch._dynamo.reset()
    fn = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    with caplog.at_level("INFO", logger="titan_megamoe.ops"):
        y = fn(x)
        fn(x)
    expected = mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False,
                        settings=auto.replace(backend="reference"))[0]
    assert torch.equal(y, expected)
    resolved = "fused" if fused_runs else "reference"
    assert seen[:2] == [resolved, resolved]
    (line,) = [r.getMessage() for r in caplog.records if "backend 'auto'" in r.getMessage()]
    gemms = "" if fused_runs else " (unquantized: the GEMMs run in torch.float32)"
    assert line.startswith(f"mega_moe: backend 'auto' runs the operator on '{resolved}' for torch.float32 experts "
                           f"in precision 'bf16'{gemms} on cpu"), line
    if not fused_runs:
        assert "the fused backend cannot run here (test: no fused kernels here)" in line


def test_operator_errors_point_to_a_backend_that_runs_here(monkeypatch):
    """Each backend the op cannot run on this CPU says to pass 'auto', names what that
    runs here, and doing so runs."""
    _recording_backends(monkeypatch, fused_runs=False)
    x, idx, w = make_problem(5, "random", seed=0)
    w1, w2, w3 = make_weights()

    def call(backend):
        return mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False,
                        settings=OperatorSettings(backend=backend))

    advice = "pass backend='auto' (here it runs 'reference')"
    with pytest.raises(NotImplementedError, match=r"settings.backend = 'fused' cannot run here: test: no fused "
                                                  r"kernels here; " + re.escape(advice)):
        call("fused")
    with pytest.raises(ValueError, match=r"settings.backend = 'stock' is TorchTitan's own path.*"
                                         + re.escape(advice) + r", or call titan_megamoe.stock.routed_experts"):
        call("stock")
    with pytest.raises(ValueError, match=r"settings.backend = 'fast' is not a backend the operator runs; "
                                         + re.escape(advice) + r", or one of 'fused', 'reference'"):
        call("fast")
    call("auto")


def test_operator_auto_refuses_what_fused_cannot_serve_by_shape(monkeypatch):
    """An intermediate size without whole fp8 scale blocks: ``auto`` runs the reference,
    and naming ``fused`` says why not."""
    seen = _recording_backends(monkeypatch, fused_runs=True)
    x, idx, w = make_problem(5, "random", seed=0)
    w1, w2, w3 = make_weights()  # intermediate size 48
    fp8 = OperatorSettings(backend="auto", precision="fp8")
    mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False, settings=fp8)
    assert seen == ["reference"]
    with pytest.raises(NotImplementedError, match="intermediate size 48 is not a multiple of 128"):
        mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False, settings=fp8.replace(backend="fused"))


# --------------------------------------------------------------------------------------
# The fused backend on more than one rank needs a capacity.
# --------------------------------------------------------------------------------------


def _capacity_rank(rank, world_size):
    # "fused" computing as the reference: the check under test comes before any kernel.
    ops.BACKENDS["fused"] = dataclasses.replace(
        ops.BACKENDS["fused"], unsupported=lambda *_: None, op=ops.BACKENDS["reference"].op
    )
    x, idx, w = make_problem(5, "random", seed=rank)
    weights = make_weights()
    local = [t[rank * 4 : (rank + 1) * 4] for t in weights]

    def call(group, ws, **settings):
        return mega_moe(x, idx, w, *ws, group, score_before_experts=False, settings=OperatorSettings(**settings))

    for backend in ("fused", "auto"):  # auto: fused runs here
        with pytest.raises(ValueError, match="settings.capacity_tokens_per_rank = 0 with the fused backend on 2 ranks"):
            call(dist.group.WORLD, local, backend=backend)
    call(dist.group.WORLD, local, backend="fused", capacity_tokens_per_rank=5)
    call(dist.group.WORLD, local, backend="reference")
    call(None, weights, backend="fused")  # one rank: the call's own token count


def test_fused_on_several_ranks_needs_a_capacity():
    run_ranks(_capacity_rank, 2, timeout_s=300)


# --------------------------------------------------------------------------------------
# What importing loads.
# --------------------------------------------------------------------------------------


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_config_module_is_a_leaf():
    loaded = _python(
        "import sys, titan_megamoe.config\n"
        "print(sorted(m for m in sys.modules if m.startswith(('titan_megamoe', 'torch', 'triton'))))"
    )
    assert loaded == "['titan_megamoe', 'titan_megamoe.config', 'titan_megamoe.precision', 'titan_megamoe.settings']"


def test_torchtitan_loading_the_config_registers_everything_without_the_kernels():
    loaded = _python(
        """
import sys
from torchtitan.config import ConfigManager
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.protocols.model_converter import build_model_converters

job = ConfigManager().parse_args([
    "--job.custom_config_module=titan_megamoe.config", "--model.name=qwen3", "--model.flavor=debugmodel_moe",
    "--model.converters", "mega_moe", "--mega_moe.backend=reference",
])
(converter,) = build_model_converters(job, None).converters
assert type(converter).__name__ == "MegaMoEConverter"
assert "megamoe_text" in DATASETS and "30B-A3B-4L" in qwen3_args
print(sorted(m for m in sys.modules if m == "titan_megamoe.fused" or m.startswith("titan_megamoe.kernels.")))
"""
    )
    # The tile table is plain data that the fused backend's support check reads.
    assert loaded == "['titan_megamoe.kernels.configs']"


def test_reference_backend_runs_without_triton_or_torchtitan():
    # PyTorch itself imports Triton where it is installed (torch._dynamo, on a custom op's
    # first call), so the run blocks it: as on a host without Triton.
    loaded = _python(
        """
import sys
sys.modules["triton"] = None
import torch
from titan_megamoe.ops import mega_moe
from titan_megamoe.settings import OperatorSettings

g = torch.Generator().manual_seed(0)
x = torch.randn(6, 16, generator=g, requires_grad=True)
idx = torch.rand(6, 4, generator=g).topk(2, dim=1).indices
w = torch.rand(6, 2, generator=g)
w1, w3 = (torch.randn(4, 8, 16, generator=g, requires_grad=True) for _ in range(2))
w2 = torch.randn(4, 16, 8, generator=g, requires_grad=True)
y, _ = mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False,
                settings=OperatorSettings(backend="reference"))
y.square().sum().backward()
assert x.grad is not None
print(sorted(m for m in sys.modules if m.startswith("torchtitan") or m in ("titan_megamoe.fused", "titan_megamoe.stock")))
"""
    )
    assert loaded == "[]"
