#!/bin/bash
# The GPU measurements for a lent GPU, in named parts (each with its own time limit, so one that hangs costs only
# that): tests (tests/test_cuda.py), probe (a decode step eager vs replayed as a CUDA graph), qwen05 (the bench at
# the Qwen2.5-0.5B shape: training step and whole iterations), gsm8k and countdown (the Qwen recipes' iterations on
# random Qwen2.5-0.5B and 3B weights: speed does not depend on them; a random model never samples eos, so every
# completion runs to max_completion_length, the slowest case), gpt2 (training steps of GPT-2 124M), qwen05c (the
# Qwen training step compiled, and at micro-batches of 32; not in the default list). All of them take more than one
# 10-minute call: 7-9 minutes for tests probe qwen05 gsm8k (tests, never run on a GPU yet, up to 4), 8 for countdown
# gpt2, qwen05c untimed (a guess: 3-5).
# $ OUT=gpu_results bash scripts/bench_gpu.sh tests probe qwen05 gsm8k   # results in $OUT: log.txt and JSON per part
# $ GRAPHS=--cuda_graphs OUT=gpu_results bash scripts/bench_gpu.sh qwen05 gsm8k   # generate replayed as CUDA graphs
# docs/h200/ holds the first session's output (probe qwen05 gsm8k gpt2, no GRAPHS, without the last gpt2 step)
set -u
cd "$(dirname "$0")/.."  # the repository's root: train.py, tests/, python -m scripts.bench
OUT=${OUT:-gpu_results}
GRAPHS=${GRAPHS:-}
GRAPHS_FLAG=$([ -n "$GRAPHS" ] && echo True || echo False)
mkdir -p "$OUT"
TMP=$(mktemp -d)
export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log.txt"; }
step() { local limit=$1; shift; log "$*"; timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -40; \
         log "exit ${PIPESTATUS[0]}"; }

tests() { step 240 python3 -m pytest -x -q -p no:cacheprovider tests/test_cuda.py; }

# a decode step at 64 and 256 rows, cache 640 columns: eager, and replayed as a CUDA graph (no host work at all),
# casting the float32 weights at every step or reading bf16 copies of them (cuda_graphs.half_weights)
probe() { step 60 python3 - "$OUT/decode_graph.json" <<'EOF'
import json, sys, torch
from lib import cuda_graphs
from scripts.benchmarks import common as bench
from lib.measure import timed
res = {}
for preset in ("gpt2", "qwen2.5-0.5b"):
    for rows in (64, 256):
        args = bench.get_args(["--preset", preset, "--device", "cuda", "--G", "1", "--prompts", str(rows)])
        model, S = bench.build_model(args), 640
        cfg = model.config
        kv = [[torch.randn(rows, cfg.n_kv_head, S, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in "kv"] for _ in range(cfg.n_layer)]
        mask = torch.ones(rows, S, dtype=torch.bool, device="cuda")
        tok, pos = torch.randint(0, cfg.vocab_size, (rows,), device="cuda"), torch.full((rows,), 600, device="cuda")
        col, u = torch.tensor([600], device="cuda"), torch.rand(rows, 2, device="cuda")
        def step():
            with torch.no_grad(), bench.autocast(args):
                return model.decode(tok, pos, kv, col, mask, u, 1.0, None, None)
        eager = timed(step, "cuda", 20)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, cache_enabled=False), torch.cuda.graph(g):
            model.decode(tok, pos, kv, col, mask, u, 1.0, None, None)
        graph = timed(g.replay, "cuda", 20)
        # the same step reading bf16 copies of the matmuls' weights (cuda_graphs.half_weights), as generate's graphs
        # do
        half = cuda_graphs.half_weights(model, dict(half={}, graphs={}), torch.bfloat16)
        inputs = dict(tok=tok, pos=pos, kv=kv, col=col, key_mask=mask, u=u, temperature=1.0, top_k=None, top_p=None)
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            cuda_graphs._step(model, half, **inputs)  # warm-up
        g2 = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, cache_enabled=False), torch.cuda.graph(g2):
            cuda_graphs._step(model, half, **inputs)
        graph_half = timed(g2.replay, "cuda", 20)
        weights = sum(p.numel() for p in model.parameters()) * 2  # bf16 weights read once per step
        cache = 2 * cfg.n_layer * rows * cfg.n_kv_head * S * cfg.head_dim * 2
        res[f"{preset}_{rows}"] = r = dict(eager_ms=eager * 1e3, graph_ms=graph * 1e3, host_share=1 - graph / eager,
                                           read_gb=(weights + cache) / 1e9,
                                           graph_tb_s=(weights + cache) / graph / 1e12,
                                           graph_half_ms=graph_half * 1e3,
                                           graph_half_tb_s=(weights + cache) / graph_half / 1e12)
        print(preset, rows, {k: round(v, 4) for k, v in r.items()})
json.dump(res, open(sys.argv[1], "w"), indent=1)
EOF
}

qwen05() { step 150 python3 -m scripts.bench --preset qwen2.5-0.5b --device cuda --prompts 8 --G 16 --prompt_len 128 \
    --new_tokens 512 --only train_step,iteration --repeat 2 --json "$OUT/qwen05.json" $GRAPHS; }

# the training step alone at the same shape, compiled, and with micro-batches of 32 (is MFU host- or size-bound?)
qwen05c() { step 200 python3 -m scripts.bench --preset qwen2.5-0.5b --device cuda --prompts 8 --G 16 --prompt_len 128 \
    --new_tokens 512 --only train_step --repeat 2 --compile --json "$OUT/qwen05_compile.json"
step 120 python3 -m scripts.bench --preset qwen2.5-0.5b --device cuda --prompts 8 --G 16 --prompt_len 128 \
    --new_tokens 512 --only train_step --repeat 2 --micro_batch_size 32 --json "$OUT/qwen05_mb32.json"; }

# config/qwen_gsm8k.py as written but eager (no compile): bf16, activation checkpointing, 32 x 8 rows, completions
# of 512, on a random Qwen2.5-0.5B: 3 iterations; prompts of 150 random letters (the byte tokenizer: a token each)
gsm8k() { python3 - "$TMP" <<'EOF'
import os, sys
from benchmarks import common as bench
from benchmarks.runs import task_file
model = bench.build_model(bench.get_args(["--preset", "qwen2.5-0.5b", "--device", "cpu"]))
model.save_pretrained(os.path.join(sys.argv[1], "qwen05"))
task_file(bench.get_args(["--prompt_len", "150"]), sys.argv[1])
EOF
step 120 python3 train.py config/qwen_gsm8k.py --init_from="$TMP/qwen05" --tokenizer=bytes --chat_template=none \
    --system_prompt=None --task="$TMP/{split}.jsonl" --max_iters=3 --eval_interval=0 --save_interval=0 \
    --out_dir="$TMP/run_gsm8k" --compile=False --cuda_graphs=$GRAPHS_FLAG
cp "$TMP/run_gsm8k/metrics.jsonl" "$OUT/qwen_gsm8k_metrics.jsonl" 2>/dev/null; }

# config/qwen_countdown.py the same way on a random Qwen2.5-3B (32 x 8 rows, completions of 1024): 2 iterations
countdown() { python3 - "$TMP" <<'EOF'
import os, sys
from benchmarks import common as bench
bench.build_model(bench.get_args(["--preset", "qwen2.5-3b", "--device", "cpu"])).save_pretrained(
    os.path.join(sys.argv[1], "qwen3b"))
EOF
step 200 python3 train.py config/qwen_countdown.py --init_from="$TMP/qwen3b" --tokenizer=bytes --chat_template=none \
    --system_prompt=None --max_iters=2 --eval_interval=0 --save_interval=0 --out_dir="$TMP/run_countdown" \
    --compile=False --cuda_graphs=$GRAPHS_FLAG
cp "$TMP/run_countdown/metrics.jsonl" "$OUT/qwen_countdown_metrics.jsonl" 2>/dev/null; }

gpt2() { step 60 python3 -m scripts.bench --preset gpt2 --device cuda --only train_step --json "$OUT/gpt2.json"
step 120 python3 -m scripts.bench --preset gpt2 --device cuda --only train_step --compile \
  --json "$OUT/gpt2_compile.json"
step 120 python3 -m scripts.bench --preset gpt2 --device cuda --only train_step --compile --micro_batch_size 64 \
    --json "$OUT/gpt2_compile_mb64.json"; }

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/log.txt"
for part in ${*:-tests probe qwen05 gsm8k countdown gpt2}; do
    $part
done
log "done"
