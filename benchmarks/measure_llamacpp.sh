#!/usr/bin/env bash
# Every measurement of BENCHMARKS.md's llama.cpp section, on the built-in pair, in one go (~45 min on 2 cores).
# Usage: bash benchmarks/measure_llamacpp.sh OUT [LLAMA_BIN]
#   OUT: directory for the GGUF files, the JSON reports and the printed tables (OUT/log.txt)
#   LLAMA_BIN: directory holding llama-speculative-simple (benchmarks/build_llama_speculative.sh); default runs/llama-bin/build/bin
# PROMPTS (default 8) held-out prompts of benchmarks/heldout.jsonl, NEW (default 128) tokens each, REPEATS (default 3) rounds.
set -euo pipefail
out=$1
bin=${2:-runs/llama-bin/build/bin}
prompts=${PROMPTS:-8}; new=${NEW:-128}; repeats=${REPEATS:-3}
mkdir -p "$out/gguf"
read -r target draft < <(python -c "from verispec.pair import TARGET_DIR, DRAFT_DIR; print(TARGET_DIR, DRAFT_DIR)")
log="$out/log.txt"
{ date -u; lscpu | grep -E "Model name|^Flags"; python -c "from verispec.llamacpp import system_info; print(system_info())"; } > "$log"
for type in f32 q8_0; do
    verispec convert --model "$target" --out "$out/gguf/target-$type.gguf" --type "$type" >> "$log"
    verispec convert --model "$draft" --out "$out/gguf/draft-$type.gguf" --type "$type" >> "$log"
done
g="$out/gguf"
common=(--prompts benchmarks/heldout.jsonl --max-prompts "$prompts" --max-new-tokens "$new" --repeats "$repeats")
run() { echo; echo "\$ verispec $*"; verispec "$@"; } >> "$log"
# 1-2. f32 target and draft, greedy and T = 1: verispec at k = 2..6 and auto, llama.cpp's own program at k = 2..6
run bench --peer llamacpp --target "$g/target-f32.gguf" --draft "$g/draft-f32.gguf" "${common[@]}" --k 2,3,4,5,6,auto \
    --llama-cpp-bin "$bin" --json "$out/peer_f32_t0.json"
run bench --peer llamacpp --target "$g/target-f32.gguf" --draft "$g/draft-f32.gguf" "${common[@]}" --k 2,3,4,5,6,auto \
    --temperature 1 --llama-cpp-bin "$bin" --json "$out/peer_f32_t1.json"
# 1b. every draft length without and with a confidence stop, on both sides (verispec --confidence-threshold, llama.cpp
#     --spec-draft-p-min), in one run: each side's best over both
run bench --peer llamacpp --target "$g/target-f32.gguf" --draft "$g/draft-f32.gguf" "${common[@]}" --k 4,5,6,8 \
    --confidence-threshold 0.3 --llama-cpp-bin "$bin" --json "$out/peer_f32_t0_confidence.json"
# 3. q8_0 target: the draft in f32 and in q8_0 (c of each from the profiler), against llama.cpp plain q8_0
run profile --target "$g/target-q8_0.gguf" --draft "$g/draft-f32.gguf"
run profile --target "$g/target-q8_0.gguf" --draft "$g/draft-q8_0.gguf"
for d in f32 q8_0; do
    run bench --peer llamacpp --target "$g/target-q8_0.gguf" --draft "$g/draft-$d.gguf" "${common[@]}" --k 2,3,4,5,6,auto \
        --llama-cpp-bin "$bin" --json "$out/peer_q8_0_draft_$d.json"
done
# 4. prompt lookup against llama-cpp-python's
run bench --peer llamacpp --target "$g/target-f32.gguf" --draft ngram "${common[@]}" --k 2,4 --json "$out/peer_f32_ngram.json"
# 5. verispec on llama.cpp against transformers' assisted generation on the same weights
run bench --peer hf --target "$target" --draft "$draft" "${common[@]}" --k 2 --json "$out/peer_hf_k2.json"
run bench --peer hf --target "$target" --draft "$draft" "${common[@]}" --k 4 --json "$out/peer_hf_k4.json"
echo "wrote $log and $out/*.json"
