#!/usr/bin/env bash
# Trains the built-in pair: the target preset by next-token cross-entropy, then the draft
# preset by distillation (KL) from it, with held-out early stopping. This is the command
# MODEL_CARD.md names; the shipped pair came from it on one H200 (bfloat16 autocast).
#
#   bash benchmarks/train_pair.sh DATA RUN
#
# DATA: a directory of `verispec train data`; RUN: where target/ and draft/ go (checkpoints,
# train_log.json, and model/, the Hugging Face directory of the best held-out weights).
# Environment (defaults in brackets): DTYPE [bfloat16], TARGET_PRESET [target],
# DRAFT_PRESET [draft], TARGET_STEPS [2500], DRAFT_STEPS [2500], BATCH [32], SEQ [1024],
# TARGET_SECONDS and DRAFT_SECONDS [0 = no limit]: wall-clock caps, so a run on a lent
# machine always ends in time (the figures in MODEL_CARD.md say whether a cap was hit).
set -euo pipefail
DATA=${1:?usage: train_pair.sh DATA RUN}
RUN=${2:?usage: train_pair.sh DATA RUN}
PY=${PYTHON:-python3}
common=(--data "$DATA" --batch-size "${BATCH:-32}" --seq-len "${SEQ:-1024}" --dtype "${DTYPE:-bfloat16}" --eval-every 100 --checkpoint-every 500)
$PY -m verispec.cli train target --preset "${TARGET_PRESET:-target}" --out "$RUN/target" "${common[@]}" \
    --steps "${TARGET_STEPS:-2500}" --lr 1e-3 --max-seconds "${TARGET_SECONDS:-0}"
$PY -m verispec.cli train draft --preset "${DRAFT_PRESET:-draft}" --teacher "$RUN/target/model" --out "$RUN/draft" "${common[@]}" \
    --steps "${DRAFT_STEPS:-2500}" --lr 3e-3 --max-seconds "${DRAFT_SECONDS:-0}"
