"""A tiny random-weight Llama, built offline, so vLLM can really run in tests and demos.

Its output is noise, but its tokens, batching, prefix cache and aborts are vLLM's own.
The build is deterministic (fixed seeds, a fixed training text) and needs no network:
the tokenizer learns from docstrings of the Python standard library.

    python -m workers.tiny_model OUT_DIR
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"
SEED = 20240501
COMPLETE_MARKER = ".complete"

# Renders each message as "<role>: content" on its own line, then opens the reply.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# A fixed, sorted list rather than "every module": the training text, and so the
# vocabulary, must not depend on what else happens to be importable.
_CORPUS_MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "gzip", "hashlib", "heapq", "hmac", "html", "http",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "operator",
    "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil",
    "socket", "statistics", "string", "struct", "subprocess", "tempfile", "textwrap",
    "threading", "time", "typing", "unittest", "urllib", "uuid", "zipfile",
)  # fmt: skip

Progress = Callable[[str], None]


def build_tiny_model(out_dir: Path, *, progress: Progress | None = None) -> Path:
    """Builds the model into ``out_dir`` unless a complete one is already there."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    say = progress or (lambda _line: None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its target so the final rename stays on one filesystem (atomic):
    # a crash leaves at worst a stray temp dir, never a half model at out_dir.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        say("[1/4] training tokenizer ...")
        tokenizer = _train_tokenizer()
        say("[2/4] initialising random weights ...")
        model = _random_llama(tokenizer.bos_token_id, tokenizer.eos_token_id)
        say("[3/4] saving tokenizer and weights ...")
        tokenizer.save_pretrained(tmp)
        _quietly(model.save_pretrained, tmp)
        say("[4/4] finishing ...")
        (tmp / COMPLETE_MARKER).write_text("ok\n")  # written last: its presence means done
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_complete(model_dir: Path) -> bool:
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def _publish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() and not is_complete(out_dir):
        shutil.rmtree(out_dir)  # a leftover without the marker is not trusted
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another builder renamed first; its model is as good as ours.
        if not is_complete(out_dir):
            raise


def _quietly(save: Callable[[Path], object], path: Path) -> None:
    # transformers draws a progress bar on stderr, where our caller reads our step lines.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        save(path)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _training_text() -> Iterator[str]:
    with warnings.catch_warnings():
        # Reading some attributes warns (typing.io, typing.re); they are only text here.
        warnings.simplefilter("ignore")
        yield from _docstrings()


def _docstrings() -> Iterator[str]:
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        if module.__doc__:
            yield module.__doc__
        for attr, value in sorted(vars(module).items()):
            # Submodules are skipped: which ones a package holds depends on what else
            # was imported before, and the text must not.
            if attr.startswith("_") or isinstance(value, types.ModuleType):
                continue
            if isinstance(doc := getattr(value, "__doc__", None), str):
                yield doc


def _train_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        # All 256 bytes up front, so any text (and any generated id) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_training_text(), trainer=trainer)
    # Prepends <s> like a Llama tokenizer, so prompts start the same way in vLLM and HF.
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, core.token_to_id(BOS))],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=16384,
        chat_template=CHAT_TEMPLATE,
    )


def _random_llama(bos_token_id: int, eos_token_id: int) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention rejects 16
        num_key_value_heads=1,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    # A private RNG stream: fixed weights without disturbing the caller's seed state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return LlamaForCausalLM(config)  # type: ignore[no-untyped-call]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m workers.tiny_model OUT_DIR", file=sys.stderr)
        return 2
    out_dir = build_tiny_model(Path(args[0]), progress=lambda line: print(line, file=sys.stderr))
    print(f"tiny model ready at {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
