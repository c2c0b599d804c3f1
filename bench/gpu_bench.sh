#!/usr/bin/env bash
# The GPU rows of bench/RESULTS.md (issue 16), run from the repository root on a CUDA machine:
#   bash bench/gpu_bench.sh checks steps compile swap peers caching levers     # any subset, in that order
# checks   CUDA correctness: block swap / fp8 tests with CUDA visible, and the quickstart trained on the GPU
# steps    one LoRA step, ours vs diffusers + peft, and bf16 vs fp8 / fp8_scaled / fp8_compute base, eager
# compile  the same with every block torch.compile'd (train_lora.py's torch_compile)
# swap     block swap overhead, eager and compiled (FLUX.1-dev 0/16/30 and Qwen-Image 0/20/40 blocks, fp8_scaled),
#          and Qwen-Image with block_swap_prefetch 2 and 4
# peers    ours vs sd-scripts (FLUX.1) and musubi-tuner (Qwen-Image): $SD_SCRIPTS, $MUSUBI checkouts; eager and
#          compiled (--compile), every precision, and FLUX.1 eager with checkpoint_saves_projections; prints the
#          `headline:` lines RESULTS.md opens with
# caching  latent caching images/s of 16 photo JPEGs with FLUX.1's VAE on the GPU, loading ahead in 0-8 threads
# levers   the core's speed levers off and on (complex RoPE, LayerNorm without the copy, the compiled checkpoint region,
#          the recompute without the last projection's GEMM, checkpoint_saves_projections)
# All at 1024 px (4096 image tokens), 512 text tokens, full-width blocks (FLUX 2 double + 4 single,
# Qwen-Image 4 blocks), bf16, gradient checkpointing, rank 16. Logs go to $LOGS (default bench/gpu_logs).
set -o pipefail
PY=${PYTHON:-python3}
LOGS=${LOGS:-bench/gpu_logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
SHAPE="--image-tokens 4096 --text-tokens 512 --double 2 --single 4 --qwen-blocks 4 --warmup 2 --reps 3"
for part in "$@"; do
  case $part in
    checks)
      $PY -m pytest -x -q -p no:warnings tests/test_block_swap.py tests/test_fp8.py tests/test_fp8_compute.py 2>&1 | tail -5 | tee "$LOGS/checks.log"
      $PY tools/make_tiny_models.py --out tiny_models >/dev/null && $PY tools/make_tiny_dataset.py --out tiny_models/concept --concept --overwrite >/dev/null
      $PY train_lora.py --config_file configs/quickstart.toml --output_dir /tmp/qs 2>&1 | tr '\r' '\n' | grep -v "it/s\]" \
        | tail -15 | tee -a "$LOGS/checks.log"
      ls /tmp/qs | tee -a "$LOGS/checks.log" ;;
    steps)
      $PY bench/bench_train_step.py --device cuda --dtype bf16 --sizes mid --checkpointing --mfu $SHAPE 2>&1 | tee "$LOGS/steps_eager.log" ;;
    compile)
      $PY bench/bench_train_step.py --device cuda --dtype bf16 --sizes mid --checkpointing --mfu --compile $SHAPE \
        --families ${COMPILE_FAMILIES:-flux,qwen_image} 2>&1 \
        | grep --line-buffered -v Warning | tee "$LOGS/steps_compile.log" ;;
    swap)
      for c in "" "--compile"; do
        $PY bench/bench_block_swap.py --family flux --swaps 0,16,30 $c 2>&1 | grep -v Warning | tee -a "$LOGS/swap.log"
        $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20,40 $c 2>&1 | grep -v Warning | tee -a "$LOGS/swap.log"
      done
      for p in 2 4; do  # deeper prefetch for Qwen-Image's large blocks
        $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20,40 --prefetch $p 2>&1 | grep -v Warning | tee -a "$LOGS/swap.log"
      done ;;
    peers)  # eager, then both sides compiled as their trainers do; each run ends with RESULTS.md's headline lines
      for c in "" "--compile"; do
        $PY bench/bench_peers.py --device cuda --sizes mid --gemm 8192 --sd_scripts "$SD_SCRIPTS" --musubi "$MUSUBI" $SHAPE $c 2>&1 \
          | grep --line-buffered -v Warning | tee -a "$LOGS/peers.log"
      done
      # FLUX.1 eager and compiled with checkpoint_saves_projections (its trained gates keep the tails' outputs)
      for c in "" "--compile"; do
        $PY bench/bench_peers.py --device cuda --sizes mid --gemm 8192 --families flux --sd_scripts "$SD_SCRIPTS" $SHAPE \
          --save-projections $c 2>&1 | grep --line-buffered -v Warning | tee -a "$LOGS/peers.log"
      done
      grep "^headline:" "$LOGS/peers.log" ;;
    caching)
      $PY bench/bench_caching.py --device cuda --vae flux --workers 0,2,4,8 2>&1 | tee "$LOGS/caching.log" ;;
    levers)
      $PY bench/bench_core_levers.py --device cuda --image-tokens 4096 --text-tokens 512 --double 2 --single 4 \
        --qwen-blocks 4 --reps 7 2>&1 | grep --line-buffered -v Warning | tee "$LOGS/levers.log" ;;
    *) echo "unknown part $part (checks, steps, compile, swap, peers, caching, levers)"; exit 2 ;;
  esac
done
