"""The Gluon grouped GEMM core (``kernels.gluon.sm90``) without a GPU: Gluon does not run
under the Triton interpreter, so its kernels are compiled for sm_90a here and their
machine code checked (fits an H100/H200, no spills, the warp-specialized structure took:
register reallocation, TMA loads, MMAs left in flight by their waits); the host-side
layout and argument checks run on CPU tensors. Numerics: ``tests/gpu/test_gluon_gemm_gpu.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SHARED_LIMIT = 232448
MMA = {"bf16": ".f32.bf16.bf16", "fp8": ".f32.e4m3.e4m3"}


@pytest.fixture(scope="module")
def gluon_resources(tmp_path_factory):
    out = tmp_path_factory.mktemp("gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "kernel_resources.py"), "--gluon",
                           "--precisions", "bf16,fp8", "--shape", "235B-A22B", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "kernel_resources.json").read_text())["precisions"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_every_gemm_compiles_warp_specialized(gluon_resources, precision):
    records = {r["kernel"]: r for r in gluon_resources[precision]}
    expected = {"gluon gate_up", "gluon down", "gluon dy_w2", "gluon dgrad", "gluon gemm1", "gluon swiglu_grad"} | (
        {"gluon wgrad", "gluon wgrad fp32"} if precision == "fp8" else set())
    assert set(records) == expected, set(records)
    for name, r in records.items():
        assert r["shared_bytes"] <= SHARED_LIMIT, (name, r["shared_bytes"])
        # GEMM1 and the backward's first GEMM in fp8: a few loop-invariant words of the
        # consumers' 224 registers (the arrival-waiting load warp takes 56) go to local
        # memory before the promoting mainloop and come back for the epilogue, once a tile;
        # bf16's GEMM1 holds both accumulators into its epilogue, and a word or two more.
        spilled = {("fp8", "gluon swiglu_grad"): 128, ("fp8", "gluon gemm1"): 128,
                   ("bf16", "gluon gemm1"): 32}.get((precision, name), 0)
        assert r["stack_bytes"] <= spilled and (r["local_accesses"] == 0) == (spilled == 0), (name, "spills")
        assert r["calls"] == 0, (name, "subroutine calls")
        assert r["mma"].endswith(MMA[precision]), (name, r["mma"])
        assert r["setmaxnreg"] > 0, (name, "no register reallocation between the partitions")
        assert r["tma_loads"] > 0, (name, "no TMA loads")
        # The weight gradients store each tile through TMA, under the next tile's MMAs.
        assert (r["tma_stores"] > 0) == name.startswith("gluon wgrad"), (name, r["tma_stores"])
        # A wait that leaves MMAs in flight: ptxas serializes every wgmma of a kernel where an
        # instruction touches an accumulator in flight (its waits then all leave none).
        # The weight gradients wait for each block's MMA: their column scales leave no
        # registers for a second partial (the other warpgroup's MMAs run under a promotion).
        in_flight = {("bf16", "gluon gate_up"): 2, ("bf16", "gluon gemm1"): 2, ("fp8", "gluon wgrad"): 0,
                     ("fp8", "gluon wgrad fp32"): 0}.get((precision, name), 1)
        assert max(r["mma_waits_in_flight"]) == in_flight, (name, r["mma_waits_in_flight"])


def test_layout_matches_the_receive_layout():
    """``ExpertLayout.from_counts`` places rows as ``kernels.layout`` does: each expert on a
    ``row_align`` boundary, its tiles on ``block_m`` virtual rows, empty experts sharing the
    next one's starts."""
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout

    counts = [0, 1, 127, 128, 129, 0, 0, 300]
    layout = ExpertLayout.from_counts(torch.tensor(counts), block_m=128, row_align=32)
    base, block = 0, 0
    for e, count in enumerate(counts):
        assert layout.local_base[e].item() == base and layout.block_base[e].item() == block, e
        assert layout.local_rows[e].item() == count
        base += -(-count // 32) * 32
        block += -(-count // 128) * 128
    assert layout.rows == base and layout.num_blocks.item() == block // 128


def test_host_checks_name_what_does_not_fit():
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles, grouped_gemm

    layout = ExpertLayout.from_counts(torch.tensor([3, 5]), block_m=128, row_align=32)
    rows = layout.rows + 128
    a = torch.zeros(rows, 256, dtype=torch.bfloat16)
    b = torch.zeros(2, 512, 256, dtype=torch.bfloat16)
    out = torch.empty(rows, 512, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    cases = [
        (dict(a=a.to(torch.float16)), "bf16 or e4m3"),
        (dict(a=a.to(fp8), b=b.to(fp8)), "need a_scale and b_scale"),
        (dict(b=b.transpose(1, 2).contiguous().transpose(1, 2)), "b are not"),
        (dict(out=torch.empty(rows, 256, dtype=torch.bfloat16)), "expected a"),
        (dict(tiles=GemmTiles(256, 96, 3)), "multiples of the tile"),
        (dict(tiles=GemmTiles(512, 64, 3)), "block_n = 512"),
        (dict(b2=torch.zeros_like(b), tiles=GemmTiles(128, 64, 3)), "swiglu epilogue"),
        (dict(epilogue="gelu"), "epilogue 'gelu' is unknown"),
        (dict(a=a.to(fp8), b=b.to(fp8), a_scale=torch.ones(rows, 2), b_scale=torch.ones(2, 4, 2)), "128 x 128 tiles"),
        (dict(b=torch.zeros(3, 512, 256, dtype=torch.bfloat16)), "places 2 experts' rows; b holds 3"),
    ]
    for change, message in cases:
        args = dict(a=a, b=b, out=out, layout=layout, tiles=GemmTiles(256, 64, 3))
        args.update(change)
        with pytest.raises(ValueError, match=message):
            grouped_gemm(args.pop("a"), args.pop("b"), args.pop("out"), args.pop("layout"), args.pop("tiles"),
                         programs=4, **args)


def test_token_grouped_gemm_host_checks_name_what_does_not_fit():
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import GemmTiles
    from titan_megamoe.kernels.gluon.sm90.token_grouped_gemm import token_grouped_gemm

    fp8 = torch.float8_e4m3fn
    a, b = torch.zeros(256, 512, dtype=fp8), torch.zeros(384, 512, dtype=fp8)
    a_scale, b_scale = torch.ones(4, 256), torch.ones(4, 384)
    block_start = torch.tensor([0, 1, 4], dtype=torch.int32)
    outs = tuple(torch.empty(2, 128, 384, dtype=torch.bfloat16) for _ in range(2))
    cases = [
        (dict(a=a.to(torch.bfloat16)), "e4m3 operands with fp32 scales"),
        (dict(b=torch.zeros(512, 384, dtype=fp8).t()), "b are not"),
        (dict(b=torch.zeros(384, 640, dtype=fp8)), "expected a \\[M, T\\] and b \\[N, T\\]"),
        (dict(a_scale=torch.ones(256, 4)), "scales \\[T / 128, M\\]"),
        (dict(block_start=block_start.to(torch.int64)), "1-D int32"),
        (dict(tiles=GemmTiles(256, 128, 4)), "128 x 128 tiles"),
        (dict(outs=outs[:1]), "expected one \\[2, 256, 384\\] or two \\[2, 128, 384\\]"),
        (dict(a=torch.zeros(320, 512, dtype=fp8), a_scale=torch.ones(4, 320),
              outs=tuple(torch.empty(2, 160, 384, dtype=torch.bfloat16) for _ in range(2))), "per output 160"),
    ]
    for change, message in cases:
        args = dict(a=a, a_scale=a_scale, b=b, b_scale=b_scale, block_start=block_start, outs=outs)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            token_grouped_gemm(**args, programs=4)


def _one_rank_chunks():
    """Arrival words of one rank receiving two experts' rows (host checks only: no kernel runs)."""
    from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkFlags

    return ChunkFlags(torch.zeros(64, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                      torch.zeros(16, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                      torch.zeros(2, dtype=torch.int32), rank=0, ep=1, chunk_ready=16, max_chunks=1)


def test_swiglu_grad_gemm_host_checks_name_what_does_not_fit():
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles
    from titan_megamoe.kernels.gluon.sm90.swiglu_grad_gemm import SwigluGradTensors, swiglu_grad_gemm

    layout = ExpertLayout.from_counts(torch.tensor([3, 5]), block_m=128, row_align=32)
    rows, hidden, inter = layout.rows + 128, 256, 256
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    dy, w2t = torch.zeros(rows, hidden, dtype=bf16), torch.zeros(2, inter, hidden, dtype=bf16)
    chunks = _one_rank_chunks()
    outs = SwigluGradTensors(torch.zeros(rows, 2 * inter, dtype=bf16), torch.zeros(rows),
                             torch.empty(rows, 2 * inter, dtype=bf16), torch.empty(rows, inter, dtype=bf16),
                             torch.empty(rows, 2))
    cases = [
        (dict(dy=dy.to(torch.float16)), "bf16 or e4m3"),
        (dict(dy=dy.to(fp8), w2t=w2t.to(fp8)), "need dy_scale, w2t_scale"),
        (dict(dy=torch.zeros(rows, 384, dtype=bf16)), "expected dy \\[rows, 256\\]"),
        (dict(tiles=GemmTiles(256, 64, 4)), "tiles 128 wide"),
        (dict(w2t=torch.zeros(2, 320, hidden, dtype=bf16)), "expected dy \\[rows, 256\\] and preact, dab \\[rows, 640\\]"),
        (dict(w2t=torch.zeros(3, inter, hidden, dtype=bf16)), "places 2 experts' rows"),
        (dict(saved_m=96), "tl tiles 96"),
        (dict(saved_m=32), "wholly saved or wholly theirs"),
    ]
    for change, message in cases:
        args = dict(dy=dy, w2t=w2t, layout=layout, chunks=chunks, outs=outs, tiles=GemmTiles(128, 64, 4), saved_m=64)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            swiglu_grad_gemm(args.pop("dy"), args.pop("w2t"), args.pop("layout"), args.pop("chunks"),
                             args.pop("outs"), args.pop("tiles"), score_before_experts=False, row_align=32,
                             programs=4, **args)


def test_gate_up_gemm_host_checks_name_what_does_not_fit():
    from titan_megamoe.kernels.gluon.sm90.gate_up_gemm import GateUpTensors, gate_up_gemm
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles

    layout = ExpertLayout.from_counts(torch.tensor([3, 5]), block_m=128, row_align=32)
    rows, hidden, inter = layout.rows + 128, 256, 256
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    x, w = torch.zeros(rows, hidden, dtype=bf16), torch.zeros(2, inter, hidden, dtype=bf16)
    chunks = _one_rank_chunks()
    outs = GateUpTensors(torch.empty(rows, inter, dtype=bf16))
    cases = [
        (dict(x=x.to(torch.float16)), "bf16 or e4m3"),
        (dict(x=x.to(fp8), w1=w.to(fp8), w3=w.to(fp8)), "need x_scale, w1_scale, w3_scale and h_scales"),
        (dict(w3=torch.zeros(2, 384, hidden, dtype=bf16)), "w3 as w1"),
        (dict(outs=GateUpTensors(outs.h, preact=torch.zeros(rows, inter, dtype=bf16))), "expected \\[saved rows, 512\\]"),
        (dict(tiles=GemmTiles(256, 64, 4)), "tiles 128 wide"),
        (dict(act_dtype=torch.float16), "act_dtype torch.float16"),
        (dict(layout=ExpertLayout.from_counts(torch.tensor([3, 5]), block_m=64, row_align=32)), "a tile is 128 rows"),
    ]
    for change, message in cases:
        args = dict(x=x, w1=w, w3=w, layout=layout, chunks=chunks, outs=outs, tiles=GemmTiles(128, 64, 4),
                    act_dtype=bf16)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            gate_up_gemm(args.pop("x"), args.pop("w1"), args.pop("w3"), args.pop("layout"), args.pop("chunks"),
                         args.pop("outs"), args.pop("tiles"), programs=4, **args)


def test_the_tile_table_names_what_each_rows_gemm_runs():
    """``gemm2_kernel`` / ``dgrad_kernel``: the Gluon core on sm90 rows only, over whole
    blocks, on bf16 or blockwise e4m3 operands, with ``[W1 | W3]`` transposed; anything
    else is refused naming the field."""
    import dataclasses

    from titan_megamoe.kernels import configs

    native = configs.TILE_CONFIGS["sm90", "native"]
    assert (native.gemm2.kernel, native.dgrad.kernel) == ("gluon", "tl")
    fp8 = configs.TILE_CONFIGS["sm90", "fp8_block"]
    assert (fp8.gemm2.kernel, fp8.dgrad.kernel, fp8.wgrad_kernel) == ("gluon", "gluon", "gluon")
    assert native.wgrad_kernel == "tl"
    # The backward's first kernel runs on the core where GEMM1 was saved; GEMM1 does not (v45).
    assert all((row.grad1_kernel, row.gemm1_kernel) == ("gluon", "tl") for row in (native, fp8))
    assert all(row.gemm2.kernel == "tl" for (arch, _), row in configs.TILE_CONFIGS.items() if arch != "sm90")
    refused = [
        (dict(gemm2_kernel="cuda"), "gemm2_kernel = 'cuda'; known: tl, gluon"),
        (dict(gemm2_m=64), "gemm2_m = 64 must be block_m"),
        (dict(dgrad_kernel="gluon"), "w13_as_stored_rows must be 0"),
        (dict(mx_upcast=1), "mx_upcast and mx_dequantized_weights must be 0"),
        (dict(wgrad_kernel="cuda"), "wgrad_kernel = 'cuda'; known: tl, gluon"),
        (dict(wgrad_kernel="gluon", wgrad_m=64), "wgrad_m, wgrad_n, wgrad_k = 64, 128, 128 must be 128"),
        (dict(grad1_kernel="cuda"), "grad1_kernel = 'cuda'; known: tl, gluon"),
        (dict(grad1_kernel="gluon", grad1_saved_n=64), "grad1_saved_n = 64 must be 128"),
        (dict(grad1_kernel="gluon", grad1_m=32), "grad1_m = 32 a multiple of 64"),
        (dict(gemm1_kernel="cuda"), "gemm1_kernel = 'cuda'; known: tl, gluon"),
        (dict(gemm1_kernel="gluon", gemm1_n=256), "gemm1_n = 256 must be 128"),
    ]
    for change, message in refused:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(native, **change)
    with pytest.raises(ValueError, match=r"tile row \(sm100, mxfp8\) runs a rows GEMM on the Gluon core"):
        configs.check_table({("sm100", "mxfp8"): dataclasses.replace(configs.TILE_CONFIGS["sm100", "mxfp8"],
                                                                    gemm2_kernel="gluon")})
    with pytest.raises(ValueError, match=r"tile row \(sm100, mxfp8\) runs GEMM1 on the Gluon core"):
        configs.check_table({("sm100", "mxfp8"): dataclasses.replace(configs.TILE_CONFIGS["sm100", "mxfp8"],
                                                                    gemm1_kernel="gluon")})
    with pytest.raises(ValueError, match=r"tile row \(sm100, mxfp8\) runs the backward's first kernel on the Gluon"):
        configs.check_table({("sm100", "mxfp8"): dataclasses.replace(configs.TILE_CONFIGS["sm100", "mxfp8"],
                                                                    grad1_kernel="gluon")})
    with pytest.raises(ValueError, match=r"tile row \(sm100, mxfp8\) runs the weight gradients on the Gluon core"):
        configs.check_table({("sm100", "mxfp8"): dataclasses.replace(configs.TILE_CONFIGS["sm100", "mxfp8"],
                                                                    wgrad_kernel="gluon")})
