"""A small Llama-architecture checkpoint made locally: what the vLLM tests and `kvcache bench vllm` serve.

vLLM's `load_format="dummy"` fills weights with values too small for the output to depend on the
context, so a test that compares two runs would pass whatever the KV held. This writes a real
checkpoint instead: config.json, a byte-level BPE tokenizer trained with `tokenizers` on a small
corpus, and seeded random safetensors weights large enough that every token's logits depend on
the whole prefix (a wrong KV block changes the first generated token).

The shape is what vLLM's CPU attention accepts: head size 32, 64, 80, ...; the KV block size is
vLLM's to choose (a multiple of 32). Needs numpy, safetensors and tokenizers, not torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CORPUS = ("the cache keeps the keys and values of every prompt so that repeated context is never "
          "computed twice; a block is the KV of consecutive tokens, keyed by a chained hash of its "
          "prefix. 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-()[]{}")


@dataclass(frozen=True)
class TinyLlama:
    """The checkpoint's shape. The defaults are the tests' model (two layers, 128 KiB of fp32
    KV per layer per 128-token block); the benchmark asks for a deeper, wider one."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 512
    max_positions: int = 8192
    std: float = 0.08              # weight scale: large enough that logits depend on the context
    seed: int = 0

    def config(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "vocab_size": self.vocab,
                "max_position_embeddings": self.max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
                "bos_token_id": 1, "eos_token_id": 2}

    def tensors(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)

        def w(*shape):
            return (rng.standard_normal(shape, dtype=np.float32) * self.std).astype(np.float32)

        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = {"model.embed_tokens.weight": w(self.vocab, h) * 10, "lm_head.weight": w(self.vocab, h),
               "model.norm.weight": np.ones(h, np.float32)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {p + "self_attn.q_proj.weight": w(self.heads * self.head_dim, h),
                    p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.v_proj.weight": w(kv, h),
                    p + "self_attn.o_proj.weight": w(h, self.heads * self.head_dim),
                    p + "mlp.gate_proj.weight": w(self.intermediate, h),
                    p + "mlp.up_proj.weight": w(self.intermediate, h),
                    p + "mlp.down_proj.weight": w(h, self.intermediate),
                    p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32)}
        return out

    def write(self, path: str | Path) -> Path:
        """Write the checkpoint into `path` (created) and return it; the same shape and seed
        write the same bytes."""
        from safetensors.numpy import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config(), indent=1))
        save_file(self.tensors(), str(path / "model.safetensors"))
        _write_tokenizer(path, self.vocab)
        return path


def _write_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": 1 << 20}, indent=1))
