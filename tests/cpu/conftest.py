import pytest

from torchtitan_series import skipped_unless_series

SLOW = {
    "test_fused_interpret.py": (
        "test_quantized_matches_reference", "test_quantized_rows_past_the_window_run_in_rounds",
        "test_float32_weights_with_bf16_tokens_quantize_from_float32",
        "test_forward_and_backward_match_reference[dtype1-0.03]",
        "test_rows_past_the_window_run_in_rounds_then_the_buffers_grow",
        "test_fused_backend_under_activation_checkpointing", "test_fused_backend_trains_through_the_op",
        "test_fused_backend_compiles_fullgraph", "test_refusals_and_buffer_sizes",
        "test_bad_expert_ids_poison_and_the_next_call_raises[-1]",
        "test_bad_expert_ids_poison_and_the_next_call_raises[-3]",
        "test_bad_expert_ids_poison_and_the_next_call_raises[1000000]",
        "test_bad_expert_ids_poison_and_the_next_call_raises[1099511627776]",
        "test_bad_expert_ids_found_late_raise_once_and_poison_the_calls_before",
        "test_bad_expert_ids_poison_every_rank",
    ),
    "test_kernels_interpret.py": (
        "test_block_scales_for_every_significand", "test_mainloop_matches_reference",
        "test_quantize_weights_bit_exact", "test_dequantized_rows",
        "test_gemm_bench_weight_gradients_match_its_reference",
    ),
    "test_model_parity.py": (
        "test_converted_matches_stock_fsdp_ep", "test_converted_layer_matches_stock_tp_ep[reference-True]",
        "test_converted_layer_matches_stock_tp_ep[stock-False]",
    ),
    "test_model_tomls.py": ("test_toml_trains_one_step_on_the_reference_backend",),
    "test_reference.py": (
        "test_gradcheck_float64", "test_two_ranks_fp8_within_tolerance", "test_a_bad_expert_id_raises_on_every_rank",
        "test_two_ranks_match_formula[False-first_rank_only]", "test_two_ranks_match_formula[False-skewed]",
        "test_two_ranks_match_formula[True-random]", "test_two_ranks_match_formula[True-skewed]",
        "test_two_ranks_match_formula[True-first_rank_only]",
    ),
    "test_scripts.py": (
        "test_every_sm90_kernel_fits_an_h100", "test_sm100_mxfp8_kernels_compile_to_native_mx_mma",
        "test_kernel_resources_flags_a_row_over_the_limit", "test_cpu_main_job_prints_at_once_and_runs_a_small_ab",
        "test_gpu_test_groups_take_every_gpu_test_once", "test_gpu_tests_refuse_to_run_without_a_gpu",
    ),
    "test_converter.py": (
        "test_each_family_converts_and_matches_stock[qwen3-reference]",
        "test_each_family_converts_and_matches_stock[qwen3-stock]", "test_float32_experts_run_fused_on_bf16_copies",
        "test_fused_layer_runs_stock_for_a_dtype_fused_cannot_run_only_under_auto[True]",
    ),
    "test_gluon_compile.py": ("test_every_gemm_compiles_warp_specialized",),
    "test_stock_backend.py": ("test_ranks_match_reference[4]",),
}
"""Per test module, the tests (a function: every case of it; ``name[case]``: that case)
that take more than a few seconds on two cores: marked ``slow``, which the quick loop
(``pytest -m "not slow" tests/cpu``) leaves out and CI runs. What stays in the quick loop
still runs every module of the package: the fused kernels under the interpreter in fp32,
a bad id, a late peer; one layer against stock TorchTitan; the reference on two ranks."""


def pytest_pycollect_makemodule(module_path, parent):
    return skipped_unless_series("0.2", module_path, parent)


def pytest_collection_modifyitems(items):
    """Mark the ``SLOW`` tests (``test_suite.py`` checks that each entry names a test)."""
    for item in items:
        names = SLOW.get(item.path.name, ())
        if item.name in names or item.originalname in names:
            item.add_marker(pytest.mark.slow)
