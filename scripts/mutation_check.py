#!/usr/bin/env python3
"""Mutation check: every named bug below must make the CPU core suite fail ("be killed").

Each mutation is an exact find/replace on one source file. The snippet must occur exactly once in the
file, or the check FAILS (a refactor that moves the code must update the snippet here; a mutation
must never silently become a no-op). Each mutant runs a targeted, fast subset of tests/core (``-x``,
the first failure kills it) in a temporary copy of the repository (``attnplug/`` and ``tests/``), so
the working tree is never modified, whatever happens (Ctrl-C included). Before the mutants, the
union of the subsets runs once on the unmutated copy: it must pass, or a "kill" would mean nothing
(``--baseline-passed``: the caller ran those tests on this tree and they passed; scripts/test.sh passes it
after its core suite, a superset, passed in the same run).

    .venvs/core/bin/python scripts/mutation_check.py            # all mutations (CI: scripts/test.sh mutation)
    .venvs/core/bin/python scripts/mutation_check.py -k mask     # names containing "mask"
    .venvs/core/bin/python scripts/mutation_check.py --list

Prints a kill table (mutation, file, tests run, killed?, seconds) and exits non-zero unless every
selected mutation was killed and the baseline passed. ``--budget`` (seconds, default 1800) bounds the
whole run: mutants not started within it are reported as NOT RUN and fail the check. ``--jobs`` (default:
the CPU count) mutants run at once, each in its own copy; the baseline runs its selections with as many
pytest-xdist workers.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

K = "attnplug/core/kernels/attention.py"
MG = "attnplug/core/kernels/merge.py"
DK = "attnplug/core/kernels/decode.py"
PL = "attnplug/core/plan.py"
PT = "attnplug/core/page_table.py"
GU = "attnplug/core/kernels/graph_update.py"
DR = "attnplug/core/draft.py"
CA = "attnplug/core/cascade.py"

KP = "tests/core/test_kernel_paths.py"
FK = "tests/core/test_fast_kernels.py"
KT = "tests/core/test_kernels.py"
GD = "tests/core/test_graph_draft_oracles.py"
SK = "tests/core/test_sinks.py"
ML = "attnplug/core/kernels/mla.py"
MT = "tests/core/test_mla.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]  # pytest node ids / files, relative to the repo root
    what: str


MUTATIONS = [
    # -- attention kernel ------------------------------------------------------------------------------
    Mutation(
        "mask_free_ignored",
        K,
        "free_hi = tl.minimum(hi, tl.load(mask_free + b))",
        "free_hi = hi",
        (
            f"{KP}::test_verify_prefix_longer_than_default_block",
            f"{KP}::test_verify_small_block_n_forced",
            f"{KP}::test_mask_free_counts_only_leading_visible_columns",
        ),
        "phase 1 (no mask work) runs over the whole row: the custom mask is ignored below the row end",
    ),
    Mutation(
        "causal_shift_dropped",
        K,
        "pos = kv_len - q_len + tok  # absolute position",
        "pos = tok  # absolute position",
        (f"{KT}::test_extend",),
        "query i sits at position i instead of kv_len - q_len + i (causal mask aligned top-left)",
    ),
    Mutation(
        "causal_fast_path_past_diagonal",
        K,
        "free_hi = tl.minimum(hi, kv_len - q_len + q0 + 1)",
        "free_hi = hi",
        (f"{KP}::test_several_tiles_per_request",),
        "phase 1 (no causal mask) runs up to the tile's last visible key: early rows see the future",
    ),
    Mutation(
        "k_v_strides_swapped",
        K,
        "    stride_qh,\n    stride_kp,\n    stride_kt,\n    stride_kh,\n"
        "    stride_vp,\n    stride_vt,\n    stride_vh,\n",
        "    stride_qh,\n    stride_vp,\n    stride_vt,\n    stride_vh,\n"
        "    stride_kp,\n    stride_kt,\n    stride_kh,\n",
        (f"{KP}::test_k_and_v_caches_with_different_strides",),
        "K is read with V's strides and V with K's",
    ),
    Mutation(
        "online_softmax_no_rescale",
        K,
        "acc = acc * alpha[:, None] + tl.dot(p, v",
        "acc = acc + tl.dot(p, v",
        (f"{KP}::test_several_tiles_per_request", f"{KT}::test_decode"),
        "the running output is not rescaled when the running max grows",
    ),
    Mutation(
        "split_chunk_drops_a_key",
        K,
        "hi = tl.minimum(hi, lo + chunk)",
        "hi = tl.minimum(hi, lo + chunk - 1)",
        (f"{KP}::test_keys_land_in_several_splits",),
        "each split stops one key short of the next split's first key",
    ),
    Mutation(
        "window_start_off_by_one",
        K,
        "lo = tl.maximum(0, kv_len - q_len + q0 - window_left)",
        "lo = tl.maximum(0, kv_len - q_len + q0 - window_left + 1)",
        (f"{KT}::test_softcap_and_window_and_scale", f"{KP}::test_several_tiles_per_request"),
        "the sliding window drops its oldest key",
    ),
    Mutation(
        "kv_start_ignored",
        K,
        "lo = tl.maximum(lo, tl.load(kv_start + b))",
        "lo = lo",
        (f"{KT}::test_kv_start_restricts_keys",),
        "the fa3 tree part attends to the prefix keys too",
    ),
    Mutation(
        "gqa_wrong_kv_head",
        K,
        "head = kvh * GROUP + rows % GROUP",
        "head = (kvh * GROUP + rows % GROUP + GROUP) % (GROUP * tl.num_programs(1))",
        (f"{KT}::test_decode",),
        "GQA packing pairs each query head group with the next KV head",
    ),
    Mutation(
        "decode_active_splits_short",
        DK,
        "active = tl.maximum(1, tl.cdiv(span, tl.maximum(chunk, 1)))",
        "active = tl.maximum(1, tl.cdiv(span, tl.maximum(chunk, 1)) - 1)",
        (f"{FK}::test_decode_split", f"{FK}::test_decode_short_replay_of_long_capture"),
        "the fused decode merges one split fewer than hold keys: the last split's keys are lost",
    ),
    Mutation(
        "pairs_parity_swapped",
        DK,
        "acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_M, BLOCK_D])",
        "acc = tl.reshape(tl.join(acc_o, acc_e), [BLOCK_M, BLOCK_D])",
        (f"{FK}::test_decode_fp8_pairs",),
        "fp8 byte pairs: the even and odd output dims trade places",
    ),
    Mutation(
        "pairs_v_tail_unmasked",
        DK,
        "            w = tl.load(ptr, mask=ok[:, None], other=0)",
        "            w = tl.load(ptr)",
        (f"{FK}::test_decode_fp8_pairs",),
        "fp8 byte pairs: V's ragged tail block reads the keys past the request (NaN bytes reach P @ V)",
    ),
    Mutation(
        "noncausal_prefill_splits_overlap",
        "attnplug/core/kernels/prefill.py",
        "        lo = split * chunk\n",
        "        lo = 0 * chunk\n",
        ("tests/core/test_cascade_graph.py::test_prefix_part_on_the_prefill_kernel",),
        "the prefill kernel's non-causal splits (cascade prefix parts) all read the first chunk of keys",
    ),
    Mutation(
        "noncausal_empty_split_stores",
        "attnplug/core/kernels/prefill.py",
        "        keys_ok = row_ok & (rows * 0 + lo < hi)\n",
        "        keys_ok = row_ok\n",
        ("tests/core/test_cascade_graph.py::test_prefix_part_on_the_prefill_kernel",),
        "a non-causal split without keys (an unshared batch in a cascade graph) loads q and stores its partial",
    ),
    Mutation(
        "pdl_inside_if_node",
        "attnplug/core/providers/triton.py",
        "pdl=self._pdl() and not graph_if.requested(),",
        "pdl=self._pdl(),",
        ("tests/core/test_cascade_graph.py::test_prefix_part_launches_as_a_programmatic_dependent",),
        "the prefix part launches as a programmatic dependent inside a CUDA IF node (no kernel before it there)",
    ),
    # -- merge kernels -----------------------------------------------------------------------------------
    Mutation(
        "split_merge_skipped",
        MG,
        "tl.int32) + s) < num_splits",
        "tl.int32) + s) < 1",
        (f"{KP}::test_keys_land_in_several_splits", f"{KP}::test_merge_splits_against_torch"),
        "only split 0's partial is added: the other splits' keys are lost",
    ),
    Mutation(
        "merge_state_wrong_weight",
        MG,
        "wa = tl.exp2(sa - m_safe)\n    wb = tl.exp2(sb - m_safe)",
        "wa = tl.exp2(sa - m_safe)\n    wb = tl.exp2(sa - m_safe)",
        (f"{KP}::test_merge_state_against_torch",),
        "state b is weighted with state a's LSE",
    ),
    # -- attention sinks: each row's softmax counts its head's sink exactly once ----------------------------
    Mutation(
        "sink_counted_twice_split_partials",
        K,
        "    if HAS_SINKS and not SPLIT:",
        "    if HAS_SINKS:",
        (f"{SK}::test_triton_split_kv",),
        "sink counted twice: the paged kernel's split partials carry the sink, the merge adds it again",
    ),
    Mutation(
        "sink_counted_twice_decode_partials",
        DK,
        "    if HAS_SINKS and not SPLIT:",
        "    if HAS_SINKS:",
        (f"{SK}::test_triton_decode_kernel_fused_merge",),
        "sink counted twice: the decode kernel's split partials and its fused merge carry the sink",
    ),
    Mutation(
        "sink_counted_twice_cascade_parts",
        CA,
        'sinks = scales.pop("sinks", None)  # both parts without the sink; it joins once, after their m',
        'sinks = scales.get("sinks")  # both parts without the sink; it joins once, after their m',
        (f"{SK}::test_cascade",),
        "sink counted twice: the cascade's suffix part runs with it, the merged state gets it again",
    ),
    Mutation(
        "sink_counted_twice_cascade_graph",
        CA,
        'sinks = scales.pop("sinks", None)  # both parts without the sink; it joins once, after the IF',
        'sinks = scales.get("sinks")  # both parts without the sink; it joins once, after the IF',
        (f"{SK}::test_cascade_graph",),
        "sink counted twice: a cascade graph's suffix part runs with it, the merge gets it again",
    ),
    Mutation(
        "sink_dropped_in_split_merge",
        MG,
        "            tot_splits += tl.exp2(sink2 - m_safe)",
        "            tot_splits += 0.0",
        (f"{SK}::test_triton_split_kv",),
        "sink dropped in one split path: the split merge takes the sink's max but not its weight",
    ),
    Mutation(
        "sink_dropped_in_fused_decode_merge",
        DK,
        "        tot += tl.exp2(sink2 - m_safe)",
        "        tot += 0.0",
        (f"{SK}::test_triton_decode_kernel_fused_merge",),
        "sink dropped in one split path: the decode kernel's fused merge leaves the sink out",
    ),
    # -- planner (validation, lengths, mask-free columns) -----------------------------------------------
    Mutation(
        "kv_len_last_page_off_by_one",
        PL,
        "kv_lens = (npages - lo_last) * page + last  #",
        "kv_lens = (npages - lo_last) * page + last - lo_last  #",
        (f"{KP}::test_page_sizes_1_and_256",),
        "kv_len counts one token less in the last page",
    ),
    Mutation(
        "mask_free_past_first_hidden_column",
        PL,
        "np.minimum.at(free, req, (hidden - mask_indptr[req]) % free[req])",
        "col = (hidden - mask_indptr[req]) % free[req]; free[req] = -1; np.maximum.at(free, req, col)",
        (f"{KP}::test_mask_free_counts_only_leading_visible_columns",),
        "mask_free stops at the last hidden column of a request's mask, not the first",
    ),
    Mutation(
        "decode_wide_threshold_inclusive",
        "attnplug/core/providers/triton.py",
        'return "decode_wide" if programs > _WIDE_PROGRAMS_PER_SM * self._sms else "decode"',
        'return "decode_wide" if programs >= _WIDE_PROGRAMS_PER_SM * self._sms else "decode"',
        (f"{FK}::test_full_decode_batches_beyond_four_programs_an_sm_read_decode_wide",),
        "a full decode batch of exactly four programs an SM reads the decode_wide entry",
    ),
    Mutation(
        "whole_waves_round_up",
        "attnplug/core/providers/triton.py",
        "per = slots // programs",
        "per = num_pages(slots, programs)",
        (f"{FK}::test_split_rule_of_short_contexts",),
        "a whole-waves split count rounds up: 4 x 32768 takes 9 splits (288 programs for 264 slots)",
    ),
    Mutation(
        "whole_waves_no_extra_program",
        "attnplug/core/providers/triton.py",
        "if 5 * per * programs < 4 * slots:",
        "if False:",
        (f"{FK}::test_split_rule_of_short_contexts",),
        "whole waves leave a quarter of the slots idle (12 x 8192: 2 splits, not 4)",
    ),
    Mutation(
        "mask_tail_bytes_dropped",
        PL,
        "hidden = np.concatenate((hidden, (~mask[n8:]).nonzero()[0] + n8))",
        "pass",
        ("tests/core/test_plan_host_fast.py::test_hidden_positions_are_the_false_entries",),
        "the hidden entries past the mask's last whole 8-byte word are not listed",
    ),
    Mutation(
        "last_page_len_validation_loose",
        PL,
        "(last - lo_last).view(np.uint32) > lo_last * (page - 1)",
        "(last - lo_last).view(np.uint32) > lo_last * page",
        ("tests/core/test_plan_validation.py::test_bad_batch",),
        "a last page holding page_size + 1 tokens is accepted",
    ),
    # -- page-table converters -------------------------------------------------------------------------
    Mutation(
        "page_table_last_page_len_off_by_one",
        PT,
        "(seq_lens - 1) % page_size + 1, torch.zeros_like(seq_lens)",
        "seq_lens % page_size + 1, torch.zeros_like(seq_lens)",
        ("tests/core/test_page_table.py::test_block_table_round_trip",),
        "converters give a last-page length one too large (and 1 for a full page)",
    ),
    Mutation(
        "block_table_one_page_too_many",
        PT,
        "mask = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < num_pages[:, None]",
        "mask = torch.arange(block_table.shape[1], device=block_table.device)[None, :] <= num_pages[:, None]",
        ("tests/core/test_page_table.py::test_block_table_round_trip",),
        "block table -> CSR takes one page past each request's last page",
    ),
    Mutation(
        "slot_mapping_wrong_page",
        PT,
        "pages = block_table[req_ids.long(), pos // page_size].long()",
        "pages = block_table[req_ids.long(), (pos + 1) // page_size].long()",
        ("tests/core/test_page_table.py::test_slot_mapping_matches_reference",),
        "the last token of a page is mapped into the next page",
    ),
    # -- CUDA-graph metadata update kernel ----------------------------------------------------------------
    Mutation(
        "graph_update_wrong_request_row",
        GU,
        "row = BT + r * stride_bt_row",
        "row = BT + b * stride_bt_row",
        (
            "tests/core/test_graph_update_kernel.py::test_token_table_with_row_ids",
            f"{GD}::test_graph_replay_from_token_table_matches_reference",
        ),
        "request b reads table row b instead of its row id (SGLang's req_pool_indices)",
    ),
    Mutation(
        "graph_update_last_page_off_by_one",
        GU,
        "tl.store(KV_LAST + rows, s - (npg - 1) * page_size, mask=live)",
        "tl.store(KV_LAST + rows, s - (npg - 1) * page_size - 1, mask=live)",
        (f"{GD}::test_graph_replay_from_block_table_matches_reference",),
        "replay metadata: last-page length one short (FlashInfer's plan and the host twins read it)",
    ),
    Mutation(
        "graph_update_tree_mask_from_block_start",
        GU,
        "src0 = tl.sum(tl.where(rows < b, s_src, 0).to(tl.int64), axis=0) * Q + src_w - Q",
        "src0 = tl.sum(tl.where(rows < b, s_src, 0).to(tl.int64), axis=0) * Q",
        (
            "tests/core/test_graph_update_kernel.py::test_matches_brute_force_and_writes_nothing_else",
            "tests/core/test_cascade_verify_graph.py::test_device_tree_update_matches_the_host_update",
        ),
        "verify replay from a token table (SGLang's tree masks): the tree part read from the block's first columns",
    ),
    Mutation(
        "graph_update_chain_mask_hides_self",
        GU,
        "val = (m_col <= s_b - Q + i) | pad_b",
        "val = (m_col < s_b - Q + i) | pad_b",
        (f"{GD}::test_graph_replay_from_block_table_matches_reference",),
        "verify replay: each draft token does not see itself",
    ),
    Mutation(
        "cascade_graph_suffix_keeps_shared_pages",
        GU,
        "col = (j + skip_b).to(tl.int64) * ENTRY_TOKENS",
        "col = j.to(tl.int64) * ENTRY_TOKENS",
        ("tests/core/test_cascade_graph.py::test_device_update_matches_host_update",),
        "cascade graphs: each suffix starts at page 0, so the shared pages are read twice",
    ),
    Mutation(
        "cascade_graph_tiles_for_uncut_groups",
        GU,
        "tiled = lead & (c > 0) if HAS_TILE_COUNT else lead",
        "tiled = lead",
        ("tests/core/test_cascade_graph.py::test_prefix_part_on_the_prefill_kernel",),
        "cascade graphs, device update: every group gets prefix tiles, so a replay that cut nothing still runs them",
    ),
    Mutation(
        "cascade_graph_strided_prefix_skips_a_tile",
        "attnplug/core/kernels/prefill.py",
        "for t in range(tile + tl.num_programs(0), count, tl.num_programs(0)):",
        "for t in range(tile + 2 * tl.num_programs(0), count, tl.num_programs(0)):",
        ("tests/core/test_cascade_graph.py::test_strided_prefix_part_covers_every_cut_tile",),
        "cascade graphs: the strided prefix part skips each program's second cut tile (its rows miss the prefix)",
    ),
    Mutation(
        "cascade_graph_shared_pages_ignore_mismatch",
        GU,
        "first_diff = tl.minimum(first_diff, tl.min(tl.where(m & (p0 != pb), j, lim), axis=0))",
        "first_diff = tl.minimum(first_diff, lim)",
        ("tests/core/test_cascade_graph.py::test_device_update_matches_host_update",),
        "cascade graphs: requests whose leading pages differ are cut as if they shared them",
    ),
    Mutation(
        "cascade_graph_group_pages_from_whole_batch",
        CA,
        "return start, end, (np.minimum.reduceat(found, heads)[gid] if n else found)",
        "return start, end, (np.full(n, found.min()) if n else found)",
        ("tests/core/test_cascade_graph_groups.py::test_groups_cut_on_host_and_device_equal_reference",),
        "cascade graphs, host path: a group's shared pages taken from the whole batch (the fewest any group shares)",
    ),
    Mutation(
        "cascade_graph_device_group_reads_first_group",
        GU,
        "found = tl.load(SHARED + gst, mask=real, other=0).to(tl.int32)",
        "found = tl.load(SHARED + gst * 0, mask=real, other=0).to(tl.int32)",
        ("tests/core/test_cascade_graph_groups.py::test_groups_cut_on_host_and_device_equal_reference",),
        "cascade graphs, device path: every group cuts the pages the batch's first group shares",
    ),
    # -- cascade grouping (host) -----------------------------------------------------------------------------
    Mutation(
        "cascade_groups_nested_check_dropped",
        CA,
        "    if cut <= m and bool(same[:, low:cut].all(axis=1).any()):",
        "    if False:",
        ("tests/core/test_cascade.py::test_nested_prefixes_pick_the_deeper_groups",),
        "cascade grouping: nested prefixes form one shallow group instead of the deeper ones",
    ),
    Mutation(
        "cascade_common_pages_whole_row",
        CA,
        "    return col.size if col.all() else int(col.argmin())",
        "    return col.size",
        ("tests/core/test_cascade.py::test_groups_share_page_ids_and_every_sharing_pair_is_grouped",),
        "cascade grouping: the members' common pages counted as every shareable page, differing ones included",
    ),
    Mutation(
        "cascade_shareable_ignores_mask",
        CA,
        "        committed = np.minimum(committed, plan.mask_free_cpu.numpy())",
        "        pass",
        ("tests/core/test_cascade_mask_cap.py",),
        "cascade: a custom mask that hides a prefix column no longer caps the shared pages (read unmasked)",
    ),
    # -- draft planner (pure functions) --------------------------------------------------------------------
    Mutation(
        "draft_step_drops_current_token",
        DR,
        "kv_len = seq + step + 1",
        "kv_len = seq + step",
        (f"{GD}::test_every_draft_step_matches_dense",),
        "draft step i attends to draft tokens 0..i-1 only",
    ),
    Mutation(
        "prefix_token_slots_wrong_offset",
        DR,
        "slots = kv_indices.long()[kv_indptr.long()[req] + t // P] * P + t % P",
        "slots = kv_indices.long()[kv_indptr.long()[req] + t // P] * P + (t + 1) % P",
        (f"{GD}::test_every_draft_step_matches_dense",),
        "prefix token t is read from slot t+1 of its page",
    ),
    Mutation(
        "draft_rows_use_branch_0",
        DR,
        "dr_val = draft_slots.reshape(B * K, -1).long()[row, ",
        "dr_val = draft_slots.reshape(B * K, -1).long()[row // K * K, ",
        (f"{GD}::test_every_draft_step_matches_dense",),
        "every branch attends to branch 0's draft tokens",
    ),
    # -- branch cascade (issue 43): cascade graphs on by default, the one-launch prefix part ----------------
    Mutation(
        "cascade_prefix_merge_drops_base",
        "attnplug/core/kernels/prefill.py",
        '    w = tl.where(m > float("-inf"), 1.0, 0.0)\n',
        '    w = tl.where(m > float("-inf"), 0.0, 0.0)\n',
        ("tests/core/test_cascade_graph.py::test_prefix_part_on_the_prefill_kernel",),
        "cascade graphs: the prefix kernel's in-kernel merge gives the suffix state no weight",
    ),
    Mutation(
        "cascade_prefix_merge_counter_not_rearmed",
        "attnplug/core/kernels/prefill.py",
        '                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")\n',
        "",
        ("tests/core/test_cascade_launches.py::test_an_unshared_replay_pays_one_launch_for_the_prefix_part",),
        "cascade graphs: the prefix kernel's merge counters are not re-armed: the next replay never merges",
    ),
    Mutation(
        "cascade_fa3_graph_prefix_on_fa3",
        "attnplug/core/providers/fa3.py",
        'return provider_instance("triton", self.config, self.device).fork()',
        "return self.fork()",
        ("tests/core/test_cascade_launches.py::test_an_unshared_replay_pays_one_launch_for_the_prefix_part",),
        "cascade graphs: fa3's prefix part is an FA3 call and a merge, replayed where nothing is shared",
    ),
    Mutation(
        "cascade_prefix_merge_launched_apart",
        "attnplug/core/providers/triton.py",
        "fused = merge_base and noncausal and sinks is None and (not split or a.counters is not None)",
        "fused = False",
        ("tests/core/test_cascade_launches.py::test_an_unshared_replay_pays_one_launch_for_the_prefix_part",),
        "cascade graphs: the prefix part's merge is a launch of its own again",
    ),
    Mutation(
        "gluon_default_off",
        "attnplug/core/providers/triton.py",
        "return env_flag(GLUON_ENV, True)",
        "return env_flag(GLUON_ENV, False)",
        ("tests/core/test_gluon_plan.py::test_gluon_is_on_by_default",),
        "the Gluon prefill back to opt-in (ATTNPLUG_GLUON unset plans the Triton kernels on sm90)",
    ),
    Mutation(
        "cascade_graphs_default_on",
        CA,
        "env_flag(CASCADE_GRAPHS_ENV, False)",
        "env_flag(CASCADE_GRAPHS_ENV, True)",
        ("tests/core/test_cascade_launches.py::test_cascade_graphs_are_opt_in_under_the_cascade_mode",),
        "cascade graphs on unless ATTNPLUG_CASCADE_GRAPHS=0 (the opt-in lost)",
    ),
    # -- branch mla: MLA (issue 45) -------------------------------------------------------------------------
    Mutation(
        "mla_rope_part_dropped",
        ML,
        "        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)\n",
        "",
        (f"{MT}::test_triton_mla_deepseek_shape",),
        "MLA scores: the rope part q_pe . k_pe dropped (only q_nope . c)",
    ),
    Mutation(
        "mla_rope_columns_offset",
        ML,
        "pe = tl.load(row[:, None] + R + dr[None, :]",
        "pe = tl.load(row[:, None] + R - DR + dr[None, :]",
        (f"{MT}::test_triton_mla_deepseek_shape",),
        "MLA scores: k_pe read from the Dr latent columns before the rope part (split offset)",
    ),
    Mutation(
        "mla_output_wrong_latent_columns",
        ML,
        "acc += tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)",
        "acc += tl.dot(p.to(c.dtype), tl.where(rr[None, :] < R - DR, c, 0.0).to(c.dtype), "
        "input_precision=DOT_PRECISION)",
        (f"{MT}::test_triton_mla_deepseek_shape",),
        "MLA absorbed output: the last Dr latent columns of the value rows dropped",
    ),
    Mutation(
        "mla_fa3_value_columns_shifted",
        "attnplug/core/providers/fa3_mla.py",
        'return q[..., R:], k_cache[..., R:], v_cache, {"qv": q[..., :R]}',
        'return q[..., R:], k_cache[..., R:], k_cache[..., -R:], {"qv": q[..., :R]}',
        (f"{MT}::test_fa3_mla_on_the_standin",),
        "MLA fa3: FA3's value cache taken from the latent's last R columns (rope part included)",
    ),
    Mutation(
        "ragged_rope_part_dropped",
        "attnplug/core/kernels/ragged.py",
        "        s = tl.dot(q2, k2, s, input_precision=DOT_PRECISION)",
        "        s = s",
        ("tests/core/test_ragged.py::test_ragged_prefill_matches_float32_reference",),
        "ragged prefill (SGLang's MLA prefill): the qk head dim's second part (DeepSeek's 64 rope columns) dropped",
    ),
    Mutation(
        "ragged_causal_top_left",
        "attnplug/core/kernels/ragged.py",
        "causal_off = kv_len - q_len\n",
        "causal_off = 0\n",
        ("tests/core/test_ragged.py::test_ragged_prefill_matches_float32_reference",),
        "ragged prefill: the causal mask aligned top-left (an extend's queries miss their cached prefix)",
    ),
    # -- gluon (issue 46): the triton provider's plan-time choice of the Gluon prefill kernel ---------------
    Mutation(
        "gluon_takes_sinks",
        "attnplug/core/providers/triton.py",
        "            and not cfg.sinks\n            and cfg.group_size == _next_pow2(cfg.group_size)",
        "            and cfg.group_size == _next_pow2(cfg.group_size)",
        ("tests/core/test_gluon_plan.py::test_uncovered_features_plan_the_triton_kernels",),
        "the Gluon kernel (no sinks) is planned for layers with attention sinks",
    ),
    Mutation(
        "gluon_takes_any_page_size",
        "attnplug/core/providers/triton.py",
        "            and cfg.page_size == 16\n            and not cfg.kv_quantized\n",
        "            and not cfg.kv_quantized\n",
        ("tests/core/test_gluon_plan.py::test_uncovered_features_plan_the_triton_kernels",),
        "the Gluon kernel is planned for page sizes other than 16",
    ),
    Mutation(
        "gluon_keeps_split_plan",
        "attnplug/core/providers/triton.py",
        "            if gluon is None or splits == 1:\n                break",
        "            break",
        ("tests/core/test_gluon_plan.py::test_uncovered_features_plan_the_triton_kernels",),
        "a batch that needs KV splits keeps the Gluon tiles (the Gluon kernel has no splits)",
    ),
    Mutation(
        "gluon_tiles_unsorted",
        "attnplug/core/providers/triton.py",
        'kernel in ("prefill", "gluon")\n',
        'kernel == "prefill"\n',
        ("tests/core/test_gluon_plan.py::test_covered_batches_plan_gluon",),
        "the Gluon kernel's tile list is not sorted by causal work (longest-first schedule lost)",
    ),
    # -- plan knobs (issue 40): each provider's Options type ------------------------------------------------
    Mutation(
        "options_take_foreign_knob",
        PL,
        "        unknown = sorted(knobs.keys() - names)\n",
        "        unknown = []\n",
        ("tests/core/test_plan_validation.py::test_each_provider_options_refuse_another_providers_knob",),
        "a knob another provider reads is not refused with attnplug's message",
    ),
    Mutation(
        "pinned_options_drop_splits",
        "attnplug/core/providers/base.py",
        "        if num_kv_splits is not None and self.takes_split_count():\n",
        "        if False:\n",
        ("tests/core/test_plan_validation.py::test_pinned_options_keep_the_split_count_where_the_provider_takes_it",),
        "a graph part's / draft step's forced split count is dropped (its static memory was sized by it)",
    ),
]


def check_snippets(muts: list[Mutation]) -> list[str]:
    """Every snippet occurs exactly once in its file (else: the error lines)."""
    errors = []
    for m in muts:
        text = (REPO / m.file).read_text()
        n = text.count(m.find)
        if n != 1:
            errors.append(f"{m.name}: snippet found {n} times in {m.file} (must be exactly 1): {m.find!r}")
        for t in m.tests:
            if not (REPO / t.split("::")[0]).is_file():
                errors.append(f"{m.name}: test file {t.split('::')[0]} does not exist")
    return errors


def copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for sub in ("attnplug", "tests"):
        shutil.copytree(REPO / sub, dst / sub, ignore=ignore, symlinks=True)
    for f in ("pyproject.toml",):
        if (REPO / f).exists():
            shutil.copy2(REPO / f, dst / f)


def pytest_cmd(tests: list[str], workers: int = 0) -> list[str]:
    xdist = ["-n", str(workers)] if workers > 1 else []
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts="] + [
        *xdist,
        *tests,
    ]


def env_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("TRITON_INTERPRET", "1")
    return env


def run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str, float]:
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=False
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        rc = 124
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()
        raise
    return rc, out, time.time() - t0


def summary_line(out: str) -> str:
    lines = [l for l in out.strip().splitlines() if re.search(r"\b(passed|failed|error|no tests ran)\b", l)]
    return lines[-1].strip("= ") if lines else (out.strip().splitlines() or ["(no output)"])[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--budget", type=float, default=1800.0, help="seconds for the whole check (baseline included)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per test run")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once (one copy each)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (prints their paths)")
    ap.add_argument(
        "--baseline-passed",
        action="store_true",
        help="skip the unmutated run: the caller ran these tests on this tree and they passed (test.sh: core)",
    )
    a = ap.parse_args()
    muts = [m for m in MUTATIONS if a.k in m.name]
    if a.list:
        for m in muts:
            print(f"{m.name:40s} {m.file:40s} {m.what}")
        return 0
    if not muts:
        print(f"mutation_check: no mutation matches -k {a.k!r}")
        return 2
    errors = check_snippets(muts)
    if errors:
        print("mutation_check: FAILED before running anything: a mutation would be a no-op", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        return 1
    t_start = time.time()
    jobs = max(1, min(a.jobs, len(muts)))
    copies = [Path(tempfile.mkdtemp(prefix="attnplug-mutants-")) for _ in range(jobs)]
    try:
        for tmp in copies:
            copy_tree(tmp)
            probe = subprocess.run(
                [sys.executable, "-c", "import attnplug; print(attnplug.__file__)"],
                cwd=tmp,
                env=env_for(tmp),
                capture_output=True,
                text=True,
            )
            where = probe.stdout.strip()
            if probe.returncode != 0 or not where.startswith(str(tmp)):
                print(
                    f"mutation_check: the copy's attnplug is not the one imported ({where or probe.stderr[-500:]})",
                    file=sys.stderr,
                )
                return 1
        tmp, env = copies[0], env_for(copies[0])
        union = list(dict.fromkeys(t for m in muts for t in m.tests))
        print(
            f"mutation_check: {len(muts)} mutations, {len(union)} test selections, {jobs} at once, copies in"
            f" {' '.join(map(str, copies))}",
            flush=True,
        )
        if a.baseline_passed:
            rc, out, secs = 0, "", 0.0
            print(f"baseline (unmutated): the {len(union)} selections passed in the caller's run (--baseline-passed)")
        else:
            rc, out, secs = run(pytest_cmd(union, jobs), tmp, env, a.budget)
            print(f"baseline (unmutated): {summary_line(out)} [{secs:.0f} s]", flush=True)
        if rc != 0:
            print(out[-6000:], file=sys.stderr)
            why = f"timed out after {secs:.0f} s (--budget)" if rc == 124 else "fail without any mutation"
            print(f"mutation_check: FAILED: the selected tests {why}", file=sys.stderr)
            return 1
        free: queue.Queue[Path] = queue.Queue()
        for c in copies:
            free.put(c)

        def mutant(m: Mutation) -> tuple:
            left = a.budget - (time.time() - t_start)
            if left < 5:
                return (m, "NOT RUN (budget)", 0.0, "", "")
            copy = free.get()
            path = copy / m.file
            original = path.read_text()
            try:
                path.write_text(original.replace(m.find, m.replace, 1))
                rc, out, secs = run(pytest_cmd(list(m.tests)), copy, env_for(copy), min(a.timeout, left))
            finally:
                path.write_text(original)
                free.put(copy)
            failed = re.search(r"\b\d+ failed\b", summary_line(out)) is not None
            if rc == 1 and failed:
                verdict = "killed"
            elif rc == 0:
                verdict = "SURVIVED"
            elif rc == 124:
                verdict = "TIMEOUT"
            else:
                verdict = f"ERROR rc={rc}"
            first = next((l for l in out.splitlines() if l.startswith(("FAILED", "ERROR"))), "")
            print(f"  {m.name}: {verdict} ({secs:.0f} s) {first[:150]}", flush=True)
            if verdict != "killed" and verdict != "SURVIVED":
                print(out[-3000:], flush=True)
            return (m, verdict, secs, summary_line(out), first)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(mutant, muts))
    finally:
        for c in copies:
            if a.keep:
                print(f"mutation_check: kept {c}")
            else:
                shutil.rmtree(c, ignore_errors=True)
    total = time.time() - t_start
    w1 = max(len(m.name) for m in muts)
    w2 = max(len(m.file) for m in muts)
    print()
    print(f"{'mutation':{w1}s}  {'file':{w2}s}  {'killed?':10s} {'time':>6s}  tests run")
    print(f"{'-' * w1}  {'-' * w2}  {'-' * 10} {'-' * 6}  {'-' * 40}")
    for m, verdict, secs, summ, _ in rows:
        tests = ", ".join(t.split("::")[-1] if "::" in t else t for t in m.tests)
        print(f"{m.name:{w1}s}  {m.file:{w2}s}  {verdict:10s} {secs:5.0f}s  {tests} ({summ})")
    killed = sum(1 for r in rows if r[1] == "killed")
    ok = killed == len(muts)
    print(f"\nmutation_check: {killed}/{len(muts)} mutations killed in {total:.0f} s -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
