"""The teacher cache (`verispec.training.teacher`) and distillation from it (`train draft --teacher-cache`).

- The cache holds the target's top-k log-probabilities and the log of the rest, position by
  position, as the target computes them; it is built in chunks that a stopped run resumes,
  and the resumed cache equals one built in one go; a cache made from other settings is refused.
- `distill_loss` is the KL divergence of the coarsened distributions: with every token kept
  it is the full KL; it is zero at q = p and positive elsewhere.
- Distilling from the cache raises the draft's acceptance (beta) against its target; with a
  teacher and held-out evaluations the exported draft is the one of highest held-out beta.
"""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from train_helpers import held_out_beta, small_config, tiny_draft_config

from verispec.models.checkpoint import load_pretrained
from verispec.training.data import load_tokens
from verispec.training.teacher import TeacherCache, build_teacher_cache, distill_loss
from verispec.training.train import train

SEQ = 32
CHUNK = 1000  # windows per chunk: a few chunks over the small corpus


@pytest.fixture(scope="module")
def data(small_corpus):
    return small_corpus


def _cfg(data, out, steps, **kw):
    return small_config(data, out, steps, seq_len=SEQ, **kw)


@pytest.fixture(scope="module")
def teacher(tiny_teacher):
    return tiny_teacher


def _build(teacher, data, out, **kw):
    return build_teacher_cache(
        teacher, data, out, seq_len=SEQ, top_k=8, chunk_windows=CHUNK, batch_size=64, progress=False, **kw
    )


def test_the_cache_holds_the_targets_top_k_and_the_rest(teacher, data, tmp_path):
    out, missing = _build(teacher, data, tmp_path / "cache")
    assert missing == 0
    cache = TeacherCache(out, data)
    assert cache.spec.windows == (len(load_tokens(data, "train")) - 1) // SEQ > CHUNK  # more than one chunk
    window = cache.spec.windows - 1  # the last window of the last chunk
    tokens = load_tokens(data, "train")[window * SEQ : window * SEQ + SEQ]
    with torch.no_grad():
        logp = F.log_softmax(load_pretrained(teacher)(tokens[None]).float(), dim=-1)[0]  # [L, V]
    top, ids = logp.topk(8, dim=-1)
    assert torch.equal(cache.ids[window], ids)
    assert torch.allclose(cache.logp[window].float(), top, atol=2e-2)  # float16
    rest = torch.log1p(-top.exp().sum(-1))
    assert torch.allclose(cache.rest_logp[window], rest, atol=1e-3)


def test_a_stopped_build_resumes_to_the_same_cache_and_other_settings_are_refused(teacher, data, tmp_path):
    partial, missing = _build(teacher, data, tmp_path / "resumed", max_seconds=1e-9)  # stops after its first chunk
    assert missing > 0 and len(list(partial.glob("chunk-*.npz"))) == 1
    with pytest.raises(ValueError, match="chunks missing"):
        TeacherCache(partial, data)
    assert _build(teacher, data, partial)[1] == 0
    whole, _ = _build(teacher, data, tmp_path / "whole")
    for name in sorted(p.name for p in whole.glob("chunk-*.npz")):
        a, b = np.load(whole / name), np.load(partial / name)
        assert all(np.array_equal(a[key], b[key]) for key in ("ids", "logp", "rest_logp"))
    with pytest.raises(ValueError, match="top_k"):
        build_teacher_cache(teacher, data, partial, seq_len=SEQ, top_k=4, chunk_windows=CHUNK, progress=False)


def test_distill_loss_is_the_kl_of_the_coarsened_distributions():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    logp = F.log_softmax(p_logits, dim=-1)
    full_kl = (logp.exp() * (logp - F.log_softmax(q_logits, dim=-1))).sum(-1).mean()
    every = logp.topk(11, dim=-1)
    assert torch.allclose(
        distill_loss(q_logits, every.indices, every.values, torch.full((2, 5), -80.0)), full_kl, atol=1e-5
    )
    top = logp.topk(3, dim=-1)
    rest = logp.scatter(-1, top.indices, float("-inf")).logsumexp(-1)
    assert distill_loss(p_logits, top.indices, top.values, rest).abs() < 1e-6  # q = p
    assert distill_loss(q_logits, top.indices, top.values, rest) > 0.01


def test_distilling_from_the_cache_raises_acceptance_and_exports_the_best_beta(teacher, data, tmp_path):
    cache, _ = _build(teacher, data, tmp_path / "cache")
    draft_config = tiny_draft_config()
    before = load_pretrained(
        train(draft_config, _cfg(data, tmp_path / "d0", 1, teacher_cache=str(cache)), progress=False) / "model"
    )
    out = train(
        draft_config,
        _cfg(data, tmp_path / "d1", 60, teacher=str(teacher), teacher_cache=str(cache), eval_every=20),
        progress=False,
    )
    after = load_pretrained(out / "model")
    beta = held_out_beta(teacher, (before, after), data)
    assert beta[1] > beta[0] + 0.1
    log = json.loads((out / "train_log.json").read_text())
    evaluated = [e for e in log["log"] if "beta_t1" in e]
    assert [e["step"] for e in evaluated] == [20, 40, 60]
    best = max(evaluated, key=lambda e: e["beta_greedy"] + e["beta_t1"])
    assert log["best"]["step"] == best["step"]
    assert all(0 <= e["beta_greedy"] <= 1 and 0 <= e["beta_t1"] <= 1 for e in evaluated)


def test_a_cache_of_other_data_is_refused(teacher, data, tmp_path):
    cache, _ = _build(teacher, data, tmp_path / "cache")
    other = tmp_path / "other"
    shutil.copytree(data, other)
    tokens = np.fromfile(other / "train.bin", dtype=np.uint16)
    tokens[:10] = 1
    tokens.tofile(other / "train.bin")
    with pytest.raises(ValueError, match="other data"):
        TeacherCache(cache, other)
