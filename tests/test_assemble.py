"""The composition root (verispec/assemble.py): Settings are checked where they are built, survive
pickling (a Ray replica loads from them), fill their defaults the same way every time, and load
the parts the command line and the server use. The server imports no command-line module."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from verispec import assemble
from verispec.assemble import Settings
from verispec.models.toy import make_toy_pair
from verispec.policy import AdaptiveLength, FixedLength


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_toy_pair(tmp_path_factory.mktemp("toy"))


@pytest.mark.parametrize(
    "given, named",
    [
        ({"backend": "onnx"}, "--backend"),
        ({"gguf_type": "q9_k"}, "--gguf-type"),
        ({"threads": 0}, "--threads"),
        ({"threads": True}, "--threads"),
        ({"device": "tpu"}, "--device"),
        ({"dtype": "int3"}, "dtype"),
        ({"confidence_threshold": 1.0}, "--confidence-threshold"),
        ({"k": "fast"}, "--k"),
        ({"k": -2}, "k must"),
        ({"k_max": 0}, "k_max"),
        ({"draft": "early-exit:x"}, "layer count"),
        ({"exact_kernels": "on"}, "--exact-kernels"),
    ],
)
def test_a_bad_setting_is_a_value_error_naming_it(given, named):
    with pytest.raises(ValueError, match=named):
        Settings(**given)


def test_settings_pickle_and_resolve_to_the_built_in_pair():
    from verispec.pair import DRAFT_DIR, TARGET_DIR

    settings = Settings(k=3, threads=2, exact_kernels=False)
    assert pickle.loads(pickle.dumps(settings)) == settings
    resolved = settings.resolved()
    assert (resolved.target, resolved.draft) == (str(TARGET_DIR), str(DRAFT_DIR)) and resolved.resolved() is resolved
    for auto in (Settings(target="t"), Settings(target="t", draft="auto")):  # --draft auto: suffix drafting, said
        assert auto.draft_spec == "suffix" and "--draft auto: suffix drafting" in auto.resolved().draft_note
    plain = Settings(target="t", draft="none")
    assert plain.draft_spec is None and plain.auto_draft is None
    assert Settings().resolved().draft_note is None  # the built-in pair runs its own draft: nothing to say
    assert Settings(draft="none").draft_spec is None and Settings(target="t", draft="ngram").draft_spec == "ngram"
    assert Settings(target="t", draft="early-exit:2").resolved().backend == "torch"  # it reads the target's layers
    assert Settings(target="t", backend="llamacpp", draft="early-exit:2").resolved().backend == "llamacpp"
    assert Settings(target="t", extra_drafts=("early-exit:1",)).resolved().backend == "torch"


def test_the_policy_is_the_one_k_names():
    assert isinstance(assemble.draft_policy(Settings(k=3)), FixedLength)
    assert isinstance(assemble.draft_policy(Settings()), AdaptiveLength)


def test_load_parts_gives_what_a_server_uses(pair):
    from verispec.drafters.model import ModelDrafter

    target, draft = pair
    notes: list[str] = []
    parts = assemble.load_parts(Settings(target=str(target), draft=str(draft), backend="torch", k=2), notes.append)
    assert isinstance(parts.drafter, ModelDrafter) and isinstance(parts.policy, FixedLength)
    assert parts.tokenizer.encode("def f(x):").ids and parts.settings.target == str(target) and notes == []
    alone = assemble.load_parts(Settings(target=str(target), draft="none", backend="torch"))
    assert alone.drafter is None and assemble.load_tokenizer(Settings(target=str(target))).get_vocab_size() > 0


def test_an_early_exit_draft_needs_the_torch_llama(pair):
    target, _ = pair
    settings = Settings(target=str(target), backend="torch")
    loaded, _ = assemble.load_target(settings)
    assert assemble.load_drafter(settings, loaded, spec="early-exit:1") is not None
    with pytest.raises(ValueError, match="early exit needs verispec's PyTorch Llama"):
        assemble.load_drafter(settings, object(), spec="early-exit:1")


def test_the_server_imports_no_command_line_module():
    code = (
        "import sys, verispec.server, verispec.server.replicas, verispec.server.run; "
        "assert not any(m.startswith('verispec.cli') for m in sys.modules), sorted(sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
