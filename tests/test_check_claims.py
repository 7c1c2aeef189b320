"""Every check's title is a promise to the student and the instructor; this table
names, for every check of every lab, the buggy fixture that breaks what the
title claims (a ``Bug`` of ``tests/fixtures/buggy*.py``, by its name; where only a
shortcut breaks it, one of ``tests/fixtures/shortcut*.py``), or says why no fixture can.

``tests/test_buggy_submissions.py`` grades each fixture on the checks it names
and their neighbours, and shows that it loses exactly their points. This test
shows the table is whole: a check without an entry fails it, and so does an
entry whose fixture does not name the check in ``must_fail``.
"""
import json
from dataclasses import dataclass

from conftest import fixtures, k2c

BUGS = fixtures("buggy*", "BUGS")[0] + fixtures("shortcut*", "SHORTCUTS")[0]


@dataclass(frozen=True)
class NoFixture:
    """A check no buggy fixture can break here, and why."""
    why: str


GPU_ONLY = NoFixture("GPU tier only: it measures a real device (bandwidth, FLOP/s, memory, overlap), which the "
                     "CPU tier cannot run, so it is skipped there and no fixture can be graded on it in CI; "
                     "scripts/gpu-check.sh grades the reference on it")

CLAIMS = {
    "01-parallel-thinking": {
        'saxpy_matches_numpy': 'saxpy loop stops one element short',
        'sum_matches_numpy': 'sum chunks rounded down (the tail is never added)',
        'sum_loses_no_updates': 'race on a shared accumulator',
        'histogram_matches_numpy[20 bins]': 'histogram drops the value equal to hi',
        'histogram_matches_numpy[7 bins]': 'histogram drops the value equal to hi',
        'histogram_loses_no_updates': 'race on shared histogram bins',
        'loop_runs_in_parallel[parallel_saxpy]': 'range where prange was meant',
        'loop_runs_in_parallel[parallel_sum]': 'range where prange was meant',
        'loop_runs_in_parallel[parallel_histogram]': 'range where prange was meant',
        'speedup_laws': 'amdahl_speedup with the serial and parallel parts swapped',
        'fit_amdahl_exact': 'fit_amdahl takes t1 from the first timing',
        'fit_amdahl_noisy': 'fit_amdahl returns the parallel fraction',
    },
    "02-cuda-model": {
        'compiles_for_a_gpu[relu_kernel]': 'whole-array NumPy inside the kernel',
        'compiles_for_a_gpu[saxpy_kernel]': 'np.zeros scratch array inside saxpy_kernel',
        'compiles_for_a_gpu[broadcast_add_kernel]': 'a plain Python helper called from broadcast_add_kernel',
        'launch_config': 'launch_config rounds down',
        'relu_every_element': 'guard leaves the last element unwritten',
        'relu_guard': 'missing bounds guard',
        'saxpy_kernel': 'global index without the block offset',
        'broadcast_add_kernel[block 16x16]': '2D x and y swapped',
        'broadcast_add_kernel[block 32x4]': '2D x and y swapped',
        'each_thread_writes_its_own_element[relu_kernel]': 'negative index the simulator wraps around',
        'each_thread_writes_its_own_element[saxpy_kernel]': 'global index without the block offset',
        'broadcast_add_thread_mapping': 'grid-stride loop with x along the rows',
        'host_relu': 'relu() swaps blocks and threads',
        'host_saxpy': 'saxpy() sizes the grid from the block',
        'host_broadcast_add': 'broadcast_add() adds a block to each dimension',
        'saxpy_bandwidth': GPU_ONLY,
    },
    "03-shared-memory": {
        'compiles_for_a_gpu[block_sum_kernel]': 'shared array sized from blockDim, not a constant',
        'compiles_for_a_gpu[scan_block_kernel]': 'scan loads its two elements by looping over a tuple',
        'compiles_for_a_gpu[add_offsets_kernel]': 'add_offsets_kernel calls a plain Python helper',
        'compiles_for_a_gpu[tiled_matmul_kernel]': 'matmul tiles sized from blockDim, not a constant',
        'compiles_for_a_gpu[histogram_kernel]': 'histogram bins sized from counts.size, not a constant',
        'block_sum_grid_stride': 'block_sum without the grid-stride loop',
        'block_sum_one_per_thread': 'block_sum starts from x[g] without a guard',
        'block_sum_no_races': 'no barrier between filling shared memory and the tree',
        'block_sum_bank_conflicts': 'interleaved addressing (bank conflicts)',
        'block_reduce': 'host functions compute with NumPy and launch no kernel',
        'scan_block_kernel': 'scan is inclusive',
        'scan_no_races': "no barrier in the scan's down-sweep",
        'exclusive_scan': 'host functions compute with NumPy and launch no kernel',
        'tiled_matmul_kernel': 'last partial tile dropped (tiles rounded down)',
        'tiled_matmul_reuses_tiles': 'matmul reads global memory in its inner loop',
        'tiled_matmul_no_races': 'no barrier after using a tile',
        'tiled_matmul_access_patterns': 'uncoalesced tile loads (threadIdx.x down the rows of A)',
        'tiled_matmul': 'host functions compute with NumPy and launch no kernel',
        'histogram_kernel[7 bins]': 'histogram kernel without the grid-stride loop',
        'histogram_kernel[200 bins]': 'only the first THREADS bins zeroed',
        'histogram_no_races': 'histogram update not atomic',
        'histogram_privatised': 'histogram with global atomics only (not privatised)',
        'histogram': 'host functions compute with NumPy and launch no kernel',
        'reduce_speed': GPU_ONLY,
        'matmul_speed': GPU_ONLY,
        'histogram_speed': GPU_ONLY,
    },
    "04-cupy-streams": {
        'bias_gelu_on_numpy': 'GELU with a wrong constant',
        'bias_gelu_kernel_compiles': "np.tanh written in the kernel's CUDA C",
        'bias_gelu_kernel_runs_on_host': 'fused kernel computes x + bias, not its GELU',
        'softmax_on_numpy': 'softmax over axis 1, not the last axis (right for 2-D only)',
        'softmax_stable_for_huge_inputs': 'softmax without subtracting the row max',
        'pipeline_results[same shape]': 'pipeline returns before waiting for the copies back',
        'pipeline_results[row sums]': 'pipeline returns before waiting for the copies back',
        'pipeline_issues_next_copy_before_waiting': 'pipeline synchronizes after every chunk',
        'pipeline_overlaps[2 streams]': 'pipeline on one stream, whatever n_streams says',
        'pipeline_overlaps[3 streams]': 'pipeline synchronizes after every chunk',
        'pipeline_overlaps[3 streams, compute-bound]': 'pipeline synchronizes after every chunk',
        'pipeline_uses_n_streams': 'pipeline always makes at least two streams',
        'pipeline_uses_pinned_buffers': 'pipeline with pageable host buffers',
        'pipeline_no_hazards': 'pipeline computes on a stream the copy-in is not ordered with',
        'to_torch_shares_memory': 'to_torch copies instead of sharing memory',
        'from_torch_shares_memory': 'from_torch copies instead of sharing memory',
        'arithmetic_intensity': 'arithmetic intensity by floor division',
        'roofline_classifies': 'roofline counts the ridge point itself as memory-bound',
        'roofline_attainable': "roofline's attainable FLOP/s not capped at the peak",
        'bias_gelu_kernel_on_device': GPU_ONLY,
        'softmax_on_device': GPU_ONLY,
        'fused_faster_than_unfused': GPU_ONLY,
        'pipeline_overlap_speedup': GPU_ONLY,
        'zero_copy_on_device': GPU_ONLY,
        'roofline_measured': GPU_ONLY,
    },
    "05-message-passing": {
        'split_rows': 'extra row off by one on uneven splits',
        'exchange_halos': 'periodic neighbours at the domain edge',
        'heat_1d_matches_serial': 'extra row off by one on uneven splits',
        'exchange_halos_nonblocking': 'non-blocking receives land in the opposite ghost cells',
        'nonblocking_posts_receives_before_waiting': 'non-blocking exchange waits on each receive before sending',
        'heat_1d_nonblocking_matches_serial': 'extra row off by one on uneven splits',
        'exchange_halo_rows': 'halo rows swapped',
        'heat_2d_matches_serial': 'extra row off by one on uneven splits',
        'ping_pong': 'ping_pong sends float64 buffers (8 bytes per element)',
        'fit_alpha_beta_exact': 'fit_alpha_beta rounds the sizes down to whole bytes',
        'fit_alpha_beta_noisy': 'fit_alpha_beta through the first and last points only',
    },
    "06-collectives": {
        'chunk_bounds': 'chunk boundaries drop the tail when n % p != 0',
        'bcast_binomial_results': 'bcast tree always rooted at rank 0',
        'reduce_binomial_results': 'reduce receives into its partial sum instead of adding',
        'allreduce_ring_results': 'chunk boundaries drop the tail when n % p != 0',
        'allreduce_recursive_doubling_results[p = 2, 4, 8]': 'recursive doubling adds to x, not to the running total',
        'allreduce_recursive_doubling_results[p = 3, 5]': "recursive doubling forgets the folded rank's data (breaks for p = 3)",
        'allgather_ring_results': 'allgather forwards its own block in every step',
        'reduce_scatter_ring_results': 'chunk boundaries drop the tail when n % p != 0',
        'alltoall_pairwise_results': 'alltoall files each block under the rank it sent to',
        'bcast_binomial_cost': 'bcast as a loop of sends from the root',
        'reduce_binomial_cost': 'reduce as every rank sending to the root',
        'allreduce_ring_cost': 'allreduce funnelled through rank 0 (right answer, wrong cost)',
        'allreduce_recursive_doubling_cost': 'recursive doubling folds when p is already a power of two',
        'allgather_ring_cost': 'allgather funnelled through rank 0 (right answer, wrong cost)',
        'reduce_scatter_ring_cost': 'reduce_scatter as a whole allreduce, then a slice (right answer, wrong cost)',
        'alltoall_pairwise_cost': 'alltoall sends the whole vector to every rank',
    },
    "07-training-memory": {
        'parameter_count': 'LM head counted apart from the embedding it shares',
        'static_terms[fp32]': "Adam's two moments counted as one",
        'static_terms[mixed]': 'mixed precision without the float32 master copy (14 bytes per parameter)',
        'zero_16_bytes_per_parameter': 'mixed precision without the float32 master copy (14 bytes per parameter)',
        'published_activations_per_layer': 'activations per layer as sbh(34 + 5as/h) with // (5as/h floored)',
        'published_full_recomputation': "checkpointing that still counts every block's activations",
        'activations_match_traced_run': 'attention scores, softmax and its mask left out (the as²b terms)',
        'checkpointed_activations_match_traced_run': "checkpointing that still counts every block's activations",
        'peak_adds_up': 'peak leaves out the block recomputed during backward',
        'estimates_at_scale': 'attention scores, softmax and its mask left out (the as²b terms)',
        'estimates_are_computed_not_run': 'activations traced from a forward pass of the same model on the meta device',
        'profile_step_trains': 'profile_step profiles the forward pass only',
        'profile_step_counts_matmuls[plain]': 'profile_step profiles the forward pass only',
        'profile_step_counts_matmuls[checkpointed]': 'profile_step profiles the forward pass only',
        'profile_step_times': 'profile_step reports inclusive CPU time as self time',
        'peak_matches_cuda_max_memory_allocated': GPU_ONLY,
    },
    "08-data-parallel": {
        'replicas_start_equal': "rank 0's parameters never broadcast",
        'naive_matches_single_process': "rank 0's parameters never broadcast",
        'bucketed_matches_single_process': 'bucket gradients summed, not averaged over the world size',
        'accumulation_matches_single_process': 'bucket gradients summed, not averaged over the world size',
        'frozen_and_tied_parameters': 'a tied weight all-reduced twice (once per name)',
        'naive_one_all_reduce_per_parameter': 'NaiveDDP.sync_gradients ends with a barrier',
        'bucketed_one_all_reduce_per_bucket': 'a bucket closes only once it exceeds the cap (> for >=)',
        'bucketed_communication_starts_during_backward': 'every all-reduce starts after backward (no overlap)',
        'bucketed_does_not_wait_during_backward': "the hook waits for its bucket's all-reduce",
        'accumulation_communicates_once_per_step': 'no_sync() ends with a barrier',
        'topk_compress': 'topk_compress ranks by value, not magnitude',
        'error_feedback_conserves_gradient': 'error feedback never adds the residual back',
        'error_feedback_sends_top_k_of_corrected_gradient': 'error feedback never adds the residual back',
    },
    "09-zero-sharding": {
        'zero_bytes_closed_forms': 'zero_bytes floors the sharded terms (// for /)',
        'zero_bytes_paper_figure_1': 'zero_bytes: stage 2 leaves the gradients unsharded',
        'zero_bytes_paper_tables': 'zero_bytes: stage 2 leaves the gradients unsharded',
        'flatten_padded': 'flatten_padded pads only when n does not divide, by n elements',
        'zero1_matches_unsharded_adam': 'gradients summed over ranks, not averaged',
        'zero1_matches_unsharded_sgd_momentum': 'gradients summed over ranks, not averaged',
        'zero1_optimizer_state_bytes': 'every rank keeps the whole optimizer state (all-reduce, full step)',
        'zero3_matches_unsharded_adam': 'ZeRO-3 gradients summed over ranks, not averaged',
        'zero3_stores_only_shards': 'ZeRO-3 layers keep their full parameters (never emptied)',
        'zero3_peak_gathered_bytes': 'ZeRO-3 layer saves its gathered parameters for backward',
        'zero1_traffic': "ZeRO-1 all-gathers every rank's whole gradient and sums its own shard",
        'zero3_traffic': "ZeRO-3 backward all-gathers every rank's whole gradient and sums its own shard",
    },
    "10-tensor-parallel": {
        'copy_to_tensor_parallel_region': "f's backward is the identity (no all-reduce)",
        'reduce_from_tensor_parallel_region': "g's backward all-reduces the gradient too (as f's does)",
        'gather_from_sequence_parallel_region': "sequence all-gather's backward keeps this rank's rows of the gradient (no reduce-scatter)",
        'reduce_scatter_to_sequence_parallel_region': "sequence reduce-scatter's backward is zero outside this rank's rows (no all-gather)",
        'column_parallel_linear': "f's backward is the identity (no all-reduce)",
        'row_parallel_linear': 'row-parallel bias added on every rank before the all-reduce',
        'parallel_mlp': 'row-parallel bias added on every rank before the all-reduce',
        'parallel_mlp_sequence_parallel': 'row-parallel bias added on every rank before the all-reduce',
        'parallel_self_attention': 'row-parallel bias added on every rank before the all-reduce',
        'transformer_layer_tensor_parallel': 'row-parallel bias added on every rank before the all-reduce',
        'transformer_layer_sequence_parallel': 'sequence parallel: LayerNorm gradients not all-reduced',
        'tensor_parallel_layer_collectives': 'tensor parallel only: q, k and v each apply f (the sequence gather is hoisted, f is not)',
        'sequence_parallel_layer_collectives': 'sequence parallel only: q, k and v each gather the sequence (f is hoisted, the gather is not)',
        'no_rank_holds_a_full_weight': 'column layer keeps the full master weight it sliced its shard from',
        'heads_not_divisible_raises': 'heads not divisible by t: local heads rounded down, no ValueError',
        'linear_sizes_not_divisible_raise': 'column split applied to the input features (weight [out, in/t])',
        'vocab_parallel_embedding': 'vocab-parallel embedding: ids of other ranks not zeroed (they read row 0 of the shard)',
        'vocab_parallel_cross_entropy': "vocab-parallel cross-entropy's backward subtracts the one-hot on every rank",
        'vocab_parallel_embedding_looks_up_locally': 'vocab-parallel embedding all-gathers the whole table in every forward',
        'vocab_parallel_cross_entropy_sends_per_token_values': 'vocab-parallel cross-entropy all-gathers the logits and calls F.cross_entropy',
    },
    "11-pipeline-parallel": {
        'gpipe_schedule_is_valid': 'GPipe: device d runs the backward of stage p - 1 - d (the backward numbered from the end)',
        '1f1b_schedule_is_valid': '1F1B steady state runs the backward before the forward (deadlock)',
        'interleaved_schedule_is_valid': 'interleaved: device d holds consecutive chunks d*v .. d*v+v-1, not d, d+p, ...',
        'schedules_take_the_closed_form_time': 'interleaved warm-up capped at m forwards instead of m*v (valid, but waits)',
        '1f1b_holds_fewer_microbatches_in_flight': '1F1B warm-up of p - d forwards instead of p - d - 1',
        'simulate_reproduces_closed_forms': 'simulate ticks in whole time steps (right for integer times only)',
        'simulate_matches_the_check_on_random_schedules': 'simulate adds t_comm to dependencies on the same device',
        'simulate_reports_a_deadlock': 'simulate never notices a deadlock (loops forever)',
        'partition_matches_brute_force': 'partition floors the stage times (// for /: right for integer costs)',
        'partition_with_device_speeds': 'partition ignores the device speeds',
        'executor_gpipe_matches_single_process': 'executor: microbatch loss not divided by m',
        'executor_1f1b_matches_single_process': 'executor with blocking sends: 1F1B deadlocks',
        'executor_follows_the_schedule': 'executor ignores the schedule: the whole batch through the stages once, no microbatches',
        'executor_1f1b_holds_p_microbatches': "executor keeps every microbatch's output and graph (retain_graph=True, never dropped)",
    },
    "12-context-parallel": {
        'local_attention': 'local_attention scales the scores by 1/d instead of 1/sqrt(d)',
        'merge_partial_softmax': "merge weighs block b by a sigmoid of lse_a - lse_b (the blocks' weights swapped)",
        'merge_is_stable_for_huge_logits': 'merge by exp of the raw log-sum-exps (overflows near 1e4)',
        'blockwise_attention': 'blockwise merge does not carry the log-sum-exp (right for two blocks only)',
        'blockwise_attention_never_makes_the_full_score_matrix': 'blockwise_attention attends to the whole sequence at once',
        'zigzag_layout': 'contiguous chunks under causal masking (balance lost)',
        'zigzag_balances_causal_work': 'contiguous chunks under causal masking (balance lost)',
        'zigzag_layout_on_more_sizes': 'contiguous chunks under causal masking (balance lost)',
        'sequence_not_in_2P_chunks_is_an_error': 'zigzag_indices rounds the chunk down instead of refusing the sequence',
        'balance': 'balance deals the sequences out in turn, whatever their lengths',
        'ring_attention': 'ring masks causally whatever the causal flag',
        'ring_attention_causal': "causal ring attends to the chunks after the query's, not before",
        'ring_attention_gradients': 'ring backward stops the dK/dV buffer one rank short of home',
        'ring_attention_huge_logits': 'ring backward stops the dK/dV buffer one rank short of home',
        'ring_sends_P_minus_1_blocks': 'ring shifts the K/V block after the last step too (P transfers, one wasted)',
        'ring_overlaps_transfers_with_compute': 'ring waits for the next block before computing the current one (no overlap)',
        'no_rank_holds_the_whole_k_or_v': 'ring keeps every K/V block it received, for the backward (the whole K and V)',
        'ulysses_attention': 'Ulysses splits heads where the second all-to-all needs sequence',
        'ulysses_layout': 'Ulysses splits heads where the second all-to-all needs sequence',
        'ulysses_attention_gradients': 'Ulysses splits heads where the second all-to-all needs sequence',
        'ulysses_makes_two_all_to_alls_each_way': 'Ulysses sends q, k and v in three all-to-alls',
        'ulysses_heads_not_divisible_raises': 'ulysses_attention lets reshape fail when the heads do not divide by P',
        'blockwise_attention_speed': GPU_ONLY,
    },
    "13-hybrid-parallel": {
        'rank_from_env_one_node': 'rank_from_env takes SLURM_NODEID as the local rank',
        'rank_from_env_across_nodes': 'rank_from_env takes SLURM_LOCALID as the global rank',
        'rank_from_env_prefers_torchrun': "rank_from_env reads srun's variables before torchrun's",
        'rank_from_env_errors': 'rank_from_env never checks the rank against the world size',
        'sbatch_directives': 'make_sbatch never asks for the GPUs',
        'torch_launch': 'make_sbatch splits the node list at commas instead of asking scontrol',
        'mpi_launch': "make_sbatch's mpiexec starts one rank per node",
        'job_validation': 'make_sbatch accepts keys it does not know',
        'run_plan_2x2_matches_single_process': 'run_plan: DDP over the whole world instead of the dp group',
        'run_plan_pure_dp_and_pure_tp_match_single_process': 'run_plan: DDP over the whole world instead of the dp group',
        'run_plan_gradient_accumulation_matches_single_process': 'run_plan: micro-batch loss not divided by the number of micro-batches',
        'run_plan_recompute_and_adam_match_single_process': 'run_plan: DDP over the whole world instead of the dp group',
        'run_plan_rejects_unsupported_plans': 'run_plan runs a ZeRO plan as plain data parallelism instead of refusing it',
        'run_plan_2x2_traffic': 'run_plan ignores the mesh: whole models, data parallel over every rank',
        'run_plan_times_ranked_by_cost_model': "compute time upside down: the device's speed over the flops",
        'memory_matches_module_07_estimator': "one stage counts the output head apart from the embedding, as a pipeline's last stage does",
        'memory_follows_the_zero_table': "ZeRO's memory not divided by dp",
        'memory_holds_the_schedules_microbatches': '1F1B holds pp - j microbatches even when there are fewer',
        'memory_of_recompute_strategies': 'selective recomputation frees the scores but keeps their dropout mask and output',
        'tp_communication_is_per_layer': 'TP all-reduces counted once per stage instead of per layer',
        'dp_allreduce_is_the_ring_closed_form': 'ZeRO-3 gathers the parameters once per step, not for every microbatch',
        'pipeline_time_and_bubble': "the pipeline's bubble ignores the microbatches (stages never overlap)",
        'compute_on_heterogeneous_devices': "a stage computes at its fastest device's speed",
        'cost_model_on_random_plans': "the step adds every stage's gradient all-reduce, as if they ran one after another",
        'invalid_plans_raise_value_error': 'check_plan checks that tp divides the hidden size, not the heads',
        'search_matches_brute_force_on_8_devices': 'greedy search: the most promising shape that fits, never the others',
        'search_matches_brute_force_on_16_devices': 'search ignores the memory budget',
        'search_chooses_a_strategy_per_layer': 'greedy search: the most promising shape that fits, never the others',
        'search_with_two_device_speeds': 'search ignores the memory budget',
        'search_on_one_device': "search caps a stage's memory by the budget, not by its devices' own memory",
        'search_raises_when_nothing_fits': 'search ignores the memory budget',
        'search_scales_to_large_clusters': 'search ignores the memory budget',
        'search_matches_brute_force_on_more_cases': 'search ignores the memory budget',
    },
}


def test_every_check_names_a_fixture_that_breaks_its_claim():
    proc = k2c("grade", "all", "--list", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    checks = json.loads(proc.stdout)
    assert set(CLAIMS) == set(checks), "one table per lab"
    bugs = {(bug.lab, bug.name): bug for bug in BUGS}
    problems = []
    for lab, listed in checks.items():
        names = [check["name"] for check in listed]
        problems += [f"{lab}: {name}: no entry" for name in names if name not in CLAIMS[lab]]
        problems += [f"{lab}: {name}: no such check" for name in CLAIMS[lab] if name not in names]
        gpu = {check["name"] for check in listed if check["gpu"]}
        for name, entry in CLAIMS[lab].items():
            if isinstance(entry, NoFixture):
                if not entry.why.strip():
                    problems.append(f"{lab}: {name}: no fixture and no reason")
                if entry is GPU_ONLY and name not in gpu:
                    problems.append(f"{lab}: {name}: graded on the CPU tier, so a fixture can break it")
            elif (lab, entry) not in bugs:
                problems.append(f"{lab}: {name}: no fixture named {entry!r}")
            elif name not in bugs[lab, entry].must_fail:
                problems.append(f"{lab}: {name}: fixture {entry!r} does not list it in must_fail")
    assert not problems, "\n".join(problems)
