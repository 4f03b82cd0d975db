"""Which tests are `slow`: outside the quick loop (`python -m pytest -q -m "not slow"`);
and which are long checks, outside the suite (`LONG`).

The quick loop keeps, for every test function, at least one case that compiles and runs
its programs, so every module of the package is exercised; what moves out are the
further schedules, sampler settings, families and sizes of the same check, the
statistical laws beyond one per family, and the checks that start whole processes (a mesh
of simulated devices, two hosts, the GPU check). The whole suite (`python -m pytest -q`,
what CI runs) runs them all.

`SLOW` maps a test function ("file::name") to why it is slow and, for a parametrised
test, the case ids that stay in the quick loop (an empty tuple: every case is slow).
"""

from __future__ import annotations

import pytest

# (why, case ids kept in the quick loop); None: a test without cases, wholly slow.
SLOW: dict[str, tuple[str, tuple[str, ...] | None]] = {
    # Statistical laws: one chi-square test per family stays quick.
    "test_sampling.py::test_follows_ar_distribution":
        ("a chi-square law per schedule and sampler; Packed-SS at T=1 stays", ("packed-T=1",)),
    "test_sampling.py::test_wrong_rules_are_caught": ("the law test's power, twice", ()),
    "test_sampling.py::test_seed_reproduces_and_batch_matches_single":
        ("a sampled batch program of every schedule", None),
    "test_sampling.py::test_temperature_zero_is_greedy": ("one program per schedule", ("packed",)),
    "test_sampling.py::test_the_sampled_program_at_temperature_zero_is_greedy":
        ("one sampled program per schedule", ("packed",)),
    "test_sampling.py::test_the_sampled_program_at_temperature_zero_breaks_ties_as_greedy":
        ("one sampled program per schedule", ("packed",)),
    "test_sampling.py::test_branched_follows_ar_distribution":
        ("a chi-square law per number of branches, over five tokens", None),
    "test_branched.py::test_greedy_is_the_reference_continuation":
        ("one program per number of branches", ("3",)),
    "test_sampling.py::test_a_capped_stored_proposal_keeps_the_law":
        ("a chi-square law beyond one per family", None),
    "test_setdlm_sampling.py::test_follows_serial_distribution":
        ("a chi-square law per schedule and sampler; Packed at T=1 stays", ("packed-T=1",)),
    "test_setdlm_sampling.py::test_branched_follows_serial_distribution":
        ("a chi-square law per number of branches", None),
    "test_setdlm_sampling.py::test_always_accept_is_caught": ("the law test's power", None),
    "test_setdlm_sampling.py::test_temperature_zero_is_greedy":
        ("one program per schedule", ("packed",)),
    "test_setdlm_sampling.py::test_the_sampled_program_at_temperature_zero_is_greedy":
        ("one sampled program per schedule", ("packed",)),
    "test_numerics.py::test_small_temperature_is_greedy":
        ("every schedule at five temperatures", ()),
    "test_numerics.py::test_setdlm_non_finite_weights_raise":
        ("every schedule with broken weights", None),
    "test_numerics.py::test_nemotron_non_finite_weights_raise":
        ("every schedule with broken weights (the loop's finite check stays, with"
         " test_non_finite_logits_still_give_vocabulary_ids)", None),
    "test_numerics.py::test_fixture_small_temperature_is_greedy":
        ("a sampled program of the fixture (the tiny models' check stays)", None),
    # Exactness over more schedules, widths and families than one.
    "test_greedy_exactness.py::test_speculative_equals_ar":
        ("a property search over random models, widths and lengths", None),
    "test_greedy_exactness.py::test_fixture_greedy_continuation":
        ("one program per schedule and width", ("3-packed", "3-linear")),
    "test_greedy_exactness.py::test_fixture_with_draft_adapter":
        ("one program per schedule", ("packed",)),
    "test_batched.py::test_batch_equals_each_prompt_alone":
        ("a batched program per schedule, sampler and family",
         ("nemotron-packed-ltr-0.0", "setdlm-packed-ltr-0.0")),
    "test_batched.py::test_batch_mixes_prompt_buckets": ("a second bucket's programs", ()),
    "test_batched.py::test_bench_batches_give_each_prompts_tokens":
        ("the bench's batched path over several schedules", None),
    "test_batched.py::test_continuous_batching_gives_each_prompts_tokens":
        ("a queue per family and sampler", ("setdlm-0.0",)),
    "test_chunked.py::test_chunks_are_the_one_shot_decode":
        ("chunk programs per schedule and family",
         ("nemotron-packed-0.0-ltr", "setdlm-packed-0.0-ltr")),
    "test_stream.py::test_stop_sequences_end_the_output_at_the_earliest":
        ("stop markers per schedule and family", ("nemotron-packed", "setdlm-packed")),
    "test_feedback.py::test_every_path_stays_exact_while_the_choice_changes":
        ("each path's programs for three candidates; decode stays", ("decode",)),
    "test_serving_auto.py::test_a_server_moves_to_a_better_choice_and_every_request_stays_exact":
        ("a second choice's programs compiled while the server decodes (test_auto.py's "
         "server on auto stays)", None),
    "test_one_engine.py::test_every_schedule_runs_from_the_cli":
        ("every schedule through the CLI", ("nemotron-packed", "setdlm-serial")),
    "test_one_engine.py::test_bench_runs_a_setdlm_checkpoint":
        ("a whole bench of a SetDLM checkpoint", None),
    "test_one_engine.py::test_vmapped_decoder_equals_decode_per_prompt":
        ("a vmapped program per family and sampler", ("greedy-setdlm",)),
    "test_serving.py::test_other_schedules_serve_greedy_and_sampled_requests_in_one_state":
        ("SetDLM's Branched-SS behind a server (Nemotron's stays, and SetDLM's Branched-SS "
         "is checked against its reference in the suite)", ("setdlm-tiny-branched-shape3",)),
    "test_embedded_model.py::test_all_schedules_return_ar_greedy_tokens":
        ("every schedule of the embedded model on its prompts", None),
    "test_embedded_setdlm.py::test_ltr_schedules_return_serial_greedy_and_drafts_are_accepted":
        ("every schedule of the embedded SetDLM model on its prompts", None),
    "test_theorem_3_2.py::test_packed_never_needs_more_calls_than_linear":
        ("the bound at three widths", ("4",)),
    "test_theorem_3_2.py::test_bound_holds_with_eos_stopping": ("a third set of programs", None),
    "test_reference_loop.py::test_first_call_alone": ("one program per schedule", ("packed",)),
    "test_reference_loop.py::test_engine_equals_python_loop":
        ("one program per schedule, width and length; one of each schedule stays",
         ("0-3-19-None-packed", "1-5-25-3-linear", "3-2-12-5-quadratic", "0-3-19-None-ar")),
    "test_setdlm_decode.py::test_ltr_is_the_serial_greedy_output":
        ("one program per schedule and width", ("packed-3", "serial-1")),
    "test_setdlm_decode.py::test_confidence_order_is_the_serial_reference":
        ("one program per schedule and width", ("packed-3",)),
    "test_compile_once.py::test_second_decode_does_not_recompile":
        ("a fresh compile per schedule", ("packed",)),
    # Golden decodes: Packed-SS greedy and sampled on each family's embedded model stay.
    "test_golden_fixtures.py::test_fixture_decode_matches_golden":
        ("the fixture models' golden decodes", None),
    "test_golden.py::test_decode_matches_golden":
        ("the embedded models' batch, stream, queue and stop cases of golden.SUITE",
         tuple(f"{m}-packed-{k}" for m in ("nld-tiny", "setdlm-tiny")
               for k in ("greedy", "t0.9-k40-p0.95"))),
    # Programs whose structure is checked at more dtypes and layouts than one.
    "test_cache_in_place.py::test_decode_loop_never_copies_the_cache":
        ("a program per schedule and sampler; Packed-SS greedy and sampled stay",
         ("greedy-packed", "t1-packed")),
    "test_cache_in_place.py::test_setdlm_loop_never_copies_the_cache":
        ("a program per schedule, order and sampler", ("packed-ltr-1.0",
                                                        "linear-confidence-0.0")),
    "test_cache_in_place.py::test_bf16_decode_loop_never_copies_the_cache":
        ("bf16 programs per schedule", ("packed",)),
    "test_cache_in_place.py::test_setdlm_bf16_loop_never_copies_the_cache":
        ("SetDLM's bf16 program (its float32 twin stays)", None),
    "test_bf16_3b_programs.py::test_loop_carries_no_float32_weights":
        ("a 3B program compiled per schedule", ("packed",)),
    "test_bf16_3b_programs.py::test_memory_analysis": ("AR's 3B program", ("packed",)),
    "test_bf16_3b_programs.py::test_cache_written_in_place": ("AR's 3B program", ("packed",)),
    "test_bf16_3b_programs.py::test_attention_reads_live_chunks": ("AR's 3B program", ("packed",)),
    "test_parity_bf16.py::test_cached_route": ("the cached route's programs in bf16", ()),
    "test_params_layout.py::test_both_layouts_compute_the_same_cached_forward":
        ("a cached forward in both layouts", None),
    # Whole processes and whole tools.
    "test_mesh.py::test_meshes_give_one_devices_tokens_on_the_fixture":
        ("a process with 8 simulated devices compiling every mesh's programs", None),
    "test_mesh.py::test_meshes_give_one_devices_tokens_on_the_embedded_model":
        ("a process with 8 simulated devices compiling every mesh's programs", None),
    "test_multihost.py::test_two_processes_read_their_own_slices_and_give_one_process_tokens":
        ("two processes joined as two hosts", None),
    "test_gpu_check.py::test_smoke_run_without_the_packages_the_gpu_image_lacks":
        ("every step of the GPU check, each in its own process", None),
    "test_benchmarks.py::test_doubled_model_decodes_identically_with_twice_the_forwards":
        ("every schedule, twice", None),
    "test_benchmarks.py::test_probe_picks_fastest_block_size": ("a probe over block sizes", None),
    "test_benchmarks.py::test_batching_benchmarks_run_on_short_queues":
        ("both batching benchmarks end to end", None),
    "test_benchmarks.py::test_gpu_timing_smoke_prints_every_call":
        ("every schedule's call timed", None),
    "test_server_mesh.py::test_serve_on_a_mesh_answers_completions_and_chats_streamed_and_not":
        ("a server process on a mesh of simulated devices", None),
    "test_gpu_check.py::test_the_check_stops_within_its_budget":
        ("the GPU check's processes, stopped at their budget", None),
    "test_compile_cache.py::test_second_process_reuses_compiled_programs":
        ("two processes compiling and reading back (the cache's in-process checks stay)",
         None),
    "test_serving.py::test_other_schedules_serve_greedy_and_sampled_requests_in_one_state":
        ("servers of other schedules", ("setdlm-tiny-packed-None",)),
    "test_serving.py::test_memory_stays_flat_over_hundreds_of_varied_requests":
        ("360 requests through the server", None),
    "test_executables.py::test_loaded_programs_give_the_compiled_tokens":
        ("three processes decoding both embedded models, compiling and reading back (the "
         "in-process checks stay)", None),
    "test_server_start.py::test_warmup_only_makes_the_programs_ready_and_exits":
        ("a server's programs compiled, then read back", None),
    "test_scripts.py::test_startup":
        ("server and decode processes started cold and warm (the script's --help stays)",
         None),
    "test_scripts.py::test_lm_eval_serving":
        ("lm-evaluation-harness against a server process", None),
    "test_scripts.py::test_serving":
        ("a server process under concurrent clients (the script's --help stays)", None),
    "test_scripts.py::test_stream_overhead":
        ("streamed against one-shot decodes, timed (the script's --help stays)", None),
    "test_scripts.py::test_branches":
        ("every number of branches on both embedded models (the script's --help stays)", None),
    "test_scripts.py::test_auto":
        ("every candidate of a width, calibrated and timed in rounds (the script's --help "
         "stays)", None),
    "test_auto.py::test_setdlm_on_auto_is_exact_and_refuses_another_order":
        ("SetDLM's candidates calibrated (Nemotron's stay)", None),
    "test_auto.py::test_a_server_on_auto_decodes_with_its_choice_and_reports_it":
        ("a server's programs, compiled before it listens", None),
    "test_scripts.py::test_roofline":
        ("the roofline's compiled programs (the script's --help stays)", None),
    "test_scripts.py::test_real_size_end_to_end":
        ("every stage of the real-size benchmark in its own process (the stages in this "
         "process stay)", None),
    "test_convert_safety.py::test_interrupts_leave_complete_output_or_none":
        ("conversions interrupted at many points", None),
    "test_training.py::test_losses_fall_and_export_reloads_identically": ("a training run", None),
    "test_setdlm_training.py::test_setdlm_losses_fall_and_export_reloads_identically":
        ("a training run", None),
    # The docs: the commands a page marks `# test: slow` (whole benchmarks, training,
    # the GPU check's smoke run, a mesh of simulated devices), each with small limits.
    "test_docs.py::test_slow_block": ("doc commands marked slow in their pages", None),
    "test_docs.py::test_slow_python": ("doc examples marked slow in their pages", None),
    # Hostile input: the longest waits and the bulk of the fuzzing.
    "test_server_fuzz.py::test_completions_fuzz":
        ("a fuzz run decoding through the server (the raw-body fuzz stays)", None),
    "test_server_fuzz.py::test_chat_fuzz": ("a fuzz run decoding through the server", None),
    "test_server_shutdown.py::test_a_signal_at_a_random_moment_drains":
        ("a server process per signal moment; one stays", ("0-15",)),
    "test_server_shutdown.py::test_a_request_on_an_idle_keep_alive_connection_while_draining_gets_a_json_503":
        ("a server process of its own (one drain stays in the quick loop)", None),
    "test_server_limits.py::test_a_tiny_top_p_is_greedy":
        ("a server's tiny top-p (the decode's own stays in test_hostile_inputs.py and "
         "test_cli_hostile.py)", None),
    "test_server_limits.py::test_a_hostile_template_ends_with_a_clear_error_while_health_answers":
        ("the looping template runs to its 5 s limit", ("format", "percent", "tojson", "repeat",
                                                          "huge")),
    "test_cli_hostile.py::test_missing_peer_is_one_line_at_the_timeout":
        ("three processes waiting for a peer", None),
    "test_hostile_inputs.py::test_tiny_top_p_decodes_the_greedy_tokens":
        ("a sampled program per family; Nemotron's stays", ("nld-tiny",)),
}

# The long checks: run with `--long-checks` only (CI runs them after the suite), with the
# golden matrix (test_golden*.py) and the docs' recipes (test_docs.py, `# test: long`).
# (why, the case ids that are long); None: every case. The suite keeps the rest: for
# each, the same check on the fixtures or another case of the same path.
LONG: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "test_batched.py::test_batch_equals_each_prompt_alone":
        ("a sampled batched program per schedule (Packed-SS's stays in the suite, and every "
         "schedule's greedy one)",
         ("nemotron-ar-ltr-1.0", "nemotron-linear-ltr-1.0", "nemotron-quadratic-ltr-1.0",
          "nemotron-branched-ltr-1.0", "setdlm-serial-ltr-1.0", "setdlm-linear-ltr-1.0",
          "setdlm-quadratic-ltr-1.0", "setdlm-branched-ltr-1.0")),
    "test_one_engine.py::test_every_schedule_runs_from_the_cli":
        ("every schedule through the CLI (the CLI hands the schedule to `decode`; Packed-SS "
         "and SetDLM's serial decoder stay, and every schedule's exactness is checked on the "
         "fixtures in the suite)",
         ("nemotron-ar", "nemotron-linear", "nemotron-quadratic", "nemotron-branched",
          "setdlm-native", "setdlm-linear", "setdlm-quadratic", "setdlm-branched")),
    "test_serving.py::test_other_schedules_serve_greedy_and_sampled_requests_in_one_state":
        ("SetDLM's Branched-SS behind a server (Nemotron's stays, and SetDLM's Branched-SS "
         "is checked against its reference in the suite)", ("setdlm-tiny-branched-shape3",)),
    "test_embedded_model.py::test_all_schedules_return_ar_greedy_tokens":
        ("every schedule of the embedded model on its prompts (the suite checks every "
         "schedule's greedy exactness on the fixtures and random models)", None),
    "test_embedded_setdlm.py::test_ltr_schedules_return_serial_greedy_and_drafts_are_accepted":
        ("every schedule of the embedded SetDLM model on its prompts (as above)", None),
}


def mark(items) -> None:
    """Marks the slow and the long items of a collection (pytest_collection_modifyitems)."""
    for item in items:
        name = f"{item.path.name}::{item.originalname}"
        case = getattr(item, "callspec", None)
        if name in SLOW:
            kept = SLOW[name][1]
            if kept is None or case is None or case.id not in kept:
                item.add_marker(pytest.mark.slow)
        if name in LONG:
            long = LONG[name][1]
            if long is None or (case is not None and case.id in long):
                item.add_marker(pytest.mark.long_check)


def unknown(items) -> list[str]:
    """Entries of SLOW (or their kept cases) that name nothing collected: a renamed test
    must not drop out of the list unnoticed."""
    seen = {(f"{i.path.name}::{i.originalname}", getattr(getattr(i, "callspec", None), "id", None))
            for i in items}
    names = {n for n, _ in seen}
    missing = [n for n in {**SLOW, **LONG} if n not in names]
    for table in (SLOW, LONG):
        for n, (_, cases) in table.items():
            missing += [f"{n}[{k}]" for k in cases or () if (n, k) not in seen]
    return missing
