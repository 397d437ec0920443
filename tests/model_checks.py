"""What the model tests share: a small GPT's shape, a preset's model settings, a model with decisive random weights,
a parameter count that allocates nothing, and the causality check."""
import torch
from omegaconf import OmegaConf

from model import build_model
from model.config import ModelConfig
from training.config import REPO_ROOT, RunConfig

SMALL_GPT = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65)


def decisive_model(cfg: ModelConfig, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """A model of `cfg` in eval mode, every parameter (biases too) drawn from N(0, scale) by `seed`: at 0.3 each
    next token is clear, so greedy paths never hang on a near tie between batch shapes or kernels."""
    model, generator = build_model(cfg), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
    return model.eval()


def preset(name: str) -> ModelConfig:
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(f"{REPO_ROOT}/configs/{name}.yaml"))
    return OmegaConf.to_object(cfg).model


def count_on_meta(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def assert_causal(model) -> None:
    """Changing the token at t changes the logits at t and never those before it."""
    idx = torch.randint(0, 65, (1, 16))
    for t in (0, 7, 15):
        changed = idx.clone()
        changed[0, t] = (idx[0, t] + 1) % 65
        before, after = model(idx), model(changed)
        torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
        assert not torch.equal(before[:, t], after[:, t])
