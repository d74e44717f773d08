"""Chat messages -> a prompt, by the model's own chat template (as `transformers` renders it).

Owns `load_chat_template` (the `chat_template` of a Hugging Face directory's
tokenizer_config.json, or of a GGUF file's metadata; None when there is none), `check_messages`
(OpenAI's `messages`, checked: roles and string contents) and `render` (the template in a
sandboxed Jinja2 environment with `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` and `raise_exception`, as transformers' `apply_chat_template`). Knows nothing of
models or HTTP.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models.gguf_header import metadata
from .protocol import BadRequest

ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(path: str | Path) -> tuple[str, dict] | None:
    """(template, {"bos_token": ..., "eos_token": ...}) of a model, or None without a template."""
    path = Path(path)
    if path.is_file():  # a GGUF file: its metadata
        keys = ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
        try:
            fields = metadata(path, keys)
            template = fields.get("tokenizer.chat_template")
            if not isinstance(template, str) or not template:
                return None
            tokens = metadata(path, ("tokenizer.ggml.tokens",)).get("tokenizer.ggml.tokens") or []
        except (OSError, ValueError):  # an unreadable file: no template
            return None
        specials = {}
        for name in ("bos", "eos"):
            token = fields.get(f"tokenizer.ggml.{name}_token_id")
            specials[f"{name}_token"] = tokens[token] if isinstance(token, int) and 0 <= token < len(tokens) else ""
        return template, specials
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text(encoding="utf-8"))
    template = data.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(template, str) or not template:
        return None

    def token(value) -> str:
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    return template, {"bos_token": token(data.get("bos_token")), "eos_token": token(data.get("eos_token"))}


def without_added_bos(prompt: str, specials: dict, bos: int | None) -> str:
    """A rendered chat prompt less its leading BOS text where the tokenizer adds a BOS itself
    (`bos`, models/token_text.prompt_bos), so that the prompt has one BOS, as llama.cpp's chat does."""
    text = specials.get("bos_token") or ""
    return prompt[len(text) :] if bos is not None and text and prompt.startswith(text) else prompt


def check_messages(messages) -> list[dict]:
    """OpenAI's messages: a non-empty list of {"role": one of ROLES, "content": a string (or a
    list of text parts)}; BadRequest naming the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):  # [{"type": "text", "text": ...}]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadRequest(f"'messages[{i}].content' parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"'messages[{i}].content' must be a string", "messages")
        checked.append({"role": role, "content": content})
    return checked


def render(template: str, specials: dict, messages: list[dict]) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)
    except TemplateError as error:
        raise BadRequest(f"the chat template refused these messages: {error}", "messages") from None
