#!/usr/bin/env bash
# One device call on a GPU box without internet, stage by stage, each under its own time limit, results
# under $OUT/r and packed into $OUT/results.tar.gz (the device tool brings back at most a few files).
# The device has no .git: pass the commit of the (clean) tree that travels.
#
#   there:  ARCTIC_COMMIT=<sha> bash scripts/gpu_round.sh tests zorro-dense
#           (from the repo root; carry .whl, and .tcache holding autotune.tar.gz from an earlier results.tar.gz)
#
# Stages (about how long on the H200):
#   tests          nox -s gpu_tests (ARCTIC_TESTS_LIMIT_S: the stage limit, default 560 s)  (~9 min on 2026-12-02:
#                  arctic-dedup 4 min, arctic-zorro-train 4.5 min)
#   sdpa-tests     the GPU tests of tree attention's sdpa backend        (~1 min)
#   zorro-dense    ZoRRO dense P=8192 G=16 R=512: sdpa and Flex dedup vs HF SDPA  (~2 min)
#   zorro-ragged   the ragged variant                                    (~2 min)
#   zorro-hybrid   Qwen3.5-like hybrid (needs the fla wheels; with Triton 3.6 only timed despite fla #640, see
#                  scripts/fetch_triton_parts.sh for Triton 3.7.1 and ARCTIC_TRITON)  (~5-7 min: 247 s measured
#                  with fla's kernels already compiled, before the 4- and 16-sample baselines were added; on a fresh
#                  machine fla's autotuner first compiles ~180 configs, ~2.4 s each: run it after hybrid-tests)
#   hybrid-tests   the hybrid GPU gradient test (fla kernels when they are usable; a fresh machine first spends
#                  2-4 min compiling fla's autotune configs)  (~5 min)
#   zorro-sweep    dedup-ratio sweep at P 2048 and 8192, or the P of ARCTIC_SWEEP_PROMPTS="512 2048 8192"  (~4 min)
#   zorro-sweep-ends  the sweep at P 512 and 32768 (rows merge by prompt)  (~4 min)
#   zorro-memory   peak memory at equal G, max G, dedup at 4x the baseline's max G  (~5 min)
#   zorro-profile  kernels by category for one dedup step                (~1.5 min)
#   zorro-profile-hybrid  the same for the hybrid (full recompute; Gated DeltaNet kernels as a category; after
#                  hybrid-tests or zorro-hybrid on the same machine, so fla's kernels are compiled)  (~2 min)
#   zorro-profile-hybrid-torch  the same with transformers' torch norms and conv (--fused-kernels never): the A/B
#                  of the fused kernels  (~2 min)
#   zorro-profile-hybrid-nr  the hybrid profile without recompute (dedup vs 2 packed samples, 80 kernels kept)  (~1 min)
#   bf16-noise-hybrid  where the hybrid's bf16 gradient error comes from: dedup and two non-dedup controls against the
#                  fp32 truth, seeds 0-2 of the hybrid GPU test's batch, fused kernels on and off  (~3 min)
#   tree-attention the tree-attention benchmark (all backends, three shapes)  (~4 min)
#   tree-quick     its correctness section and the first shape            (~2 min)
#   tree-sdpa-rule sdpa vs Flex on many small trees, 4K-token trees and a trie (auto's rule)  (~3 min)
#   fca-decode     the forest decode benchmark                           (~3 min)
#                  ARCTIC_FCA_CASES=single_group_16x8704,...: those cases; ARCTIC_FCA_ROUNDS=3: the variant
#                  list three times over, alternating; ARCTIC_FCA_BUDGET_S / ARCTIC_FCA_LIMIT_S: the diagnosis's
#                  --budget-s (default 170) and the stage's limit (default 240 s))  (~3 min)
#                  time), computed, or contiguous (fca_loop_probe.json)  (~1-2 min)
#                  stages, one and four programs per SM (fca_loop_probe_suffix_ids.json)  (~1 min)
#                  item, and a read-only kernel's ceiling (fca_flat_probe.json)  (~1 min)
#                  sharing (fca_timeline.json, fca_timeline.png)  (~1 min)
#                  without dependent launches, clocks and power logged (fca_decode_paged_order.json)  (~1 min)
#   forest-tests   the forest decode GPU tests alone                     (~1-2 min)
#                  (throughput, memory, warp stalls, occupancy; fca_ncu.log)  (~2 min)
#                  (fca_ncu_single.log)  (~1 min)
#                  (fca_ws_probe.json)  (~1 min)
#                  duration; fca_ncu_plan.log)  (~1 min)
#   fused-kernels  the hybrid's fused norms and conv against transformers' torch code  (~1 min)
#   kernel-tests   the GPU tests of the fused kernels (norms, conv, SwiGLU, log-prob chunk, fused hybrids)  (~1 min)
#   dense-tests    the dense bf16 gradient tests of arctic-zorro-train (every tree-attention backend)  (~1 min)
#   pack-unpack    pack/unpack bandwidth sweep                           (~1 min)
#   fca-quick      the forest decode benchmark without its tuning sweep   (~1.5 min)
#   headline       the README's headline rows again: python benchmarks/run.py --quick (pack/unpack, tree attention
#                  quick, forest decode quick, ZoRRO dense, fused kernels; each benchmark's JSON + PNG)  (~8 min)
# Stages with vLLM (after scripts/unpack_carry.sh installed it into /tmp/site and .whl holds the project's
# wheels; the two-call procedure is in docs/gpu.md):
#   fca-vllm       FCA inside vLLM vs vLLM's default decode, every row and the exactness engines
#                  (benchmarks/fca_vllm.py; ARCTIC_FCA_VLLM_ARGS: extra arguments such as "--rows ... --skip-exactness";
#                  it starts no engine after ARCTIC_FCA_VLLM_BUDGET_S, default 470 s)  (~9 min)
#   fca-vllm-quick the same with --quick (the 4B 8x16 row, one 0.6B row, exactness on the 0.6B shape)  (~5 min)
#   fca-vllm-tests arctic-fca's GPU tests: FCA inside vLLM, same greedy tokens in float32, logprobs in bf16  (~2 min)
#   fca-vllm-repeats  the host-bound 0.6B 8x16x4096 row with three engines of each backend, started alternately
#                  (--instances 3): vLLM's host time per step differs between engine instances by more than the
#                  backends differ there (~70 s an engine, ~7 min); ARCTIC_FCA_VLLM_ARGS="--rows
#                  06b_noshare_128x1x8192_t128" for the no-sharing row instead; ARCTIC_BENCH_NO_PDL=1 launches FCA's
#                  kernels without dependent launches; ARCTIC_BENCH_FA3_OWN_SCHEDULE=1 lets FlashAttention schedule
#                  the requests FCA leaves it from their own lengths (=nosplit: also one split per request; compare
#                  the rows' attention GPU ms)
#   fca-vllm-fa3-ab  the 0.6B 8x16x8192 row (every request grouped) three times: FlashAttention's share scheduled
#                  by vLLM ahead of time, by FA3 itself, by FA3 with one split; JSONs in $out/fa3_ab_{0,1,nosplit}
#                  (the default engine once, FCA's three times: 4 engines of ~70 s, ~5 min)
# Stages of the RL stack (after vLLM's carry and scripts/unpack_carry.sh .carry/rl/calls/00, which installs Ray,
# DeepSpeed, TRL and the four packages into /tmp/site):
#   rl-step        benchmarks/rl_step_gpu.py, our side: ARCTIC_RL_MODEL (default 1.7b, the shape whose trainer stays
#                  awake beside the sampler on an 80 GB card; 4b fits one with ARCTIC_RL_VARIANTS=colocated, the
#                  trainer offloaded while sampling: 247 s on an H100), ARCTIC_RL_VARIANTS (default "colocated
#                  colocated_trainer_awake"), 3 steps; JSON in $out/rl_ours  (~3 min a variant at 1.7b: 65 s of
#                  engine start, 42 s first step, 22 s a step on an H100; 4b: 84 s, 62 s, 27 s)
#   rl-step-trl    the same script, TRL 1.16's side alone, 2 steps (the first is warm-up); JSON in $out/rl_trl; join
#                  both with --merge where no GPU is needed  (~7 min: TRL's 1.7B step is ~163 s on an H100)
#   main-job       python recipes/grpo_parity.py as a user runs it: on a GPU machine it trains on the GPU, trainer and
#                  sampler colocated (sleep / wake), ZoRRO and FCA on; its report in $out/main_job  (~3 min)
#   main-job-repeats  the main job at seed 0 with FCA and with --no-fca, and at seed 1 with FCA: does the wider
#                  model learn on the GPU at its learning rate (3e-3; at 1e-2 it collapsed at 0.5 on the H100 and in 3
#                  of 4 CPU seeds with and without FCA)?  $out/main_job_seed*  (~3 x 2.5 min)
#   readme-loop    benchmarks/readme_loop_gpu.py: the README's loop snippet as a user's script, edited for one GPU
#                  (a random model of ARCTIC_RL_MODEL's layer shape, default 4b: needs the H200's memory; colocated);
#                  JSON in $out  (not yet run: the model build, ~1 min of engine start, 3 steps)
# The exit status is that of the last stage that failed (0 when all succeeded).
set -uo pipefail
out="${OUT:-benchmarks/results}/r"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# A stage that runs past its limit gets SIGABRT first, so Python prints where every thread was (faulthandler).
export PYTHONFAULTHANDLER=1
# vLLM on these boxes: no FlashInfer sampler is carried, no hub, no usage reports.
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
fi
# Triton's autotune choices (fla's kernels cache theirs: FLA_CACHE_RESULTS) travel between calls: a carried
# .tcache/autotune.tar.gz (from an earlier call's results) is unpacked into the cache first, so a fresh machine
# compiles only the chosen configs; every call packs the choices it has into $out/autotune.tar.gz.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache}"
mkdir -p "$TRITON_CACHE_DIR"
# scripts/h200_autotune.tar.gz: the choices of the 2026-12-01 H200 runs (Triton 3.6 and 3.7.1, fla-core 0.6.0; a
# choice is keyed by Triton's version, the kernel's source and the configs, so a stale one is simply never found).
for choices in scripts/h200_autotune.tar.gz .tcache/autotune.tar.gz; do
  if [ -f "$choices" ]; then tar -xzf "$choices" -C "$TRITON_CACHE_DIR"; fi
done
# The tree's own code goes first (a carried wheel of an older commit is only there for its entry point).
packages="$PWD/packages/arctic-dedup/src:$PWD/packages/arctic-zorro-train/src:$PWD/packages/arctic-fca/src"
packages="$packages:$PWD/packages/arctic-rl/src:$PWD/src"
# ARCTIC_TRITON=/tmp/triton371: a newer Triton assembled by scripts/gpu_triton.sh goes first on the path (for fla's
# Gated DeltaNet kernels on Hopper; torch.compile users such as FlexAttention may not work with it).
triton_dir=""
if [ -n "${ARCTIC_TRITON:-}" ] && [ -d "$ARCTIC_TRITON/triton" ]; then triton_dir="$ARCTIC_TRITON:"; fi
export PYTHONPATH="$packages:$triton_dir/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/device.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  >> "$out/device.txt" 2>&1
failed=0
run() {  # run NAME SECONDS COMMAND...
  local name=$1 seconds=$2
  shift 2
  local began=$SECONDS
  timeout -s ABRT -k 15 "$seconds" "$@" > "$out/$name.log" 2>&1
  local status=$?
  [ "$status" -ne 0 ] && failed=$status
  echo "== $name: exit $status in $((SECONDS - began)) s =="
  grep -v -i "warn" "$out/$name.log" | tail -"${ARCTIC_TAIL:-12}"
}
zorro=(python3 benchmarks/zorro_train.py --quick --out "$out")
for stage in "$@"; do
  case "$stage" in
    tests) OUT="$out" run gpu_tests "${ARCTIC_TESTS_LIMIT_S:-560}" python3 -m nox -s gpu_tests ;;
    sdpa-tests) ARCTIC_GPU_TESTS=1 TRITON_INTERPRET=0 run sdpa_tests 150 python3 -m pytest -q -m gpu -k sdpa \
      -p no:cacheprovider packages/arctic-dedup/tests/attention/test_tree_attention_gpu.py ;;
    zorro-dense) run zorro_dense 240 "${zorro[@]}" --sections dense --dedup-backends sdpa flex --baselines hf_sdpa ;;
    zorro-ragged) run zorro_ragged 240 "${zorro[@]}" --sections ragged --dedup-backends sdpa flex --baselines hf_sdpa ;;
    zorro-hybrid) run zorro_hybrid 560 "${zorro[@]}" --sections hybrid --dedup-backends sdpa --time-despite-fla-640 ;;
    hybrid-tests) ARCTIC_GPU_TESTS=1 TRITON_INTERPRET=0 run hybrid_tests 420 python3 -m pytest -q -m gpu -k hybrid \
      -p no:cacheprovider -rs packages/arctic-zorro-train/tests/test_gpu.py ;;
    zorro-sweep) run zorro_sweep 330 "${zorro[@]}" --sections sweep --sweep-prompts ${ARCTIC_SWEEP_PROMPTS:-2048 8192} ;;
    zorro-sweep-ends) run zorro_sweep_ends 330 "${zorro[@]}" --sections sweep --sweep-prompts 512 32768 ;;
    zorro-memory) run zorro_memory 420 "${zorro[@]}" --sections memory --dedup-backends sdpa ;;
    zorro-profile) run zorro_profile 200 python3 benchmarks/lab/zorro_profile.py --out "$out" ;;
    zorro-profile-hybrid) run zorro_profile_hybrid "${ARCTIC_PROFILE_S:-300}" python3 benchmarks/lab/zorro_profile.py --model hybrid --backend sdpa \
      --time-despite-fla-640 --baseline-samples 1 --out "$out" ;;
    zorro-profile-hybrid-torch) run zorro_profile_hybrid_torch "${ARCTIC_PROFILE_S:-300}" python3 benchmarks/lab/zorro_profile.py \
      --model hybrid --backend sdpa --fused-kernels never --time-despite-fla-640 --baseline-samples 1 --out "$out" ;;
    zorro-profile-hybrid-nr) run zorro_profile_hybrid_nr "${ARCTIC_PROFILE_S:-300}" python3 benchmarks/lab/zorro_profile.py \
      --model hybrid --backend sdpa --recompute none --top 80 --time-despite-fla-640 --baseline-samples 2 --out "$out" ;;
    bf16-noise-hybrid) run bf16_noise_hybrid 300 python3 benchmarks/lab/zorro_bf16_noise.py --family qwen3_5 \
      --seeds 0 1 2 --out "$out" ;;
    tree-attention) run tree_attention 300 python3 benchmarks/tree_attention.py --out "$out" ;;
    tree-quick) run tree_quick 200 python3 benchmarks/tree_attention.py --quick --budget-s 170 --out "$out" ;;
    tree-sdpa-rule) run tree_sdpa_rule 240 python3 benchmarks/tree_attention.py --sdpa-rule --out "$out" ;;
    fca-decode) run fca_decode 240 python3 benchmarks/fca_decode.py --out "$out" ;;
    forest-tests) ARCTIC_GPU_TESTS=1 TRITON_INTERPRET=0 run forest_tests 240 python3 -m pytest -q -m gpu \
      -p no:cacheprovider -rs packages/arctic-dedup/tests/forest/test_forest_gpu.py ;;
    fused-kernels) run fused_kernels 150 python3 benchmarks/fused_kernels.py --out "$out" ;;
    kernel-tests) ARCTIC_GPU_TESTS=1 TRITON_INTERPRET=0 run kernel_tests 240 python3 -m pytest -q -m gpu \
      -p no:cacheprovider -rs packages/arctic-zorro-train/tests/test_fused_norms.py \
      packages/arctic-zorro-train/tests/test_causal_conv.py packages/arctic-zorro-train/tests/test_swiglu.py \
      packages/arctic-zorro-train/tests/test_fused_model.py packages/arctic-zorro-train/tests/test_fused_logprobs.py ;;
    dense-tests) ARCTIC_GPU_TESTS=1 TRITON_INTERPRET=0 run dense_tests 240 python3 -m pytest -q -m gpu -k dense \
      -p no:cacheprovider -rs packages/arctic-zorro-train/tests/test_gpu.py ;;
    fca-quick) run fca_quick 150 python3 benchmarks/fca_decode.py --quick --out "$out" ;;
    headline) run headline 590 python3 benchmarks/run.py --quick --out "$out" ;;
    pack-unpack) run pack_unpack 150 python3 benchmarks/pack_unpack.py --out "$out" ;;
    fca-vllm) run fca_vllm 590 python3 benchmarks/fca_vllm.py --out "$out" --budget-s "${ARCTIC_FCA_VLLM_BUDGET_S:-470}" \
      ${ARCTIC_FCA_VLLM_ARGS:-} ;;
    fca-vllm-quick) run fca_vllm_quick 400 python3 benchmarks/fca_vllm.py --quick --out "$out" --budget-s 300 ;;
    fca-vllm-tests) ARCTIC_GPU_TESTS=1 TRITON_INTERPRET=0 run fca_vllm_tests 425 python3 -m pytest -q -m gpu \
      -p no:cacheprovider -rs packages/arctic-fca/tests ;;
    fca-vllm-repeats) run fca_vllm_repeats 590 python3 benchmarks/fca_vllm.py --models 06b --skip-exactness \
      --rows 06b_8x16x4096_t128 --instances 3 --budget-s 470 --out "$out" ${ARCTIC_FCA_VLLM_ARGS:-} ;;
    fca-vllm-fa3-ab) for mode in 0 1 nosplit; do
        backends="default fca"; [ "$mode" = 0 ] || backends=fca
        ARCTIC_BENCH_FA3_OWN_SCHEDULE=$mode run "fa3_ab_$mode" 190 python3 benchmarks/fca_vllm.py --models 06b \
          --skip-exactness --rows 06b_8x16x8192_t256 --backends $backends --budget-s 120 --out "$out/fa3_ab_$mode"
      done ;;
    rl-step) run rl_step "${ARCTIC_RL_LIMIT_S:-590}" python3 benchmarks/rl_step_gpu.py --model "${ARCTIC_RL_MODEL:-1.7b}" \
      --variants ${ARCTIC_RL_VARIANTS:-colocated colocated_trainer_awake} --steps 3 --trl-python '' --out "$out/rl_ours" ;;
    rl-step-trl) run rl_step_trl "${ARCTIC_RL_LIMIT_S:-590}" python3 benchmarks/rl_step_gpu.py \
      --model "${ARCTIC_RL_MODEL:-1.7b}" --variants --steps 2 --out "$out/rl_trl" ;;
    main-job) run main_job "${ARCTIC_RL_LIMIT_S:-590}" python3 recipes/grpo_parity.py --out "$out/main_job" \
      ${ARCTIC_MAIN_JOB_ARGS:-} ;;
    main-job-repeats) for args in "--seed 0" "--seed 0 --no-fca" "--seed 1"; do
        name="main_job_$(echo "$args" | tr -d ' -')"
        run "$name" 170 python3 recipes/grpo_parity.py $args --out "$out/$name"
      done ;;
    readme-loop) run readme_loop "${ARCTIC_RL_LIMIT_S:-590}" python3 benchmarks/readme_loop_gpu.py \
      --model "${ARCTIC_RL_MODEL:-4b}" --timeout-s 540 --out "$out" ;;
    *) echo "unknown stage $stage (see the header of $0)"; exit 2 ;;
  esac
done
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$out/autotune.tar.gz" -T -)
tar -czf "$out/../results.tar.gz" -C "$out" .
exit $failed
