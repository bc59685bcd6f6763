"""Checks of the kernels' shared helpers, the tile-GEMM mainloop, the quantizers and the
received rows' dequantization, against the numerical spec (``titan_megamoe.reference``). The CPU tests run them under the
Triton interpreter at tiny shapes, the GPU tests at real ones.

Import this module only where Triton may define kernels (under the interpreter, only in
a process started with ``TRITON_INTERPRET=1``).
"""

import itertools

import torch
import triton
import triton.language as tl

from titan_megamoe.kernels.configs import INTERPRET
from titan_megamoe.kernels.mainloop import mx_dot, tile_gemm
from titan_megamoe.kernels.quantize import e4m3_scale, quantize_rows, quantize_weights
from titan_megamoe.kernels.transpose import quantize_transposed
from titan_megamoe.precision import AMAX_FLOOR, E4M3_MAX, FP8_BLOCK, MXFP8, NATIVE, UE8M0_EXP_MIN, Format
from titan_megamoe.reference import dequantize_blocks, quantize_blocks, relative_error


@triton.jit
def gemm_tile_kernel(
    a, a_scale, b, b_scale, b2, b2_scale, out, out2, num_rows, expert,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TWO_B: tl.constexpr, SCALE_K: tl.constexpr, B_SCALE_N: tl.constexpr, MX_DOT: tl.constexpr,
    QUANTIZE_A: tl.constexpr, UPCAST_DOT: tl.constexpr, B_N_MAJOR: tl.constexpr, B_K_SPLIT: tl.constexpr,
):
    """``out = A B[expert]^T`` (and ``out2 = A B2[expert]^T``; with ``B_K_SPLIT``, B's rows
    from ``B_K_SPLIT`` on are B2's), one tile per program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    at = rows[:, None] * N + cols[None, :]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < N)
    if TWO_B:
        acc, acc2 = tile_gemm(
            a, a_scale, rows, b, b_scale, b2, b2_scale, expert, n0, 0, K, N, K,
            BLOCK_M, BLOCK_N, BLOCK_K, True, SCALE_K, B_SCALE_N, MX_DOT, QUANTIZE_A, UPCAST_DOT, B_N_MAJOR, 0,
        )
        tl.store(out2 + at, acc2, mask=mask)
    else:
        acc = tile_gemm(
            a, a_scale, rows, b, b_scale, b2, None, expert, n0, 0, K, N, K,
            BLOCK_M, BLOCK_N, BLOCK_K, False, SCALE_K, B_SCALE_N, MX_DOT, QUANTIZE_A, UPCAST_DOT, B_N_MAJOR,
            B_K_SPLIT,
        )
    tl.store(out + at, acc, mask=mask)


def _padded_rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t [r, c]`` in a buffer of ``rows`` rows, the extra ones NaN (0xFF bytes, in every
    float format): the mainloop reads whole tiles of rows."""
    if t is None:
        return None
    buf = torch.full((rows, t.shape[1] * t.element_size()), 0xFF, dtype=torch.uint8, device=t.device)
    buf = buf.view(t.dtype)
    buf[: t.shape[0]] = t
    return buf


def run_tile_gemm(a, b, b2, a_scales, b_scales, b2_scales, expert: int, fmt: Format,
                  block_m: int, block_n: int, block_k: int, mx_upcast: bool = False, n_major: bool = False,
                  split_k: bool = False, **launch):
    """The mainloop over ``a [M, K]`` and expert ``expert`` of ``b`` (and ``b2``)
    ``[E, N, K]`` (``n_major``: ``[E, K, N]``; ``split_k``: ``b`` and ``b2`` the halves of
    one N-major B along K, ``[E, K / 2, N]`` each), scaled as ``fmt`` says (quantized ``a`` without ``a_scales``: the
    mainloop quantizes it as it reads it, or, MX held in bf16, rounds it; quantized ``b``
    without ``b_scales``: bf16 values
    already dequantized; ``mx_upcast``: MX tiles upcast in the mainloop, not handed to
    ``tl.dot_scaled``); returns ``(out, out2 or None)`` ``[M, N]`` fp32."""
    m, k = a.shape
    n = b.shape[2 if n_major else 1]
    m_pad = triton.cdiv(m, block_m) * block_m
    out = torch.full((m, n), float("nan"), device=a.device)
    out2 = None if b2 is None or split_k else torch.full_like(out, float("nan"))
    gemm_tile_kernel[(m_pad // block_m, triton.cdiv(n, block_n))](
        _padded_rows(a, m_pad), _padded_rows(a_scales, m_pad), b, b_scales, b2, b2_scales, out, out2,
        m, expert,
        N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TWO_B=out2 is not None,
        SCALE_K=fmt.row_scale_k,
        B_SCALE_N=fmt.weight_block[0] if b_scales is not None else 0, MX_DOT=mx_dot(fmt, mx_upcast),
        QUANTIZE_A=(fmt.row_scale_k or fmt.round_k) if a_scales is None else 0, UPCAST_DOT=INTERPRET,
        B_N_MAJOR=n_major, B_K_SPLIT=k // 2 if split_k else 0, **launch,
    )
    return out, out2


def _blocky(shape, block: tuple[int, int], generator) -> torch.Tensor:
    """Normal values times a power of two drawn per ``block`` of the last two dimensions
    (2^-8 .. 2^8): a scale applied to the wrong block shows."""
    rows, cols = shape[-2:]
    exponents = torch.randint(-8, 9, shape[:-2] + (-(-rows // block[0]), -(-cols // block[1])), generator=generator)
    factor = torch.exp2(exponents.float()).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return torch.randn(shape, generator=generator) * factor[..., :rows, :cols]


def check_mainloop(device, m: int, n: int, k: int, block_m: int, block_n: int, block_ks: tuple[int, ...],
                   tolerances: dict[str, float], seed: int, **launch) -> None:
    """Both quantized formats, and unquantized operands of each dtype named in
    ``tolerances`` (the relative error allowed, by format or dtype name), with one and two
    B operands, against the product of the dequantized operands in float64. B holds 3
    experts; the last one is used."""
    g = torch.Generator().manual_seed(seed)
    experts = 3
    for fmt in (FP8_BLOCK, MXFP8):
        scale_k = fmt.activation_block[1]
        a = _blocky((m, k), fmt.activation_block, g)
        bs = [_blocky((experts, n, k), fmt.weight_block, g) for _ in range(2)]
        qa, sa = quantize_blocks(a, fmt.activation_block, fmt.power_of_two)
        quantized = [[quantize_blocks(w, fmt.weight_block, fmt.power_of_two) for w in b] for b in bs]
        qbs = [torch.stack([q for q, _ in per_expert]) for per_expert in quantized]
        sbs = [torch.stack([s for _, s in per_expert]) for per_expert in quantized]
        b_refs = [dequantize_blocks(q[-1], s[-1], fmt.weight_block).double() for q, s in zip(qbs, sbs)]
        on = [t.to(device) for t in (qa, sa, *qbs, *sbs)]
        # (A, its scales, the dequantized A): quantized beforehand; and, for a scaled MMA,
        # bf16 rows that the mainloop quantizes as it reads them.
        a_forms = [(on[0], on[1], dequantize_blocks(qa, sa, fmt.activation_block).double())]
        if fmt.scaled_mma:
            a16 = a.to(torch.bfloat16)
            a_forms.append((a16.to(device), None, dequantize_blocks(
                *quantize_blocks(a16, fmt.activation_block, fmt.power_of_two), fmt.activation_block).double()))
        # Promotion steps inside a scale block; a scaled MMA over whole ones.
        fitting = [bk for bk in block_ks if (bk % scale_k if fmt.scaled_mma else scale_k % bk) == 0]
        assert fitting, (fmt.name, block_ks)
        # B with its scales; for a scaled MMA also dequantized to bf16 (the same values).
        b_forms = [(on[2], on[3], on[4], on[5])]
        if fmt.scaled_mma:
            dequantized = [torch.stack([dequantize_blocks(q, s, fmt.weight_block) for q, s in per_expert])
                           for per_expert in quantized]
            b_forms.append(tuple(d.to(torch.bfloat16).to(device) for d in dequantized) + (None, None))
        # An MX dot scaled by the MMA, and upcast in the mainloop.
        upcasts = (False, True) if fmt.scaled_mma else (False,)
        for block_k in fitting:
            for two_b, upcast in itertools.product((False, True), upcasts):
                for (a_in, a_scales, a_ref), (b, b2, b_scales, b2_scales) in itertools.product(a_forms, b_forms):
                    outs = run_tile_gemm(
                        a_in, b, b2 if two_b else None, a_scales, b_scales, b2_scales if two_b else None,
                        experts - 1, fmt, block_m, block_n, block_k, upcast, **launch,
                    )
                    for got, b_ref in zip(outs[: 1 + two_b], b_refs):
                        err = relative_error(got.cpu(), a_ref @ b_ref.T)
                        case = (fmt.name, m, n, k, block_k, two_b, upcast, a_scales is None, b_scales is None,
                                err, f"seed {seed}")
                        assert err <= tolerances[fmt.name], case
        if fmt.scaled_mma:
            # MX held in bf16: unscaled bf16 operands, the unrounded A rows rounded as the
            # mainloop reads them.
            (a_in, _, a_ref), (b, b2, _, _) = a_forms[1], b_forms[1]
            for block_k, two_b in itertools.product(fitting, (False, True)):
                outs = run_tile_gemm(a_in, b, b2 if two_b else None, None, None, None, experts - 1,
                                     fmt.in_bf16(), block_m, block_n, block_k, **launch)
                for got, b_ref in zip(outs[: 1 + two_b], b_refs):
                    err = relative_error(got.cpu(), a_ref @ b_ref.T)
                    assert err <= tolerances[fmt.name], (fmt.name, "in bf16", m, n, k, block_k, two_b, err)

    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if name not in tolerances:
            continue
        a = torch.randn(m, k, generator=g).to(dtype)
        bs = [torch.randn(experts, n, k, generator=g).to(dtype) for _ in range(2)]
        expected = [a.double() @ b[-1].double().T for b in bs]
        for block_k in block_ks:
            for two_b in (False, True):
                for n_major in (False, True):  # B as [E, N, K], or as [E, K, N] read N-major
                    b_in = [b.transpose(1, 2).contiguous() if n_major else b for b in bs]
                    outs = run_tile_gemm(
                        a.to(device), b_in[0].to(device), b_in[1].to(device) if two_b else None, None, None, None,
                        experts - 1, NATIVE, block_m, block_n, block_k, n_major=n_major, **launch,
                    )
                    for got, want in zip(outs[: 1 + two_b], expected):
                        err = relative_error(got.cpu(), want)
                        assert err <= tolerances[name], (
                            name, m, n, k, block_k, two_b, n_major, err, f"seed {seed}")
            if k % (2 * block_k) == 0:
                # One N-major B in two halves along K (the dgrad GEMM's W1 and W3 as stored).
                halves = [h.transpose(1, 2).contiguous().to(device) for h in bs[0].chunk(2, dim=2)]
                got, _ = run_tile_gemm(a.to(device), *halves, None, None, None, experts - 1, NATIVE,
                                       block_m, block_n, block_k, n_major=True, split_k=True, **launch)
                err = relative_error(got.cpu(), expected[0])
                assert err <= tolerances[name], (name, "split K", m, n, k, block_k, err, f"seed {seed}")


@triton.jit
def block_scales_kernel(amax, scales, multipliers, n, POWER_OF_TWO: tl.constexpr, BLOCK: tl.constexpr):
    """``e4m3_scale`` of each of ``amax [n]``."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = at < n
    scale, multiplier = e4m3_scale(tl.load(amax + at, mask=live, other=0.0), POWER_OF_TWO)
    tl.store(scales + at, scale, mask=live)
    tl.store(multipliers + at, multiplier, mask=live)


def check_block_scales(device, exponent_fields: list[int]) -> None:
    """``e4m3_scale`` for block maxima of every fp32 significand under each of
    ``exponent_fields`` (the biased exponent bits; 0: subnormals), and 0, bit for bit: fp32
    scales and multipliers are the correctly rounded ``amax / 448`` and ``448 / amax``
    (``amax`` floored at ``AMAX_FLOOR``); a power-of-two scale is the smallest power of two
    (at least 2^-127) with ``448 * scale >= amax`` and its multiplier is its reciprocal;
    every scale is the reference's."""
    significands = torch.arange(1 << 23, dtype=torch.int32)
    bits = torch.cat([torch.zeros(1, dtype=torch.int32)] + [significands | (f << 23) for f in exponent_fields])
    amax = bits.view(torch.float32)
    positive = amax > 0
    e4m3_max = torch.tensor(E4M3_MAX)
    for power_of_two in (False, True):
        scales, multipliers = (torch.full_like(amax, float("nan"), device=device) for _ in range(2))
        block = 1 << 16 if INTERPRET else 1024  # the interpreter runs programs one after another
        block_scales_kernel[(triton.cdiv(len(amax), block),)](
            amax.to(device), scales, multipliers, len(amax), POWER_OF_TWO=power_of_two, BLOCK=block,
        )
        scales, multipliers = scales.cpu(), multipliers.cpu()
        if power_of_two:
            s, m, a = scales.double(), multipliers.double(), amax.double()
            smallest = (E4M3_MAX * s >= a) & ((E4M3_MAX * s / 2 < a) | (s == 2.0**UE8M0_EXP_MIN))
            ok = torch.where(positive, smallest & (s * m == 1), (s == 1) & (m == 1))
            assert bool(ok.all()), ("power-of-two scales", _first_difference(ok, torch.ones_like(ok)))
        else:
            floored = amax.clamp_min(AMAX_FLOOR)
            wanted = {"scales": (scales, floored / e4m3_max), "multipliers": (multipliers, e4m3_max / floored)}
            for what, (got, want) in wanted.items():
                want = torch.where(positive, want, 1.0)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (what, _first_difference(got, want))
        _, reference_scales = quantize_blocks(amax[:, None], (1, 1), power_of_two)
        assert torch.equal(scales.view(torch.int32), reference_scales.flatten().view(torch.int32)), (
            "reference", power_of_two, _first_difference(scales, reference_scales.flatten()))


def quantize_input(rows: int, cols: int, scale_k: int, generator) -> torch.Tensor:
    """Rows of magnitudes 2^-40 .. 2^40, and the hard cases: an all-zero row (+0.0 and
    -0.0), an all-zero block, a row of 1e-30s, one of 1e30s, blocks whose amax / 448 is a
    power of two, one outlier per block, amax / 448 subnormal in fp32 (above, at and below
    2^-127, UE8M0's smallest scale), and (when ``cols`` is not a multiple of ``scale_k``) a
    partial last block."""
    assert rows >= 9
    t = torch.randn(rows, cols, generator=generator)
    t *= torch.exp2(torch.randint(-40, 41, (rows, 1), generator=generator).float())
    t[0] = 0.0
    t[0, ::2] = -0.0
    t[1, :scale_k] = 0.0
    t[2] = torch.randn(cols, generator=generator) * 1e-30
    t[3] = torch.randn(cols, generator=generator) * 1e30
    t[4] = torch.rand(cols, generator=generator)
    t[4, ::scale_k] = 448.0 * 2.0**-5
    t[5, ::scale_k] = -448.0 * 2.0**7
    t[6, ::scale_k] *= 1e6
    t[7] = torch.randn(cols, generator=generator) * 1e-37
    t[8] = torch.rand(cols, generator=generator) * 1e-40
    planted = t[8, ::scale_k]
    t[8, ::scale_k] = 448.0 * 2.0**-127 * torch.tensor([1.5, 1.0, 0.5]).repeat(len(planted))[: len(planted)]
    return t


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    where = (got != want).nonzero()
    return f"{len(where)} differ, first at {where[0].tolist()}: {got[tuple(where[0])]} vs {want[tuple(where[0])]}"


def _poison_freed_memory(device, *like: torch.Tensor) -> None:
    """Fill memory blocks of the sizes of ``like`` with 0xFF bytes (NaN in e4m3 and fp32)
    and free them: a GPU's caching allocator hands those blocks to the next allocations
    of those sizes, so an output element a kernel fails to write shows."""
    for t in like:
        torch.full((t.numel() * t.element_size(),), 0xFF, dtype=torch.uint8, device=device)


def check_quantize(device, rows: int, cols: int, seed: int) -> None:
    """``quantize_rows`` against ``reference.quantize_blocks`` (computed on the CPU), bit
    for bit: e4m3 bytes and scales, for fp8_block and mxfp8, from fp32 and bf16 rows."""
    g = torch.Generator().manual_seed(seed)
    for fmt in (FP8_BLOCK, MXFP8):
        scale_k = fmt.activation_block[1]
        for dtype in (torch.float32, torch.bfloat16):
            t = quantize_input(rows, cols, scale_k, g).to(dtype)
            if INTERPRET and dtype == torch.bfloat16:
                # The interpreter widens subnormal bf16 wrongly (GPUs shift the bits).
                t[t.abs() < torch.finfo(dtype).tiny] = 0.0
            q_ref, scales_ref = quantize_blocks(t, fmt.activation_block, fmt.power_of_two)
            x = t.to(device)
            _poison_freed_memory(device, q_ref, scales_ref)
            q, scales = quantize_rows(x, scale_k, fmt.power_of_two)
            assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            assert q.shape == q_ref.shape and scales.shape == scales_ref.shape
            got, want = q.cpu().view(torch.uint8), q_ref.view(torch.uint8)
            assert torch.equal(got, want), (fmt.name, str(dtype), "e4m3", _first_difference(got, want), f"seed {seed}")
            got, want = scales.cpu().view(torch.int32), scales_ref.view(torch.int32)
            assert torch.equal(got, want), (fmt.name, str(dtype), "scales", _first_difference(got, want), f"seed {seed}")


def check_quantize_weights(device, seed: int) -> None:
    """``quantize_weights`` and ``quantize_transposed`` against ``reference.quantize_blocks``
    (on the CPU), bit for bit, in both formats' weight blocks, on weights with partial blocks along N and K and the
    hard cases of ``quantize_input`` in their rows."""
    g = torch.Generator().manual_seed(seed)
    for fmt in (FP8_BLOCK, MXFP8):
        w = quantize_input(3 * 300, 260, fmt.weight_block[1], g).view(3, 300, 260)
        (q, scales), = quantize_weights([w.to(device)], fmt)
        q_ref, scales_ref = quantize_blocks(w, fmt.weight_block, fmt.power_of_two)
        assert q.shape == q_ref.shape and scales.shape == scales_ref.shape, (fmt.name, q.shape, scales.shape)
        got, want = q.cpu().view(torch.uint8), q_ref.view(torch.uint8)
        assert torch.equal(got, want), (fmt.name, "e4m3", _first_difference(got, want), f"seed {seed}")
        got, want = scales.cpu().view(torch.int32), scales_ref.view(torch.int32)
        assert torch.equal(got, want), (fmt.name, "scales", _first_difference(got, want), f"seed {seed}")
        # Transposed side by side, as the backward reads them: the first weight fills whole
        # blocks, the last ends in a partial one along both dimensions.
        pair = [w[:, :256], w]
        q, scales = quantize_transposed([p.to(device) for p in pair], fmt, transpose_block=32)
        q_ref, scales_ref = quantize_blocks(torch.cat([p.transpose(1, 2) for p in pair], dim=2),
                                            fmt.weight_block, fmt.power_of_two)
        assert q.shape == q_ref.shape and scales.shape == scales_ref.shape, (fmt.name, q.shape, scales.shape)
        got, want = q.cpu().view(torch.uint8), q_ref.view(torch.uint8)
        assert torch.equal(got, want), (fmt.name, "transposed e4m3", _first_difference(got, want), f"seed {seed}")
        got, want = scales.cpu().view(torch.int32), scales_ref.view(torch.int32)
        assert torch.equal(got, want), (fmt.name, "transposed scales", _first_difference(got, want), f"seed {seed}")
        if fmt.scaled_mma:
            # Dequantized to bf16, straight and transposed: the reference's values, exactly,
            # wherever bf16 holds them (magnitudes from its smallest normal, 2^-126, up).
            (values, no_scales), = quantize_weights([w.to(device)], fmt, dequantize=True)
            assert no_scales is None and values.dtype == torch.bfloat16
            want = dequantize_blocks(*quantize_blocks(w, fmt.weight_block, True), fmt.weight_block)
            _assert_dequantized(values.cpu(), want, (fmt.name, "dequantized", f"seed {seed}"))
            values, _ = quantize_transposed([p.to(device) for p in pair], fmt, transpose_block=32, dequantize=True)
            want = dequantize_blocks(q_ref, scales_ref, fmt.weight_block)
            _assert_dequantized(values.cpu(), want, (fmt.name, "transposed dequantized", f"seed {seed}"))


def _assert_dequantized(got: torch.Tensor, want: torch.Tensor, case) -> None:
    """bf16 ``got`` equals fp32 ``want`` wherever ``|want|`` is a normal bf16 magnitude, and
    stays below that range elsewhere."""
    tiny = torch.finfo(torch.bfloat16).tiny
    normal = want.abs() >= tiny
    assert normal.float().mean() > 0.2, case
    assert torch.equal(got.float()[normal], want[normal]), case
    assert (got.float()[~normal].abs() <= tiny).all(), case


def check_dequantized_rows(device, seed: int) -> None:
    """``dequantized_rows_kernel`` on a receive layout of three local experts (5 rows, none,
    20; aligned to 16 rows) in a buffer of 64 rows, programs of 8 rows: each expert's rows equal
    ``reference.dequantize_blocks`` of the e4m3 rows rounded to the output dtype (the
    interpreter rounds to bf16 by truncation: within a bf16 step there), its padding rows
    up to the alignment are 0 although their bytes and scales are NaN, and the rows past
    the last block are left as they were. Both row formats, a partial last scale block;
    then, with ``MX_TOKEN_BLOCK`` 8, the same rows and unquantized ones, each column
    quantized along the tokens in MX blocks of 8 of its expert's rows and dequantized, as
    the reference quantizes the transposed rows."""
    from titan_megamoe.kernels.wgrad import dequantized_rows_kernel

    g = torch.Generator().manual_seed(seed)
    block, cols, token_block = 16, 200, 8
    local_rows = torch.tensor([5, 0, 20], dtype=torch.int32)
    local_base = torch.tensor([0, 16, 16], dtype=torch.int32)
    num_rows, used = 64, 48
    live = torch.zeros(num_rows, dtype=torch.bool)
    for base, count in zip(local_base.tolist(), local_rows.tolist()):
        live[base : base + count] = True

    def along_tokens(values: torch.Tensor) -> torch.Tensor:
        rounded = torch.zeros_like(values)
        for base, count in zip(local_base.tolist(), local_rows.tolist()):
            q, scales = quantize_blocks(values[base : base + count].T, (1, token_block), True)
            rounded[base : base + count] = dequantize_blocks(q, scales, (1, token_block)).T
        return rounded

    cases = []
    for fmt in (FP8_BLOCK, MXFP8):
        scale_k = fmt.activation_block[1]
        q, scales = quantize_blocks(quantize_input(num_rows, cols, scale_k, g), fmt.activation_block, fmt.power_of_two)
        q, scales = q.contiguous(), scales.contiguous()  # rows as the receive buffer holds them
        q.view(torch.uint8)[~live] = 0xFF
        scales[~live] = float("nan")
        values = torch.where(live[:, None], dequantize_blocks(q, scales, fmt.activation_block), 0.0)
        cases.append((fmt.name, q, scales, scale_k, 0, values))
        cases.append((fmt.name, q, scales, scale_k, token_block, along_tokens(values)))
    rows = torch.where(live[:, None], quantize_input(num_rows, cols, 32, g), float("nan"))
    cases.append(("unquantized rows", rows, None, 0, token_block, along_tokens(torch.nan_to_num(rows))))
    for name, t, scales, scale_k, mx_token_block, values in cases:
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((num_rows, cols), float("nan"), dtype=dtype, device=device)
            dequantized_rows_kernel[(num_rows // 8, triton.cdiv(cols, 128))](
                t.to(device), None if scales is None else scales.to(device), out, num_rows,
                local_base.to(device), local_rows.to(device), 3,
                COLS=cols, SCALE_K=scale_k, LOCAL_PAD=4, ROW_ALIGN=block, BLOCK_R=8, BLOCK_C=128,
                MX_TOKEN_BLOCK=mx_token_block,
            )
            got = out.cpu()
            case = (name, f"MX_TOKEN_BLOCK {mx_token_block}", str(dtype), f"seed {seed}")
            assert got[used:].isnan().all(), case + ("rows past the last block",)
            got, expected, padding = got[:used], values[:used], ~live[:used]
            assert torch.equal(got[padding], torch.zeros_like(got[padding])), case + ("padding rows",)
            if dtype == torch.bfloat16 and INTERPRET:
                step = 2.0**-7 * expected.abs() + torch.finfo(dtype).tiny
                assert ((got.float() - expected).abs() <= step).all(), case
            else:
                want = expected.to(dtype)
                assert torch.equal(got, want), case + (_first_difference(got, want),)


def blockwise_scaled_mm_stand_in(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """``torch.nn.functional.scaled_mm`` with 1 x 128 blocks on both operands, as it takes
    them on Hopper (it checks these layouts and raises otherwise), in float64: ``a [M, K]``
    K-major, ``b [K, N]`` K-major (a transposed view), the scales ``[M, K / 128]`` and
    ``[N, K / 128]`` outer-dimension major. For devices where torch has no such GEMM."""
    from torch.nn.functional import ScalingType

    assert recipe_a == recipe_b == ScalingType.BlockWise1x128
    (m, k), n = a.shape, b.shape[1]
    assert a.stride(1) == 1 and b.stride(0) == 1 and k % 128 == 0, (a.stride(), b.stride())
    assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (n, k // 128) and scale_b.stride() == (1, n), (scale_b.shape, scale_b.stride())
    a64 = (a.double().view(m, k // 128, 128) * scale_a.double()[:, :, None]).view(m, k)
    b64 = (b.t().double().view(n, k // 128, 128) * scale_b.double()[:, :, None]).view(n, k)
    return (a64 @ b64.T).to(output_dtype)
