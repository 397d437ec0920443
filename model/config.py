"""Architecture settings shared by every model in `model/` (the `model:` section of a run config)."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelConfig:
    arch: str = "gpt"  # "gpt" (model/gpt.py) or "encoder" (model/encoder.py)
    # Defaults are GPT-2 small (124M); presets in configs/ override them.
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    # None: taken from the prepared dataset's meta.json (65 for character-level Shakespeare).
    vocab_size: Optional[int] = None
    # Embedding rows are padded up to a multiple of this: 50257 -> 50304 makes the head matmul
    # tile cleanly on tensor cores. Padded logits are never sampled and learn to stay low.
    vocab_multiple: int = 64
    # Feed-forward width; null means 4 x n_embd (GPT-2). The encoder_1b preset sets 4096.
    ffn_hidden: Optional[int] = None
    dropout: float = 0.0
    bias: bool = True  # GPT only; nn.TransformerEncoderLayer always has biases

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def padded_vocab_size(self) -> int:
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is unset: resolve it from the dataset's meta.json first")
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m
