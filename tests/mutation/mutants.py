"""The mutants of the mutation check (tests/mutation/check.py): one per claimed invariant.

Each replaces one exact snippet of the package with code that breaks the claim, and names the
tests that must then fail. Keep the snippets short and unique; the check fails on a stale one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    claim: str  # the invariant the mutant breaks
    file: str  # relative to the repository root
    old: str  # exact snippet, occurring once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail on the mutant


FLEET_SYNC = "tests/test_fleet_sync.py"

MUTANTS: list[Mutant] = [
    Mutant(
        id="fingerprint-values-ignored",
        claim="verification compares every tensor's fingerprint with the sender's",
        file="rollfleet/weights/verify.py",
        old='("differing", sorted(n for n in set(sent) & set(held) if sent[n] != held[n])),',
        new='("differing", []),',
        tests=("tests/test_weight_sync.py::test_version_mode_checks_versions_only",),
    ),
    Mutant(
        id="verify-only-names-sent",
        claim="a push that leaves a tensor out fails verification (whole-model fingerprints)",
        file="rollfleet/weights/verify.py",
        old='("not sent", sorted(set(held) - set(sent))),',
        new='("not sent", []),',
        tests=("tests/test_weight_sync.py::test_version_mode_checks_versions_only",),
    ),
    Mutant(
        id="session-commits-a-partial-sync",
        claim="an engine commits a sync's version only when every tensor arrived in the session",
        file="rollfleet/engine/weights/weight_session.py",
        old="missing = sorted(self._required - session.arrived)",
        new="missing = []",
        tests=("tests/test_engine_sessions.py::test_a_session_missing_one_tensor_is_not_served_until_a_complete_one",),
    ),
    Mutant(
        id="ranks-apply-without-agreeing",
        claim="a weight update applies on every tp rank or on none",
        file="rollfleet/engine/tp/ranks.py",
        old="refusals = sorted({r for r in self.gather(refusal) if r})",
        new="refusals = sorted({r for r in [self.gather(refusal)[self.rank]] if r})",
        tests=("tests/test_engine_weight_routes.py::test_bad_tensor_updates_change_nothing",),
    ),
    Mutant(
        id="update-does-not-wait-for-batch",
        claim="a weight update waits for the running batch",
        file="rollfleet/engine/runtime/scheduler.py",
        old="if action.needs_idle and self.running and not self.halted:",
        new="if False:",
        tests=("tests/test_engine_sessions.py::test_a_weight_update_waits_for_the_running_batch",),
    ),
    Mutant(
        id="failed-verify-stays-active",
        claim="an engine that fails verification takes no more traffic",
        file="rollfleet/fleet/fleet.py",
        old="            if engine_id in failed:\n",
        new="            if False:\n",
        tests=(f"{FLEET_SYNC}::test_a_push_whose_tensors_change_under_it_is_not_verified_and_not_served",),
    ),
    Mutant(
        id="push-not-verified",
        claim="every push is verified before the fleet serves its version",
        file="rollfleet/fleet/fleet.py",
        old="failed = self.pool.run(find_unverified(report, clients, self.cfg.verify_mode))",
        new="failed = {}",
        tests=(f"{FLEET_SYNC}::test_a_push_whose_tensors_change_under_it_is_not_verified_and_not_served",),
    ),
    Mutant(
        id="failed-push-keeps-serving",
        claim="a push that fails part-way takes every target out of rotation",
        file="rollfleet/fleet/fleet.py",
        old="                for slot in (self.slots[t.engine_id] for t in targets if self.slots[t.engine_id]"
        ".is_running):\n",
        new="                for slot in ():\n",
        tests=(f"{FLEET_SYNC}::test_a_push_that_fails_part_way_leaves_no_engine_serving",),
    ),
    Mutant(
        id="router-one-answer-for-all",
        claim="each prompt gets its own answer",
        file="rollfleet/fleet/fleet.py",
        old='[{"input_ids": ids, **request} for ids in prompt_ids]',
        new='[{"input_ids": prompt_ids[0], **request} for ids in prompt_ids]',
        tests=("tests/test_fleet.py::test_generate_spreads_over_engines_in_input_order",),
    ),
    Mutant(
        id="loop-accepts-stale-samples",
        claim="a step trains only on samples of the version it pushed",
        file="rollfleet/train/invariants.py",
        old="for s in samples if s.weight_version != version]",
        new="for s in samples if False]",
        tests=("tests/test_loop_checks.py",),
    ),
    Mutant(
        id="loop-accepts-lost-samples",
        claim="no prompt is lost or duplicated in a step",
        file="rollfleet/train/invariants.py",
        old="    if missing or extra:\n",
        new="    if False:\n",
        tests=("tests/test_loop_checks.py",),
    ),
    Mutant(
        id="loop-accepts-too-stale-samples",
        claim="an async step trains on no token older than step - grpo.max_staleness",
        file="rollfleet/train/invariants.py",
        old="if not 0 <= age <= max_staleness",
        new="if not 0 <= age",
        tests=("tests/test_async_logic.py",),
    ),
    Mutant(
        id="engine-reads-released-weights",
        claim="weight reads after a weights release are refused with 400 and touch no freed memory",
        file="rollfleet/engine/model/model.py",
        old="        if self.weights_released():\n            raise WeightUpdateError(\n",
        new="        if False:\n            raise WeightUpdateError(\n",
        tests=(
            "tests/test_engine_robustness.py::test_weight_reads_after_a_release_are_refused_and_touch_no_freed_memory",
        ),
    ),
    Mutant(
        id="colocated-turn-leaves-graphs-released",
        claim="a colocated trainer turn resumes every memory tag it releases (SGLang's CUDA graphs too)",
        file="rollfleet/fleet/colocation.py",
        old='RESUME_AFTER_PUSH = ["cuda_graph", "kv_cache"]',
        new='RESUME_AFTER_PUSH = ["kv_cache"]',
        tests=("tests/test_sglang_contract.py::test_a_colocated_turn_resumes_every_tag_it_released_in_sglangs_order",),
    ),
    Mutant(
        id="colocated-turn-ignores-release-weights",
        claim="rollout.release_weights=false keeps the engines' weights through a colocated turn",
        file="rollfleet/fleet/colocation.py",
        old="fleet.sleep(release_tags(fleet.rollout.release_weights))",
        new="fleet.sleep(release_tags(True))",
        tests=(
            "tests/test_colocated_feed.py::"
            "test_a_trainer_turn_releases_what_the_config_says_and_the_engines_serve_after",
        ),
    ),
    Mutant(
        id="engine-follower-survives-failed-batch",
        claim="a tp follower whose batch action fails like rank 0's goes on with the next batch",
        file="rollfleet/engine/tp/lockstep.py",
        old="            if action in BATCH_ACTIONS:",
        new="            if False:",
        tests=(
            "tests/test_engine_tp_follower.py::"
            "test_a_batch_failing_on_every_rank_aborts_its_requests_and_both_ranks_go_on",
        ),
    ),
    Mutant(
        id="restore-not-verified",
        claim="a restored engine serves only once its weights are verified against the version's",
        file="rollfleet/fleet/restore.py",
        old="return dict(zip(engine_ids, pool.run(every())))",
        new="return dict.fromkeys(engine_ids)",
        tests=("tests/test_recovery.py::test_a_restore_that_delivers_other_weights_than_it_claims_is_not_served",),
    ),
    Mutant(
        id="payload-reader-reaches-live-tensors",
        claim="no opcode of a weight payload reaches a rebuilt tensor while it is read (BUILD would grow it)",
        file="rollfleet/wire/unpickled.py",
        old="return Rebuilt(self.value(*(a.value if isinstance(a, Named) else a for a in args)))",
        new="return self.value(*(a.value if isinstance(a, Named) else a for a in args))",
        tests=("tests/test_buckets.py::test_what_the_c_unpickler_reaches_is_inert",),
    ),
    Mutant(
        id="adapter-plan-never-dropped",
        claim="the LoRA sender reads peft's state dict again once the model changed under its plan",
        file="rollfleet/weights/adapter.py",
        old="if plan is None or not plan.holds(self.model):",
        new="if plan is None:",
        tests=("tests/test_lora.py::test_the_adapter_plan_gives_peft_state_dict_until_the_model_changes",),
    ),
    Mutant(
        id="kept-turn-releases-anyway",
        claim="with rollout.release_kv_cache false a colocated turn releases, offloads and resumes nothing",
        file="rollfleet/fleet/colocation.py",
        old="if fleet.rollout.release_kv_cache is False:  # the plan fits both turns at once: nothing moves",
        new="if False:",
        tests=(
            "tests/test_colocated_feed.py::"
            "test_a_trainer_turn_releases_what_the_config_says_and_the_engines_serve_after[False-False]",
        ),
    ),
    Mutant(
        id="kept-memory-without-the-trainers-room",
        claim="the plan keeps the engines' memory through the turn only where the trainer's turn fits beside it",
        file="rollfleet/fleet/memory_plan.py",
        old="self.room_beside_engine >= TRAINER_HEADROOM * self.trainer_figures and self.kv_pool_tokens",
        new="self.kv_pool_tokens",
        tests=("tests/test_memory_plan.py::test_engines_release_as_before_where_the_trainers_turn_needs_their_memory",),
    ),
    Mutant(
        id="lora-versions-never-pruned",
        claim="a LoRA sync leaves only the newest KEEP_LAST adapter directories",
        file="rollfleet/weights/transports/lora.py",
        old="self._writing().submit(_prune, Path(self.spec.path))",
        new="pass",
        tests=("tests/test_lora.py::test_transport_sends_an_adapter_that_serves_like_peft_merge[tensors]",),
    ),
    Mutant(
        id="cpu-steps-unpadded",
        claim="on the CPU a row's logits do not depend on how many rows share its step (steps padded: kv/cpu_rows.py)",
        file="rollfleet/engine/kv/paged.py",
        old="rows, logits_at = cpu_padded(rows, logits_at, self.cpu_rows)",
        new="pass",
        tests=("tests/test_kv_paged.py::test_a_rows_logits_on_cpu_do_not_depend_on_how_many_rows_share_its_step",),
    ),
    Mutant(
        id="cpu-rows-not-measured",
        claim="CPU steps are padded to the rows this CPU's BLAS needs to round each row alike (measured, not assumed)",
        file="rollfleet/engine/kv/cpu_rows.py",
        old="return max([FLOOR, *(_alike_from(int(w), threads, batched) for w in set(widths))])",
        new="return FLOOR",
        tests=(
            "tests/test_cpu_rows.py::test_products_of_as_many_rows_as_measured_round_each_row_as_any_larger_product",
        ),
    ),
    Mutant(
        id="fused-projections-copied",
        claim="fused projections read the parameters the engine updates (views of one buffer, not copies)",
        file="rollfleet/engine/kv/fused_projections.py",
        old="weight.data = fused[start : start + rows]",
        new="weight.data = fused[start : start + rows].clone()",
        tests=(
            "tests/test_fused_projections.py::"
            "test_a_fused_runner_serves_updates_and_release_and_resume_like_an_unfused_one",
        ),
    ),
    Mutant(
        id="overlap-fed-at-the-wrong-position",
        claim="a step launched before the last one's draws are read samples the token after them",
        file="rollfleet/engine/kv/overlap.py",
        old="seq.sampling_row(self.stops.stop_ids, ahead=1)",
        new="seq.sampling_row(self.stops.stop_ids)",
        tests=(
            "tests/test_overlap.py::test_overlapped_steps_record_what_waiting_steps_record_and_give_every_page_back",
            "tests/test_kv_paged.py::test_overlapped_decode_steps_answer_as_steps_that_wait",
        ),
    ),
    Mutant(
        id="overlap-thrown-away-step-kept",
        claim="a step in flight thrown away unread leaves its rows to feed their newest token again",
        file="rollfleet/engine/kv/overlap.py",
        old="                seq.kv_len -= 1",
        new="                pass",
        tests=("tests/test_overlap.py::test_a_step_thrown_away_unread_leaves_its_rows_to_decode_again",),
    ),
    Mutant(
        id="cpu-attention-products-over-1-3-queries",
        claim="a CPU prompt's logits do not depend on how it was chunked or cached (invariant attention)",
        file="rollfleet/engine/kv/attention.py",
        old="    if queries < least:  # padded",
        new="    if False:  # padded",
        tests=("tests/test_kv_paged.py::test_a_prompts_logits_on_cpu_do_not_depend_on_how_it_was_chunked_or_cached",),
    ),
]
