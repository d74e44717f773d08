"""Shared pytest setup: make the helper modules in tests/ importable (`from stats_helpers import ...`)."""

import pathlib
import sys

_TESTS_DIR = str(pathlib.Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _kernel_built_once():
    """Build (or load) the CPU kernel before any test, so that its one-time notice on stderr
    and its compile time never land inside a test that reads stderr or a timing."""
    from verispec.models.kernels import kernel_status

    kernel_status()


@pytest.fixture(scope="module")
def markov():
    """The Markov toy target and two drafts (tests/toy_models.py), shared by the exactness tests."""
    from toy_models import MarkovLM

    target = MarkovLM(seed=1)
    drafts = {
        "random": MarkovLM(seed=2),  # an independent table: low acceptance, many residual draws
        "close": MarkovLM.perturbed(target, noise=1.0, seed=3),  # acceptance ~0.5: accepted blocks, bonus tokens, cuts
    }
    return target, drafts


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A small corpus (60 stdlib files) tokenised with a 400-token BPE (train_helpers.small_data)."""
    from train_helpers import small_data

    return small_data(tmp_path_factory.mktemp("corpus"), tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def tiny_teacher(small_corpus, tmp_path_factory):
    """The tiny preset trained 60 steps on small_corpus: a target to distil and cache from."""
    from train_helpers import small_config

    from verispec.training.train import PRESETS, train

    return (
        train(PRESETS["tiny"], small_config(small_corpus, tmp_path_factory.mktemp("teacher"), 60), progress=False)
        / "model"
    )
