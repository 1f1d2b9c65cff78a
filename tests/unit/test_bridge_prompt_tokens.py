from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from bridge.prompt_tokens import PromptCounter


def write_tokenizer(directory: Path) -> None:
    vocab = {"<s>": 0, "[UNK]": 1, "user:": 2, "assistant:": 3, "hello": 4, "world": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Like the tiny model's: a BOS on every encoded prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))


def test_counts_with_the_models_tokenizer_including_bos(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    counter = PromptCounter.from_model_dir(tmp_path)
    assert counter.count_prompt("hello world") == 3
    assert counter.count_chat([("user", "hello")]) == 4  # <s> user: hello assistant:


def test_without_a_tokenizer_it_estimates_from_bytes(tmp_path: Path) -> None:
    counter = PromptCounter.from_model_dir(tmp_path)
    assert counter.count_prompt("x" * 40) == 11
