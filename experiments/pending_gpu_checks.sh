#!/usr/bin/env bash
# The GPU checks left open when a session's H200 time ran out, in one place, for the next run.
# (The eighth session's list ran on dafac34 in the ninth: logs data/bench/*dafac34*, the
# workbook digest data/bench/workbook_h200_dafac34.md; the ninth's window, fp8bench and grid
# ran on b72baa6: data/bench/*b72baa6*; the tenth's fp8bench and grid ran on e4e0d12, f1d7888
# and 11dc3f5: data/bench/*_fp8_f1d7888.log, *_grid_11dc3f5.log; its profile and smem on 4026198:
# data/bench/gpu_tests_profile_4026198.log, data/bench/ncu_small_kernels_h200_4026198/; the
# twelfth's tail (with the split kernels' tests) and grid ran on 7840448:
# data/bench/gpu_tests_7840448.log, data/bench/nvidia-h200_grid_7840448.log; nb05 on 0c76bc5:
# data/bench/workbook_nb05_h200_0c76bc5.md, 73 s; the thirteenth and fourteenth sessions' trims, turns,
# split and dense ran on a89f486, 109d804, 3b44e9d: data/bench/*a89f486*, *109d804*, *3b44e9d*;
# dense again, with the CSR-only kernels and the FP8 entry, in the fifteenth on e3cd9d5:
# data/bench/*dense*e3cd9d5*; bars and suite in the sixteenth on ce5f459 and 2550cc7:
# data/bench/*ws_bars*, gpu_suite_*; the sixteenth session's mask and fold patches in the
# seventeenth on 798007e and f53f744, in the package since f53f744: data/bench/*_mask_*,
# *_fold_*; ids (step 14) on 639cdc6 and 05f2f12: data/bench/*_ids_*, *_lat_*; suite and lazy
# (step 15, a patch then) in the eighteenth on 0e6a75d: data/bench/gpu_suite_0e6a75d.log,
# *_lazy_*; abstail on 5e64540: data/bench/max_abs_tail_h200.log; suite in the nineteenth on
# 93f6818: data/bench/gpu_suite_93f6818.log; lists and suite in the twentieth on 3d492b9,
# 57d8cc1 and 98a1af7 (through experiments/list_length_gpu_check.sh): data/bench/*list_length_*,
# gpu_suite_57d8cc1.log, gpu_tests_default_kernel_98a1af7.log; the split rule's one-wave
# change on aa517c6 and f28832c: data/bench/*split_waves*, gpu_tests_splits_*; waves in the
# twenty-first on 6e30932: data/bench/*_split_waves_grid_6e30932.log, the whole-list check
# *_list_length_verify_waves_6e30932.log; waves, grid, lists and suite in the twenty-third on
# 22da721 and c682036: *_ws_split_waves_grid_22da721.log, *_grid_c682036.log,
# *_list_length_verify_c682036.log, gpu_suite_c682036.log, the middling lists' run
# *_grid_ctx1024_c682036.log; t32, prefetch, verify and suite in the twenty-fourth on 994416d
# and 9aecea0: *_t32_994416d.log, *ws_prefetch_*_994416d.log, *_list_length_verify*_9aecea0.log,
# gpu_suite_9aecea0.log; tilerate's probe on c435418, by hand with shorter caps:
# data/bench/ncu_tile_rate_h200_c435418/; l2rows, l2small and tmid in the twenty-fifth on
# b1f7a7a, l2gate on 1f8b501 (then one wave's rule, narrowed to split calls after its A/B):
# data/bench/*l2rows*b1f7a7a*, *small_l2*b1f7a7a*, *_tmid_b1f7a7a.log, *l2gate*1f8b501*; in
# the twenty-sixth, the split rule's A/B and ws tests on f971c08 (*l2split*f971c08*), grid on
# 4a64402 (*_grid_4a64402.log) and tilerate at the grid's T = 64 H128 on f9473e5
# (data/bench/ncu_tile_rate_h200_f9473e5/), with steps 24-26's probes and A/Bs (small_t_floor*,
# ws_clk_now*, *sinkpf*, *epi4*), by hand: commands in each log's first line; in the
# twenty-seventh, descpf (since folded into sinkearly) on f8fed7e (*descpf*f8fed7e*), sinkearly on
# 7b19af4 (*sinkearly*7b19af4*, profile_gluon_ws_t64_h128_7b19af4.log), grid on e7f6083
# (*_grid_e7f6083.log), suite and the grid again on b45fa3c (*b45fa3c*); in the twenty-eighth,
# qprologue and smallsink on 1ddf06a (*1ddf06a*), qprologuepf on 584cafa (*584cafa*),
# rangeprologue on ad742b8 (*ad742b8*): none kept, PERF_NOTES steps 28-31; flushkind on 6a54645
# (*6a54645*), the grid on dead290 (*_grid_dead290.log), l2b256 on 1974b67 (*1974b67*, not
# kept, step 32); in the twenty-ninth, lengths and pairs on 3dc547d (*3dc547d*: steps 33 and 34;
# the lengths tests again on 332dbcc, gpu_tests_lengths_332dbcc.log), earlypv on 0e5194d
# (*earlypv*0e5194d*: step 35, not kept); in the thirtieth, lentests, l2policy (step 36, not
# kept) and fp8lengths on ca24298 (*ca24298*), nowait on 959d8b9 (*nowait*959d8b9*, step 37,
# kept, then taken out: see PERF_NOTES); the grid and ctxlengths on fb3bbfe (*fb3bbfe*), the suite on 4cd0507
# (gpu_suite_4cd0507.log: 1014 passed); in the thirty-first, densewidth on c70ccf8 and 90cbd32
# (*90cbd32*: step 38), the suite on bd1b82c, midsplit on 65c024a and mid1024 on e5f79cf (step 39:
# *65c024a*, *_grid_ctx1024_e5f79cf.log, exported on the CPU); in the thirty-second, lenpub on
# 2ebbb73 (*lenpub*2ebbb73*: step 40, not kept), mid1024verify on 522c424 (*522c424*),
# lenchoice on 4ad43a9 (*4ad43a9*: step 41), the suite on 38686ff (gpu_suite_38686ff.log: 1018
# passed), l2split on 21980c7 (*21980c7*: step 36's policies apart); in the thirty-third, qfirst and
# qfirstmap and qfirstncu on a9f55a1 and 784d617 with the patch (*qfirst*: step 42, not kept),
# wsprofile on a248625 (profile_gluon_ws_ctx65536_*), idsahead on a248625 (*idsahead*: step 43,
# not kept), regsplit on b4b79d8 (*regsplit*: no split better than 224/48), padp on
# 1c71bc7 (*padp*: step 44, not kept); in the thirty-fourth, callrows on 542345b
# (*callrows*: step 45, kept), wstests on 86b21b9 and bfcf013, outdirect on d3393e0 (*outdirect*:
# step 46, kept), the grid on 86b21b9 (cut short) and bfcf013, smalltchoice on 1400662, wholemap
# on 880e703 and smallcallrows on d482a17 (*small_callrows*: not kept); in the thirty-fifth,
# fp8outdirect on c4e9b62 and fp8outsmall on 19d0616 (*fp8_out*: step 47, own stores where a
# program runs one item).) Open: fp8outsmall again (the one-item gate).
# (Formerly
# open: trims, the thirteenth session's two host-path trims, 52458fb, CPU-verified only). From
# the repository root, with `.peers` carried (steps fp8bench, grid) and the workbook wheels as `.whl` (steps
# workbook, nb05; the device README says how):
#   OUT=dir COMMIT=sha STEP=profile|smem|fp8bench|nb05|window|grid|tail|trims|turns|dense|suite|bars|ids|lazy|abstail|waves|lists|verify|prefetch|t32|tmid|tilerate|l2rows|l2small|l2gate|sinkearly|qprologue|qprologuepf|rangeprologue|flushkind|l2b256|pairs|lengths|lentests|l2policy|fp8lengths|nowait|ctxlengths|l2split|densewidth|midsplit|mid1024|mid1024verify|lenpub|lenchoice|qfirst|qfirstmap|qfirstncu|wsprofile|idsahead|regsplit|padp|callrows|outdirect|smalltchoice|wholemap|smallcallrows|fp8outdirect|fp8outsmall|wstests|earlypv|smallsink|split|plans|workbook|fp8host|host|all \
#     bash experiments/pending_gpu_checks.sh
# Each step writes under $OUT and is capped; `all` runs profile and smem (at most 5 minutes);
# fp8bench (up to 9 minutes with peer (b)'s first build) and nb05 (up to 7) each in a command of
# their own; the others are earlier sessions' steps, kept for reruns.
# Keep few files under $OUT: the device returns a limited number.
#   profile   tests/test_profile.py's GPU test, verbose: the ncu view's evidence (it passed in the
#             run of 389977b, whose log was not kept)
#   smem      the shared-memory ceiling hypothesis of PERF_NOTES ("Shared-memory accounting"):
#             Nsight Compute's memory sections of gluon_ws_small_fp8 and the bf16 gluon_ws_small
#             at H16 T=2048 (experiments/h28fp8s_gpu_check.sh STEP=ncu)
#   fp8bench  sparse-mla bench --fp8 with room for its T = 1024 and 256 points (cut at b72baa6),
#             and peer (b)'s first run (flashmla*_fp8decode: the stand-in's decode binding is
#             built on first use, into $FLASHMLA_BUILD_DIR_decode; check its log line)
#   nb05      notebook 05 at its full size (it outlasted a 200 s cap at dafac34; 73 s at 0c76bc5)
#   (and, in a command of its own, experiments/h29fp8c_gpu_check.sh: the FP8 kernel whose
#   consumer dequantizes K itself, experiments/fp8_consumer.py, up to 570 s)
#   window    experiments/host_window.py (ran at b72baa6)
#   grid      sparse-mla bench --grid with FlashMLA, at least 5 calls a round (ran at b72baa6;
#             again after 4784978: timed providers share one output buffer, PERF_NOTES "Timing
#             in turns" predicts default / forced within 1.00 +- 0.01 at the heavy points);
#             open again since gluon_ws's short last tile (twelfth session: T = 64-1024 moved,
#             T = 4096/16384 should not)
#   trims     the thirteenth session's host-path trims (op._planned, dispatch._file_stamp's
#             os.access), split-ticket helper (algorithm._split_ticket) and the fourteenth's
#             (the last plan by guard, op._last; no device objects per call): the plan, op and
#             split-kernel GPU tests, then experiments/host_split.py with
#             FlashMLA (needs .whl for xdist and .peers; under 3 minutes)
#   turns     scripts/host_cost.py --turns 8, dense (every kernel and FlashMLA, in turns, at the
#             thirteenth session's seven shapes) and --fp8 (TURNS_MODES="dense fp8" picks);
#             issue 26's 40 us bound, after a host-path change (up to 9 minutes)
#   dense     the fourteenth session's plans for dense [T, K] ids: their GPU tests (replays
#             bitwise equal to the full path, every dense kernel and the FP8 ones) and
#             host_cost --ids dense in turns with FlashMLA, and --fp8 --ids dense (ran on
#             3b44e9d for the dense readers, on e3cd9d5 for every kernel; 4 minutes)
#   suite     the whole GPU test suite (-m gpu), property tests at a fifth of their examples
#             (SPARSE_MLA_PROPERTY_SCALE=0.2), each test's result as it ends (a cut run still
#             says what passed), the slowest 25; in 9 minutes at most. The fifteenth session
#             found test_ws_small_groups's GPU cases failing since b7db5ec: no run had taken the
#             whole suite since; take this step once a session
#   bars      gluon_ws's mbarriers in one allocation per role (fewer compiler barriers; was
#             experiments/patches/ws_bars_by_role.diff, in the package since the sixteenth
#             session): the GPU tests of every gluon_ws path and gluon_ws_fp8, then
#             experiments/ws_bars_ab.py against ce5f459's kernel (in turns at T = 64 and
#             16384, H128; under 7 minutes)
#   ids       step 14 (seventeenth session): gluon_ws's producer publishes each tile's slot ids
#             in shared memory with its first half and the consumers mask from them (no id
#             reloads from kv_indices): the GPU tests of every gluon_ws path and gluon_ws_fp8,
#             then ws_bars_ab.py against f53f744's kernel (.ab_base/hopper_ws_f53f744.py, carried;
#             `git show f53f744:sparse_mla/gluon/hopper_ws.py` writes it) at the heavy and
#             latency points, twice each (under 5 minutes)
#   lazy      step 15 (a row keeps its stale max until a pair passes it by more than 8 in log2
#             units, and a warp none of whose rows moved skips its O rescale; a patch until the
#             eighteenth session): the GPU tests of every gluon_ws path and gluon_ws_fp8 (with
#             the late-max-jump test), then ws_bars_ab.py against 05f2f12's kernel
#             (.ab_base/hopper_ws_05f2f12.py, carried; `git show
#             05f2f12:sparse_mla/gluon/hopper_ws.py` writes it); under 5 minutes
#   waves     bench --grid --context 65536 (every grid head, T 1-1024, the package kernels and
#             FlashMLA) under the one-wave split rule (PERF_NOTES "No cliffs" step 17), appended
#             to the committed CSV, then export --kernel-choice with that run in place of the
#             earlier whole-list runs (14:39:34, 15:04:00); the file and the CSV come back in
#             $OUT (under 8 minutes). Predicted: gluon_wgmma chosen at T = 16 with 96-128 heads
#             (0.92 of FlashMLA at H128), the other choices as before
#   verify    config=None with the shipped choice on whole lists (--context 65536, T 1/4/16/32/64)
#             and middling lists (--context 1024, T 1/4/16/32/64) at every grid head, against the
#             kernels and FlashMLA padded (the twenty-third session's two exports, checked at 9
#             heads for whole lists only, and the twenty-fourth's T = 32 export); predicted:
#             within 1.02 of the fastest package kernel at every point; under 6 minutes with
#             FlashMLA's build
#   prefetch  PERF_NOTES "No cliffs" step 20, a patch (experiments/patches/ws_desc_prefetch.diff):
#             gluon_ws prefetches q's and out's TMA descriptors at the kernel's start
#             (prefetch.tensormap, as CUTLASS kernels do); applied to the copy here, then the GPU
#             tests of every gluon_ws path and gluon_ws_fp8 and ws_bars_ab.py against the
#             unpatched file (under 9 minutes). Predicted: T = 64 H128 0..-0.3 us, T = 16384
#             within noise
#   l2rows    PERF_NOTES "No cliffs" step 22, a patch (experiments/patches/ws_l2_rows.diff):
#             gluon_ws's producer asks L2 for the next pair's KV rows (one 1 KiB bulk prefetch a
#             row); applied to the copy here, then the GPU tests of every gluon_ws path and
#             ws_bars_ab.py against the unpatched file at whole lists (T = 64 H128 / H96, T = 4
#             H128 split, T = 16 H64 split), the grid's T = 64 H128, T = 16384 H128 and GLM H64
#             (under 6 minutes). Predicted: whole lists T = 64 H128 43.0 -> about 41.3 us (the
#             tile 1.67 -> 1.57 us, FlashMLA's), T = 16384 and the grid's T = 64 within noise
#   tmid      token counts between the grid's (twenty-fourth session; MID_TOKENS, default
#             128,512,2048): whole lists, middling lists and whole prompts (the last into a CSV
#             of their own, nvidia-h200_grid_mid_t.csv) at every grid head, then the sm90 export
#             with them (the latest three whole-list and middling runs: T 1-1024 / 1-16, T = 32,
#             these); the file, the three CSVs and the log come back (under 9 minutes). Why: T = 32
#             was unmeasured until the twenty-fourth session and its export moved 28 points by
#             3-14%; between 64 and 256 (33-64 heads: gluon_ws_small at 64, gluon_ws at 256),
#             256 and 1024, 1024 and 4096 the choice is a bucket boundary no run has checked.
#             After it: experiments/choice_diff.py, and copy the CSVs and the file in
#   l2small   step 22 for gluon_ws_small (experiments/patches/ws_small_l2_rows.diff, on top of
#             ws_l2_rows.diff): its producer asks L2 for the rows of the tiles two and three
#             ahead (every other tile); the GPU tests of gluon_ws_small and ws_bars_ab.py
#             --kernel gluon_ws_small against the file with only the first patch, on whole lists
#             (T = 64 H16 / H64, T = 256 H32, T = 1024 H16) and the grid's T = 64 / 16384 H16
#             (under 7 minutes). Predicted: whole lists -1..-4% (its 3-stage ring already keeps
#             more bytes in flight than gluon_ws's one pair), the grid's points within noise
#   l2gate    step 22 in the package (twenty-fifth session): gluon_ws's L2_ROWS, set (at 1f8b501)
#             when every item has a program of its own (hopper_ws.l2_rows); the GPU tests of every gluon_ws
#             path, then the grid's T = 64 / 128 (short lists) and whole lists at T 4 / 64 / 128,
#             every grid head, with FlashMLA, into l2gate_grid.csv (under 8 minutes). Predicted
#             from l2rows's A/B: gluon_ws -1..-2% at T = 64 with 96-128 heads (the grid's
#             T = 64 H128 from 1.012 of FlashMLA to about 0.995), -0.5..-1% on whole lists at
#             T = 64, -1.5..-2.5% at T = 4 H128 (split); T = 128 with 65+ heads unchanged (256+
#             items: off)
#   sinkearly PERF_NOTES "No cliffs" step 27 (twenty-seventh session, in the package since
#             7b19af4): the GPU tests of every gluon_ws path and gluon_ws_fp8, ws_bars_ab.py
#             against 5eeb10a's kernel (.ab_base/hopper_ws_5eeb10a.py, carried; `git show
#             5eeb10a:sparse_mla/gluon/hopper_ws.py` writes it), then `sparse-mla profile` of
#             gluon_ws at the grid's T = 64 H128 (about 3 minutes)
#   qprologue step 28, a patch (experiments/patches/ws_q_prologue.diff): ws_clk_now.py on the
#             package kernel (its entry stamps), the patch's GPU tests, ws_bars_ab.py against the
#             package file and ws_clk_now.py on the patched kernel (under 6 minutes)
#   qprologuepf step 30, a patch (experiments/patches/ws_q_prologue_pf.diff, step 28 with the
#             first range's line and a small call's ids asked of L2 before Q): ws_clk_now.py
#             (with the first tiles' landing) on the package, step 28 and step 30, then
#             ws_bars_ab.py of step 30 against the package file (about 4 minutes)
#   rangeprologue step 31, a patch (experiments/patches/ws_range_prologue.diff: step 30
#             without moving Q, i.e. only the first range's line and a small call's ids asked
#             of L2 from the prologue): ws_clk_now.py on it, then ws_bars_ab.py against the
#             package file (about 2.5 minutes)
#   flushkind the grid's small calls (T = 64 H64 / H128, T = 256 H64: ours, FlashMLA, each also
#             with every list empty) timed after the bench's L2 flush and after that flush
#             plus a 256 MiB read (L2 clean): experiments/small_t_floor.py --flush; then the
#             GPU tests of every gluon_ws path at the commit (about 5 minutes with FlashMLA's
#             first build)
#   l2b256    step 32: experiments/ws_l2_256b.py, gluon_ws with its row gathers' cp.async asking
#             L2 for 256-byte blocks (a PTX rewrite through Triton's stage hook) against the
#             package kernel, in turns: whole lists T = 128 H64 and T = 64 H128, the grid's
#             T = 64 H128 and T = 256 H64, T = 16384 H128 (about 3 minutes)
#   pairs     ws_clk_now.py --pairs on whole lists (T = 128 H64, T = 64 H128: one long item an
#             SM, where step 21 found ours ~6% slower a tile than FlashMLA): when pairs 1-3's
#             buffer 0L comes back to the producer, when consumer 0 waits for it and when it has
#             landed (about 1.5 minutes)
#   lengths   dense ids with their rows' lengths (kv_lengths, FlashMLA's topk_length; twenty-ninth
#             session): tests/test_dense_lengths.py's GPU tests with the dense-ids and FP8 dense
#             tests (every kernel, the plans, CUDA graphs), then the grid's providers default,
#             default_dense, default_dense_len and FlashMLA at H 8-128 x T 64-16384 (about 6
#             minutes with FlashMLA's build). Predicted: default_dense_len within 1.03 of
#             default (CSR) everywhere, where default_dense was up to 1.66x at T = 4096
#   earlypv   step 35 (twenty-ninth session, a patch since: experiments/patches/
#             ws_early_pv0.diff, measured at 0e5194d and not kept): gluon_ws's consumer 0 runs
#             its own PV and releases 0L before the pair's max comes back (FlashMLA's order;
#             step 33 found consumer 0 waiting 0.5-1.1 us a pair for 0L): the GPU tests of every
#             gluon_ws path and gluon_ws_fp8 with the patch, then ws_bars_ab.py against the
#             package file at whole lists and the heavy and grid points (about 3 minutes).
#             Predicted: whole lists T = 128 H64 and T = 64 H128 -3..-8%, T = 16384 H64 / H128
#             and GLM H64 -1..-4%, the grid's T = 64 H64 / H128 0..-2%. Measured: slower
#             everywhere (+0.6..+5.7%)
#   lentests  the GPU tests of the lengths step alone (tests/test_dense_lengths.py, the dense-ids
#             and FP8 dense tests; about 1.5 minutes): the thirtieth session's first run, after
#             e9fa3e5's refactor of the launchers' dense arguments (CPU-tested only)
#   l2policy  step 36 (thirtieth session): experiments/ws_l2_256b.py --variants rows_last+q_first,
#             gluon_ws with FlashMLA's two L2 policies added to its PTX (the row gathers'
#             cp.async evict_last, Q's TMA loads evict_first) against the package kernel, in
#             turns: whole lists T = 128 H64 and T = 64 H128, the grid's T = 64 H128, T = 16384
#             H128 (about 3 minutes). Predicted: whole lists -2..-5% if the policies are what
#             FlashMLA's higher L2 hit rate there (77% against 66%, step 21) is made of; the
#             others within +-1%
#   fp8lengths the FP8 cache's dense ids with lengths (thirtieth session: gluon_ws_small_fp8 reads
#             them itself now, as gluon_ws_fp8 did): `sparse-mla bench --fp8` with fp8_default
#             and fp8_default_dense_len at H 8-64 x T 64-16384 (about 2 minutes). Predicted:
#             fp8_default_dense_len within 1.03 of fp8_default (CSR) at every point
#   nowait    step 37 (thirtieth session; a patch since, experiments/patches/
#             ws_nowait_last_read.diff, applied by the step): gluon_ws (and gluon_ws_fp8, which shares the
#             consumers) no longer waited for the TMA engine to have read a program's last
#             output block before the program ends (FlashMLA's epilogue does not either): the
#             GPU tests of every gluon_ws path, then ws_bars_ab.py against 2d17d54's file
#             (.ab_base/hopper_ws_before.py, carried) at the grid's T = 64 H128 / H64 and
#             T = 256 H64, whole lists T = 64 H128 and T = 16384 H128 (about 4 minutes).
#             Predicted: T = 64 -1..-2% (the last block's read, 0.2-0.3 us in step 24's
#             stamps, off the program's end), T = 256 -0.5%, T = 16384 and whole lists
#             within noise
#   ctxlengths steps of a long request (whole lists, T 1-128, H 8-128) with FlashMLA's dense
#             ids and their lengths (`default_dense_len`) beside CSR `default` and FlashMLA,
#             rows into nvidia-h200_ctx_lengths.csv (not the context grid's CSV, whose latest
#             run the kernel-choice export reads; about 2 minutes). Predicted: within 1.03 of
#             `default` (at whole lists the padding is at most 127 ids a row)
#   densewidth the lengths GPU tests (the FP8 ones' ids moved into a helper at fb30d3a), the
#             plans' and the op's (max_kv_length is in the plan key and the op's schema), then
#             experiments/dense_width.py: dense ids at an engine's fixed width (top-k + 128) with
#             kv_lengths on short contexts (256, 1024) at T 1-16, H 16-128, against their CSR
#             form and FlashMLA, and with max_kv_length (about 4 minutes). Predicted (PERF_NOTES
#             step 38): with the bound within 0.97-1.03 of CSR at every point
#   midsplit  the max_kv_length GPU tests (mla_gluon's launch count added after bd1b82c's
#             suite), then experiments/ws_split.py on middling lists (context 1024, ~384
#             slots) at T 1-16, H 40-128: unsplit, the rule's count, x2-x4, config=None and
#             FlashMLA (about 3 minutes). dense_width.py found gluon_ws x5 at 0.94x the CSR
#             default at T = 4 H64 there, where the rule (WS_SPLIT_MIN_SAVED) does not split
#   mid1024   PERF_NOTES step 39: the middling-list grid (context 1024, T 1/4/16, every grid
#             head, the kernels, default and FlashMLA) with gluon_ws's new split rule, appended
#             to nvidia-h200_grid_ctx1024.csv (then exported on the CPU: sm90_export's runs, this
#             one in place of 08:11:08; about 2 minutes). Predicted: gluon_ws's rule x3 / x4
#             0.85-0.95x FlashMLA at T 1-4
#   mid1024verify  after that export: default against gluon_ws, gluon_ws_small and FlashMLA at
#             the same points, and the bench's default_dense_wide (an engine's 640-wide top-k
#             with lengths and max_kv_length: not yet run on a GPU; a run a token count,
#             about 4 minutes in all). Predicted:
#             default at most 0.95x FlashMLA at T 1-4, default_dense_wide within 1.03 of default
#   lenpub    PERF_NOTES step 40, a patch (experiments/patches/ws_published_len.diff; it was
#             the package at 2ebbb73, where it ran): a large call's consumers read each item's
#             list length from the producer (published with its Q) instead of loading
#             kv_indptr themselves after each epilogue: gluon_ws's GPU tests with it, then
#             experiments/ws_bars_ab.py in turns against the package's file at T = 16384 H64 /
#             H128, GLM H64, T = 4096 H128, T = 1024 H64 and two small-call controls (about 3
#             minutes; carry the xdist wheels). Predicted: T = 16384 H64 / H128 -1.5..-3.5%,
#             GLM H64 -0.5..-1.5%, T = 4096 / 1024 -1..-3%, the small calls +-0.5%
#   lenchoice PERF_NOTES step 41: dense ids with lengths never choose a kernel that reads CSR
#             only (mid1024verify found default_dense_wide at T = 1 H1 3.7x the CSR call: its
#             gluon_mma got the lists packed by torch ops): default, default_dense_len,
#             default_dense_wide, gluon_mma, gluon_ws and FlashMLA at H 1/2/8, T 1/4/16 on
#             middling and whole lists, then the lengths GPU tests (about 7 minutes).
#             Predicted: default_dense_wide and default_dense_len at H1 within 1.10 of default
#             (gluon_ws in gluon_mma's place), elsewhere within 1.03 as before
#   qfirst    PERF_NOTES step 42, a patch (experiments/patches/ws_q_first.diff, on a9f55a1): a
#             program's first Q loaded by gluon_ws's consumers with an evict-first L2 policy
#             (gl.load can say it, Gluon's TMA copy cannot), in small single-split calls; its
#             GPU tests with every small call taking it, then ws_bars_ab.py in turns at whole,
#             middling and short lists (about 2 minutes; carry the xdist wheels)
#   qfirstmap the same patch on and off, each in a bench run with FlashMLA: whole lists at T 48-132
#             x H 48/64/128 (about 90 s; carry .peers)
#   qfirstncu the same patch on and off, and FlashMLA, under Nsight Compute (tile_rate_ncu.py) at
#             whole lists T = 128 H64: L2 hit rates and DRAM bytes (carry .peers)
#   idsahead  PERF_NOTES step 43, a patch (experiments/patches/ws_ids_ahead.diff, on a248625):
#             gluon_ws's producer loads the next pair's slot ids behind its first two halves
#             (its registers 48 -> 64, consumer 1's 224 -> 216); its GPU tests, then
#             ws_bars_ab.py in turns against the package's file at its own 224/48 split and at
#             216/64 (about 3 minutes; carry the xdist wheels; NO_TESTS=1: the first A/B only)
#   regsplit  gluon_ws's register split (CONSUMER_REGS:PRODUCER_REGS, REGSPLITS to choose) against
#             the default 224:48, the same kernel file, in turns (ws_bars_ab.py --after-launch /
#             --before-launch) at the grid's two level points (T = 64 H128, GLM H64) and T = 16384
#             H64 (about 3 minutes)
#   padp      PERF_NOTES step 44, a patch (experiments/patches/ws_padded_p1.diff, on 1c71bc7):
#             consumer 1 stores a short tile's P1 as one [64, 64] tile padded with zeros in
#             registers (three warpgroup barriers fewer); gluon_ws's GPU tests, then an A/B in
#             turns at the short lists' T = 64 / 32 and a whole-list control (carry the xdist
#             wheels; about 2 minutes)
#   callrows  PERF_NOTES step 45, a patch (experiments/patches/ws_call_rows.diff): in a small
#             call whose shares of kv_indices are at most 128 ids a program, gluon_ws's consumer 1
#             asks L2 for its share's KV rows at the start (while Q lands); gluon_ws's GPU tests,
#             then ws_bars_ab.py in turns at the grid's short lists (T = 64 H 64 / 128), whole
#             lists at T 1-16 (split calls) and controls (carry the xdist wheels; about 4 minutes)
#   outdirect PERF_NOTES step 46, a patch (experiments/patches/ws_out_direct.diff): gluon_ws's
#             consumers write O by their own 16-byte stores (each [64, 64] block through the P
#             buffer, no TMA, no wait for it); gluon_ws's GPU tests with it, then ws_bars_ab.py in
#             turns at the grid's short lists, whole lists and the long points (carry the xdist
#             wheels; about 4 minutes)
#   smalltchoice experiments/small_t_choice.py: config=None and gluon_ws / gluon_ws_small
#             forced, in turns, at T 48 / 64 / 96 x H 40 / 48 / 64 on short, middling and whole
#             lists: whether the recorded choice at small T (gluon_ws_small) still holds after
#             step 46 (about 2 minutes)
#   wholemap  gluon_ws, default and FlashMLA on whole lists between the grid's token counts (T 48-132
#             x H 48 / 64 / 128, context 65536), a bench run (about 2 minutes; carry .peers)
#   smallcallrows step 45 for gluon_ws_small, a patch (experiments/patches/ws_small_call_rows.diff):
#             its consumer asks L2 for a small call's KV rows while the first Q lands; its GPU
#             tests, then ws_bars_ab.py --kernel gluon_ws_small in turns (carry the xdist wheels;
#             about 2 minutes)
#   fp8outdirect step 46 for gluon_ws_fp8, a patch (experiments/patches/ws_fp8_out_direct.diff):
#             its consumers store O themselves (OUT_DIRECT), SPARSE_MLA_FP8_OUT=tma the old way;
#             gluon_ws's and gluon_ws_fp8's GPU tests with it, then experiments/fp8_out_ab.py in
#             turns (carry the xdist wheels; about 3 minutes; the patch applies on c4e9b62, whose
#             run found 2-3% at T = 64 and +2-2.7% at T = 16384: step 47 keeps it to calls of
#             one item a program)
#   fp8outsmall step 47 as the package has it: gluon_ws_fp8 stores O itself where each program
#             runs one item (OUT_DIRECT, launch.single_item; at 19d0616 in every small call),
#             by TMA in the others; gluon_ws's and gluon_ws_fp8's GPU
#             tests, then experiments/fp8_out_ab.py in turns against TMA in every call (carry
#             the xdist wheels; about 3 minutes)
#   wstests   the GPU tests of every gluon_ws path and gluon_ws_fp8's (ws_gpu_tests) at this
#             commit, as the package has them (carry the xdist wheels; about 2 minutes)
#   wsprofile sparse-mla profile --context 65536 of gluon_ws at whole lists T = 128 H64 and T = 64
#             H128 (stalls per source line), then tests/test_profile.py's GPU tests (about 3 min)
#   l2split   step 36's policies one at a time (experiments/ws_l2_256b.py --variants rows_last
#             q_first; prepared in the thirtieth session, not run): whole lists T = 128 H64 and
#             T = 64 H128, T = 16384 H128 (about 4 minutes). Predicted: rows_last holds the
#             whole-list gain (the rows' reuse across tokens), q_first nothing beyond noise
#   smallsink step 29, a patch (experiments/patches/ws_small_sink_early.diff): gluon_ws_small's
#             GPU tests with it, then ws_bars_ab.py --kernel gluon_ws_small against the package
#             file at T = 64 H4-48, T = 256, 16384 and GLM H16 (under 5 minutes)
#   tilerate  PERF_NOTES "No cliffs" step 21 (twenty-fourth session): Nsight Compute's full set
#             and warp-stall samples of gluon_ws and FlashMLA at whole lists, T = 64, H128 (one
#             wave of 128 items of 1152 slots, where FlashMLA's tile is 6% shorter), side by side
#             (experiments/tile_rate_ncu.py; the details and raw pages come back as CSV; about
#             75 s a point with FlashMLA's build), then the same at the grid's T = 64 H128 (short
#             lists, the grid's one point at parity); TILERATE_CONTEXTS picks (default "0 65536";
#             65536 ran on c435418: data/bench/ncu_tile_rate_h200_c435418/)
#   t32       chunk sizes between the measured token counts (twenty-third session): whole
#             lists and whole short prompts at T = 32, middling lists (context 1024) at T = 32,
#             64 and 256, every grid head, appended to the committed CSVs, then the sm90 export
#             with them (the latest two ctx65536 and ctx1024 runs, every short-list run); the
#             file, the three CSVs and the log come back (under 5 minutes). Why: at T = 32 on
#             middling lists config=None is 1.04-1.10x the fastest package kernel at H 1-4 and
#             80-128 (run 08:11:08, nvidia-h200_grid_ctx1024_unpaired.csv): no choice was
#             measured there. After the export: `python experiments/choice_diff.py` here (every
#             committed point the export moves, none may go to a kernel its run timed slower)
#   lists     config=None with the shipped choice by list length, against the kernels and
#             FlashMLA padded, at the steps of long requests (--context 65536, T 1-16, the
#             heads of ca4e873's verify run) and at middling lists (--context 1024); predicted:
#             default within 1.02 of the fastest package kernel at every point, at H 20-80 T = 1-4
#             the forced gluon_mma times (0.79-0.83 of FlashMLA); under 3 minutes (the
#             twentieth session ran experiments/list_length_gpu_check.sh instead, which also
#             measured the short and middling lists of H 4, 24, 48 and 96 and re-exported)
#   abstail   experiments/max_abs_tail.py: how often each kernel's max abs error passes 2x
#             PyTorch's over seeded random sinks, at the few-heads case the eighteenth
#             session's suite failed once (under 2 minutes)
#   split     experiments/ws_small_split.py: gluon_ws_small with a token's list split over 2 or
#             3 programs at T = 64 / 256 against the package kernel and FlashMLA (under 4 min)
#   tail      the twelfth session's test_gpu_ws_short_last_tile (written after its GPU time ran
#             out; the same cases ran as a one-token sweep) and the gluon_ws reference tests
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
OUT=${OUT:-/tmp/pending_gpu_checks}
STEP=${STEP:-all}
# The commit the logs and rows are named by: give it (the device's copy of the repository keeps
# the git HEAD of the session's first call while its working tree is the latest: the
# twenty-first session's suite log read 6e30932 for 4cde5ef's tree)
COMMIT=${COMMIT:?"give COMMIT=<sha> (the device's git HEAD can be stale)"}
mkdir -p "$OUT"
# pytest-xdist and execnet from .whl into /tmp/site (the steps that run tests with -n);
# wheels: every wheel of .whl (the workbook's too: ipywidgets, nbformat, nbclient)
xdist() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/pytest_xdist-*.whl .whl/execnet-*.whl > /dev/null 2>&1
}
wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > /dev/null 2>&1
}
# The GPU tests of every gluon_ws path and of gluon_ws_fp8 (its consumers), with every kernel's
# tests of softmax scales 0 and below (scale_of_zero), for a kernel change;
# log gpu_tests_ws_$1_<commit>.log
ws_gpu_tests() {
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_kernels_gpu.py tests/test_fp8_prefill.py tests/test_dense_ids.py tests/test_gluon.py \
    -k "(gluon_ws and not small) or ws_knobs or small_call_order or short_last or ws_prefill or late_max or scale_of_zero" \
    > "$OUT/gpu_tests_ws_$1_${COMMIT:0:7}.log" 2>&1
  echo "$1 tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_$1_${COMMIT:0:7}.log"
}
# experiments/ws_bars_ab.py against /tmp/hopper_ws_before.py at the heavy and the latency
# points, twice each, in a Triton cache of its own (see bars); log ws_$1_ab_h200_<commit>.log
# ($1: the step's name; any further arguments replace the default --before and --points)
ws_ab() {
  local name=$1; shift
  [ $# -gt 0 ] || set -- --before /tmp/hopper_ws_before.py \
    --points 64:128:1024 16384:64:512 16384:128:1024 glm:16384:64:2048
  TRITON_CACHE_DIR=/tmp/${name}_triton_cache PYTHONPATH=$PWD timeout ${AB_TIME:-300} \
    python3 experiments/ws_bars_ab.py --repeat 2 "$@" \
    > "$OUT/ws_${name}_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "$name ab: rc=$?"; cat "$OUT/ws_${name}_ab_h200_${COMMIT:0:7}.log"
}
# One grid run of the package kernels, default and FlashMLA, appended to the CSV its arguments
# name (--out), its log to $OUT/$1_<commit>.log
grid_run() {
  local name=$1; shift
  local limit=${GRID_LIMIT:-180}  # seconds a run may time points (the bench's --time-limit)
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout $((limit + 20)) \
    python3 -m sparse_mla.cli bench --grid --no-ceilings --time-limit $limit \
    --providers gluon_mma,gluon_wgmma,gluon_ws_small,gluon_ws,default,flashmla \
    --commit "${COMMIT:0:7}" "$@" >> "$OUT/${name}_${COMMIT:0:7}.log" 2>&1
  echo "$name $*: rc=$?"
}
# Each run's summary (lab.grid.grid_summary) of the bench CSV $1
run_summary() {
  PYTHONPATH=$PWD python3 -c "from sparse_mla import bench; from sparse_mla.lab.grid import \
grid_summary; r = bench.read_rows('$1'); \
[print(grid_summary(r, t)) for t in sorted({x['timestamp'] for x in r})]"
}
apply_patch() { git apply "$1" 2> /dev/null || patch -p1 -s < "$1"; }  # the device has no .git
# gluon_ws's files saved (/tmp/hopper_ws_before.py is also an A/B's --before), then patch $1
# applied; unpatch_ws puts the saved files back (the package's again)
patch_ws() {
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py &&
    cp sparse_mla/gluon/launch.py /tmp/launch_before.py && apply_patch "$1"
}
unpatch_ws() {
  cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py
  cp /tmp/launch_before.py sparse_mla/gluon/launch.py
}
# The shipped sm90 choice exported from the committed runs: the grid of 391741a, the latest $1
# runs of the whole-list (ctx65536) and middling-list (ctx1024) files (each run covers every
# grid head; the twenty-third session's middling run, 08:11:08, replaced the five before it),
# every short-list run; the export's stderr appended to $2, the file copied to $OUT. MID_RUNS:
# the middling-list runs' count when it differs (5 since the thirty-first session's three runs
# of T 1/4/16, e5f79cf, replaced 08:11:08 beside 09:29:28 and 17:19:26).
sm90_export() {
  local D=data/bench/nvidia-h200 runs
  runs=$(PYTHONPATH=$PWD python3 - $D "$1" "${MID_RUNS:-}" <<'PYEOF'
import csv, sys
d, n = sys.argv[1], int(sys.argv[2])
def runs(name):
    try:
        with open(f"{d}_{name}.csv", newline="") as f:
            return sorted({r["timestamp"] for r in csv.DictReader(f) if r.get("T")})
    except FileNotFoundError:  # grid_mid_t: none before the first tmid run
        return []
m = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else n
out = ["2026-12-02T12:41:51+00:00", *runs("grid_ctx65536")[-n:], *runs("grid_ctx1024")[-m:]]
for name in ("grid_ctx64", "grid_ctx256", "grid_small_t", "grid_mid_t"):
    out += runs(name)
print(" ".join(f"--run {r}" for r in out))
PYEOF
)
  echo "export: $runs"
  local mid=""; [ -f ${D}_grid_mid_t.csv ] && mid=${D}_grid_mid_t.csv
  PYTHONPATH=$PWD python3 -m sparse_mla.cli export ${D}_grid.csv ${D}_grid_ctx65536.csv \
    ${D}_grid_ctx64.csv ${D}_grid_ctx256.csv ${D}_grid_ctx1024.csv ${D}_grid_small_t.csv $mid \
    --arch sm90 --root sparse_mla/tuned --kernel-choice $runs > /dev/null 2>> "$2"
  echo "export: rc=$?"
  cp sparse_mla/tuned/sm90/triton/attention/sparse_attention_dsv4/DEFAULT.json "$OUT/sm90_DEFAULT.json"
}
want() { [ "$STEP" = "$1" ] || { [ "$STEP" = all ] && case $1 in profile|smem) true;; *) false;; esac; }; }
if want plans; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_plans_fp8.py \
    > "$OUT/plans_fp8.log" 2>&1
  echo "plans: rc=$?"; tail -n 3 "$OUT/plans_fp8.log"
fi
if want workbook; then
  if [ -d .whl ]; then
    wheels
    export PYTHONPATH=$PWD:/tmp/site
  fi
  mkdir -p "$OUT/nb"
  timeout 200 python3 scripts/run_notebooks.py notebooks/03_sweep_and_export.ipynb \
    notebooks/05_gluon_mla.ipynb --out "$OUT/nb" > "$OUT/notebooks.log" 2>&1
  echo "workbook: rc=$?"; rm -f "$OUT"/nb/*.ipynb; tail -n 3 "$OUT/notebooks.log"
fi
if want fp8host; then
  OUT="$OUT/h26d" timeout 200 bash experiments/h26d_gpu_check.sh > /dev/null 2>&1
  echo "fp8host: rc=$?"
fi
if want host; then
  timeout 90 python3 scripts/host_cost.py --plans both --shapes 64x16384 > "$OUT/host_cost.log" 2>&1
  echo "host: rc=$?"; tail -n 14 "$OUT/host_cost.log"
fi
if want profile; then
  timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_profile.py \
    > "$OUT/profile_test.log" 2>&1
  echo "profile: rc=$?"; tail -n 5 "$OUT/profile_test.log"
fi
if want smem; then
  OUT="$OUT/smem" PY=python3 STEP=ncu timeout 160 bash experiments/h28fp8s_gpu_check.sh \
    > /dev/null 2>&1
  echo "smem: rc=$?"; ls "$OUT/smem"
fi
if want nb05; then
  if [ -d .whl ]; then wheels; fi
  PYTHONPATH=$PWD:/tmp/site timeout 400 python3 scripts/run_notebooks.py \
    notebooks/05_gluon_mla.ipynb --out "$OUT/nb05" > "$OUT/nb05.log" 2>&1
  echo "nb05: rc=$?"; rm -f "$OUT"/nb05/*.ipynb; tail -n 3 "$OUT/nb05.log"
fi
if want window; then
  timeout 110 python3 experiments/host_window.py > "$OUT/host_window.log" 2>&1
  echo "window: rc=$?"; cat "$OUT/host_window.log"
fi
if want fp8bench; then
  # peer (b)'s decode binding, built before the bench so its build is not in the bench's limit
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 330 \
    python3 -c "import flash_mla; flash_mla._build_decode()" > "$OUT/peer_b_build.log" 2>&1
  echo "peer (b) build: rc=$?"; tail -n 5 "$OUT/peer_b_build.log"
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 200 \
    python3 -m sparse_mla.cli bench --fp8 --time-limit 150 --commit "$COMMIT" \
    --out "$OUT/nvidia-h200_fp8.csv" > "$OUT/nvidia-h200_fp8_${COMMIT:0:7}.log" 2>&1
  echo "fp8bench: rc=$?"; grep "^\[" "$OUT/nvidia-h200_fp8_${COMMIT:0:7}.log"
fi
if want fp8lengths; then  # gluon_ws_small_fp8 reading dense ids with lengths: the FP8 entry's
  # config=None on FlashMLA's dense ids with their lengths against CSR, small T where the
  # heads-on-N FP8 kernel is the default (no peer built: the package's own providers)
  PYTHONPATH=$PWD timeout 200 python3 -m sparse_mla.cli bench --fp8 --heads 8,16,32,64 \
    --tokens 64,256,1024,16384 --providers fp8_default,fp8_default_dense_len --time-limit 150 \
    --commit "$COMMIT" --out "$OUT/nvidia-h200_fp8_lengths.csv" \
    > "$OUT/nvidia-h200_fp8_lengths_${COMMIT:0:7}.log" 2>&1
  echo "fp8lengths: rc=$?"; grep "^\[" "$OUT/nvidia-h200_fp8_lengths_${COMMIT:0:7}.log"
fi
if want trims; then
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 \
    tests/test_plans.py tests/test_op.py tests/test_plans_fp8.py tests/test_op_fp8.py > "$OUT/gpu_tests_trims_${COMMIT:0:7}.log" 2>&1
  echo "trims plan/op tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_trims_${COMMIT:0:7}.log"
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 \
    tests/test_gluon.py -k "mma or split or counter" >> "$OUT/gpu_tests_trims_${COMMIT:0:7}.log" 2>&1
  echo "trims split tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_trims_${COMMIT:0:7}.log"
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 120 \
    python3 experiments/host_split.py > "$OUT/host_split_${COMMIT:0:7}.log" 2>&1
  echo "trims host_split: rc=$?"
fi
if want turns; then
  # dense: the thirteenth session's shapes and kernels with FlashMLA in the same turns
  dense="--kernels default,triton,gluon_mma,gluon_wgmma,gluon_ws,gluon_ws_small,flashmla"
  dense="$dense --shapes 16x4,64x4,128x4,16x1024,64x1024,16x16384,64x16384"
  for mode in ${TURNS_MODES:-dense fp8}; do
    flags=$([ $mode = fp8 ] && echo --fp8 --shapes 16x4,64x4,128x4,16x16384,64x16384 || echo $dense)
    PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 270 \
      python3 scripts/host_cost.py --turns 8 $flags > "$OUT/host_cost_turns_${mode}_${COMMIT:0:7}.log" 2>&1
    echo "turns $mode: rc=$?"; grep -c "min" "$OUT/host_cost_turns_${mode}_${COMMIT:0:7}.log"
  done
fi
if want dense; then
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 \
    tests/test_plans.py tests/test_dense_ids.py tests/test_plans_fp8.py tests/test_fp8_prefill.py \
    -k "dense_ids_replays or default_on_dense or bitwise or every_kernel_dense or fp8_replays or dense" \
    > "$OUT/gpu_tests_dense_plans_${COMMIT:0:7}.log" 2>&1
  echo "dense plan tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_dense_plans_${COMMIT:0:7}.log"
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 200 \
    python3 scripts/host_cost.py --turns 6 --ids dense \
    --kernels default,gluon_ws_small,gluon_ws,triton,gluon_mma,gluon_wgmma,flashmla \
    --shapes 16x4,128x4,64x1024,16x16384 > "$OUT/host_cost_turns_dense_ids_${COMMIT:0:7}.log" 2>&1
  echo "dense turns: rc=$?"; cat "$OUT/host_cost_turns_dense_ids_${COMMIT:0:7}.log"
  PYTHONPATH=$PWD timeout 150 python3 scripts/host_cost.py --turns 6 --ids dense --fp8 \
    --shapes 16x4,64x4,16x16384 > "$OUT/host_cost_turns_fp8_dense_ids_${COMMIT:0:7}.log" 2>&1
  echo "fp8 dense turns: rc=$?"; cat "$OUT/host_cost_turns_fp8_dense_ids_${COMMIT:0:7}.log"
fi
if want suite; then
  wheels  # the lab and notebook tests need the workbook's wheels (the fifteenth's first run lacked them)
  SPARSE_MLA_PROPERTY_SCALE=0.2 PYTHONPATH=$PWD:/tmp/site timeout 540 python3 -m pytest -v -m gpu \
    -p no:cacheprovider -n 12 --durations=25 -rfE --tb=short tests \
    2>&1 | grep -v "PytestBenchmark\|warner(" > "$OUT/gpu_suite_${COMMIT:0:7}.log"
  echo "suite: $(grep -c ' PASSED ' "$OUT/gpu_suite_${COMMIT:0:7}.log") passed," \
    "$(grep -c ' FAILED \| ERROR ' "$OUT/gpu_suite_${COMMIT:0:7}.log") failed or errors"
  grep " FAILED \| ERROR " "$OUT/gpu_suite_${COMMIT:0:7}.log" | head -n 20; tail -n 3 "$OUT/gpu_suite_${COMMIT:0:7}.log"
fi
if want bars; then  # in the package since the sixteenth session: the A/B against ce5f459's kernel
  git show ce5f459:sparse_mla/gluon/hopper_ws.py > /tmp/hopper_ws_before.py || { echo "bars: no git"; exit 1; }
  ws_gpu_tests bars
  # A cache of its own: Triton's cache key ignores the file name, so the copy's kernel would
  # stand in for the package's in later runs (and name the copy in line info)
  TRITON_CACHE_DIR=/tmp/bars_triton_cache PYTHONPATH=$PWD timeout 150 \
    python3 experiments/ws_bars_ab.py --before /tmp/hopper_ws_before.py \
    > "$OUT/ws_bars_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "bars ab: rc=$?"; cat "$OUT/ws_bars_ab_h200_${COMMIT:0:7}.log"
fi
if want ids; then  # step 14: the tiles' slot ids published by the producer
  cp .ab_base/hopper_ws_f53f744.py /tmp/hopper_ws_before.py || exit 1
  ws_gpu_tests ids
  ws_ab ids
fi
if want lazy; then  # step 15 (in the package since the eighteenth session): the A/B against 05f2f12
  cp .ab_base/hopper_ws_05f2f12.py /tmp/hopper_ws_before.py || exit 1
  ws_gpu_tests lazy
  ws_ab lazy
fi
if want sinkearly; then  # step 27: the sink logits loaded at an item's start, not in its epilogue
  cp .ab_base/hopper_ws_5eeb10a.py /tmp/hopper_ws_before.py || exit 1
  ws_gpu_tests sinkearly
  ws_ab sinkearly --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:1024 64:96:1024 \
    256:64:1024 16384:128:1024 glm:16384:64:2048 ctx65536:4:128:1024
  # where the grid's T = 64 H128 waits, by source line (ncu), with the change
  timeout 200 python3 -m sparse_mla.cli profile --kernel gluon_ws --heads 128 --tokens 64 \
    --top 45 > "$OUT/profile_gluon_ws_t64_h128_${COMMIT:0:7}.log" 2>&1
  echo "profile: rc=$?"; head -n 60 "$OUT/profile_gluon_ws_t64_h128_${COMMIT:0:7}.log"
fi
if want qprologue; then  # step 28: the program's first Q sent from the kernel's prologue
  # the clock stamps on the package kernel first (with the kernel's entry: how long the
  # prologue and the partitions' dispatch take before the producer starts), then the patch
  TRITON_CACHE_DIR=/tmp/clk_pkg PYTHONPATH=$PWD timeout 120 python3 experiments/ws_clk_now.py \
    > "$OUT/ws_clk_now_h200_${COMMIT:0:7}.log" 2>&1
  echo "clk (package): rc=$?"; cat "$OUT/ws_clk_now_h200_${COMMIT:0:7}.log"
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py || exit 1
  apply_patch experiments/patches/ws_q_prologue.diff || exit 1
  ws_gpu_tests qprologue
  ws_ab qprologue --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:1024 \
    256:64:1024 16384:128:1024 ctx65536:4:128:1024
  TRITON_CACHE_DIR=/tmp/clk_qp PYTHONPATH=$PWD timeout 120 python3 experiments/ws_clk_now.py \
    > "$OUT/ws_clk_now_qprologue_h200_${COMMIT:0:7}.log" 2>&1
  echo "clk (patched): rc=$?"; cat "$OUT/ws_clk_now_qprologue_h200_${COMMIT:0:7}.log"
  cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py
fi
if want qprologuepf; then  # step 30: step 28 with the first range's line and the ids asked first
  # the stamps (with the first tiles' landing) on the package, step 28 and step 30, then
  # step 30 against the package in turns (its GPU tests only if it wins)
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py || exit 1
  for v in package ws_q_prologue ws_q_prologue_pf; do
    [ $v = package ] || apply_patch experiments/patches/$v.diff || exit 1
    TRITON_CACHE_DIR=/tmp/clk_$v PYTHONPATH=$PWD timeout 120 python3 experiments/ws_clk_now.py \
      > "$OUT/ws_clk_now_${v}_h200_${COMMIT:0:7}.log" 2>&1
    echo "clk ($v): rc=$?"; cat "$OUT/ws_clk_now_${v}_h200_${COMMIT:0:7}.log"
    cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py
  done
  apply_patch experiments/patches/ws_q_prologue_pf.diff || exit 1
  ws_ab qprologuepf --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:1024 \
    64:96:1024 256:64:1024 16384:128:1024 ctx65536:4:128:1024
  cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py
fi
if want rangeprologue; then  # step 31: only the first range's line and the ids asked from the prologue
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py || exit 1
  apply_patch experiments/patches/ws_range_prologue.diff || exit 1
  TRITON_CACHE_DIR=/tmp/clk_rp PYTHONPATH=$PWD timeout 120 python3 experiments/ws_clk_now.py \
    > "$OUT/ws_clk_now_rangeprologue_h200_${COMMIT:0:7}.log" 2>&1
  echo "clk (patched): rc=$?"; cat "$OUT/ws_clk_now_rangeprologue_h200_${COMMIT:0:7}.log"
  ws_ab rangeprologue --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:1024 \
    64:96:1024 256:64:1024 16384:128:1024 ctx65536:4:128:1024
  cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py
fi
if want flushkind; then  # twenty-eighth session: does a small call's time include L2's writebacks?
  for f in write read; do
    PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 400 \
      python3 experiments/small_t_floor.py --flush $f --points 64:64 64:128 256:64 \
      > "$OUT/small_t_floor_flush_${f}_h200_${COMMIT:0:7}.log" 2>&1
    echo "flush $f: rc=$?"; cat "$OUT/small_t_floor_flush_${f}_h200_${COMMIT:0:7}.log"
  done
  ws_gpu_tests head  # the package's gluon_ws paths at this commit
fi
if want l2b256; then  # step 32: the gathers' cp.async asking L2 for 256-byte blocks (a PTX rewrite)
  TRITON_ALWAYS_COMPILE=1 PYTHONPATH=$PWD timeout 300 python3 experiments/ws_l2_256b.py \
    --points ctx65536:128:64:512 ctx65536:64:128:1024 64:128:1024 256:64:512 16384:128:1024 \
    > "$OUT/ws_l2_256b_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "l2b256: rc=$?"; cat "$OUT/ws_l2_256b_ab_h200_${COMMIT:0:7}.log"
fi
if want l2policy; then  # step 36: FlashMLA's L2 policies (rows evict_last, Q evict_first) by PTX rewrite
  TRITON_ALWAYS_COMPILE=1 PYTHONPATH=$PWD timeout 300 python3 experiments/ws_l2_256b.py \
    --variants rows_last+q_first --points ctx65536:128:64:512 ctx65536:64:128:1024 \
    64:128:1024 16384:128:1024 > "$OUT/ws_l2_policy_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "l2policy: rc=$?"; cat "$OUT/ws_l2_policy_ab_h200_${COMMIT:0:7}.log"
fi
if want nowait; then  # step 37, a patch since: no wait for the last output reads before the end
  cp .ab_base/hopper_ws_before.py /tmp/hopper_ws_before.py || exit 1  # 2d17d54's, the wait kept
  apply_patch experiments/patches/ws_nowait_last_read.diff || exit 1
  ws_gpu_tests nowait
  ws_ab nowait --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:512 256:64:512 \
    ctx65536:64:128:1024 16384:128:1024
  cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py  # the package's file again
fi
if want ctxlengths; then  # whole lists at small T with FlashMLA's dense ids and their lengths
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 150 \
    python3 -m sparse_mla.cli bench --grid --context 65536 --tokens 1,4,16,64,128 \
    --heads 8,16,32,64,128 --providers default,default_dense_len,flashmla --time-limit 110 \
    --commit "$COMMIT" --out "$OUT/nvidia-h200_ctx_lengths.csv" \
    > "$OUT/nvidia-h200_ctx_lengths_${COMMIT:0:7}.log" 2>&1
  echo "ctxlengths: rc=$?"; tail -n 4 "$OUT/nvidia-h200_ctx_lengths_${COMMIT:0:7}.log"
fi
if want l2split; then  # step 36's two policies apart: which one holds the 1.2-1.6%
  TRITON_ALWAYS_COMPILE=1 PYTHONPATH=$PWD timeout 400 python3 experiments/ws_l2_256b.py \
    --variants rows_last q_first --points ctx65536:128:64:512 ctx65536:64:128:1024 \
    16384:128:1024 > "$OUT/ws_l2_split_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "l2split: rc=$?"; cat "$OUT/ws_l2_split_ab_h200_${COMMIT:0:7}.log"
fi
if want midsplit; then  # gluon_ws split at middling lists: is WS_SPLIT_MIN_SAVED too cautious?
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
    tests/test_dense_lengths.py -k "max_kv_length" > "$OUT/gpu_tests_max_kv_length_${COMMIT:0:7}.log" 2>&1
  echo "max_kv_length tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_max_kv_length_${COMMIT:0:7}.log"
  WS_SPLIT_CONTEXT=1024 WS_SPLIT_EXTRA=2,3,4 PYTHONPATH=$PWD:$PWD/.peers:$PWD/experiments \
    FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 300 python3 experiments/ws_split.py \
    1x64 2x64 4x64 8x64 16x64 1x128 2x128 4x128 8x128 16x128 4x40 8x40 \
    > "$OUT/ws_split_ctx1024_h200_${COMMIT:0:7}.log" 2>&1
  echo "midsplit: rc=$?"; cat "$OUT/ws_split_ctx1024_h200_${COMMIT:0:7}.log"
fi
if want mid1024; then  # step 39: the split rule's change measured at middling lists
  D=data/bench/nvidia-h200 GRID_LIMIT=100
  grid_run mid1024 --context 1024 --tokens 1,4,16 --out ${D}_grid_ctx1024.csv
  cp ${D}_grid_ctx1024.csv "$OUT/"; tail -n 52 "$OUT/mid1024_${COMMIT:0:7}.log" | cut -c1-220
fi
if want qfirst; then  # step 42, a patch: a program's first Q loaded by its consumers, evict-first
  patch_ws experiments/patches/ws_q_first.diff || exit 1
  xdist
  SPARSE_MLA_QF_MIN=0 SPARSE_MLA_QF_ITEMS=0 PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest \
    -q -m gpu -p no:cacheprovider -n 12 tests/test_kernels_gpu.py tests/test_dense_ids.py tests/test_gluon.py \
    -k "(gluon_ws and not small) or ws_knobs or small_call_order or short_last or ws_prefill" \
    > "$OUT/gpu_tests_ws_qfirst_${COMMIT:0:7}.log" 2>&1
  echo "qfirst tests (every small call): rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_qfirst_${COMMIT:0:7}.log"
  SPARSE_MLA_QF_MIN=0 SPARSE_MLA_QF_ITEMS=0 AB_TIME=400 ws_ab qfirst_map \
    --before /tmp/hopper_ws_before.py --points ctx65536:48:128:1024 ctx65536:56:128:1024 \
    ctx65536:66:128:1024 ctx65536:96:64:512 ctx65536:112:64:512 ctx65536:192:64:512 \
    ctx65536:256:64:512 ctx65536:64:96:1024 ctx65536:64:64:512 ctx1024:64:128:1024 \
    ctx1024:128:64:512 256:64:512 512:64:512
  unpatch_ws
fi
if want qfirstmap; then  # step 42: gluon_ws with and without the patch against FlashMLA, whole lists
  patch_ws experiments/patches/ws_q_first.diff || exit 1
  for mode in on off; do  # on: every small single-split call; off: none (the package's kernel)
    items=0; [ $mode = off ] && items=1000000000
    SPARSE_MLA_QF_MIN=0 SPARSE_MLA_QF_ITEMS=$items PYTHONPATH=$PWD:$PWD/.peers \
      FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 250 python3 -m sparse_mla.cli bench --grid \
      --no-ceilings --context 65536 --tokens 48,64,96,112,128,132 --heads 48,64,128 --no-glm \
      --providers gluon_ws,flashmla --time-limit 200 --commit "${COMMIT:0:7}" \
      --out "$OUT/qfirst_${mode}.csv" >> "$OUT/qfirst_map_${mode}_${COMMIT:0:7}.log" 2>&1
    echo "qfirstmap $mode: rc=$?"
  done
  PYTHONPATH=$PWD python3 - "$OUT" <<'PYEOF'
import csv, sys
def load(m):
    d = {}
    for r in csv.DictReader(open(f"{sys.argv[1]}/qfirst_{m}.csv")):
        if r.get("T") and r["ms"]:
            d.setdefault((int(r["T"]), int(r["H"])), {})[r["provider"][:8]] = float(r["ms"])
    return d
on, off = load("on"), load("off")
for k in sorted(on):
    a, b = on[k], off.get(k, {})
    if "gluon_ws" in a and "gluon_ws" in b:
        print(f"T={k[0]} H={k[1]}: on/FlashMLA {a['gluon_ws'] / a['flashmla']:.3f}, "
              f"off/FlashMLA {b['gluon_ws'] / b['flashmla']:.3f}, on/off {a['gluon_ws'] / b['gluon_ws']:.3f}")
PYEOF
  unpatch_ws
fi
if want qfirstncu; then  # step 42: Nsight Compute at whole lists T = 128 H64, the patch on / off, FlashMLA
  patch_ws experiments/patches/ws_q_first.diff || exit 1
  for mode in on off; do
    items=0; prov=gluon_ws,flashmla
    [ $mode = off ] && { items=1000000000; prov=gluon_ws; }
    SPARSE_MLA_QF_MIN=0 SPARSE_MLA_QF_ITEMS=$items PYTHONPATH=$PWD:$PWD/.peers \
      FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 280 python3 experiments/tile_rate_ncu.py \
      --out /tmp/qf_ncu_$mode --T 128 --H 64 --context 65536 --providers $prov \
      > "$OUT/qfirst_ncu_${mode}_${COMMIT:0:7}.log" 2>&1
    echo "qfirstncu $mode: rc=$?"
    grep -i "duration\|hit rate\|dram__bytes\|DRAM Throughput\|Memory Throughput\|^launches" \
      "$OUT/qfirst_ncu_${mode}_${COMMIT:0:7}.log" | head -20
  done
  unpatch_ws
fi
if want wsprofile; then  # step 42's follow-up: gluon_ws's stalls per source line on whole lists
  for pt in "128 64" "64 128"; do
    set -- $pt
    timeout 200 python3 -m sparse_mla.cli profile --kernel gluon_ws --tokens $1 --heads $2 \
      --context 65536 --top 45 > "$OUT/profile_gluon_ws_ctx65536_t$1_h$2_${COMMIT:0:7}.log" 2>&1
    echo "wsprofile T=$1 H=$2: rc=$?"; head -n 22 "$OUT/profile_gluon_ws_ctx65536_t$1_h$2_${COMMIT:0:7}.log" | cut -c1-150
  done
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_profile.py \
    > "$OUT/gpu_tests_profile_${COMMIT:0:7}.log" 2>&1
  echo "profile tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_profile_${COMMIT:0:7}.log"
fi
if want idsahead; then  # step 43, a patch: the producer loads the next pair's ids a pair ahead
  patch_ws experiments/patches/ws_ids_ahead.diff || exit 1  # also 216/64 registers
  [ -n "${NO_TESTS:-}" ] || ws_gpu_tests idsahead
  AB_TIME=420 ws_ab idsahead --before /tmp/hopper_ws_before.py \
    --before-launch '{"CONSUMER_REGS": 224, "PRODUCER_REGS": 48}' --points ctx65536:128:64:512 \
    ctx65536:64:128:1024 ctx65536:96:64:512 64:128:1024 256:64:512 16384:64:512 16384:128:1024 \
    glm:16384:64:2048
  [ -n "${NO_TESTS:-}" ] || AB_TIME=200 ws_ab idsahead_samesplit --before /tmp/hopper_ws_before.py \
    --before-launch '{"CONSUMER_REGS": 216, "PRODUCER_REGS": 64}' --points ctx65536:128:64:512 \
    64:128:1024 16384:128:1024
  unpatch_ws
fi
if want regsplit; then  # gluon_ws's register split: candidates against the default (224/48), in turns
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_same.py  # the same kernel, another split
  for split in ${REGSPLITS:-216:56 208:56 216:48 224:40 200:56}; do
    c=${split%:*}; p=${split#*:}
    AB_TIME=150 ws_ab regsplit_${c}_${p} --before /tmp/hopper_ws_same.py \
      --after-launch "{\"CONSUMER_REGS\": $c, \"PRODUCER_REGS\": $p}" \
      --before-launch '{"CONSUMER_REGS": 224, "PRODUCER_REGS": 48}' \
      --points 64:128:1024 glm:16384:64:2048 16384:64:512 > /dev/null
    grep "after / before" "$OUT/ws_regsplit_${c}_${p}_ab_h200_${COMMIT:0:7}.log" | sed "s/^/$c\/$p: /" | cut -c1-160
  done
fi
if want padp; then  # step 44, a patch: a short tile's P1 in one store (no barriers between slices)
  patch_ws experiments/patches/ws_padded_p1.diff || exit 1
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_kernels_gpu.py tests/test_dense_ids.py tests/test_gluon.py \
    -k "short_last or (gluon_ws and not small and not fp8)" \
    > "$OUT/gpu_tests_ws_padp_${COMMIT:0:7}.log" 2>&1
  echo "padp tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_padp_${COMMIT:0:7}.log"
  AB_TIME=120 ws_ab padp --before /tmp/hopper_ws_before.py \
    --points 64:128:1024 64:64:512 32:128:1024 ctx65536:64:128:1024
  unpatch_ws
fi
if want callrows; then  # step 45, a patch: the call's KV rows asked of L2 at the start
  patch_ws experiments/patches/ws_call_rows.diff || exit 1
  [ -n "${NO_TESTS:-}" ] || ws_gpu_tests callrows
  AB_TIME=330 ws_ab callrows --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:512 \
    32:128:1024 ctx65536:1:128:1024 ctx65536:4:64:512 ctx65536:16:128:1024 ctx1024:64:128:1024 \
    ctx65536:64:128:1024
  unpatch_ws
fi
if want outdirect; then  # step 46, a patch: O by the consumers' own stores, not TMA
  patch_ws experiments/patches/ws_out_direct.diff || exit 1
  [ -n "${NO_TESTS:-}" ] || ws_gpu_tests outdirect
  AB_TIME=330 ws_ab outdirect --before /tmp/hopper_ws_before.py --points 64:128:1024 64:64:512 \
    256:64:512 ctx65536:64:128:1024 ctx65536:128:64:512 16384:64:512 glm:16384:64:2048
  unpatch_ws
fi
if want smalltchoice; then  # after step 46: gluon_ws against gluon_ws_small at small T, 33-64 heads
  PYTHONPATH=$PWD timeout 400 python3 experiments/small_t_choice.py \
    > "$OUT/small_t_choice_h200_${COMMIT:0:7}.log" 2>&1
  echo "smalltchoice: rc=$?"; cat "$OUT/small_t_choice_h200_${COMMIT:0:7}.log"
fi
if want wholemap; then  # whole lists at one item an SM: the package against FlashMLA
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 250 python3 -m \
    sparse_mla.cli bench --grid --no-ceilings --context 65536 --tokens 48,64,96,112,128,132 \
    --heads 48,64,128 --no-glm --providers gluon_ws,default,flashmla --time-limit 200 \
    --commit "${COMMIT:0:7}" --out "$OUT/whole_map.csv" > "$OUT/whole_map_${COMMIT:0:7}.log" 2>&1
  echo "wholemap: rc=$?"; grep "T=" "$OUT/whole_map_${COMMIT:0:7}.log" | cut -c1-200
fi
if want smallcallrows; then  # step 45 for gluon_ws_small (a patch)
  cp sparse_mla/gluon/hopper_ws_small.py /tmp/hopper_ws_small_before.py
  apply_patch experiments/patches/ws_small_call_rows.diff || exit 1
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_kernels_gpu.py tests/test_dense_ids.py tests/test_gluon.py \
    -k "gluon_ws_small and not fp8" > "$OUT/gpu_tests_ws_small_callrows_${COMMIT:0:7}.log" 2>&1
  echo "smallcallrows tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_small_callrows_${COMMIT:0:7}.log"
  AB_TIME=150 ws_ab small_callrows --kernel gluon_ws_small --before /tmp/hopper_ws_small_before.py \
    --points 64:64:512 64:48:512 64:16:512 256:16:512 ctx65536:4:16:512
  cp /tmp/hopper_ws_small_before.py sparse_mla/gluon/hopper_ws_small.py
fi
if want fp8outdirect; then  # step 46 for gluon_ws_fp8 (a patch)
  for f in sparse_mla/gluon/launch_fp8.py sparse_mla/gluon/hopper_ws_fp8.py tests/test_gluon.py; do
    cp $f /tmp/$(basename $f).before  # the patch's other files, put back below
  done
  patch_ws experiments/patches/ws_fp8_out_direct.diff || exit 1
  [ -n "${NO_TESTS:-}" ] || ws_gpu_tests fp8outdirect
  PYTHONPATH=$PWD timeout 300 python3 experiments/fp8_out_ab.py --repeat 2 \
    > "$OUT/fp8_out_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "fp8outdirect ab: rc=$?"; cat "$OUT/fp8_out_ab_h200_${COMMIT:0:7}.log"
  unpatch_ws
  for f in sparse_mla/gluon/launch_fp8.py sparse_mla/gluon/hopper_ws_fp8.py tests/test_gluon.py; do
    cp /tmp/$(basename $f).before $f
  done
fi
if want fp8outsmall; then  # step 47: gluon_ws_fp8's own stores in small calls
  [ -n "${NO_TESTS:-}" ] || ws_gpu_tests fp8outsmall
  PYTHONPATH=$PWD timeout 360 python3 experiments/fp8_out_ab.py --repeat 2 \
    > "$OUT/fp8_out_small_ab_h200_${COMMIT:0:7}.log" 2>&1
  echo "fp8outsmall ab: rc=$?"; cat "$OUT/fp8_out_small_ab_h200_${COMMIT:0:7}.log"
fi
if want wstests; then  # the package's gluon_ws paths at this commit
  ws_gpu_tests head
fi
if want lenpub; then  # step 40, a patch: the list lengths published by the producer
  patch_ws experiments/patches/ws_published_len.diff || exit 1
  ws_gpu_tests lenpub
  AB_TIME=330 ws_ab lenpub --before /tmp/hopper_ws_before.py --points 16384:64:512 16384:128:1024 \
    glm:16384:64:2048 4096:128:1024 1024:64:512 256:64:512 64:128:1024
  unpatch_ws
fi
if want mid1024verify; then  # step 39 after its export: default at middling lists
  for t in 1 4 16; do  # a run a token count (the first builds FlashMLA's stand-in, ~45 s)
    PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 170 \
      python3 -m sparse_mla.cli bench --grid --no-ceilings --context 1024 --tokens $t \
      --providers gluon_ws_small,gluon_ws,default,default_dense_wide,flashmla --time-limit 150 \
      --commit "${COMMIT:0:7}" \
      --out "$OUT/verify_mid1024.csv" >> "$OUT/verify_mid1024_${COMMIT:0:7}.log" 2>&1
    echo "verify T=$t: rc=$?"
  done
  grep "T=" "$OUT/verify_mid1024_${COMMIT:0:7}.log" | cut -c1-260
fi
if want pairs; then  # the per-pair stamps of a long item: whole lists at T = 128 H64 and T = 64 H128
  TRITON_CACHE_DIR=/tmp/clk_pairs PYTHONPATH=$PWD timeout 200 python3 experiments/ws_clk_now.py \
    --pairs --points ctx65536:128:64 ctx65536:64:128 > "$OUT/ws_clk_pairs_h200_${COMMIT:0:7}.log" 2>&1
  echo "pairs: rc=$?"; cat "$OUT/ws_clk_pairs_h200_${COMMIT:0:7}.log"
fi
lengths_tests() {  # the dense-ids and kv_lengths GPU tests (every kernel, plans, graphs, FP8)
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_dense_lengths.py tests/test_dense_ids.py tests/test_fp8_prefill.py -k "dense or lengths" \
    > "$OUT/gpu_tests_lengths_${COMMIT:0:7}.log" 2>&1
  echo "lengths tests: rc=$?"; tail -n 3 "$OUT/gpu_tests_lengths_${COMMIT:0:7}.log"
}
if want lentests; then lengths_tests; fi
if want lenchoice; then  # step 41: the choice with dense ids and lengths
  for ctx in 1024 65536; do
    PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 150 \
      python3 -m sparse_mla.cli bench --grid --no-ceilings --context $ctx --tokens 1,4,16 \
      --heads 1,2,8 --time-limit 130 --commit "${COMMIT:0:7}" --out "$OUT/lenchoice.csv" \
      --providers default,default_dense_len,default_dense_wide,gluon_mma,gluon_ws,flashmla \
      >> "$OUT/lenchoice_${COMMIT:0:7}.log" 2>&1
    echo "lenchoice ctx$ctx: rc=$?"
  done
  grep "T=" "$OUT/lenchoice_${COMMIT:0:7}.log" | cut -c1-300
  lengths_tests
fi
if want densewidth; then  # an engine's fixed-width dense ids with lengths on a short context
  lengths_tests
  PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_plans.py tests/test_plans_fp8.py tests/test_op.py tests/test_op_fp8.py \
    > "$OUT/gpu_tests_plans_op_${COMMIT:0:7}.log" 2>&1
  echo "plans/op tests: rc=$?"; tail -n 3 "$OUT/gpu_tests_plans_op_${COMMIT:0:7}.log"
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 200 \
    python3 experiments/dense_width.py > "$OUT/dense_width_h200_${COMMIT:0:7}.log" 2>&1
  echo "densewidth: rc=$?"; cat "$OUT/dense_width_h200_${COMMIT:0:7}.log"
fi
if want lengths; then  # kv_lengths: the GPU tests, then dense with and without lengths timed
  lengths_tests
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 230 \
    python3 -m sparse_mla.cli bench --grid --no-glm --heads 8,16,32,64,96,128 \
    --tokens 64,256,1024,4096,16384 --providers default,default_dense,default_dense_len,flashmla \
    --time-limit 200 --commit "${COMMIT:0:7}" --out "$OUT/nvidia-h200_dense_lengths.csv" \
    > "$OUT/dense_lengths_grid_${COMMIT:0:7}.log" 2>&1
  echo "lengths grid: rc=$?"; tail -n 3 "$OUT/dense_lengths_grid_${COMMIT:0:7}.log"
fi
if want earlypv; then  # step 35, a patch: consumer 0's own PV before the pair's max
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py || exit 1
  cp tests/test_gluon.py /tmp/test_gluon_before.py || exit 1
  apply_patch experiments/patches/ws_early_pv0.diff || exit 1
  ws_gpu_tests earlypv
  ws_ab earlypv --before /tmp/hopper_ws_before.py --points ctx65536:128:64:512 \
    ctx65536:64:128:1024 64:64:512 64:128:1024 256:64:512 16384:64:512 16384:128:1024 \
    glm:16384:64:2048
  cp /tmp/hopper_ws_before.py sparse_mla/gluon/hopper_ws.py
  cp /tmp/test_gluon_before.py tests/test_gluon.py
fi
if want smallsink; then  # step 29: step 27 for gluon_ws_small (its sink loaded at an item's start)
  cp sparse_mla/gluon/hopper_ws_small.py /tmp/hopper_ws_small_before.py || exit 1
  apply_patch experiments/patches/ws_small_sink_early.diff || exit 1
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_ws_small_groups.py tests/test_kernels_gpu.py tests/test_dense_ids.py \
    tests/test_gluon.py -k "(ws_small and not fp8) or scale_of_zero" \
    > "$OUT/gpu_tests_ws_small_sink_${COMMIT:0:7}.log" 2>&1
  echo "smallsink tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_small_sink_${COMMIT:0:7}.log"
  ws_ab small_sink --kernel gluon_ws_small --before /tmp/hopper_ws_small_before.py \
    --points 64:4:512 64:16:512 64:32:512 64:48:512 256:16:512 16384:16:512 glm:16384:16:2048
  cp /tmp/hopper_ws_small_before.py sparse_mla/gluon/hopper_ws_small.py
fi
if want waves; then  # twentieth session: whole lists under the one-wave split rule, re-exported
  D=data/bench/nvidia-h200
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 450 \
    python3 -m sparse_mla.cli bench --grid --no-ceilings --context 65536 \
    --providers gluon_mma,gluon_wgmma,gluon_ws_small,gluon_ws,default,flashmla \
    --tokens 1,4,16,64,256,1024 --time-limit 430 --commit "${COMMIT:0:7}" \
    --out ${D}_grid_ctx65536.csv > "$OUT/waves_grid_${COMMIT:0:7}.log" 2>&1
  echo "waves grid: rc=$?"; tail -n 2 "$OUT/waves_grid_${COMMIT:0:7}.log"
  sm90_export 1 "$OUT/waves_export.log"  # this run in place of the earlier whole-list runs
  cp ${D}_grid_ctx65536.csv "$OUT/"
fi
if want lists; then
  P=gluon_mma,gluon_wgmma,gluon_ws_small,gluon_ws,default,flashmla
  for c in 65536 1024; do
    PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 120 \
      python3 -m sparse_mla.cli bench --grid --no-ceilings --context $c --providers $P \
      --heads 1,2,12,16,20,40,64,80,128 --tokens 1,4,16 --commit "${COMMIT:0:7}" \
      --out "$OUT/list_length_check.csv" >> "$OUT/list_length_check_${COMMIT:0:7}.log" 2>&1
    echo "lists ctx $c: rc=$?"
  done
  run_summary "$OUT/list_length_check.csv"
fi
if want prefetch; then  # twenty-third session: step 20, the TMA descriptors prefetched (a patch)
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py
  apply_patch experiments/patches/ws_desc_prefetch.diff || { echo "prefetch: patch failed"; exit 1; }
  ws_gpu_tests prefetch
  ws_ab prefetch
fi
if want t32; then  # twenty-third session: T = 32 at every list length, middling lists at 64/256
  D=data/bench/nvidia-h200
  grid_run t32 --context 65536 --tokens 32 --out ${D}_grid_ctx65536.csv
  grid_run t32 --context 1024 --tokens 32,64,256 --out ${D}_grid_ctx1024.csv
  grid_run t32 --no-glm --tokens 32 --out ${D}_grid_small_t.csv
  sm90_export 2 "$OUT/t32_${COMMIT:0:7}.log"  # the T = 32 runs beside the ones before them
  cp ${D}_grid_ctx65536.csv ${D}_grid_ctx1024.csv ${D}_grid_small_t.csv "$OUT/"
fi
if want tmid; then  # twenty-fourth session: T between the grid's at every list length
  D=data/bench/nvidia-h200 MID=${MID_TOKENS:-128,512,2048} GRID_LIMIT=150  # 3 x 170 s at most
  grid_run tmid --context 65536 --tokens $MID --out ${D}_grid_ctx65536.csv
  grid_run tmid --context 1024 --tokens $MID --out ${D}_grid_ctx1024.csv
  grid_run tmid --no-glm --tokens $MID --out ${D}_grid_mid_t.csv
  sm90_export 3 "$OUT/tmid_${COMMIT:0:7}.log"  # with the whole-list runs at T 1-1024 and 32
  cp ${D}_grid_ctx65536.csv ${D}_grid_ctx1024.csv ${D}_grid_mid_t.csv "$OUT/"
fi
if want l2rows; then  # twenty-fourth session: step 22, the next pair's KV rows into L2 (a patch)
  cp sparse_mla/gluon/hopper_ws.py /tmp/hopper_ws_before.py
  apply_patch experiments/patches/ws_l2_rows.diff || { echo "l2rows: patch failed"; exit 1; }
  ws_gpu_tests l2rows
  ws_ab l2rows --before /tmp/hopper_ws_before.py \
    --points ctx65536:64:128:1024 ctx65536:64:96:1024 ctx65536:4:128:1024 ctx65536:16:64:512 \
    64:128:1024 16384:128:1024 glm:16384:64:2048
fi
if want l2small; then  # twenty-fourth session: step 22 for gluon_ws_small (two patches, a second)
  apply_patch experiments/patches/ws_l2_rows.diff || { echo "l2small: patch 1 failed"; exit 1; }
  cp sparse_mla/gluon/hopper_ws_small.py /tmp/hopper_ws_small_before.py
  apply_patch experiments/patches/ws_small_l2_rows.diff || { echo "l2small: patch 2 failed"; exit 1; }
  xdist
  PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_ws_small_groups.py tests/test_kernels_gpu.py tests/test_dense_ids.py \
    tests/test_gluon.py -k "ws_small and not fp8" > "$OUT/gpu_tests_ws_small_l2_${COMMIT:0:7}.log" 2>&1
  echo "l2small tests: rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_small_l2_${COMMIT:0:7}.log"
  ws_ab small_l2rows --kernel gluon_ws_small --before /tmp/hopper_ws_small_before.py \
    --points ctx65536:64:16:512 ctx65536:64:64:512 ctx65536:256:32:512 ctx65536:1024:16:512 \
    64:16:512 16384:16:512
fi
if want l2gate; then  # twenty-fifth session: step 22 in the package, for calls of one wave
  ws_gpu_tests l2gate
  GRID_LIMIT=120
  grid_run l2gate --no-glm --tokens 64,128 --out "$OUT/l2gate_grid.csv"
  grid_run l2gate --context 65536 --tokens 4,64,128 --out "$OUT/l2gate_grid.csv"
  run_summary "$OUT/l2gate_grid.csv"
fi
if want tilerate; then  # twenty-fourth session: PERF_NOTES "No cliffs" step 21's probe
  # FlashMLA's stand-in builds on its first call, under ncu (38 s at c435418; outside the
  # profiled NVTX ranges)
  for c in ${TILERATE_CONTEXTS:-0 65536}; do  # 0: the grid's T = 64 H128 (short lists)
    PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 240 \
      python3 experiments/tile_rate_ncu.py --out /tmp/tile_rate_$c --context $c \
      > "$OUT/tile_rate_ctx${c}_${COMMIT:0:7}.log" 2>&1
    echo "tilerate ctx $c: rc=$?"
    for f in /tmp/tile_rate_$c/tile_rate_*.csv; do cp "$f" "$OUT/ctx${c}_$(basename "$f")"; done
    tail -n 3 "$OUT/tile_rate_ctx${c}_${COMMIT:0:7}.log"
  done
fi
if want verify; then
  GRID_LIMIT=150
  for a in "65536 1,4,16,32,64" "1024 1,4,16,32,64"; do
    set -- $a
    grid_run list_length_verify --context $1 --tokens $2 --out "$OUT/list_length_check.csv"
  done
  run_summary "$OUT/list_length_check.csv"
fi
if want abstail; then
  PYTHONPATH=$PWD timeout 150 python3 experiments/max_abs_tail.py \
    > "$OUT/max_abs_tail_h200_${COMMIT:0:7}.log" 2>&1
  echo "abstail: rc=$?"; cat "$OUT/max_abs_tail_h200_${COMMIT:0:7}.log"
fi
if want split; then
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 200 \
    python3 experiments/ws_small_split.py > "$OUT/ws_small_split_h200_${COMMIT:0:7}.log" 2>&1
  echo "split: rc=$?"; tail -n 14 "$OUT/ws_small_split_h200_${COMMIT:0:7}.log"
fi
if want tail; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon.py \
    -k "short_last or ws_prefill_matches" > "$OUT/gpu_tests_ws_tail_${COMMIT:0:7}.log" 2>&1
  echo "tail: rc=$?"; tail -n 2 "$OUT/gpu_tests_ws_tail_${COMMIT:0:7}.log"
fi
if want grid; then  # GRID_TIME: seconds it may time points (225: under 4.5 minutes in all)
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout $((${GRID_TIME:-225} + 35)) \
    python3 -m sparse_mla.cli bench --grid --time-limit ${GRID_TIME:-225} --commit "$COMMIT" \
    --out "$OUT/nvidia-h200_grid.csv" > "$OUT/nvidia-h200_grid_${COMMIT:0:7}.log" 2>&1
  echo "grid: rc=$?"; tail -n 5 "$OUT/nvidia-h200_grid_${COMMIT:0:7}.log"
fi
