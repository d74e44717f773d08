"""Prompts tokenized as llama.cpp tokenizes them: BOS where the file says so, special tokens parsed.

A GGUF whose metadata says `tokenizer.ggml.add_bos_token = true` (Llama 3, Mistral and Gemma files
do) is written here with the `gguf` package from a tiny directory whose tokenizer.json adds `<s>`
before a prompt. verispec's prompt ids (`GGUFTokenizer.encode`, the tokenizer every command gets
from `assemble.load_tokenizer`) must equal llama-cpp-python's `Llama.tokenize(text, add_bos=True,
special=True)`, what `Llama` does with a text prompt. Before the fix verispec added nothing, so the
first assertion failed. A draft of another tokenizer starts its own context with its own BOS, and a
chat prompt rendered with the BOS text keeps one BOS.
"""

import pytest

pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

from tokenizers import processors  # noqa: E402

from verispec.assemble import Settings, load_tokenizer  # noqa: E402
from verispec.drafters.draft_text import DraftText  # noqa: E402
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel, unavailable  # noqa: E402
from verispec.models.checkpoint import load_tokenizer as load_directory_tokenizer  # noqa: E402
from verispec.models.gguf_convert import convert  # noqa: E402
from verispec.models.token_text import prompt_bos, token_text_of  # noqa: E402
from verispec.models.toy import byte_level_tokenizer  # noqa: E402
from verispec.server.chat import without_added_bos  # noqa: E402

if unavailable():
    pytest.skip(f"llama.cpp cannot run here: {unavailable()}", allow_module_level=True)

TEXTS = ["The three primary colors are", "def fibonacci(n):\n", "a<|endoftext|>b", " "]
BOS = "<s>"


def _directory(path, bos: bool):
    """A tiny random Llama directory whose tokenizer.json adds `<s>` before a prompt (bos) or nothing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gguf_convert import tiny_dir

    tokenizer = byte_level_tokenizer()  # 256 bytes, then <|endoftext|> (256)
    tokenizer.add_special_tokens([BOS])  # 257
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
        )
    return tiny_dir(path, tokenizer, vocab_size=320, eos_token_id=256, bos_token_id=257)


@pytest.fixture(scope="module")
def bos_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("bos")
    directory = _directory(root / "dir", bos=True)
    return directory, convert(directory, root / "bos.gguf")


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    directory = _directory(root / "dir", bos=False)
    return directory, convert(directory, root / "plain.gguf")


def _llama_ids(path, text: str) -> list[int]:
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return model.tokenize(text.encode(), add_bos=True, special=True)


def test_a_file_that_asks_for_bos_gets_it_as_llama_cpp_python_gives_it(bos_file):
    _, path = bos_file
    tokenizer = GGUFTokenizer(LlamaCppModel(path))
    bos = 257
    assert tokenizer.adds_bos and tokenizer.bos_token_id == bos
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == _llama_ids(path, text), text
        assert ids[0] == bos, text
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids[1:], text
    assert 256 in tokenizer.encode("a<|endoftext|>b").ids  # a special token written in the prompt is itself


def test_every_command_s_tokenizer_adds_it_and_the_directory_agrees(bos_file):
    directory, path = bos_file
    for tokenizer in (load_tokenizer(Settings(target=str(path))), load_directory_tokenizer(directory)):
        assert prompt_bos(tokenizer) == 257
        for text in TEXTS:
            assert tokenizer.encode(text).ids == _llama_ids(path, text), text


def test_a_file_without_bos_gets_none(plain_file):
    _, path = plain_file
    tokenizer = GGUFTokenizer(LlamaCppModel(path))
    assert not tokenizer.adds_bos and prompt_bos(tokenizer) is None
    for text in TEXTS:
        assert tokenizer.encode(text).ids == _llama_ids(path, text) == tokenizer.encode(text, False).ids


def test_a_draft_of_another_tokenizer_starts_its_context_with_its_own_bos(bos_file, plain_file):
    """Target without BOS, draft with: the draft's context is [draft BOS] + the text's draft ids. Target
    with BOS, draft without: the target's BOS is not text, and the draft's context leaves it out."""
    bos_model, plain_model = LlamaCppModel(bos_file[1]), LlamaCppModel(plain_file[1])
    with_bos, without = token_text_of(bos_file[1], bos_model), token_text_of(plain_file[1], plain_model)
    assert with_bos.bos == 257 and without.bos is None
    same = list(range(len(without)))  # the two vocabularies are the same bytes: the identity map
    text = "hello world"
    prompt = without.encode(text)
    row = DraftText(without, with_bos, same, prompt)
    assert row.ids == [257, *with_bos.encode(text)]
    row.extend(without.encode(" again"))
    assert row.ids[0] == 257 and row.ids.count(257) == 1
    back = DraftText(with_bos, without, same, [257, *prompt])
    assert back.ids == without.encode(text)


def test_a_rendered_chat_prompt_keeps_one_bos():
    specials = {"bos_token": BOS, "eos_token": "</s>"}
    assert without_added_bos(f"{BOS}[INST] hi", specials, bos=257) == "[INST] hi"
    assert without_added_bos(f"{BOS}[INST] hi", specials, bos=None) == f"{BOS}[INST] hi"  # nothing adds one
    assert without_added_bos("[INST] hi", specials, bos=257) == "[INST] hi"


def test_a_gguf_s_chat_template_gets_its_bos_and_eos_texts(tmp_path):
    """Read from the file's metadata (models/gguf_header.metadata), so that a rendered prompt's BOS can be
    recognised and left to the tokenizer."""
    import gguf
    import numpy as np

    from verispec.server.chat import load_chat_template, render

    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    path = tmp_path / "chat.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template(template)
    writer.add_token_list(["<unk>", BOS, "</s>", "a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("x", np.zeros((2, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = load_chat_template(path)
    assert loaded == (template, {"bos_token": BOS, "eos_token": "</s>"})
    rendered = render(*loaded, [{"role": "user", "content": "hi"}])
    assert rendered == f"{BOS}[user] hi" and without_added_bos(rendered, loaded[1], bos=1) == "[user] hi"
