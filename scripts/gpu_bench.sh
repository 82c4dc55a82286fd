#!/usr/bin/env bash
# On a CUDA machine whose python already has torch (+ triton, transformers, pytest): install onecat
# without touching its packages, run the GPU tests, the GEMV sweep, the step profile and the decode
# benchmark; `speculative` runs the speculative GPU tests and the synthetic rounds on the 8B shape (no checkpoint
# needed; with A/Bs of drafts read back each round and of the next round not drafted ahead (ONECAT_DRAFT_AHEAD=0), a
# timeline profile of batch-1 rounds and the embedded default's
# shape with a drafter whose drafts are all rejected), `routes` the GPU tests
# of routed packed experts and hybrid verify graphs, then the seed routes (benchmarks/seed_routes_gpu.py; Gated
# DeltaNet needs fla-core), `embedded` the embedded target with its
# trained DFlash drafter (EMBEDDED_GGUF=path of the GGUF, DFLASH_PROMPTS=prompts saved by `benchmarks/
# speculative_gpu.py --save-prompts` where the datasets are): gate on (batch 1 and 8; batch 1 again with more
# repeats, its runs being short and noisy) and off, and a timeline profile; `merge` the GPU test of the paged
# decode's merge in its split kernel (ONECAT_MERGE_IN_SPLIT) and its A/B on target-only decode, alternated twice,
# batch 1 and 8, on the 8B and the embedded default's shapes; `rows` the few-row GEMM's GPU tests (and the speculative
# ones it serves) and its timing against cuBLAS with a tile sweep; `rows_ab` the synthetic 8B rounds (batch 1 and 8,
# n-gram- and DFlash-shaped) with the few-row GEMM off and on (ONECAT_ROWS_GEMM), alternated twice; `gdn` the fused
# Gated DeltaNet decode and verify steps' GPU tests (and the zero-centered norm's and gated attention's) and their
# timing against the torch path (benchmarks/gpu_gdn_step.py); `gdn_route` route 1 at batch 1 with Qwen3.5's fused
# kernels off, on, off, on (ONECAT_FUSED_HYBRID); `draft_vocab` route 1 at batch 1 with the DFlash compute over the
# whole LM head and over 32K ids, then the 8B DFlash-shaped rounds likewise; `draft_vocab_embedded` the embedded
# target with its trained drafter over the whole head and its 6,207 ranked ids (EMBEDDED_GGUF, DFLASH_PROMPTS);
# `route_ab` both route-1 A/Bs in four runs (fused hybrid kernels off, on, on with a 32K draft vocabulary, off);
# `sampling` the sampler's and verifier's tests on the GPU, then the embedded target with its drafter sampled at the
# seed route's settings (T 1, top-p 0.95, top-k 20; EMBEDDED_GGUF, DFLASH_PROMPTS).
# `sampled_decode` the one-step-ahead decode's GPU test with sampled batches and sampling graphs on, then greedy,
# sampled eager and sampled from captured graphs in one run (benchmarks/gpu_sampled_decode.py, random weights).
# `packed_rows` the packed many-row GEMM's GPU tests and its timing against the dequantizing path on the Qwen3.5-27B
# projections at 17-128 rows, NVFP4 with a tile sweep and W4A16 (benchmarks/gpu_packed_rows.py); `packed_rows_route`
# route 1 at batch 8 with it off and by default (ONECAT_PACKED_ROWS_GEMM 0, unset); `packed_rows_e2e` the 8B shape
# dense, W4A16, NVFP4 and FP8 at batch 1, 32 and 64, each packed arm by default and with it off
# (benchmarks/gpu_w4a16_e2e.py --packed-rows-ab); `pending_tests` the GPU tests not yet passed on a GPU (the
# RoPE folded into the split kernel, prompt lookups taken while pipelined steps are in flight, the hybrid engine's
# verify graphs with the split DeltaNet verify step now default), each selection under its own limit;
# `syncs` the synchronizing CUDA calls an engine step makes, by engine line (benchmarks/gpu_round_syncs.py: target-only,
# n-gram, synthetic DFlash dense and hybrid, MTP; batch 1 and 8); `narrow_route` route 1 at batch 1 with the hybrid's narrower verify graphs off and on
# (ONECAT_HYBRID_NARROW_VERIFY); `gemv16` the 16-row GEMV's GPU tests and its
# timing against 8-row launches at 8, 16 and 32 rows (NVFP4, W4A16); `gemv16_route` route 1 at batch 1 with it off
# and on (ONECAT_GEMV_16_ROWS); `moe_fused_route` route 2 at batch 1 and 8 with the fused routed experts off
# and on (ONECAT_MOE_FUSED_ROUTED). `route_profile` the seed routes (PROFILE_ROUTES, default both) at batch 1 and 8 (PROFILE_BATCHES)
# with a profile of one more batch of each arm (benchmarks/seed_routes_gpu.py --profile: device-busy time, idle time
# by host phase, busiest kernels). `dense_rows` the tensor-core rows GEMV for dense weights' GPU tests and its timing
# against cuBLAS and the few-row GEMM on the 8B projections at 2, 8 and 16 rows (benchmarks/gpu_rows_gemm.py);
# `dense_rows_ab` the synthetic 8B rounds (batch 1 and 8, n-gram- and DFlash-shaped) with it off and on
# (ONECAT_DENSE_ROWS_GEMV); `dense_rows_route` its timing in bfloat16 (a bf16 drafter's calls; the 8B projections
# and Qwen3.5-27B's) and route 1 at batch 1, whose DFlash drafter is bf16, with it off and on; `drafter_quant_route`
# route 1 at batch 1 with its drafter bf16, FP8 and NVFP4 (speculative_config quantization; DQ_ARMS="none fp8@32768"
# picks arms, @N with a draft vocabulary of N ids), then the drafter tests;
# `drafter_quant_rounds` the 8B DFlash-shaped rounds at batch 1 and 8 with the drafter fp16 and FP8;
# `mtp_vocab_route` route 2 at batch 1 with its MTP head scoring over the whole 248K LM head and over 32K ids.
# `moe_routed` the routed experts' GPU tests, then their tilings timed on route 2's experts at 1, 5 and 40 tokens,
# and the layer's experts routed against grouped by expert (benchmarks/gpu_moe_routed.py, NVFP4 and W4A16); `moe_routed_route` route 2 at batch 1 with the default tilings
# and with the best of that NVFP4 record at 1 token (ONECAT_MOE_ROUTED_GLU_TILES / _DOWN_TILES), default first.
# `moe_grouped` the grouped packed experts' GPU tests, then route 2 at batch 1 with its prefill's experts in the
# per-expert loop and grouped by expert (ONECAT_MOE_GROUPED_PREFILL 0, 1; the record's target_prefill_s).
# `gdn_split` the split DeltaNet verify step's GPU tests, its timing against the step kernel walking the rows
# (benchmarks/gpu_gdn_step.py, rows 1 and 8 of 8 and 16 tokens), then route 1 at batch 1 with it off and on
# (ONECAT_GDN_SPLIT_VERIFY 0, 1); `gdn_split_route` that route A/B alone. `draft_pool_route` route 1 at batch 1
# and 8 with new requests' draft lengths from the prior alone and from the finished requests' pool
# (ONECAT_DRAFT_LENGTH_POOL 0, 1). `rope_split` the GPU tests
# of a decode step's RoPE and K/V store inside the paged decode's split kernel, then target-only decode with it off
# and on (ONECAT_ROPE_IN_SPLIT), alternated twice, batch 1 and 8, the 8B and the embedded default's shapes.
# `drafter_block` the DFlash drafters' GPU tests, then the 8B shape's drafter at 512 and 4,096 context rows (and route
# 1's, Qwen3.5-27B in bf16): its
# block forward, LM head and context projection timed in CUDA graphs (the block attention kernel, SDPA, the tensor-core
# rows GEMV) against its matmuls alone and its weight bytes, with a kernel profile of an 8B round
# (benchmarks/gpu_drafter_block.py); `hybrid_rollback` the hybrid verify graphs' rollback test. `route_trace` the
# hybrid verify tests (the warm-up's padded row widths among them), then route 1 at batch 8 step by step with the
# gate off and on (benchmarks/route_step_trace.py: Triton variants built inside the timed batch), then route 1 at
# batch 1 and 8.
# `paged_sweep` the paged decode attention alone at 1K-32K contexts, batch 1 and 8, in its tile and partition
# variants, against the copy rate (benchmarks/gpu_paged_decode.py); `paged_long` the sweep at 4K-32K, target-only
# decode at 16K context, batch 1, with the long sequences' 512-token partitions off and on
# (ONECAT_PAGED_LONG_PARTITION), then the paged decode's GPU tests. `admission_waves` the pipeline's GPU tests
# with requests waiting (and without), then an offline job of 1,024 requests on 256 slots, the embedded default's
# shape, new requests started one by one and in waves of 32 (admission_wave), alternated twice
# (benchmarks/gpu_admission_waves.py). `regen` the drafter's training data: the target (EMBEDDED_GGUF) answers the
# prompts of DRAFTER_PROMPTS (a jsonl of scripts/remote_gpu_prep.sh) greedy and sampled (REGEN_EXTRA more sampled
# answers a prompt, default 2) within REGEN_BUDGET s (default 400), kept in REGEN_SAMPLES (default
# /tmp/m/samples, continued by the next call to a warm machine) and copied to OUT/samples as compact parts of at
# most 15 MiB, to carry into the next call or back (docs/training.md).
#   scripts/gpu_bench.sh OUTDIR [tests|gemv|profile|bench|speculative|routes|embedded|merge|rows|rows_ab|gdn|
#                                gdn_route|draft_vocab|draft_vocab_embedded|route_ab|sampling|sampled_decode|packed_rows|
#                                packed_rows_route|packed_rows_e2e|pending_tests|moe_fused_route|
#                                route_profile|gemv16|gemv16_route|narrow_route|syncs|dense_rows|dense_rows_ab|
#                                dense_rows_route|drafter_quant_route|drafter_quant_rounds|mtp_vocab_route|
#                                moe_routed|moe_routed_route|moe_grouped|gdn_split|
#                                gdn_split_route|draft_pool_route|rope_split|paged_sweep|admission_waves|regen|
#                                drafter_block|hybrid_rollback|paged_long|route_trace]...
#   (default: the first four; BENCH_TAR=1 also packs OUTDIR into OUTDIR.tgz, one file for transfers that
#   return only a few)
set -uo pipefail
out=${1:?usage: scripts/gpu_bench.sh OUTDIR [tests|gemv|profile|bench]...}; shift
steps=${*:-tests gemv profile bench}
mkdir -p "$out"
python3 -m pip install --no-deps --no-build-isolation -q -e . >"$out/install.log" 2>&1 || {
  echo "install failed, see $out/install.log"; tail -5 "$out/install.log"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
# route 1 at batch 1, one run per argument RUN_FUSED_VOCAB (run number, fused hybrid kernels 0/1, draft vocab size)
route_runs() {
  local tag=$1 run f n; shift
  for run in "$@"; do
    f=${run#*_}; f=${f%_*}; n=${run##*_}
    ONECAT_FUSED_HYBRID=$f timeout 140 python3 benchmarks/seed_routes_gpu.py --routes seed_route_h200 \
      --batch-sizes 1 --repeats 1 --draft-vocab-size "$n" --out "$out/seed_route_${tag}_$run.json" \
      >"$out/route_${tag}_$run.log" 2>&1
    echo "route 1 run ${run%%_*} fused hybrid kernels=$f draft vocab=$n rc=$?"
    grep -i "tok/s" "$out/route_${tag}_$run.log" | tail -2
  done
}
# one route at BATCHES with the switch VAR off, then on (one run each): VAR ROUTE BATCHES LIMIT_S TAG
switch_ab() {
  local var=$1 route=$2 batches=$3 limit=$4 tag=$5 f
  for f in 0 1; do
    env "$var=$f" timeout "$limit" python3 benchmarks/seed_routes_gpu.py --routes "$route" --batch-sizes "$batches" \
      --repeats 1 --out "$out/${tag}_$f.json" >"$out/${tag}_$f.log" 2>&1
    echo "$route batch $batches $var=$f rc=$?"; grep -iE "tok/s" "$out/${tag}_$f.log"
  done
}
# target-only decode (batch 1 and 8, the 8B and the embedded default's shapes) with the switch VAR off and on,
# alternated twice (AB_ROUNDS, AB_SHAPES narrow it): VAR TAG
decode_switch_ab() {
  local var=$1 tag=$2 round flag shape
  for round in ${AB_ROUNDS:-1 2}; do for flag in 0 1; do for shape in ${AB_SHAPES:-llama3-8b smollm2-135m}; do
    env "$var=$flag" timeout 100 python3 benchmarks/speculative_gpu_rounds.py --shape $shape \
      --batch-sizes 1,8 --repeats 3 --arms no_draft --out "$out/${tag}_${shape}_${flag}_$round.json" \
      >"$out/${tag}_${shape}_${flag}_$round.log" 2>&1
    echo "$var=$flag $shape round $round rc=$?"; grep "target-only" "$out/${tag}_${shape}_${flag}_$round.log"
  done; done; done
}
# GPU tests of one selection (pytest arguments) under its own limit: NAME ARGS...
gpu_tests() {
  local name=$1; shift
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" "$@" >"$out/tests_$name.log" 2>&1
  echo "tests $name rc=$?"; grep -E "passed|failed|FAILED" "$out/tests_$name.log" | tail -4
}
for step in $steps; do
  case $step in
    gdn) timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_gated_delta_step_gpu.py \
             tests/test_fused_kernels_gpu.py tests/test_hybrid_gpu.py \
             >"$out/gdn_tests.log" 2>&1; echo "gdn tests rc=$?"; tail -3 "$out/gdn_tests.log"
         (cd benchmarks && timeout 150 python3 gpu_gdn_step.py --out "$out/gpu_gdn_step.json" \
             >"$out/gdn_step.log" 2>&1); echo "gdn step rc=$?"; grep "rows" "$out/gdn_step.log" ;;
    gdn_route) route_runs gdn 1_0_0 2_1_0 3_0_0 4_1_0 ;;
    route_ab) route_runs ab 1_0_0 2_1_0 3_1_32768 4_0_0 ;;
    draft_vocab) for n in 0 32768; do
           timeout 140 python3 benchmarks/seed_routes_gpu.py --routes seed_route_h200 --batch-sizes 1 --repeats 1 \
             --draft-vocab-size $n --out "$out/seed_route_vocab_$n.json" >"$out/route_vocab_$n.log" 2>&1
           echo "route 1 draft vocab=$n rc=$?"; grep -i "tok/s" "$out/route_vocab_$n.log" | tail -2
           timeout 120 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1 --arms dflash_shaped \
             --draft-vocab-size $n --out "$out/rounds_vocab_$n.json" >"$out/rounds_vocab_$n.log" 2>&1
           echo "8B DFlash-shaped draft vocab=$n rc=$?"; grep "batch" "$out/rounds_vocab_$n.log" | tail -5
         done ;;
    draft_vocab_embedded) for n in 0 6207; do
             timeout 100 python3 benchmarks/speculative_gpu.py --target "${EMBEDDED_GGUF:?set EMBEDDED_GGUF}" \
               --prompts "${DFLASH_PROMPTS:?set DFLASH_PROMPTS}" \
               --drafter engine/drafters/smollm2-135m-dflash --batch-sizes 1 --repeats 3 --budget-s 50 \
               --draft-vocab-size $n --out "$out/embedded_vocab_$n.json" >"$out/embedded_vocab_$n.log" 2>&1
             echo "embedded draft vocab=$n rc=$?"; grep "bs=" "$out/embedded_vocab_$n.log" | tail -2
           done ;;
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
             tests/test_fused_kernels_gpu.py tests/test_gemv_gpu.py tests/test_gpu_engine.py >"$out/tests.log" 2>&1
           echo "tests rc=$?"; tail -3 "$out/tests.log" ;;
    gemv) (cd benchmarks && timeout 300 python3 gpu_gemv.py ${GEMV_ARGS:-} --out "$out/gemv.json" \
             >"$out/gemv.log" 2>&1); echo "gemv rc=$?"; tail -16 "$out/gemv.log" ;;
    profile) (cd benchmarks && timeout 240 python3 gpu_step_profile.py --out "$out/step_profile.json" \
             >"$out/profile.log" 2>&1); echo "profile rc=$?"; tail -25 "$out/profile.log" ;;
    bench) (cd benchmarks && timeout 560 python3 gpu_decode.py --out "$out/gpu_h200.json" ${BENCH_ARGS:-} \
             >"$out/bench.log" 2>&1); echo "bench rc=$?"; tail -12 "$out/bench.log" ;;
    speculative) timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_gemv_gpu.py \
             tests/test_speculative_graphs_gpu.py tests/test_gpu_engine.py tests/test_dflash_runtime.py \
             -k "row or verify or speculation or graphs or bit" >"$out/speculative_tests.log" 2>&1
           echo "speculative tests rc=$?"; tail -3 "$out/speculative_tests.log"
           timeout 330 python3 benchmarks/speculative_gpu_rounds.py ${ROUNDS_ARGS:-} \
             --out "$out/speculative_gpu_rounds.json" >"$out/rounds.log" 2>&1
           echo "rounds rc=$?"; grep "batch" "$out/rounds.log" | tail -40
           ONECAT_DRAFTS_ON_DEVICE=0 timeout 150 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1 \
             --arms dflash_shaped --out "$out/speculative_gpu_rounds_drafts_read_back.json" >"$out/rounds_ab.log" 2>&1
           echo "drafts read back each round rc=$?"; grep "batch" "$out/rounds_ab.log"
           ONECAT_DRAFT_AHEAD=0 timeout 200 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1,8 \
             --arms dflash_shaped --out "$out/speculative_gpu_rounds_not_ahead.json" >"$out/rounds_not_ahead.log" 2>&1
           echo "next round not drafted ahead rc=$?"; grep "batch" "$out/rounds_not_ahead.log"
           timeout 150 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1 --profile "$out/rounds_timeline" \
             >"$out/rounds_timeline.log" 2>&1; echo "timeline rc=$?"; grep "us a step" "$out/rounds_timeline.log"
           timeout 150 python3 benchmarks/speculative_gpu_rounds.py --shape smollm2-135m --batch-sizes 1,8 --repeats 3 \
             --arms dflash_rejected,no_draft,dflash_shaped --out "$out/speculative_gpu_rounds_smollm2.json" \
             >"$out/rounds_smollm2.log" 2>&1; echo "smollm2 shape rc=$?"; grep "batch" "$out/rounds_smollm2.log" ;;
    embedded) a="--target ${EMBEDDED_GGUF:?set EMBEDDED_GGUF} --drafter engine/drafters/smollm2-135m-dflash \
             --prompts ${DFLASH_PROMPTS:?set DFLASH_PROMPTS}"
           timeout 200 python3 benchmarks/speculative_gpu.py $a --repeats 3 --budget-s 100 \
             --out "$out/speculative_gpu_dflash.json" >"$out/embedded.log" 2>&1; echo "embedded rc=$?"
           timeout 120 python3 benchmarks/speculative_gpu.py $a --batch-sizes 1 --repeats 6 --budget-s 50 \
             --out "$out/speculative_gpu_dflash_b1.json" >>"$out/embedded.log" 2>&1; echo "batch 1 repeats rc=$?"
           timeout 130 python3 benchmarks/speculative_gpu.py $a --gate off --repeats 1 --budget-s 30 \
             --out "$out/speculative_gpu_dflash_gate_off.json" >>"$out/embedded.log" 2>&1; echo "gate off rc=$?"
           timeout 100 python3 benchmarks/speculative_gpu.py $a --gate off --profile "$out/embedded_timeline" \
             >>"$out/embedded.log" 2>&1; echo "timeline rc=$?"; grep -E "bs=|us a step" "$out/embedded.log" ;;
    sampling) timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_sampler_filters.py \
             tests/test_verifier_batch.py >"$out/sampling_tests.log" 2>&1; echo "sampling tests rc=$?"
           tail -2 "$out/sampling_tests.log"
           a="--target ${EMBEDDED_GGUF:?set EMBEDDED_GGUF} --drafter engine/drafters/smollm2-135m-dflash \
             --prompts ${DFLASH_PROMPTS:?set DFLASH_PROMPTS} --sampling seed_route"
           timeout 200 python3 benchmarks/speculative_gpu.py $a --repeats 3 --budget-s 100 \
             --out "$out/speculative_gpu_dflash_sampled.json" >"$out/sampled.log" 2>&1; echo "sampled rc=$?"
           grep "bs=" "$out/sampled.log" ;;
    sampled_decode) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py -k async_scheduling \
             >"$out/sampled_decode_tests.log" 2>&1; echo "sampled decode tests rc=$?"; tail -2 "$out/sampled_decode_tests.log"
           timeout 200 python3 benchmarks/gpu_sampled_decode.py --out "$out/gpu_sampled_decode.json" \
             >"$out/sampled_decode.log" 2>&1; echo "sampled decode rc=$?"; grep "batch" "$out/sampled_decode.log" ;;
    packed_rows) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_packed_rows_gpu.py \
             >"$out/packed_rows_tests.log" 2>&1; echo "packed rows tests rc=$?"; tail -2 "$out/packed_rows_tests.log"
           for fmt in nvfp4 w4a16; do
             sweep=$([ $fmt = nvfp4 ] && echo --sweep)
             (cd benchmarks && timeout 240 python3 gpu_packed_rows.py --format $fmt $sweep \
               --out "$out/gpu_packed_rows_$fmt.json" >"$out/packed_rows_$fmt.log" 2>&1)
             echo "packed rows timing $fmt rc=$?"; grep "rows" "$out/packed_rows_$fmt.log"
           done ;;
    packed_rows_route) for f in 0 ""; do
             ONECAT_PACKED_ROWS_GEMM=$f timeout 160 python3 benchmarks/seed_routes_gpu.py --routes seed_route_h200 \
               --batch-sizes 8 --repeats 1 --out "$out/seed_route_b8_packed_rows_${f:-default}.json" \
               >"$out/route_b8_packed_rows_${f:-default}.log" 2>&1
             echo "route 1 batch 8 packed rows gemm=${f:-default} rc=$?"; grep -i "tok/s" "$out/route_b8_packed_rows_${f:-default}.log"
           done ;;
    pending_tests) gpu_tests rope_split tests/test_rope_in_split_gpu.py
           gpu_tests pipelined_lookups tests/test_speculative_graphs_gpu.py -k pipelined
           gpu_tests hybrid_graphs tests/test_hybrid_gpu.py tests/test_gated_delta_step_gpu.py -k "rollback or verify or graphs" ;;
    gemv16) gpu_tests gemv16 tests/test_gemv_16_rows_gpu.py
           for fmt in nvfp4 w4a16; do
             (cd benchmarks && timeout 150 python3 gpu_packed_rows.py --format $fmt --rows 8,16,32 \
               --arms gemv_blocks_8,gemv_blocks_16 --out "$out/gemv16_$fmt.json" >"$out/gemv16_$fmt.log" 2>&1)
             echo "16-row GEMV timing $fmt rc=$?"; grep "rows" "$out/gemv16_$fmt.log"
           done ;;
    dense_rows) gpu_tests dense_rows tests/test_dense_rows_gpu.py
           (cd benchmarks && timeout 240 python3 gpu_rows_gemm.py --rows 2,8,16 --out "$out/dense_rows_gemv.json" \
             >"$out/dense_rows_gemv.log" 2>&1); echo "dense rows GEMV timing rc=$?"
           grep -E "rows:" "$out/dense_rows_gemv.log" | cut -c1-400 ;;
    drafter_block) gpu_tests drafter_block tests/test_block_attention_gpu.py tests/test_draft_ahead.py \
             tests/test_gpu_engine.py -k "block_attention or ahead or replay_graphs or bit_for_bit"
           (cd benchmarks && timeout 200 python3 gpu_drafter_block.py --profile --out "$out/drafter_block.json" \
             >"$out/drafter_block.log" 2>&1); echo "drafter block rc=$?"; grep -E "\] (default|_sdpa|_dense|alone)" \
             "$out/drafter_block.log" | cut -c1-400
           (cd benchmarks && timeout 150 python3 gpu_drafter_block.py --context 4096 \
             --out "$out/drafter_block_4k.json" >"$out/drafter_block_4k.log" 2>&1); echo "drafter block 4K rc=$?"
           grep -E "\] (default|_sdpa)" "$out/drafter_block_4k.log" | cut -c1-400
           (cd benchmarks && timeout 240 python3 gpu_drafter_block.py --shape qwen3.5-27b --dtype bfloat16 \
             --out "$out/drafter_block_qwen3.5-27b.json" >"$out/drafter_block_qwen3.5-27b.log" 2>&1)
           echo "drafter block qwen3.5-27b rc=$?"; grep -E "\] (default|_sdpa|_dense|alone)" \
             "$out/drafter_block_qwen3.5-27b.log" | cut -c1-400 ;;
    hybrid_rollback) gpu_tests hybrid_rollback tests/test_hybrid_gpu.py -k "rollback" ;;
    route_trace) gpu_tests hybrid_verify tests/test_hybrid_gpu.py -k "narrower or verify"
       for gate in off on; do
         timeout 200 python3 benchmarks/route_step_trace.py --gate $gate --batch 8 --max-tokens 128 \
           --out "$out/route_trace_gate_$gate.json" >"$out/route_trace_gate_$gate.log" 2>&1
         echo "route 1 trace gate $gate rc=$?"; tail -6 "$out/route_trace_gate_$gate.log"
       done
       timeout 220 python3 benchmarks/seed_routes_gpu.py --routes seed_route_h200 --batch-sizes 1,8 --repeats 1 \
         --out "$out/seed_route_b1_b8.json" >"$out/seed_route_b1_b8.log" 2>&1
       echo "route 1 batch 1, 8 rc=$?"; grep -iE "tok/s|built" "$out/seed_route_b1_b8.log" | tail -8 ;;
    dense_rows_ab) for flag in 0 1; do
             ONECAT_DENSE_ROWS_GEMV=$flag timeout 150 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1,8 \
               --arms ngram_shaped,dflash_shaped,no_draft --out "$out/dense_rows_ab_$flag.json" \
               >"$out/dense_rows_ab_$flag.log" 2>&1
             echo "dense rows GEMV=$flag rc=$?"; grep "batch" "$out/dense_rows_ab_$flag.log"
           done ;;
    dense_rows_route) (cd benchmarks && timeout 200 python3 gpu_rows_gemm.py --rows 2,8,16 --dtype bfloat16 \
             --shapes llama3-8b.qkv,llama3-8b.o,llama3-8b.gate_up,llama3-8b.down,qwen3.5-27b.gate_up,qwen3.5-27b.down \
             --out "$out/dense_rows_gemv_bf16.json" >"$out/dense_rows_gemv_bf16.log" 2>&1)
           echo "dense rows GEMV bf16 timing rc=$?"; grep -E "rows:" "$out/dense_rows_gemv_bf16.log" | cut -c1-300
           for f in 0 1; do
             ONECAT_DENSE_ROWS_GEMV=$f timeout 150 python3 benchmarks/seed_routes_gpu.py --routes seed_route_h200 \
               --batch-sizes 1 --repeats 1 --out "$out/seed_route_b1_dense_rows_$f.json" >"$out/route_b1_dense_rows_$f.log" 2>&1
             echo "route 1 batch 1 dense rows GEMV=$f rc=$?"; grep -iE "tok/s" "$out/route_b1_dense_rows_$f.log"
           done ;;
    drafter_quant_route) for q in ${DQ_ARMS:-none fp8 nvfp4}; do  # FORMAT or FORMAT@IDS (with a draft vocabulary)
             fmt=${q%@*}; ids=$([ "$q" = "${q#*@}" ] || echo "--draft-vocab-size ${q#*@}")
             arg="$([ "$fmt" = none ] || echo "--drafter-quantization $fmt") $ids"
             timeout 150 python3 benchmarks/seed_routes_gpu.py --routes seed_route_h200 --batch-sizes 1 --repeats 1 \
               $arg --out "$out/seed_route_b1_drafter_$q.json" >"$out/route_b1_drafter_$q.log" 2>&1
             echo "route 1 batch 1 drafter $q rc=$?"; grep -iE "tok/s" "$out/route_b1_drafter_$q.log"
           done
           gpu_tests drafter_quant tests/test_drafter_quant.py ;;
    drafter_quant_rounds) for q in none fp8; do
             arg=$([ "$q" = none ] || echo "--drafter-quantization $q")
             timeout 200 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1,8 --arms dflash_shaped,no_draft \
               $arg --out "$out/rounds_drafter_$q.json" >"$out/rounds_drafter_$q.log" 2>&1
             echo "8B DFlash-shaped rounds, drafter $q rc=$?"; grep "batch" "$out/rounds_drafter_$q.log"
           done ;;
    mtp_vocab_route) for n in 0 32768; do
             timeout 270 python3 benchmarks/seed_routes_gpu.py --routes seed_moe_route_h200 --batch-sizes 1 --repeats 1 \
               --draft-vocab-size "$n" --out "$out/seed_moe_route_b1_vocab_$n.json" >"$out/moe_route_b1_vocab_$n.log" 2>&1
             echo "route 2 batch 1 MTP draft vocab=$n rc=$?"; grep -iE "tok/s" "$out/moe_route_b1_vocab_$n.log"
           done ;;
    moe_routed) gpu_tests moe_routed tests/test_moe_gpu.py -k "packed or routed"
           for fmt in nvfp4 w4a16; do
             (cd benchmarks && timeout 250 python3 gpu_moe_routed.py --format $fmt --tokens 1,5,40 \
               --out "$out/gpu_moe_routed_$fmt.json" >"$out/moe_routed_$fmt.log" 2>&1)
             echo "routed tilings $fmt rc=$?"; grep "tokens=" "$out/moe_routed_$fmt.log" | cut -c1-300
           done ;;
    moe_routed_route) best=$(python3 benchmarks/gpu_moe_routed.py --best-env "$out/gpu_moe_routed_nvfp4.json") || {
             echo "no routed tilings record in $out: run the moe_routed step first"; continue; }
           for arm in default best; do
             (if [ $arm = best ]; then while read -r line; do export "$line"; done <<<"$best"; echo "$best"; fi
              timeout 270 python3 benchmarks/seed_routes_gpu.py --routes seed_moe_route_h200 --batch-sizes 1 \
                --repeats 1 --out "$out/seed_moe_route_b1_tiles_$arm.json" >"$out/moe_route_b1_tiles_$arm.log" 2>&1
              echo "route 2 batch 1 routed tilings $arm rc=$?"; grep -iE "tok/s" "$out/moe_route_b1_tiles_$arm.log")
           done ;;
    moe_grouped) gpu_tests moe_grouped tests/test_moe_grouped_gpu.py
           switch_ab ONECAT_MOE_GROUPED_PREFILL seed_moe_route_h200 1 220 seed_moe_route_b1_grouped ;;
    gdn_split) gpu_tests gdn_split tests/test_gated_delta_step_gpu.py -k "split or route_widths"
           for w in 8 16; do
             (cd benchmarks && timeout 150 python3 gpu_gdn_step.py --rows 1,8 --width $w --out "$out/gdn_split_w$w.json" \
               >"$out/gdn_split_w$w.log" 2>&1); echo "DeltaNet verify width $w rc=$?"; grep "a layer" "$out/gdn_split_w$w.log"
           done
           switch_ab ONECAT_GDN_SPLIT_VERIFY seed_route_h200 1 240 seed_route_b1_gdn_split ;;
    gdn_split_route) switch_ab ONECAT_GDN_SPLIT_VERIFY seed_route_h200 1 240 seed_route_b1_gdn_split ;;
    draft_pool_route) switch_ab ONECAT_DRAFT_LENGTH_POOL seed_route_h200 1,8 280 seed_route_draft_pool ;;
    syncs) timeout 300 python3 benchmarks/gpu_round_syncs.py --out "$out/gpu_round_syncs.json" >"$out/syncs.log" 2>&1
           echo "round syncs rc=$?"; grep "synchronizing" "$out/syncs.log" | cut -c1-300 ;;
    narrow_route) switch_ab ONECAT_HYBRID_NARROW_VERIFY seed_route_h200 1 150 seed_route_b1_narrow ;;
    gemv16_route) switch_ab ONECAT_GEMV_16_ROWS seed_route_h200 1 150 seed_route_b1_gemv16 ;;
    moe_fused_route) switch_ab ONECAT_MOE_FUSED_ROUTED seed_moe_route_h200 1,8 280 seed_moe_route_fused ;;
    packed_rows_e2e) (cd benchmarks && timeout 560 python3 gpu_w4a16_e2e.py --batch-sizes 1,32,64 --packed-rows-ab \
             --out "$out/w4a16_e2e_packed_rows.json" >"$out/packed_rows_e2e.log" 2>&1)
           echo "packed rows e2e rc=$?"; grep -E "bs=|speedup" "$out/packed_rows_e2e.log" | cut -c1-300 ;;
    route_profile) timeout 560 python3 benchmarks/seed_routes_gpu.py \
             --routes "${PROFILE_ROUTES:-seed_route_h200,seed_moe_route_h200}" --repeats 1 \
             --batch-sizes "${PROFILE_BATCHES:-1,8}" \
             --profile "$out/route_profile" --out "$out/seed_routes_profiled.json" >"$out/route_profile.log" 2>&1
           echo "route profile rc=$?"; grep -E "tok/s|us a step" "$out/route_profile.log" ;;
    merge) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py -k "merge" \
             >"$out/merge_tests.log" 2>&1; echo "merge tests rc=$?"; tail -3 "$out/merge_tests.log"
           decode_switch_ab ONECAT_MERGE_IN_SPLIT merge ;;
    paged_sweep) (cd benchmarks && timeout 300 python3 gpu_paged_decode.py --out "$out/gpu_paged_decode.json" \
             >"$out/paged_sweep.log" 2>&1); echo "paged decode sweep rc=$?"; grep "context" "$out/paged_sweep.log" | cut -c1-220 ;;
    paged_long) (cd benchmarks && timeout 200 python3 gpu_paged_decode.py --contexts 4096,8192,16384,32768 \
             --out "$out/gpu_paged_decode_long.json" >"$out/paged_long.log" 2>&1); echo "paged decode sweep rc=$?"
           grep "context" "$out/paged_long.log" | cut -c1-160
           for f in 0 1; do
             ONECAT_PAGED_LONG_PARTITION=$f timeout 150 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes 1 \
               --arms no_draft --prompt-len 16384 --max-tokens 128 --out "$out/paged_long_16k_$f.json" \
               >"$out/paged_long_16k_$f.log" 2>&1; echo "16K decode long partition=$f rc=$?"
             grep "target-only" "$out/paged_long_16k_$f.log"
           done
           gpu_tests paged_long tests/test_gpu_engine.py -k "triton_paged or one_pass or graphs_on_off" ;;
    regen) samples=${REGEN_SAMPLES:-/tmp/m/samples}
           opts="{\"device\": \"cuda\", \"samples_file\": \"$samples\", \"regenerate_only\": true,
             \"extra_sampled_answers\": ${REGEN_EXTRA:-2}, \"time_budget_s\": ${REGEN_BUDGET:-400}}"
           timeout $(( ${REGEN_BUDGET:-400} + 60 )) python3 -m onecat.training "${EMBEDDED_GGUF:?set EMBEDDED_GGUF}" \
             "jsonl:${DRAFTER_PROMPTS:?set DRAFTER_PROMPTS}" /tmp/m/regen "$opts" >"$out/regen.log" 2>&1
           echo "regeneration rc=$?"; grep -E "\[regen\]" "$out/regen.log" | tail -4
           [ -d "$samples" ] && cp -r "$samples" "$out/samples" && du -sh "$out/samples" ;;
    admission_waves) gpu_tests pipeline tests/test_engine_core.py -k pipeline
           (cd benchmarks && timeout 300 python3 gpu_admission_waves.py --out "$out/gpu_admission_waves.json" \
             >"$out/admission_waves.log" 2>&1); echo "admission waves rc=$?"; grep -E "wave" "$out/admission_waves.log" ;;
    rope_split) gpu_tests rope_split tests/test_rope_in_split_gpu.py
           decode_switch_ab ONECAT_ROPE_IN_SPLIT rope_split ;;
    rows) timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_rows_gemm_gpu.py \
             tests/test_gemv_gpu.py tests/test_speculative_graphs_gpu.py tests/test_dflash_runtime.py \
             tests/test_gpu_engine.py -k "rows or row or verify or speculation or graphs or bit or draft" \
             >"$out/rows_tests.log" 2>&1; echo "rows tests rc=$?"; tail -3 "$out/rows_tests.log"
           (cd benchmarks && timeout 300 python3 gpu_rows_gemm.py --sweep ${ROWS_ARGS:-} --out "$out/rows_gemm.json" \
             >"$out/rows_gemm.log" 2>&1); echo "rows gemm rc=$?"; grep -E "rows:" "$out/rows_gemm.log" | cut -c1-400 ;;
    rows_ab) for round in ${ROWS_AB_ROUNDS:-1 2}; do for flag in 0 1; do
             ONECAT_ROWS_GEMM=$flag timeout 140 python3 benchmarks/speculative_gpu_rounds.py --batch-sizes ${ROWS_AB_BATCH:-1,8} \
               --arms ngram_shaped,dflash_shaped,no_draft --out "$out/rows_ab_${flag}_$round.json" \
               >"$out/rows_ab_${flag}_$round.log" 2>&1
             echo "rows gemm=$flag round $round rc=$?"; grep "batch" "$out/rows_ab_${flag}_$round.log"
           done; done ;;
    routes) timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_moe_gpu.py \
             tests/test_hybrid_gpu.py -k "packed or rollback" >"$out/routes_tests.log" 2>&1
           echo "routed experts and hybrid verify graph tests rc=$?"; tail -3 "$out/routes_tests.log"
           timeout 560 python3 benchmarks/seed_routes_gpu.py ${ROUTES_ARGS:-} --out "$out/seed_routes_h200.json" \
             >"$out/routes.log" 2>&1; echo "routes rc=$?"; tail -12 "$out/routes.log" ;;
  esac
done
if [ "${BENCH_TAR:-0}" = 1 ]; then
  tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed $out.tgz"
fi
