#!/usr/bin/env bash
# The GPU figures of docs/performance.md on one NVIDIA GPU (a lent machine is held by the minute):
#
#     bash benchmarks/gpu.sh [OUT_DIR [STAGE ...]]    # PYTHON=... picks an interpreter with jax[cuda]
#
# Stages (all by default, in this order):
#   test        the cuDNN attention test against dot_product (values and gradients, packed, GQA)
#   compare     llama3.2-1b, cudnn_flash against dot_product (batch 4 × 2048, remat none)
#   sweep       llama3.2-1b: batch 8, unrolled layers, the unchunked loss, T = 8192
#   flags       llama3.2-1b under two XLA flag sets
#   3b          llama3.2-3b scanned and unrolled: the largest preset measured on one GPU (f32
#               weights, gradients and Adam moments: 16 bytes a parameter, 51 GB; llama3.1-8b's
#               are 128 GB of an H200's 151 GB before any activation: not tried)
#   attention   attention alone, forward + backward (benchmarks/bench_attention.py)
#   remat       llama3.2-1b with the default remat_policy=full at T = 2048 and 8192
#   policies    llama3.2-1b scanned under each remat policy that keeps matmul results, against
#               remat_policy=none scanned and unrolled
#   policies3b  llama3.2-3b scanned, remat none against save_dots
#   packed      cudnn_flash with documents as cuDNN offsets against the dense mask: the test, the
#               attention alone, llama3.2-1b at 4 × 2048 and 1 × 8192 (synthetic rows: one
#               document) and on the bundled corpus
#   scanflags   the same scanned, remat none and save_dots, under XLA flags aimed at the stacked
#               residuals (GEMMs reading and writing slices in place; fewer while-loop copies)
#   quant       quantized training (needs qwix==0.1.8 in the interpreter): the projection test on the
#               GPU, then llama3.2-3b bf16 against fp8, fp8_gpu, fp8_full and int8 (tokens/s ratios
#               and final losses side by side in one JSON)
#   optimizers  Muon against AdamW (benchmarks/bench_optimizers.py: a learning-rate sweep of each on
#               the bundled corpus, needs grain): llama-100m at 8 × 512 for 150 steps (three rates each),
#               llama3.2-1b at 4 × 1024 for 150 steps at each one's best llama-100m rate: steps to
#               AdamW's loss, step time, memory
#   families    the cuDNN test with sliding windows; qwen3-4b and gemma3-4b (5 local : 1 global,
#               cuDNN's sliding window) at 2 × 2048 with bf16 weights, remat full (not yet run)
#   rollout     the rollout engine against today's static sampler on llama3.2-1b (benchmarks/rollout_throughput.py:
#               32 prompts × G = 8, up to 256 tokens of uneven length, max_num_seqs 128)
#   rollout_test  the engine's tests on the GPU (greedy equality with the static sampler, log-probs
#               against the trainer's)
#   rl          each loss_algo (grpo, gspo-token, dapo, dr_grpo) from the same SFT start, four runs at once on
#               the one GPU (benchmarks/bench_rl_algos.py): grpo.yml's arithmetic (tiny) and grpo_math.yml's
#               word problems (llama-100m, 300 SFT steps; RL_WORD_OVERRIDES= replaces those keys); needs
#               grain, zstandard, math-verify and google-crc32c in the interpreter (carried as wheels)
# Each stage has its own time limit and the next runs whatever happened; logs and JSONs go to
# OUT_DIR (default benchmarks/results, where *.log is ignored by git), and a table of the training
# figures is printed last.
set -uo pipefail
out=${1:-benchmarks/results}
shift || true
stages=${*:-test compare sweep flags 3b attention remat policies policies3b scanflags packed quant families optimizers rollout rollout_test rl}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
stage() {  # stage NAME SECONDS CMD...: run with a limit, log to OUT_DIR/NAME.log, report its exit
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start))s"
  tail -n 4 "$out/$name.log"
}
wanted() { [[ " $stages " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
"$py" -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax',
flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, jax.devices())"

bench="$py benchmarks/bench_train.py --skip-first-step"
common="dataset_type=synthetic enable_checkpointing=false max_target_length=2048"
tuned="$common remat_policy=none attention=cudnn_flash"
wanted test && stage test_cudnn 100 env MAXLITE_TEST_PLATFORMS=cuda "$py" -m pytest -q -n 0 \
    tests/test_attention.py -k "cudnn or autoselected"
wanted compare && stage llama3.2-1b 240 $bench model_name=llama3.2-1b $common \
    per_device_batch_size=4 remat_policy=none --steps 20 \
    --compare attention=cudnn_flash --compare attention=dot_product \
    --out "$out/train_llama3.2-1b_gpu.json"
wanted sweep && stage sweep_1b 260 $bench --steps 30 model_name=llama3.2-1b $tuned \
    per_device_batch_size=4 --compare per_device_batch_size=4 --compare per_device_batch_size=8 \
    --compare scan_layers=false --compare num_vocab_tiling=1 \
    --compare per_device_batch_size=8,scan_layers=false \
    --compare max_target_length=8192,per_device_batch_size=1 --compare scan_layers=true \
    --out "$out/train_llama3.2-1b_gpu_sweep.json"
if wanted flags; then
    n=0
    for flags in "--xla_gpu_enable_triton_gemm=false" \
                 "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer="; do
        n=$((n + 1))
        XLA_FLAGS="$flags" stage "flags_$n" 80 $bench --steps 30 model_name=llama3.2-1b $tuned \
            per_device_batch_size=4 --out "$out/train_llama3.2-1b_gpu_flags_$n.json"
    done
fi
wanted 3b && stage sweep_3b 150 $bench --steps 30 model_name=llama3.2-3b $tuned \
    per_device_batch_size=4 --compare scan_layers=true --compare scan_layers=false \
    --out "$out/train_llama3.2-3b_gpu.json"
wanted attention && stage attention 120 bash -c "$py benchmarks/bench_attention.py --B 1 --T 8192 \
    --out $out/attention_gpu_8192.json && $py benchmarks/bench_attention.py --B 4 --T 2048 \
    --out $out/attention_gpu_2048.json"
wanted remat && stage remat_1b 150 $bench --steps 30 model_name=llama3.2-1b $common \
    attention=cudnn_flash per_device_batch_size=4 --compare remat_policy=full \
    --compare remat_policy=full,max_target_length=8192,per_device_batch_size=1 \
    --out "$out/train_llama3.2-1b_gpu_remat.json"
wanted policies && stage policies_1b 300 $bench --steps 30 model_name=llama3.2-1b $tuned \
    per_device_batch_size=4 --compare remat_policy=none --compare remat_policy=save_dots \
    --compare remat_policy=minimal --compare remat_policy=save_attn_mlp_proj \
    --compare remat_policy=none,scan_layers=false --compare remat_policy=save_dots,per_device_batch_size=8 \
    --compare remat_policy=none,per_device_batch_size=8 --compare remat_policy=save_dots,scan_layers=false \
    --out "$out/train_llama3.2-1b_gpu_policies.json"
wanted policies3b && stage policies_3b 200 $bench --steps 30 model_name=llama3.2-3b $tuned \
    per_device_batch_size=4 --compare remat_policy=none --compare remat_policy=save_dots \
    --out "$out/train_llama3.2-3b_gpu_policies.json"
if wanted scanflags; then
    n=0
    for flags in "" "--xla_gpu_enable_dynamic_slice_fusion=true" \
                 "--xla_gpu_copy_insertion_use_region_analysis=true" \
                 "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_copy_insertion_use_region_analysis=true"; do
        n=$((n + 1))
        XLA_FLAGS="$flags" stage "scanflags_$n" 100 $bench --steps 30 model_name=llama3.2-1b $tuned \
            per_device_batch_size=4 --compare remat_policy=none --compare remat_policy=save_dots \
            --out "$out/train_llama3.2-1b_gpu_scanflags_$n.json"
    done
fi
if wanted packed; then
    stage test_packed 150 env MAXLITE_TEST_PLATFORMS=cuda "$py" -m pytest -q -n 0 \
        tests/test_attention.py -k "cudnn or segment_offsets"
    stage attention_packed 150 bash -c "$py benchmarks/bench_attention.py --B 1 --T 8192 \
        --out $out/attention_gpu_8192_packed.json && $py benchmarks/bench_attention.py --B 4 \
        --T 2048 --out $out/attention_gpu_2048_packed.json"
    stage packed_1b 200 $bench --steps 30 model_name=llama3.2-1b $tuned per_device_batch_size=4 \
        --compare max_segments_per_seq=32 --compare max_segments_per_seq=0 \
        --compare max_target_length=8192,per_device_batch_size=1,max_segments_per_seq=32 \
        --compare max_target_length=8192,per_device_batch_size=1,max_segments_per_seq=0 \
        --out "$out/train_llama3.2-1b_gpu_packed.json"
    # the bundled corpus: 2-4 documents (padding included) in each row of 2048
    stage packed_1b_text 150 $bench --steps 30 model_name=llama3.2-1b $tuned per_device_batch_size=4 \
        dataset_type=text --compare max_segments_per_seq=32 --compare max_segments_per_seq=0 \
        --out "$out/train_llama3.2-1b_gpu_packed_text.json"
fi
if wanted quant; then
    stage test_quant 200 env MAXLITE_TEST_PLATFORMS=cuda "$py" -m pytest -q -n 0 tests/test_quant.py \
        -k "reference or 8_bit or compute_dtype"
    stage quant_3b 420 $bench --steps 30 model_name=llama3.2-3b $tuned per_device_batch_size=4 \
        --compare quantization= --compare quantization=fp8 --compare quantization=fp8_gpu \
        --compare quantization=fp8_full --compare quantization=int8 \
        --out "$out/train_llama3.2-3b_gpu_quant.json"
fi
if wanted families; then
    stage test_windows 150 env MAXLITE_TEST_PLATFORMS=cuda "$py" -m pytest -q -n 0 \
        tests/test_attention.py -k "cudnn"
    for m in qwen3-4b gemma3-4b; do
        stage "train_$m" 300 $bench --steps 20 model_name=$m $common attention=cudnn_flash \
            per_device_batch_size=2 remat_policy=full weight_dtype=bfloat16 --out "$out/train_${m}_gpu.json"
    done
fi
if wanted optimizers; then
    opt="env JAX_PLATFORMS=cuda $py benchmarks/bench_optimizers.py --steps 150"  # the script defaults to CPU
    stage optimizers_100m 230 $opt --model llama-100m --batch 8 --length 512 \
        --sweep "adamw=3e-4,1e-3,3e-3 muon=3e-3,1e-2,3e-2" --out "$out/optimizers_llama-100m_gpu.json"
    # llama3.2-1b at the best rate of each optimizer in the llama-100m sweep (no sweep of its own)
    best=$("$py" -c "import json,sys; b=json.load(open(sys.argv[1]))['best']
print(' '.join(f'{o}={r[\"learning_rate\"]}' for o, r in b.items()))" "$out/optimizers_llama-100m_gpu.json")
    stage optimizers_1b 100 $opt --model llama3.2-1b --batch 4 --length 1024 --sweep "${best:-adamw=1e-3 muon=1e-2}" \
        --out "$out/optimizers_llama3.2-1b_gpu.json"
fi
if wanted rollout; then
    stage rollout 200 "$py" benchmarks/rollout_throughput.py --models llama3.2-1b --prompts 32 --slots 128 \
        --out "$out/rollout_throughput_gpu.json"
fi
wanted rollout_test && stage test_rollout 200 env MAXLITE_TEST_PLATFORMS=cuda "$py" -m pytest -q -n 0 \
    tests/test_rollout_engine.py
if wanted rl; then  # small models leave the GPU idle: four runs share it, each with a slice of its memory
    rl="env XLA_PYTHON_CLIENT_MEM_FRACTION=0.05 JAX_PLATFORMS=cuda $py benchmarks/bench_rl_algos.py --parallel 4"
    stage rl 330 bash -c "$rl --timeout 300 --out $out/rl_algos_gpu.json & \
        $rl --recipe grpo_math.yml --timeout 300 --out $out/rl_algos_word_problems_gpu.json \
        ${RL_WORD_OVERRIDES:-model_name=llama-100m alignment_sft_steps=300 steps=600 eval_interval=100 eval_steps=25 alignment_sft_learning_rate=3e-4 learning_rate=5e-5 enable_checkpointing=false}; wait"
fi

"$py" - "$out" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("train_*_gpu*.json")):
    data = json.loads(path.read_text())
    for variant, run in (data.get("runs") or {"": data}).items():
        print(f"{path.name} {variant}: {run['device']}, {run['tokens_per_second_per_device']:.0f} "
              f"tokens/s/GPU, {run['tflops_per_device']:.1f} TFLOP/s, MFU {run['mfu']:.3f} "
              f"({run['mfu_peak_source']}); measured bf16 matmul "
              f"{run['matmul_peak_tflops_per_device']['bfloat16']:.0f} TFLOP/s, loss {run['final_loss']:.3f}")
EOF
