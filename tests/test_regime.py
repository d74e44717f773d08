"""Which attention a llama.cpp target runs (llamacpp/regime.py): the setting, the measured choice, its memo.

The regimes' exactness is tests/test_exact_kernels.py's; here: `faster` picks by the geometric
mean of per-shape ratios (a negative control: one cheap shape does not outvote the others),
`--flash-attn` on / off / auto decide as documented, a measured choice is remembered and not
measured again, and a bad value is refused with a one-line error.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec.llamacpp import memo, regime


def test_faster_takes_the_geometric_mean_of_the_ratios():
    assert regime.faster({"flash": [1.0, 1.0, 0.5], "sgemm": [1.0, 1.0, 1.0]})
    assert not regime.faster({"flash": [1.0, 1.0, 1.2], "sgemm": [1.0, 1.0, 1.0]})
    # the sum of the times would pick flash (5.5 < 6); the ratios (0.5, 2, 2) do not
    assert not regime.faster({"flash": [2.5, 1.5, 1.5], "sgemm": [5.0, 0.75, 0.25]})


@pytest.fixture
def setting():
    yield regime.set_flash_attention
    regime.set_flash_attention("auto")


def _model(tmp_path: Path, kv_type: str = "f16", sgemm_weights: bool = True):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return SimpleNamespace(path=path, kv_type=kv_type, sgemm_weights=sgemm_weights, n_threads=2)


def test_the_setting_decides_as_documented(tmp_path, monkeypatch, setting):
    measured = []
    monkeypatch.setattr(regime, "measure", lambda m: measured.append(m) or {"flash": [1.0], "sgemm": [2.0]})
    monkeypatch.setattr(memo, "cache_home", lambda: tmp_path / "cache")
    assert regime.flash_for(_model(tmp_path, sgemm_weights=False))  # auto: K-quants take flash attention, unmeasured
    assert not regime.flash_for(_model(tmp_path, kv_type="f32"))  # an f32 cache never does
    assert measured == []
    assert regime.flash_for(_model(tmp_path))  # auto, sgemm's weights: measured twice (flash the faster here)
    assert len(measured) == 2
    setting("off")
    assert not regime.flash_for(_model(tmp_path, sgemm_weights=False))
    setting("on")
    assert regime.flash_for(_model(tmp_path)) and not regime.flash_for(_model(tmp_path, kv_type="f32"))
    assert len(measured) == 2


def test_a_measured_choice_is_remembered(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(regime, "measure", lambda m: measured.append(m) or {"flash": [3.0], "sgemm": [2.0]})
    monkeypatch.setattr(memo, "cache_home", lambda: tmp_path / "cache")
    model = _model(tmp_path)
    assert regime.remembered(model)["flash"] is False
    assert regime.remembered(model) == {
        "flash": False,
        "shapes": [list(s) for s in regime.SHAPES],
        "flash_s": [3.0],
        "sgemm_s": [2.0],
        "flash_s_again": [3.0],
        "sgemm_s_again": [2.0],
        "remember": True,
    }
    assert len(measured) == 2
    model.n_threads = 1  # another thread count reads the same choice: the regime sets the numerics
    assert regime.remembered(model)["flash"] is False and len(measured) == 2
    model.path.write_bytes(b"GGUF, another file")  # a changed file is measured again
    regime.remembered(model)
    assert len(measured) == 4


def test_a_choice_two_measurements_disagree_on_is_kept_for_the_process_only(tmp_path, monkeypatch):
    """A busy minute: the second measurement picks the other regime. This process keeps one choice (that of
    both together), the cache directory keeps nothing, and the next process measures again."""
    results = iter([{"flash": [1.0], "sgemm": [2.0]}, {"flash": [9.0], "sgemm": [2.0]}] * 2)
    measured = []
    monkeypatch.setattr(regime, "measure", lambda m: measured.append(m) or next(results))
    monkeypatch.setattr(memo, "cache_home", lambda: tmp_path / "cache")
    monkeypatch.setattr(regime, "_unsettled", {})
    model = _model(tmp_path)
    first = regime.remembered(model)
    assert first["flash"] is False and first["remember"] is False  # 10 s against 4 s together
    assert regime.remembered(model) == first and len(measured) == 2  # the same choice in this process
    assert not list((tmp_path / "cache" / "attention").glob("*.json"))  # nothing kept
    monkeypatch.setattr(regime, "_unsettled", {})  # the next process
    regime.remembered(model)
    assert len(measured) == 4


def test_a_bad_setting_is_refused(setting):
    with pytest.raises(ValueError, match="--flash-attn must be one of auto, on, off, got 'yes'"):
        setting("yes")
    assert regime.flash_attention_setting() == "auto"


def test_the_cli_refuses_a_bad_flash_attn_value():
    done = subprocess.run(
        [sys.executable, "-m", "verispec", "generate", "--flash-attn", "yes", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--flash-attn: invalid choice: 'yes'" in done.stderr
