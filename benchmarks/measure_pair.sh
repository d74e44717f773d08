#!/usr/bin/env bash
# The BENCHMARKS.md measurements for a target/draft pair, in one go (about 40 minutes on the
# 2-core development machine). Stop anything else running first: a busy core skews ratios.
# Usage: bash benchmarks/measure_pair.sh TARGET_DIR DRAFT_DIR DATA_DIR OUT_DIR
set -u
T=$1; D=$2; DATA=$3; OUT=$4
P=benchmarks/heldout.jsonl; E=benchmarks/editing.jsonl
mkdir -p "$OUT"
run() { echo "\$ $*"; "$@" || echo "FAILED: $*"; }
MAXP=${MAXP:-6}; TOK=${TOK:-48}; REP=${REPEATS:-3}; EE=${EE:-2}  # overridable for a quick dry run
# PERPLEXITY=0 skips the perplexity runs (they depend on neither the prompts nor the decoding kernel)
common=(--prompts "$P" --max-prompts "$MAXP" --max-new-tokens "$TOK" --repeats "$REP")

# derived models: quantized copies of the target, a randomly initialised draft
[ -d "$OUT/target-int8" ] || run verispec quantize --model "$T" --out "$OUT/target-int8" --bits 8
[ -d "$OUT/target-int4-rtn" ] || run verispec quantize --model "$T" --out "$OUT/target-int4-rtn" --bits 4 --group-size 64
[ -d "$OUT/target-int4-gptq" ] || run verispec quantize --model "$T" --out "$OUT/target-int4-gptq" --bits 4 --group-size 64 --calibration "$DATA"
[ -d "$OUT/draft-random" ] || python - "$D" "$OUT/draft-random" <<'PY'
import sys
from verispec.models.checkpoint import load_pretrained, save_pretrained
from verispec.models.llama import LlamaForCausalLM, init_weights
trained = load_pretrained(sys.argv[1])
save_pretrained(init_weights(LlamaForCausalLM(trained.config), seed=123).eval(), sys.argv[2], tokenizer_from=sys.argv[1])
print("wrote", sys.argv[2])
PY

[ "${PERPLEXITY:-1}" = 0 ] || run verispec perplexity --model "$T" --model "$OUT/target-int8" --model "$OUT/target-int4-rtn" --model "$OUT/target-int4-gptq" --model "$D" --data "$DATA" --windows "${WINDOWS:-64}" | tee "$OUT/perplexity.txt"
run verispec plan --target "$T" --draft "$D" --draft "$OUT/target-int8" --draft early-exit:$EE --draft ngram --prompts "$P" --max-prompts "$MAXP" --max-new-tokens "$TOK" --json "$OUT/plan_t0.json" | tee "$OUT/plan_t0.txt"
run verispec bench --target "$T" --draft "$D" "${common[@]}" --k 1,2,3,4,5,6,7,8,auto --temperature 0 --json "$OUT/pair_t0.json" --csv "$OUT/pair_t0.csv" --plot-dir "$OUT/plots_pair_t0" | tee "$OUT/pair_t0.txt"
run verispec bench --target "$T" --draft "$D" "${common[@]}" --k 2,4,auto --temperature 1 --json "$OUT/pair_t1.json" | tee "$OUT/pair_t1.txt"
run verispec bench --target "$T" --draft "$OUT/draft-random" "${common[@]}" --k 2,4,auto --json "$OUT/bad_random.json" | tee "$OUT/bad_random.txt"
run verispec bench --target "$T" --draft "$T" "${common[@]}" --k 2,4,auto --json "$OUT/bad_self.json" | tee "$OUT/bad_self.txt"
for name in target-int8 target-int4-gptq; do
  run verispec bench --target "$T" --draft "$OUT/$name" "${common[@]}" --k 2,4 --temperature 0,1 --json "$OUT/drafter_$name.json" | tee "$OUT/drafter_$name.txt"
done
run verispec bench --target "$T" --draft early-exit:$EE "${common[@]}" --k 2,4 --temperature 0,1 --json "$OUT/drafter_early-exit.json" | tee "$OUT/drafter_early-exit.txt"
run verispec bench --target "$T" --draft ngram "${common[@]}" --k 2,4 --temperature 0,1 --json "$OUT/drafter_ngram.json" | tee "$OUT/drafter_ngram.txt"
run verispec bench --target "$T" --draft ngram --prompts "$E" --max-prompts "$MAXP" --max-new-tokens $((TOK * 2)) --repeats "$REP" --k 4,7,auto --temperature 0,1 --json "$OUT/drafter_ngram_editing.json" | tee "$OUT/drafter_ngram_editing.txt"
run verispec bench --peer hf --target "$T" --draft "$D" --prompts "$P" --max-prompts "$MAXP" --max-new-tokens "$TOK" --repeats "$REP" --k 4 --json "$OUT/peer_hf.json" | tee "$OUT/peer_hf.txt"
run verispec bench --peer hf --target "$T" --draft "$D" --prompts "$P" --max-prompts "$MAXP" --max-new-tokens "$TOK" --repeats "$REP" --k 2 --json "$OUT/peer_hf_k2.json" | tee "$OUT/peer_hf_k2.txt"
run verispec bench --peer hf --target "$T" --draft ngram --prompts "$E" --max-prompts "$MAXP" --max-new-tokens $((TOK * 2)) --repeats "$REP" --k 4 --json "$OUT/peer_hf_ngram.json" | tee "$OUT/peer_hf_ngram.txt"
# int4 at group 128: round-to-nearest vs GPTQ
[ -d "$OUT/target-int4-rtn-g128" ] || run verispec quantize --model "$T" --out "$OUT/target-int4-rtn-g128" --bits 4 --group-size 128
[ -d "$OUT/target-int4-gptq-g128" ] || run verispec quantize --model "$T" --out "$OUT/target-int4-gptq-g128" --bits 4 --group-size 128 --calibration "$DATA"
[ "${PERPLEXITY:-1}" = 0 ] || run verispec perplexity --model "$T" --model "$OUT/target-int4-rtn-g128" --model "$OUT/target-int4-gptq-g128" --data "$DATA" --windows "${WINDOWS:-64}" | tee "$OUT/perplexity_g128.txt"
