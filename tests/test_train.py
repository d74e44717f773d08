"""Training: the corpus split, the tokenizer, and seeded, resumable training and distillation."""

import sysconfig
from pathlib import Path

import pytest
import torch
from train_helpers import held_out_beta, small_config, tiny_draft_config

from verispec.models.checkpoint import load_pretrained
from verispec.training.data import corpus_files, is_held_out, load_tokens, split_corpus
from verispec.training.train import PRESETS, TrainConfig, held_out_loss, train

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_split_is_deterministic_disjoint_and_about_five_percent():
    train_files, held = split_corpus()
    assert split_corpus() == (train_files, held)
    assert not set(train_files) & set(held)
    assert len(train_files) + len(held) == len(corpus_files())
    assert 0.03 < len(held) / (len(train_files) + len(held)) < 0.07
    assert all(is_held_out(p, STDLIB) for p in held)


@pytest.fixture(scope="module")
def data(small_corpus):
    """A small corpus (60 stdlib files) tokenised with a 400-token BPE (conftest)."""
    return small_corpus


def test_tokenizer_round_trips_code_and_marks_documents(data):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    text = 'def f(x):\n    return {"a": x ** 2}  # ünïcode\n'
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.get_vocab_size() == 400 and tokenizer.token_to_id("<|endoftext|>") == 0
    train_tokens, held_tokens = load_tokens(data, "train"), load_tokens(data, "heldout")
    assert int((train_tokens == 0).sum()) + int((held_tokens == 0).sum()) == 60  # one <|endoftext|> per file


_cfg = small_config


def test_training_lowers_held_out_loss_and_saves_a_loadable_model(data, tmp_path):
    out = train(PRESETS["tiny"], _cfg(data, tmp_path, 60), progress=False)
    model = load_pretrained(out / "model")
    untrained = load_pretrained(train(PRESETS["tiny"], _cfg(data, tmp_path / "zero", 1), progress=False) / "model")
    assert (
        held_out_loss(model, data, seq_len=32, max_windows=64)
        < held_out_loss(untrained, data, seq_len=32, max_windows=64) - 0.5
    )
    assert (out / "model" / "tokenizer.json").exists() and (out / "model" / "tokenizer_config.json").exists()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    ids = torch.tensor([tokenizer("def f(x):")["input_ids"]])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < 1e-4


def test_resuming_from_a_checkpoint_gives_the_same_weights(data, tmp_path):
    straight = train(PRESETS["tiny"], _cfg(data, tmp_path / "a", 10), progress=False)
    interrupted = tmp_path / "b"
    train(PRESETS["tiny"], _cfg(data, interrupted, 5), progress=False)  # "killed" after its step-5 checkpoint
    resumed = train(PRESETS["tiny"], _cfg(data, interrupted, 10), progress=False)
    a, b = load_pretrained(straight / "model"), load_pretrained(resumed / "model")
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name


def test_export_writes_the_checkpoint_weights_so_far(data, tmp_path, capsys):
    from verispec.cli import main

    run = tmp_path / "run"
    train(PRESETS["tiny"], _cfg(data, run, 5), progress=False)
    finished = load_pretrained(run / "model")
    (run / "model" / "config.json").unlink()
    assert main(["train", "export", "--out", str(run), "--preset", "tiny", "--data", str(data)]) == 0
    exported = load_pretrained(run / "model")
    assert all(torch.equal(t, exported.state_dict()[n]) for n, t in finished.state_dict().items())
    assert main(["train", "export", "--out", str(run), "--preset", "target", "--data", str(data)]) == 2
    assert "does not fit this architecture" in capsys.readouterr().err
    assert main(["train", "export", "--out", str(tmp_path / "none"), "--preset", "tiny", "--data", str(data)]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["perplexity", "--model", str(run / "model"), "--data", str(data), "--windows", "2"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert float(row[1]) == pytest.approx(held_out_loss(exported, data, max_windows=2), rel=1e-5) and float(row[2]) > 1


def test_distillation_brings_the_draft_towards_the_teacher(data, tiny_teacher, tmp_path):
    teacher = tiny_teacher
    draft_config = tiny_draft_config()
    before = load_pretrained(
        train(draft_config, _cfg(data, tmp_path / "d0", 1, teacher=str(teacher)), progress=False) / "model"
    )
    after = load_pretrained(
        train(draft_config, _cfg(data, tmp_path / "d1", 60, teacher=str(teacher)), progress=False) / "model"
    )
    beta = held_out_beta(teacher, (before, after), data)
    assert beta[1] > beta[0] + 0.1


def test_bad_training_config_names_the_parameter(data, tmp_path):
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(out=str(tmp_path), data=str(data), steps=0)
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(out=str(tmp_path), data=str(data), dtype="int8")


def test_early_stopping_exports_the_best_held_out_weights(data, tmp_path, monkeypatch):
    """With eval_every, the exported model is the evaluated one with the lowest held-out loss
    (here scripted to be step 10's), not the last."""
    import json

    import verispec.training.train as train_module

    scripted = iter([3.0, 1.0, 2.0, 4.0, 5.0, 6.0])
    monkeypatch.setattr(train_module, "held_out_loss", lambda model, data: next(scripted))
    out = train(PRESETS["tiny"], _cfg(data, tmp_path, 30, eval_every=5), progress=False)
    log = json.loads((out / "train_log.json").read_text())
    assert [(e["step"], e["heldout_loss"]) for e in log["log"] if "heldout_loss" in e] == [
        (5, 3.0),
        (10, 1.0),
        (15, 2.0),
        (20, 4.0),
        (25, 5.0),
        (30, 6.0),
    ]
    assert log["best"] == {"step": 10, "heldout_loss": 1.0}
    exported = load_pretrained(out / "model").state_dict()
    best = torch.load(out / "best.pt", weights_only=False)
    last = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    assert best["step"] == 10 and all(torch.equal(t, best["model"][n]) for n, t in exported.items())
    assert not all(torch.equal(t, last[n]) for n, t in exported.items())


def test_max_seconds_stops_early_and_still_exports(data, tmp_path):
    import json

    out = train(PRESETS["tiny"], _cfg(data, tmp_path, 100_000, max_seconds=3.0), progress=False)
    log = json.loads((out / "train_log.json").read_text())
    fitted = log["train_config"]["steps"]  # the schedule, shrunk to fit the time after 60 steps
    assert 60 <= log["steps_run"] <= fitted < 100_000 and (out / "model" / "config.json").exists()
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == log["steps_run"]
    with pytest.raises(ValueError, match="max_seconds"):
        TrainConfig(out=str(tmp_path), data=str(data), max_seconds=-1)


def test_stop_after_keeps_the_schedule_and_a_second_run_finishes_it(data, tmp_path):
    import json

    stopped = train(PRESETS["tiny"], _cfg(data, tmp_path / "a", 20, stop_after=1e-9), progress=False)
    log = json.loads((stopped / "train_log.json").read_text())
    assert log["stopped_before_the_end"] and log["steps_run"] < 20 and log["train_config"]["steps"] == 20
    finished = load_pretrained(
        train(PRESETS["tiny"], _cfg(data, tmp_path / "a", 20), progress=False) / "model"
    ).state_dict()
    whole = load_pretrained(
        train(PRESETS["tiny"], _cfg(data, tmp_path / "b", 20), progress=False) / "model"
    ).state_dict()
    assert all(torch.equal(finished[name], whole[name]) for name in whole)
