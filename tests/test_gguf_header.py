"""models/gguf_header.py: a GGUF's tensor table read without decoding its metadata, equal to gguf's reader."""

import pytest

pytest.importorskip("gguf")

from gguf import GGUFReader  # noqa: E402

from verispec.models.gguf_convert import convert  # noqa: E402
from verispec.models.gguf_header import tensor_table  # noqa: E402
from verispec.pair import DRAFT_DIR  # noqa: E402


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_the_table_equals_gguf_s_reader(kind, tmp_path):
    path = convert(DRAFT_DIR, tmp_path / f"draft-{kind}.gguf", kind)  # a real vocabulary: strings to skip
    ours = tensor_table(path)
    theirs = GGUFReader(str(path)).tensors
    assert len(ours) == len(theirs) > 0
    for mine, reference in zip(ours, theirs):
        assert mine.name == reference.name and mine.type == int(reference.tensor_type)
        assert mine.shape == tuple(int(d) for d in reference.shape) and mine.offset == int(reference.data_offset)


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all" * 4)
    with pytest.raises(ValueError, match="model.gguf: not a GGUF file"):
        tensor_table(bad)


def test_chosen_metadata_equals_gguf_s_reader_and_the_rest_is_not_decoded(tmp_path):
    from verispec.models.gguf_header import metadata

    path = convert(DRAFT_DIR, tmp_path / "draft.gguf")
    reader = GGUFReader(str(path)).fields
    keys = ("general.architecture", "llama.context_length", "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id")
    found = metadata(path, keys)
    assert set(found) == set(keys)
    for key in keys:
        assert found[key] == reader[key].contents(), key
    assert metadata(path, ("no.such.key",)) == {}


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda whole: b"", "an empty file, not a GGUF file"),
        (lambda whole: b"PK\x03\x04 a zip file" * 8, r"not a GGUF file \(it starts with b'PK"),
        (lambda whole: whole[:100], "truncated: 100 bytes end inside the GGUF header"),
        (lambda whole: whole[: len(whole) - 1000], r"truncated: \d+ of the \d+ bytes its tensors need"),
    ],
)
def test_a_file_that_is_not_a_whole_gguf_is_refused_before_llama_cpp_reads_it(tmp_path, make, message):
    """llama.cpp says only "error loading model" for each of these (issue 66): one line naming the
    problem instead, from the loader and from the command line. Control: the whole file passes."""
    import subprocess
    import sys

    from verispec.llamacpp import unavailable
    from verispec.models.gguf_header import check

    whole_path = convert(DRAFT_DIR, tmp_path / "draft.gguf", "q8_0")
    check(whole_path)  # the control: nothing to say
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make(whole_path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        check(bad)
    if unavailable() is None:
        from verispec.llamacpp import LlamaCppModel
        from verispec.models.checkpoint import CheckpointError

        with pytest.raises(CheckpointError, match=message):
            LlamaCppModel(bad)
        command = [sys.executable, "-m", "verispec", "generate", "x", "--target", str(bad), "--draft", "none"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1 and lines[0].startswith("verispec: error:"), done.stderr
