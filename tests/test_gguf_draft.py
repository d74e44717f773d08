"""`verispec train draft --target FILE.gguf`: a draft distilled for a GGUF, with a vocabulary-subset head.

- The subset draft keeps the rule exact: a toy order-2 Markov target (exact joint distributions by
  enumeration) with a SubsetHeadLlama draft whose head covers 3 of its 5 tokens (q = 0 on the other
  two): the joint distribution of three tokens matches the target's at a false-failure rate of 1e-9,
  at k = 1 and 3. Negative control: a residual that forgets the tokens the draft cannot propose (the
  bug a subset head invites) fails the same test by a wide margin.
- The pipeline on a tiny GGUF written here (tests/gguf_archs.py), in seconds: corpus, teacher cache,
  subset, training, the GGUF and its card; the file loads back as a draft (its subset head on torch),
  greedy speculative output with it equals plain decoding, `--draft auto` takes it for that file (and
  not once the file changed), a second run resumes instead of redoing, and a run with other settings in
  the same directory is refused in one line.
- The GGUF reader (models/gguf_torch.py): the torch copy of a float GGUF gives llama.cpp's logits;
  without putting back llama.cpp's RoPE row order it does not (the negative control).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, chi_square, is_distributed_as, threshold
from toy_models import MarkovLM

import verispec.rejection as rejection
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.models.llama import LlamaConfig, init_weights
from verispec.stats import SpecStats
from verispec.training.draft_head import SubsetHeadLlama, choose_subset, subset_distill_loss, subset_index

PROMPT = [3, 1, 4]
TOKENS = 3
N = 30_000
SUBSET = [0, 2, 3]


def _subset_draft(vocab: int = 5) -> SubsetHeadLlama:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return init_weights(SubsetHeadLlama(config, torch.tensor(SUBSET)), std=0.5, seed=3).eval()


def _joint_counts(target, drafter, params, k):
    stats = SpecStats()
    tokens = np.asarray(generate_all(target, [PROMPT] * N, params, drafter, k=k, stats=stats))
    cells = np.ravel_multi_index(tokens.T, (target.vocab_size,) * TOKENS)
    return np.bincount(cells, minlength=target.vocab_size**TOKENS), stats


def test_the_subset_head_gives_q_zero_outside_the_subset():
    draft = _subset_draft()
    logits = draft(torch.tensor([[1, 2, 4]]))  # [1, 3, 5]
    outside = [t for t in range(5) if t not in SUBSET]
    assert torch.isneginf(logits[..., outside]).all() and torch.isfinite(logits[..., SUBSET]).all()
    with pytest.raises(ValueError, match="strictly increasing"):
        SubsetHeadLlama(draft.config, torch.tensor([2, 0]))


@pytest.mark.parametrize("k", [1, 3])
def test_a_subset_draft_keeps_the_joint_distribution_exact(one_thread, k):
    target = MarkovLM(seed=1)
    params = SamplingParams(temperature=1.0, seed=40 + k, max_new_tokens=TOKENS)
    counts, stats = _joint_counts(target, ModelDrafter(_subset_draft()), params, k)
    exact = target.continuation_probs(PROMPT, TOKENS, params).ravel()
    assert_distributed_as(counts, exact, are_counts=True, label=f"subset draft k={k}")
    assert 0 < stats.accepted < stats.proposed, stats.summary()


def test_negative_control_a_residual_that_forgets_the_tokens_outside_the_subset(one_thread, monkeypatch):
    real = rejection._residual_probs

    def forgetful(draft_probs, target_probs):
        residual = real(draft_probs, target_probs)
        inside = torch.zeros(residual.shape[-1], dtype=torch.bool)
        inside[SUBSET] = True
        kept = residual * inside
        return kept / kept.sum(-1, keepdim=True).clamp_min(1e-30)

    monkeypatch.setattr(rejection, "_residual_probs", forgetful)
    target = MarkovLM(seed=1)
    params = SamplingParams(temperature=1.0, seed=50, max_new_tokens=TOKENS)
    counts, _ = _joint_counts(target, ModelDrafter(_subset_draft()), params, 3)
    exact = target.continuation_probs(PROMPT, TOKENS, params).ravel()
    statistic, df = chi_square(counts, exact)
    assert not is_distributed_as(counts, exact, are_counts=True)
    assert statistic > 3 * threshold(df), (statistic, threshold(df))


def test_choose_subset_keeps_the_mass_and_the_argmaxes_it_is_asked_to():
    mass = torch.tensor([50.0, 30.0, 10.0, 5.0, 3.0, 2.0] + [0.0] * 100, dtype=torch.float64)
    argmax = torch.tensor([60, 30, 5, 5, 0, 0] + [0] * 100)
    ids, report = choose_subset(mass, argmax, max_cost=0.06, always=(105,))
    assert report["mass_outside"] <= 0.06 and report["greedy_outside"] <= 0.06
    assert 105 in ids.tolist() and ids.tolist() == sorted(ids.tolist())
    # the loss: zero when q equals p on the kept outcomes and on the pooled rest
    index = subset_index(torch.tensor([0, 1, 2]), 6)
    p = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 0.0])
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None, None]
    ids2, logp = torch.tensor([[[0, 1, 3]]]), p[[0, 1, 3]].log()[None, None]
    rest = torch.log(torch.tensor([[0.1]]))
    assert subset_distill_loss(logits, ids2, logp, rest, index).abs() < 1e-5
    worse = torch.log(torch.tensor([0.2, 0.3, 0.5]))[None, None]
    assert subset_distill_loss(worse, ids2, logp, rest, index) > 0.1


# ---- the pipeline on a tiny GGUF

pytest.importorskip("gguf")
llamacpp = pytest.importorskip("verispec.llamacpp")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    if llamacpp.unavailable():
        pytest.skip(f"llama.cpp cannot run here: {llamacpp.unavailable()}")
    import gguf_archs
    from test_prompt_tokens import _directory

    from verispec.models.gguf_convert import convert

    root = tmp_path_factory.mktemp("gguf-draft")
    vocabulary = convert(_directory(root / "dir", bos=False), root / "vocabulary.gguf")
    target = gguf_archs.write("llama", root / "target.gguf", vocabulary, seed=2)
    text = "".join(f"the cat number {i % 17} sat on mat {i % 5}; the dog ran to it.\n" for i in range(400))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": text[i : i + 300]}) + "\n" for i in range(0, len(text), 300)))
    return target, data


def test_the_torch_copy_of_a_float_gguf_gives_llama_cpps_logits(tiny_target, monkeypatch):
    import verispec.models.gguf_torch as gguf_torch

    target, _ = tiny_target
    ids = torch.tensor([[5, 80, 99, 104, 32, 116, 104, 101]])
    model = llamacpp.LlamaCppModel(target)
    expected = model(ids, model.new_cache(1, 16))[0]
    scale = expected.abs().max()  # logits up to ~35; llama.cpp keeps its KV cache in f16
    assert (gguf_torch.load_gguf_torch(target)(ids)[0] - expected).abs().max() < 2e-3 * scale
    monkeypatch.setattr(gguf_torch, "_unpermute", lambda weights, heads: weights)
    assert (gguf_torch.load_gguf_torch(target)(ids)[0] - expected).abs().max() > 0.1 * scale


def test_train_draft_for_a_gguf_writes_a_draft_that_decodes_exactly_and_resumes(tiny_target, tmp_path, monkeypatch):
    import verispec.models.trained_drafts as trained_drafts
    from verispec.assemble import Settings, load_drafter
    from verispec.training.draft_export import is_subset_draft
    from verispec.training.gguf_draft import DraftRun, train_gguf_draft

    target, data = tiny_target
    monkeypatch.setattr(trained_drafts, "_registry", lambda: tmp_path / "trained-drafts.json")
    assert Settings(target=str(target)).resolved().draft == "suffix"  # nothing trained yet
    run = DraftRun(
        target=str(target),
        out=str(tmp_path / "run"),
        data=str(data),
        minutes=0.3,
        layers=1,
        seq_len=32,
        top_k=8,
        batch_size=4,
    )
    lines: list[str] = []
    path = train_gguf_draft(run, say=lines.append)
    assert path == tmp_path / "run" / "draft.gguf" and is_subset_draft(path)
    card = (tmp_path / "run" / "MODEL_CARD.md").read_text()
    assert "target.gguf" in card and "held-out acceptance" in card and str(data) in card
    assert any(line.startswith("draft: step") for line in lines), lines
    chunks = sorted((tmp_path / "run" / "teacher").glob("chunk-*.npz"))
    assert chunks
    stamps = [c.stat().st_mtime_ns for c in chunks]

    settings = Settings(target=str(target), draft=str(path))
    target_model = llamacpp.LlamaCppModel(target)
    drafter = load_drafter(settings, target_model)
    assert isinstance(drafter, ModelDrafter) and isinstance(drafter.model, SubsetHeadLlama)
    prompts = [[116, 104, 101, 32, 99, 97, 116], [100, 111, 103, 32]]
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    assert generate_all(target_model, prompts, params, drafter, k=3) == generate_all(target_model, prompts, params)

    from verispec.cli.train import auto_line

    candidate = {"recommended_k": 0, "predicted_speedup": [1.0, 0.8, 0.7], "beta": 0.4, "c": 0.5}
    assert "keeps suffix drafting" in auto_line(candidate, str(target), path, trained_drafts.register)
    assert Settings(target=str(target)).resolved().draft == "suffix"  # a draft predicted not to pay: not taken
    candidate = {"recommended_k": 2, "predicted_speedup": [1.0, 1.2, 1.3], "beta": 0.8, "c": 0.1}
    assert "takes this draft" in auto_line(candidate, str(target), path, trained_drafts.register)
    auto = Settings(target=str(target)).resolved()  # --draft auto takes the trained draft, and says so
    assert auto.draft == str(path.resolve()) and "trained for this file" in auto.draft_note

    train_gguf_draft(run, say=lines.append)  # resumed: the teacher's chunks are not made again
    assert [c.stat().st_mtime_ns for c in chunks] == stamps
    with pytest.raises(ValueError, match="another --out"):
        train_gguf_draft(DraftRun(**{**run.__dict__, "layers": 2}), say=lines.append)
    changed = tmp_path / "changed.gguf"  # a copy is another file (its own path): no trained draft
    changed.write_bytes(Path(target).read_bytes())
    assert Settings(target=str(changed)).resolved().draft == "suffix"
    os.utime(target, ns=(0, Path(target).stat().st_mtime_ns + 10**9))  # the file changed since: its draft is not taken
    assert Settings(target=str(target)).resolved().draft == "suffix"


def test_the_cli_refuses_a_target_that_is_not_a_gguf_file_in_one_line(tmp_path, capsys):
    from verispec.cli import main

    assert main(["train", "draft", "--target", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a GGUF file is needed" in err[0]


def test_the_cli_trains_measures_with_plan_and_says_whether_auto_takes_the_draft(tiny_target, tmp_path, monkeypatch):
    import verispec.models.trained_drafts as trained_drafts
    from verispec.cli import main

    monkeypatch.setattr(trained_drafts, "_registry", lambda: tmp_path / "trained-drafts.json")
    target, data = tiny_target
    out = tmp_path / "cli-run"
    args = ["train", "draft", "--target", str(target), "--data", str(data), "--out", str(out), "--minutes", "0.2"]
    assert main([*args, "--layers", "1"]) == 0
    card = (out / "MODEL_CARD.md").read_text()
    assert "plan on held-out text here: beta" in card and "--draft auto" in card


def test_an_interrupt_during_training_keeps_the_steps_made_and_the_run_resumes(tiny_target, tmp_path, monkeypatch):
    import verispec.training.gguf_draft as gguf_draft

    target, data = tiny_target
    run = gguf_draft.DraftRun(
        target=str(target), out=str(tmp_path / "run"), data=str(data), minutes=0.3, layers=1, seq_len=32, top_k=8
    )
    real, calls = gguf_draft.subset_distill_loss, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(gguf_draft, "subset_distill_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_draft.train_gguf_draft(run, say=lambda line: None)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert saved["step"] == 3 and not (tmp_path / "run" / "draft.gguf").exists()
    monkeypatch.setattr(gguf_draft, "subset_distill_loss", real)
    assert gguf_draft.train_gguf_draft(run, say=lambda line: None).is_file()  # goes on from step 3
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] > 3


def test_a_file_of_another_architecture_is_refused_before_any_work(tiny_target, tmp_path):
    import gguf_archs

    from verispec.training.gguf_draft import DraftRun, train_gguf_draft

    other = gguf_archs.write("qwen2", tmp_path / "qwen2.gguf", tiny_target[0])
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        train_gguf_draft(DraftRun(target=str(other), out=str(tmp_path / "run")), say=lambda line: None)
    assert not (tmp_path / "run").exists()
