"""Chat templates and the bos rule of a checkpoint's tokenizer_config.json (no model needed).

SmolLM2's own template, rendered against transformers', is in test_smollm2.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from model_svc.chat_template import ChatTemplate, ChatTemplateError, template_source
from model_svc.config import ModelConfig
from model_svc.errors import CheckpointError
from model_svc.tiny import tiny_config
from model_svc.tokenizer import ByteTokenizer, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_renders_messages_and_the_generation_prompt() -> None:
    template = ChatTemplate(CHATML, {"bos_token": "<s>"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert template.render(messages) == body + "<|im_start|>assistant\n"
    assert template.render(messages, add_generation_prompt=False) == body


def test_trim_and_lstrip_blocks_and_special_tokens() -> None:
    source = "{{ bos_token }}\n  {% for m in messages %}\n    [{{ m.content }}]\n  {% endfor %}\n"
    rendered = ChatTemplate(source, {"bos_token": "<s>", "eos_token": None}).render(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert rendered == "<s>\n    [a]\n    [b]\n"


def test_tojson_keeps_unicode_and_loopcontrols_work() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.content | tojson }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "café 🍵"}, {"role": "user", "content": "skipped"}]
    assert ChatTemplate(source, {}).render(messages) == '"café 🍵"'


def test_text_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    rendered = ChatTemplate("{{ messages[0].content }}", {}).render(
        [{"role": "user", "content": parts}]
    )
    assert rendered == "Hello, world"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        (["hi"], r"messages\[0\]: must be an object"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role: 'wizard'"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content: must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
    ],
)
def test_malformed_messages_are_refused(messages, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(CHATML, {}).render(messages)


def test_the_template_refusing_is_a_chat_template_error() -> None:
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    template = ChatTemplate(source, {})
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="refused the messages: user first"):
        template.render([{"role": "assistant", "content": "x"}])


def test_the_sandbox_keeps_python_out_of_reach() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        template.render([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="does not compile"):
        ChatTemplate("{% for %}", {}).render([{"role": "user", "content": "x"}])


def test_template_source_forms() -> None:
    assert template_source({}) is None
    assert template_source({"chat_template": "x"}) == "x"
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    assert template_source({"chat_template": named}) == "d"
    with pytest.raises(CheckpointError, match="'default'"):
        template_source({"chat_template": [{"name": "tool_use", "template": "t"}]})


# -- what the tokenizer takes from tokenizer_config.json ---------------------------------


def _checkpoint(tmp_path: Path, settings: dict | None, *, bos_post_processor: bool) -> Path:
    """A folder with a word-level tokenizer.json (ids 0..258, bos 256) and, if given,
    a tokenizer_config.json; the post-processor prepends bos if asked to."""
    vocab = {f"w{i}": i for i in range(256)} | {"<s>": 256, "</s>": 257, "<pad>": 258}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos_post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 256)]
        )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    if settings is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    return tmp_path


@pytest.mark.parametrize(
    ("settings", "post_processor", "adds_bos"),
    [
        ({"add_bos_token": False}, True, False),  # the config wins over the post-processor
        ({"add_bos_token": True}, False, True),
        ({}, True, True),  # no word in the config: what the post-processor does, as HF
        (None, False, False),
    ],
)
def test_bos_follows_the_checkpoint(tmp_path: Path, settings, post_processor, adds_bos) -> None:
    config: ModelConfig = tiny_config()
    folder = _checkpoint(tmp_path, settings, bos_post_processor=post_processor)
    tokenizer = load_tokenizer(folder, config)
    assert tokenizer.add_bos is adds_bos
    assert tokenizer.encode("w1 w2") == ([256] if adds_bos else []) + [1, 2]
    assert tokenizer.encode("w1 w2", add_bos=True) == [256, 1, 2]
    assert tokenizer.encode("w1 w2", add_bos=False) == [1, 2]
    assert tokenizer.chat_template is None


def test_the_chat_template_gets_the_checkpoints_special_tokens(tmp_path: Path) -> None:
    settings = {"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
    tokenizer = load_tokenizer(
        _checkpoint(tmp_path, settings, bos_post_processor=False), tiny_config()
    )
    assert tokenizer.chat_template.render([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_an_unreadable_tokenizer_config_is_a_checkpoint_error(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, None, bos_post_processor=False)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: not readable JSON"):
        load_tokenizer(folder, tiny_config())


def test_the_byte_tokenizer_keeps_adding_bos() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.add_bos and tokenizer.encode("a") == [256, 97]
    assert tokenizer.chat_template is None


def test_a_chat_template_jinja_file_is_the_template_as_in_transformers(tmp_path: Path) -> None:
    """transformers 5's ``save_pretrained`` writes the template to chat_template.jinja, not
    into tokenizer_config.json; when both are there, the file wins (as transformers reads it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = _checkpoint(tmp_path, None, bos_post_processor=False)
    saved = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHATML,
    )
    saved.save_pretrained(folder)
    assert (folder / "chat_template.jinja").read_text() == CHATML
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "w1 w2"}]
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    tokenizer = load_tokenizer(folder, tiny_config())
    assert tokenizer.chat_template is not None, "chat_template.jinja was not read"
    assert tokenizer.chat_template.render(messages) == want

    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ 'from the config' }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert AutoTokenizer.from_pretrained(folder).chat_template == CHATML
    assert load_tokenizer(folder, tiny_config()).chat_template.source == CHATML
