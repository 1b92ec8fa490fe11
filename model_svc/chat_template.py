"""A checkpoint's chat template: a list of messages -> the prompt text the model was tuned on.

The template is the Jinja source in the checkpoint's ``chat_template.jinja``
(where transformers 5's ``save_pretrained`` writes it; it wins over the
config's, as transformers reads it), else in ``tokenizer_config.json``
(``chat_template``, a string, or a list of ``{"name", "template"}`` of which
``default`` is used), rendered as Hugging Face renders it: a sandbox (a template cannot reach Python
objects), ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, and the helpers templates call (``raise_exception``,
``strftime_now``, a ``tojson`` filter that keeps non-ASCII text). The
variables are ``messages``, ``add_generation_prompt`` and the special tokens
(``bos_token``, ``eos_token``...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from model_svc.errors import CheckpointError

ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: malformed, or refused by the template itself."""


def template_source(tokenizer_config: Mapping[str, Any]) -> str | None:
    """The Jinja source of ``tokenizer_config``'s chat template, or None if it has none."""
    template = tokenizer_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise CheckpointError(
        "tokenizer_config.json: chat_template is neither a string nor a list holding a "
        "'default' template"
    )


def checkpoint_template_source(
    checkpoint: str | Path, tokenizer_config: Mapping[str, Any]
) -> str | None:
    """The checkpoint's chat template: its ``chat_template.jinja`` if it has one, else
    :func:`template_source` of its ``tokenizer_config``; None if it has neither."""
    path = Path(checkpoint) / CHAT_TEMPLATE_FILE
    if not path.exists():
        return template_source(tokenizer_config)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable as UTF-8 text ({exc})") from None


class ChatTemplate:
    """``render(messages)``: the prompt text; ``special_tokens`` become template variables."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self.special_tokens = {name: value for name, value in special_tokens.items() if value}

    @cached_property
    def _template(self) -> Any:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise CheckpointError(f"chat_template does not compile: {exc}") from None

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt for ``messages``; with ``add_generation_prompt``, it ends where the
        assistant's reply begins. Raises :class:`ChatTemplateError`."""
        import jinja2

        checked = [_checked_message(i, message) for i, message in enumerate(messages)]
        if not checked:
            raise ChatTemplateError("messages: at least one message is needed")
        try:
            return self._template.render(
                messages=checked, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None


def _checked_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}]: must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ChatTemplateError(f"messages[{index}].role: {role!r} is not one of {ROLES}")
    if isinstance(content, list):  # OpenAI's content parts: only text ones are meaningful here
        if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content: must be a string")
    return {**message, "role": role, "content": content}


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)
