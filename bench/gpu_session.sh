#!/usr/bin/env bash
# One call on a lent GPU (the device tool's `run`), from the repository root, after bench/gpu_prepare.sh
# here and with its folders carried (carry [".whl", ".peers"]):
#   bash bench/gpu_session.sh PLAN [SECONDS]
# PLAN headline  issue 29's `headline:` lines, most wanted first: ours vs sd-scripts (FLUX.1, ours with
#                checkpoint_saves_projections) and musubi-tuner (Qwen-Image), ours with
#                checkpoint_saves_attention, bf16 eager, bf16 compiled, fp8 eager, fp8 compiled (FLUX.1 fp8:
#                sd-scripts' fp8_base; Qwen-Image fp8_scaled)
#      rest      CUDA checks (tests, the quickstart), FLUX.1 without the keys (eager and compiled), the core
#                levers (the two that keep attention in their own step), block swap eager / compiled / with
#                prefetch
#      profile   where the step's time goes, ours and the peer's (bench/profile_peers.py): device time as a
#                share of the wall time, kernel launches per step, the top kernels; FLUX.1 compiled, Qwen-Image
#                eager, FLUX.1 eager, Qwen-Image compiled
#      verify    the full-size compiled steps (bench_block_swap.py --compile, both families, swap 0 and the
#                24 GB card's count): dynamo's recompile limit sent all but 8 blocks eager until 2026-11-27;
#                then FLUX.1 compiled against sd-scripts with CUDA graphs on ours (--our-compile-mode)
#      eager     the fused RMSNorm on eager steps (bench_core_levers.py rms_fused, both families), the eager
#                headline lines with it, then the one headline line the H200 run of 2026-11-27 missed
#                (Qwen-Image fp8_scaled compiled)
#      checkpoint  eager_checkpoint (landed 2026-11-29, untimed on a GPU: the checkpointed forward under no_grad,
#                host time x0.80-0.83 on the CPU): its CUDA tests, its lever on both families (plain, and with
#                both keys), then the eager headline lines (bf16, fp8) with it, attention as in every line
#                before (--sdpa flash: cuDNN off on both sides)
#      attention the headline lines (bf16 eager and compiled) in torch's own attention choice on both sides
#                (--sdpa default: cuDNN first on sm90 / sm100, what users of all three trainers get; every line
#                up to 2026-11-28 switched cuDNN off), each run saying which kernels each side ran
#      candidates  code measured before it lands: each bench/candidates/*.diff applied to this copy of the tree
#                (the device's; nothing here changes; none waits since fp8_dequant_fused was dropped on
#                2026-12-04), then the fp8 CUDA tests (tests/test_fp8*.py), the eager fp8 headline lines and the
#                eager Qwen-Image block swap (an fp8_scaled base) with them; a candidate's own lever goes in here
#      swapprobe the eager Qwen-Image block swap (x1.12-x1.19 over no swap; copies 0.26 s of a step, ~60% exposed,
#                host time level): one step of swap 0 and 20 (prefetch 2, then 4) as a timeline
#                (bench_block_swap.py --trace, read by bench/trace_overlap.py: the compute stream's idle time
#                waiting on copies vs on the host, the longest gaps); traces gzipped under LOGS/traces
#      families  the families landed since the last GPU call (FLUX.3, ERNIE-Image, Nucleus-Image: fp8 packed experts,
#                expert-choice routing, grouped-query masked attention) on CUDA: every tiny transformer's CUDA forward
#                against its CPU one (tests/test_cuda_families.py, fp32 and fp8_scaled), then the Nucleus-Image
#                quickstart on the learned base in bf16 (caching, training over fp8_scaled experts, samples) and its
#                concept demo (the CPU's figure: 0/18 -> 15/18)
#      since     for a lease of one call (15 minutes in all): the CUDA tests of `families` and `checkpoint`, the eager
#                headline lines (bf16, fp8), the eager_checkpoint lever, then compiled FLUX.1 under torch's attention
#      dequantized  checkpoint_saves_dequantized (2026-12-04, untimed on a GPU: the eager recompute keeps each low-bit
#                Linear's dequantized weight for its backward): its CUDA tests, its lever on both families (fp8_scaled,
#                nf4) and the two always-on cuts of 2026-12-04 (stand_in, per_sample), the eager fp8 headline
#                lines with it (Qwen-Image fp8_scaled: 0.85, the target 0.80), then the eager Qwen-Image block swap
#                on landed code (x1.028 on 2026-12-04 with a since-dropped candidate applied: to confirm)
#      fp8compute  fp8_compute compiled (never timed; eager x1.18-1.45 of bf16): its CUDA tests (the compiled
#                layer's fused quantizers against the fp8 oracle), bf16 / fp8 / fp8_scaled / fp8_compute compiled
#                (bench_train_step, both families), then the compiled fp8 headline lines with ours on fp8_compute
#      next      for a lease of one call: the fp8 GEMMs' CUDA oracle test and their accumulation error
#                (bench/fp8_gemm_error.py), bf16 / fp8 / fp8_scaled / fp8_compute compiled in one process (both
#                families), the eager Qwen-Image fp8_scaled line again, the eager stand_in / per_sample cuts
#                (the 2026-12-04 18:42 call ran the one before: both fp8 levers' tests and lines)
#      fp8swap   fp8 / fp8_scaled / fp8_compute against bf16 (bench_train_step, both families), then block
#                swap eager (FLUX.1 0 and 16 blocks, Qwen-Image 0 and 20 with prefetch 2)
# SECONDS (default 540) bounds the whole call: each step runs under the time left, a step that would start
# with under 45 s left is skipped and said so. Logs go to $OUT (the device tool brings back 8 files at
# most: these are 6) or bench/gpu_logs; session.log ends with every headline line of the call.
# Settings as bench/gpu_bench.sh: 1024 px (4096 image + 512 text tokens), full-width blocks (FLUX.1 2 double
# + 4 single, Qwen-Image 4), bf16 autocast, gradient checkpointing, rank 16.
set -o pipefail
plan=${1:?usage: bash bench/gpu_session.sh PLAN [SECONDS], PLAN one of headline rest profile verify eager checkpoint \
attention candidates swapprobe fp8swap families since dequantized fp8compute next}
budget=${2:-540}
start=$SECONDS
LOGS=${OUT:-bench/gpu_logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
# Without the carried folders every step failed at its imports (the device's python has no toml, diffusers,
# prodigyopt) or found no peer: the whole call spent for nothing. Said at once now.
if [ -z "${PYTHON:-}" ] && [ ! -d .whl ]; then
    echo "no .whl here: run bench/gpu_prepare.sh on the dev machine and carry [\".whl\", \".peers\"]" | tee -a "$LOGS/session.log"
    exit 1
fi
case $plan in swapprobe | fp8swap | families) ;; *)  # every other plan runs a peer
    if [ ! -d .peers/sd-scripts ] || [ ! -d .peers/musubi-tuner ]; then
        echo "no .peers/sd-scripts or .peers/musubi-tuner: run bench/gpu_prepare.sh and carry .peers" | tee -a "$LOGS/session.log"
        exit 1
    fi ;;
esac
if [ -d .whl ] && [ -z "${PYTHON:-}" ]; then  # the device's torch stays; what else it lacks comes as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" | tee -a "$LOGS/session.log"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
PY=${PYTHON:-python3}
# A smoke test here: PYTHON=.venv/bin/python DEVICE=cpu SHAPE="--image-tokens 64 --text-tokens 16 --double 1
# --single 1 --qwen-blocks 1 --warmup 1 --reps 1" GEMM=1024 bash bench/gpu_session.sh headline 1800
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-"--image-tokens 4096 --text-tokens 512 --double 2 --single 4 --qwen-blocks 4 --warmup 3 --reps 10"}
# attention as in every line so far (flash on both sides, cuDNN off: RESULTS.md) unless a plan says --sdpa default
PEERS="--device $DEVICE --sizes mid --gemm ${GEMM:-8192} --sd_scripts .peers/sd-scripts --musubi .peers/musubi-tuner $SHAPE --sdpa flash"
KEEP="--save-attention"  # the headline's: ours in its fastest documented setting
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
    $PY -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'diffusers', diffusers.__version__,
        'transformers', transformers.__version__, 'peft', peft.__version__)"
    echo "plan $plan, budget ${budget} s"
} 2>&1 | tee -a "$LOGS/session.log"

# step LOG LIMIT COMMAND...: COMMAND under min(LIMIT, time left), its output appended to LOGS/LOG
step() {
    local log=$1 limit=$2
    shift 2
    local left=$((budget - (SECONDS - start) - 5))
    if ((left < 45)); then
        echo "skipped (${left} s left): $*" | tee -a "$LOGS/session.log"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== at $((SECONDS - start)) s, limit $limit s: $*" | tee -a "$LOGS/session.log" "$LOGS/$log"
    # library noise out (FutureWarning / DeprecationWarning lines and warnings' source echo), our own
    # warnings in: the trainer's (e.g. torch_compile's recompile-limit one) are findings
    timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v -E 'FutureWarning|DeprecationWarning|^ +warnings\.warn\(' \
        >>"$LOGS/$log"
    echo "== rc ${PIPESTATUS[0]} at $((SECONDS - start)) s" | tee -a "$LOGS/session.log" "$LOGS/$log"
}

case $plan in
    headline)
        step peers_eager.log 150 $PY bench/bench_peers.py $PEERS --precisions bf16 --save-projections $KEEP
        for family in flux qwen_image; do  # one run each: a compile that outlasts its limit costs one line
            step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families $family --precisions bf16 \
                --save-projections $KEEP --compile
        done
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections $KEEP
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP
        step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections $KEEP --compile
        step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP --compile
        ;;
    rest)
        step checks.log 120 $PY -m pytest -x -q -p no:cacheprovider tests/test_block_swap.py tests/test_fp8.py \
            tests/test_fp8_compute.py tests/test_residual_projection.py
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families flux --precisions bf16
        step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families flux --precisions bf16 --compile
        step levers.log 240 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 \
            --levers rope,layernorm,compile,tail,save,save_compiled,quantized_compiled
        step levers.log 150 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 \
            --levers attention,attention_compiled
        for c in "" "--compile"; do
            step swap.log 150 $PY bench/bench_block_swap.py --family flux --swaps 0,16,30 $c
            step swap.log 150 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20,40 $c
        done
        step swap.log 150 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20,40 --prefetch 2
        ;;
    profile)  # where the step's time goes: FLUX.1 compiled first (0.91 against sd-scripts, MFU 44% vs their 48%)
        PROF="--device $DEVICE --sd_scripts .peers/sd-scripts --musubi .peers/musubi-tuner --reps 10 --steps 3 --sdpa flash ${PROF_SHAPE:-}"
        step profile.log 200 $PY bench/profile_peers.py $PROF --families flux --precision bf16 --save-projections --save-attention --compile
        step profile.log 120 $PY bench/profile_peers.py $PROF --families qwen_image --precision bf16 --save-attention
        step profile.log 120 $PY bench/profile_peers.py $PROF --families flux --precision bf16 --save-projections --save-attention
        step profile.log 200 $PY bench/profile_peers.py $PROF --families qwen_image --precision bf16 --save-attention --compile
        ;;
    verify)  # the compiled full-size step after the per-block recompile fix of 2026-11-27 (2.03 s on an H200 before)
        step swapc.log 220 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20 --prefetch 2 --compile
        step swapc.log 220 $PY bench/bench_block_swap.py --family flux --swaps 0,16 --compile
        # FLUX.1 compiled is 0.91 with 11% of our wall in host gaps (the profile of 2026-11-27): CUDA graphs on ours
        step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families flux --precisions bf16 \
            --save-projections $KEEP --compile --our-compile-mode reduce-overhead
        ;;
    eager)  # eager Qwen-Image is bound by launching kernels (H200 profile: GPU busy 46% of the step)
        step levers.log 150 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 --levers rms_fused
        step peers_eager.log 150 $PY bench/bench_peers.py $PEERS --precisions bf16 --save-projections $KEEP
        step peers_compiled.log 220 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP --compile
        ;;
    checkpoint)  # the eager step's host time: the checkpointed forward records no graph (eager_checkpoint.py)
        # the CUDA tests alone (-k cuda): the files' CPU tests ran here (the three files: ~230 s on 2 busy cores)
        step checks.log 120 $PY -m pytest -x -q -p no:cacheprovider -k cuda tests/test_eager_checkpoint.py \
            tests/test_saved_attention.py tests/test_residual_projection.py
        step levers.log 200 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 \
            --levers eager_checkpoint,eager_checkpoint_kept
        step peers_eager.log 150 $PY bench/bench_peers.py $PEERS --precisions bf16 --save-projections $KEEP
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections $KEEP
        ;;
    attention)  # torch's own SDPA choice on both sides (cuDNN on Hopper): the setting users train in; one family
        # a run (cuDNN hit an illegal memory access on diffusers' strided FLUX call on torch 2.11 + H100: a sticky
        # CUDA error ends its process, so one family's crash leaves the other's lines)
        for family in flux qwen_image; do
            step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families $family --precisions bf16 \
                --save-projections $KEEP --sdpa default
        done
        for family in flux qwen_image; do
            step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families $family --precisions bf16 \
                --save-projections $KEEP --compile --sdpa default
        done
        ;;
    candidates)  # a patch already applied (a warm machine keeps the tree) is left as it is
        for patch in bench/candidates/*.diff; do  # (git apply needs no repository; patch where git is missing)
            [ -e "$patch" ] || continue  # none waiting: the rest of the plan measures the landed code
            if command -v git >/dev/null; then
                git apply --reverse --check "$patch" 2>/dev/null || git apply "$patch"
            else
                patch -p1 -R -s -f --dry-run <"$patch" >/dev/null 2>&1 || patch -p1 -s -f <"$patch"
            fi || { echo "$patch does not apply" | tee -a "$LOGS/session.log"; exit 1; }
        done
        step checks.log 120 $PY -m pytest -x -q -p no:cacheprovider -k cuda tests/test_fp8.py tests/test_fp8_compute.py
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections $KEEP
        step peers_eager.log 100 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP
        step swap.log 100 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20 --prefetch 2
        ;;
    swapprobe)  # where the eager Qwen-Image swap's x1.18 goes: a deeper prefetch, then one step under the profiler
        step swap.log 150 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20 --prefetch 2 \
            --steps 3 --trace "$LOGS/traces/prefetch2"
        step swap.log 150 $PY bench/bench_block_swap.py --family qwen_image --swaps 20 --prefetch 4 \
            --steps 3 --trace "$LOGS/traces/prefetch4"
        # a full-size trace gzipped may pass the 16 MiB a returned file may have (a 3-block one: 1.2 MB, 60 blocks
        # ~25 MB): trace_overlap's report in swap.log holds the figures either way
        gzip -f "$LOGS"/traces/*/*.json 2>/dev/null
        ;;
    families)  # CUDA checks of the newest families; no peer
        step checks.log 180 $PY -m pytest -x -q -p no:cacheprovider tests/test_cuda_families.py
        step quickstart.log 60 $PY tools/make_tiny_dataset.py --out tiny_models/concept --concept --overwrite
        QS="--config_file configs/quickstart_nucleus_image.toml"  # its files out of LOGS: 8 come back at most
        step quickstart.log 150 $PY train_lora.py $QS --mixed_precision bf16 --output_dir /tmp/qs_nucleus
        step quickstart.log 120 $PY tools/concept_demo.py $QS --lora /tmp/qs_nucleus/tiny_nucleus_image_lora.safetensors \
            --grid "$LOGS/nucleus_concept_grid.png"
        ;;
    since)  # what landed since the last GPU call (2026-11-28), most wanted first, for a lease of one call: the CUDA
        # tests of the newest families and of eager_checkpoint, the eager headline lines (eager_checkpoint's first
        # GPU figures), its lever against torch's checkpoint, then compiled FLUX.1 under torch's attention choice
        step checks.log 170 $PY -m pytest -q -p no:cacheprovider -k cuda tests/test_cuda_families.py \
            tests/test_eager_checkpoint.py tests/test_saved_attention.py tests/test_residual_projection.py
        step peers_eager.log 120 $PY bench/bench_peers.py $PEERS --precisions bf16 --save-projections $KEEP
        step peers_eager.log 90 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP
        step peers_eager.log 90 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections $KEEP
        step levers.log 150 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 \
            --levers eager_checkpoint,eager_checkpoint_kept
        step peers_compiled.log 200 $PY bench/bench_peers.py $PEERS --families flux --precisions bf16 \
            --save-projections $KEEP --compile --sdpa default
        ;;
    dequantized)  # the eager fp8 step dequantized each weight three times (forward, recompute, backward),
        # the peers twice
        step checks.log 90 $PY -m pytest -q -p no:cacheprovider -k cuda tests/test_saved_dequantized.py
        step levers.log 240 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 \
            --levers dequantized,stand_in,per_sample,dequantized_nf4
        step peers_eager.log 90 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP \
            --save-dequantized
        step peers_eager.log 90 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections \
            $KEEP --save-dequantized
        step swap.log 150 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20 --prefetch 2 --steps 3
        ;;
    next)  # for a lease of one call (after 2026-12-04 18:42, whose `next` timed both fp8 levers): the fp8 GEMMs'
        # CUDA oracle test with its accumulation bound and the device's measured excess, then bf16 / fp8 /
        # fp8_scaled / fp8_compute compiled in one process (is fp8_compute faster than bf16?), then the eager
        # Qwen-Image fp8_scaled line again (0.86 drifted through its ten steps), then the untimed eager cuts
        step checks.log 100 $PY -m pytest -q -p no:cacheprovider -k cuda tests/test_fp8_compute.py
        step checks.log 60 $PY bench/fp8_gemm_error.py --device "$DEVICE"
        for family in flux qwen_image; do
            step fp8.log 150 $PY bench/bench_train_step.py --device "$DEVICE" --dtype bf16 --sizes mid --families $family \
                --skip-ref --checkpointing --compile --mfu $SHAPE --warmup 2 --reps 5
        done
        step peers_eager.log 90 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP \
            --save-dequantized
        step levers.log 120 $PY bench/bench_core_levers.py --device "$DEVICE" $SHAPE --reps 7 --levers stand_in,per_sample
        ;;
    fp8compute)  # fp8_compute compiled, never timed: eager it is slower than bf16 (x1.18-1.45: each quantizer's
        # passes and launches beside a small fp8 GEMM); compiled, inductor fuses each quantizer into one kernel
        step checks.log 100 $PY -m pytest -q -p no:cacheprovider -k cuda tests/test_fp8_compute.py
        step checks.log 60 $PY bench/fp8_gemm_error.py --device "$DEVICE"  # the CUDA test's accumulation bound
        for family in flux qwen_image; do
            step fp8.log 150 $PY bench/bench_train_step.py --device "$DEVICE" --dtype bf16 --sizes mid --families $family \
                --skip-ref --checkpointing --compile --mfu $SHAPE --warmup 2 --reps 5
        done
        step peers_compiled.log 120 $PY bench/bench_peers.py $PEERS --families flux --precisions fp8 --save-projections \
            $KEEP --compile --fp8-compute
        step peers_compiled.log 120 $PY bench/bench_peers.py $PEERS --families qwen_image --precisions fp8_scaled $KEEP \
            --compile --fp8-compute
        ;;
    fp8swap)  # the second call when one lease holds both: fp8 compute's speed, then block swap's cost
        for family in flux qwen_image; do
            step fp8.log 100 $PY bench/bench_train_step.py --device "$DEVICE" --dtype bf16 --sizes mid --families $family \
                --skip-ref --checkpointing --mfu $SHAPE
        done
        step swap.log 120 $PY bench/bench_block_swap.py --family flux --swaps 0,16
        step swap.log 120 $PY bench/bench_block_swap.py --family qwen_image --swaps 0,20 --prefetch 2
        ;;
    *)
        echo "unknown plan $plan (headline, rest, profile, verify, eager, checkpoint, attention, candidates, swapprobe, fp8swap,"
        echo "families, since, dequantized, fp8compute, next)"
        exit 2
        ;;
esac
grep -h "^headline:" "$LOGS"/peers_*.log 2>/dev/null | tee -a "$LOGS/session.log"
echo "done at $((SECONDS - start)) s" | tee -a "$LOGS/session.log"
