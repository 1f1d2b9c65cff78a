from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tokenbus.prompt_tokens import ChatTemplate, PromptCounter

ROLE_LINES = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_tokenizer(directory: Path) -> None:
    vocab = {"<s>": 0, "[UNK]": 1, "user:": 2, "assistant:": 3, "hello": 4, "world": 5}
    vocab |= {"system:": 6, "be": 7, "brief": 8, "</s>": 9}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    # Like the tiny model's: a BOS on every prompt encoded with special tokens.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))


def write_model(directory: Path, template: str | None, **config: object) -> Path:
    write_tokenizer(directory)
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", **config})
    )
    return directory


def test_a_completion_prompt_gets_the_tokenizers_special_tokens(tmp_path: Path) -> None:
    counter = PromptCounter.from_model_dir(write_model(tmp_path, ROLE_LINES))
    assert counter.count_prompt("hello world") == 3  # <s> hello world


def test_a_chat_is_the_rendered_template_without_added_special_tokens(tmp_path: Path) -> None:
    counter = PromptCounter.from_model_dir(write_model(tmp_path, ROLE_LINES))
    # user: hello assistant: (no <s>: vLLM's chat rule adds none the template lacks)
    assert counter.count_chat([("user", "hello")]) == 3


def test_a_template_that_writes_bos_gets_exactly_one(tmp_path: Path) -> None:
    counter = PromptCounter.from_model_dir(write_model(tmp_path, "{{ bos_token }}" + ROLE_LINES))
    assert counter.count_chat([("system", "be brief"), ("user", "hello")]) == 7


def test_the_template_can_come_from_the_tokenizer_config(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": ROLE_LINES}]
    model = write_model(tmp_path, None, chat_template=named, bos_token={"content": "<s>"})
    template = ChatTemplate.from_model_dir(model)
    assert template is not None
    assert template.render([("user", "hello")]) == "user: hello\nassistant: "


def test_templates_render_as_transformers_does() -> None:
    # trim_blocks and lstrip_blocks, loop controls, tojson without HTML escapes, and
    # generation blocks kept as their body (the expected text is transformers' own).
    source = (
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}"
    )
    template = ChatTemplate(source, {"bos_token": "<s>"})
    assert template.render([("system", "x"), ("user", "<b>&")]) == (
        '{"role": "user", "content": "<b>&"}'
    )


def test_a_template_may_refuse() -> None:
    import jinja2

    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        template.render([("user", "hello")])


def test_without_a_template_chats_count_as_role_lines(tmp_path: Path) -> None:
    counter = PromptCounter.from_model_dir(write_model(tmp_path, None))
    assert counter.count_chat([("user", "hello")]) == 4  # <s> user: hello assistant:


def test_without_a_tokenizer_it_estimates_from_bytes(tmp_path: Path) -> None:
    assert PromptCounter.from_model_dir(tmp_path).count_prompt("x" * 40) == 11
    assert PromptCounter.from_model_dir(tmp_path, bytes_per_token=1).count_prompt("x" * 40) == 41


def test_counts_are_the_lengths_encode_gives_on_a_byte_level_bpe() -> None:
    # The count takes the tokenizer's batch path without offsets; it must count what
    # ``encode`` (the engine's tokenizing) makes, special tokens added or not, for any
    # text: multi-byte characters, a special token's own text, spaces and newlines.
    from tokenizers import decoders, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["a partition is an ordered, immutable sequence of records"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    counter = PromptCounter(tokenizer)
    texts = [
        "",
        "a partition is an ordered sequence",
        "héllo wörld 🙂 数据 — ﬁ",
        "<s>user: hi</s>\n\n  tabs\tand   spaces ",
        "records " * 300,
    ]
    for text in texts:
        with_special = len(tokenizer.encode(text).ids)
        without = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert with_special == without + 1
        assert counter.count_prompt(text) == with_special, text
        assert counter._count(text, add_special_tokens=False) == without, text
