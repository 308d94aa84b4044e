"""Tokenizers: a checkpoint's own `tokenizer.json`, or a small deterministic byte-level BPE for
demo checkpoints, both through Hugging Face `tokenizers`, with DeepSeek's special tokens.

Special tokens take the first ids, in the order of SPECIAL_TOKENS, so BOS = 0, EOS = 1 and
PAD = 2 as in the real configs. They are spelled as deepseek-recipe renders prompts (its
SpecialToken defaults: the tool-call marker is `｜DSML｜`, markup such as `<｜DSML｜invoke` being
plain text around it), so the model server's prompt encoding works on demo checkpoints. The
model's vocabulary (logit width) may be larger than the tokenizer's: ids past the tokenizer are
never produced by encode().
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>",
                  "<｜latest_reminder｜>", "｜DSML｜", "</｜DSML｜", "<｜deepseek_image｜>", "<tool_result>",
                  "</tool_result>", "<｜action｜>", "<｜query｜>")

# a fixed, varied training text for the demo tokenizer (prose, code, numbers, CJK, chat markup):
# the same bytes every time, so the same merges and the same ids on every machine
_CORPUS_SEEDS = (
    "The quick brown fox jumps over the lazy dog. A cache that remembers repeated context saves prefill.",
    "def lookup(keys):\n    return [store.get(k) for k in keys if k in store]\n",
    "Tokens, blocks and namespaces: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "深度求索 缓存 推理 模型 上下文 长文本", "Prefix caching, sliding windows, compressed attention, experts.",
    "{\"role\": \"user\", \"content\": \"hello\"} <think>reasoning</think> answer",
)


@dataclass
class Tokenizer:
    """Thin wrapper: encode/decode plus the ids the engine needs."""
    backend: object

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(BOS)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(EOS)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def save(self, path: str) -> None:
        self.backend.save(os.path.join(path, "tokenizer.json"))


def build_demo_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens trained on a fixed text: deterministic."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"a byte-level tokenizer needs at least {len(SPECIAL_TOKENS) + 256} tokens, "
                         f"the config has {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    corpus = [s for i in range(64) for s in _CORPUS_SEEDS[i % len(_CORPUS_SEEDS):] + (f"line {i} of {64}",)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return Tokenizer(tok)


def load_tokenizer(path: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    f = os.path.join(path, "tokenizer.json")
    if not os.path.exists(f):
        raise FileNotFoundError(f"no tokenizer.json in {path}; `kvcache model init` writes one for demo checkpoints")
    return Tokenizer(HFTokenizer.from_file(f))
