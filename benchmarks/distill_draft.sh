#!/usr/bin/env bash
# A stronger built-in draft (issue 14), on any machine, resumable: every stage picks up where a
# stopped run left it, so it can run over several sessions on a CPU.
#
#   bash benchmarks/distill_draft.sh RUN [PRESET]
#
# 1. RUN/data: the corpus and split of MODEL_CARD.md (`verispec train data`), refused unless its
#    tokenizer is the built-in pair's byte for byte (the target stays as it is).
# 2. RUN/teacher: the built-in target's top-32 next-token distributions over the training
#    split, windows of 1024 tokens (`verispec train teacher`, chunks of 64 windows; about 1.1 GB).
# 3. RUN/draft-PRESET: the draft distilled from that cache (`verispec train draft --teacher-cache`),
#    held-out beta at T = 0 and T = 1 every EVAL steps choosing the exported weights.
# Environment (defaults in brackets): DTYPE [bfloat16: autocast, for CPUs with AVX512_BF16 or
# AMX and for GPUs; float32 otherwise], STEPS [6000], BATCH [16], LR [3e-3], EVAL [250],
# CAP [0 = none]: stop each stage after this many seconds, its schedule unchanged (run the
# script again to go on).
set -euo pipefail
RUN=${1:?usage: distill_draft.sh RUN [PRESET]}
PRESET=${2:-draft}
PY=${PYTHON:-python3}
DTYPE=${DTYPE:-bfloat16}
pair_target=$($PY -c "from verispec.pair import TARGET_DIR; print(TARGET_DIR)")
$PY -m verispec.cli train data --out "$RUN/data"
cmp "$RUN/data/tokenizer.json" "$pair_target/tokenizer.json" || { echo "RUN/data's tokenizer is not the built-in pair's: another Python's standard library?" >&2; exit 1; }
$PY -m verispec.cli train teacher --teacher "$pair_target" --data "$RUN/data" --out "$RUN/teacher" --seq-len 1024 --teacher-top-k 32 \
    --batch-size 4 --dtype "$DTYPE" --max-seconds "${CAP:-0}" | tee "$RUN/teacher.out"
grep -q ": complete" "$RUN/teacher.out" || { echo "the teacher cache is not complete yet: run this again to go on" >&2; exit 0; }
$PY -m verispec.cli train draft --preset "$PRESET" --teacher "$pair_target" --teacher-cache "$RUN/teacher" --data "$RUN/data" \
    --out "$RUN/draft-$PRESET" --seq-len 1024 --batch-size "${BATCH:-16}" --steps "${STEPS:-6000}" --lr "${LR:-3e-3}" \
    --eval-every "${EVAL:-250}" --checkpoint-every 50 --dtype "$DTYPE" --stop-after "${CAP:-0}"
