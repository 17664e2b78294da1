"""What the suite is made of, as data (no imports: scripts/test.sh reads it before jax loads).

- PRODUCTION_CODEGEN: the modules that measure the compiled programs users run (HLO bytes and
  copies) or depend on their last bit (greedy identity at a near-tie); they compile with XLA's
  defaults in a process of their own (tests/conftest.py says why).
- LONGEST_FIRST: the modules in order of measured wall time, longest first (docs/testing.md,
  `python scripts/test_profile.py`), so xdist's two workers, which take whole files in order, end
  together instead of one long file running alone at the end.
- EXPECTED_SKIPS: the only skips allowed in CI (CI=true): (module, fragment of the reason), at
  run time or at collection (tests/skip_guard.py). Anything else the project installs must be
  there; a skip elsewhere fails the run. On the 2-core machine with scripts/setup.sh's install no
  module skips at collection (`CI=true pytest --collect-only tests` reports no error).
- QUICK: `bash scripts/test.sh --quick`: one case per property, the inner loop (module -> the
  test functions whose first case runs: a parametrized test runs its first parameter set only).
"""

PRODUCTION_CODEGEN = (
    "test_greedy_identity.py",
    "test_tree_chain.py",
    # a sampled row (top-p 0.9) in a live-width batch must draw what it draws alone: under the
    # fast code generation's level 0 the top-p filter compiled differently per width (the
    # miscompile tests/conftest.py describes) and the row's tokens moved; exact under defaults.
    # The rest of the scheduler's tests (test_serving.py) compare jaxspec with itself: fast.
    "test_serving_sampled_widths.py",
)

LONGEST_FIRST: tuple[str, ...] = (
    "test_serving.py",
    "test_serving_sampled_widths.py",
    "test_adaptive.py",
    "test_sharding.py",
    "test_serving_mesh.py",
    "test_families.py",
    "test_accelerator_path.py",
    "test_tree.py",
    "test_distributions.py",
    "test_loop_logprobs.py",
    "test_speculative.py",
    "test_formats.py",
    "test_trained_drafters.py",
    "test_qwen3_5.py",
    "test_hybrid_serving.py",
    "test_docs.py",
    "test_parity.py",
    "test_moe.py",
    "test_gemma4.py",
    "test_qwen3_5_moe.py",
    "test_device_exports.py",
    "test_attention_impls.py",
    "test_greedy_identity.py",
    "test_paged_forward.py",
    "test_batch_admission.py",
    "test_notebooks.py",
    "test_server_ops.py",
    "test_server_faults.py",
    "test_tree_chain.py",
    "test_cli.py",
    "test_prefix_cache.py",
    "test_bench.py",
    "test_dflash.py",
    "test_prefill_chunks.py",
    "test_dspark.py",
    "test_peagle.py",
    "test_malformed.py",
    "test_acceptance.py",
    "test_suffix.py",
    "test_block.py",
    "test_structured_loop.py",
    "test_server.py",
    "test_penalty_law.py",
    "test_serving_programs.py",
    "test_cli_inputs.py",
    "test_paged_cache.py",
    "test_gemma4_gguf.py",
    "test_ngram_ceiling.py",
    "test_accel_roofline.py",
    "test_roofline.py",
    "test_server_structured.py",
    "test_policy.py",
    "test_server_logprobs.py",
    "test_server_clients.py",
    "test_bench_device.py",
    "test_progress.py",
    "test_train.py",
    "test_byo_target.py",
    "test_sampling.py",
    "test_hub.py",
    "test_skip_guard.py",
    "test_structured.py",
    "test_paged_kernels.py",
    "test_wheel.py",
    "test_registry.py",
    "test_kernels.py",
    "test_gemma_gguf.py",
    "test_qwen3_5_mtp.py",
    "test_input_checks.py",
    "test_loading.py",
    "test_help.py",
    "test_cases.py",
    "test_engine_units.py",
    "test_drafter_window.py",
    "test_logprobs.py",
    "test_jax_compat.py",
    "test_config.py",
    "test_logit_bias.py",
    "test_vllm_peer.py",
    "test_paired_bench.py",
    "test_repository.py",
    "test_layers.py",
    "test_kv_manager.py",
    "test_corpus.py",
)

EXPECTED_SKIPS = (
    ("test_bench_device.py", "set JAXSPEC_DEVICE_SMOKE=1"),
)

QUICK: dict[str, tuple[str, ...]] = {
    "test_acceptance.py": ("test_emitted_tokens_have_target_law", "test_check_rejects_broken_rule",
                           "test_greedy_is_the_limit"),
    "test_sampling.py": ("test_top_p_keeps_minimal_nucleus", "test_min_p",
                         "test_new_param_values_do_not_recompile"),
    "test_speculative.py": ("test_greedy_speculative_is_token_identical",
                            "test_max_new_tokens_is_exact", "test_eos_inside_the_window_stops_the_row",
                            "test_distribution_test_catches_a_broken_rule"),
    "test_tree.py": ("test_tree_window_mask_depth_and_padding", "test_tree_greedy_is_token_identical",
                     "test_tree_sampling_has_the_target_distribution"),
    "test_distributions.py": ("test_sampled_output_has_the_target_law",),
    "test_adaptive.py": ("test_adaptive_greedy_is_token_identical",),
    "test_parity.py": ("test_tiny_checkpoint_logits_match_transformers",),
    "test_loading.py": ("test_loaded_model_pytree", "test_errors_are_one_line"),
    "test_config.py": ("test_shipped_configs_parse", "test_unknown_key_lists_valid"),
    "test_cli.py": ("test_bad_arguments",),
    "test_serving.py": ("test_greedy_rows_equal_solo_runs_whatever_shares_the_batch",),
    "test_paged_cache.py": ("test_the_view_of_shuffled_pages_is_the_contiguous_cache",),
    "test_prefix_cache.py": ("test_the_pool_counts_holders_caches_unheld_pages_and_evicts_them",),
    "test_kernels.py": ("test_panel_matmul_matches_float64", "test_prefix_attention_matches_float64"),
    "test_formats.py": ("test_eagle3_logits_match_an_independent_torch_forward",),
    "test_families.py": ("test_logits_match_transformers_past_the_window",),
    "test_qwen3_5.py": ("test_logits_match_transformers",),
    "test_qwen3_5_mtp.py": ("test_head_forward_equals_the_published_definition",),
    "test_qwen3_5_moe.py": ("test_logits_match_transformers",),
    "test_docs.py": ("test_generated_parts_are_current", "test_relative_links_resolve"),
    "test_help.py": ("test_import_jaxspec_is_light_and_every_export_resolves",),
    "test_cases.py": ("test_every_registered_drafter_has_cases",),
    "test_engine_units.py": ("test_requests_pack_bucket_and_check",),
    "test_suffix.py": ("test_greedy_suffix_is_token_identical",),
    "test_input_checks.py": ("test_bad_prompt_token_ids_are_refused",),
    "test_bench.py": ("test_expected_tokens_per_step",),
    "test_sharding.py": ("test_bad_meshes_are_refused_with_their_numbers",),
    "test_accelerator_path.py": ("test_decode_loop_copies_no_cache",),
}
