"""`bench --peer llamacpp` runs verispec's side under the llama.cpp flags it is given (--exact-kernels,
--flash-attn, --threads capped at the cores) and its report says what that side ran, read back from the
library and the loaded target. Each run is a fresh process: exact kernels are fixed before its first model.
The file is a K-quant (Q4_K_M), whose `--flash-attn auto` is flash attention: `off` must show as off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verispec.llamacpp import default_threads, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="llama.cpp does not run here")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from verispec.llamacpp.quantize import quantize
    from verispec.models.gguf_convert import convert
    from verispec.models.toy import make_toy_pair

    root = tmp_path_factory.mktemp("settings")
    target_dir, _ = make_toy_pair(root, sizes="kquant")
    return quantize(convert(target_dir, root / "target-F32.gguf", "f32"), root / "target-Q4_K_M.gguf", "Q4_K_M", 1)


def _bench(target, tmp_path, *flags: str) -> tuple[dict, str, str]:
    """(the JSON report, stdout, stderr) of one `bench --peer llamacpp` process with `flags`."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "peer.json"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    line = [sys.executable, "-m", "verispec", "bench", "--peer", "llamacpp", "--target", str(target)]
    line += ["--draft", "ngram", "--prompts", str(prompts), "--k", "1", "--max-new-tokens", "4", "--repeats", "1"]
    line += ["--max-prompts", "1", "--json", str(out), *flags]
    done = subprocess.run(line, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout, done.stderr


def test_exact_kernels_off_and_the_capped_threads_reach_verispecs_side(target, tmp_path):
    cores = default_threads()
    report, out, err = _bench(target, tmp_path, "--exact-kernels", "off", "--threads", str(cores + 1))
    # exact kernels off: no shape-invariant context, so sgemm's attention (context.py)
    assert report["verispec_side"] == dict(exact_kernels=False, flash_attention=False, threads=cores)
    assert f"verispec side: exact kernels off, flash attention off, {cores} threads" in out
    assert f"--threads {cores + 1} is more than the {cores} cores" in err


def test_flash_attn_reaches_verispecs_side_under_exact_kernels(target, tmp_path):
    auto, out, _ = _bench(target, tmp_path)
    assert auto["verispec_side"] == dict(exact_kernels=True, flash_attention=True, threads=default_threads())
    assert "verispec side: exact kernels on, flash attention on" in out
    off, out, _ = _bench(target, tmp_path, "--flash-attn", "off")
    assert off["verispec_side"]["exact_kernels"] and not off["verispec_side"]["flash_attention"]
    assert "verispec side: exact kernels on, flash attention off" in out
