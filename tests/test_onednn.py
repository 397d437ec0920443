"""The server's fp32 linear layers packed for oneDNN (model/onednn.py), in one process: a GPT (biases, tied head)
and a Llama (untied head), their large weights packed and the small ones dense, give the dense model's logits to
1e-5, whole window and through the key/value cache, keep no dense copy of a packed weight, and take new weights
from a state dict as the dense model does."""
import pytest
import torch

from model.config import ModelConfig
from model.generate import CachedDecoder
from model.onednn import PackedLinears, packable
from model_checks import decisive_model

# Widths where some weights are packed (2**19 elements and more) and some stay dense.
SHAPES = {"gpt": ModelConfig(arch="gpt", n_layer=1, n_head=4, n_embd=512, block_size=32, vocab_size=50),
          "llama": ModelConfig(arch="llama", n_layer=1, n_head=4, n_kv_head=2, n_embd=512, ffn_hidden=1024,
                               block_size=32, vocab_size=1100)}


@pytest.mark.parametrize("arch", SHAPES)
@torch.no_grad()
def test_packed_linears_give_the_dense_logits_and_take_new_weights(arch):
    """Some weights packed, some left dense."""
    cfg = SHAPES[arch]
    # At the initialization's scale, biases random too (they start at zero).
    dense, packed, other = (decisive_model(cfg, seed, scale=0.02) for seed in (1, 1, 2))
    assert packable(packed)
    linears = PackedLinears(packed)
    dense_ones = [m for m in packed.modules() if isinstance(m, torch.nn.Linear) and m not in linears.linears.values()]
    assert linears.linears and dense_ones and all(m.weight.numel() == 0 for m in linears.linears.values())
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(20)[None].expand(2, -1)
    assert torch.allclose(packed((ids, positions)), dense((ids, positions)), atol=1e-5, rtol=0)
    steps = []
    for net in (dense, packed):
        decoder = CachedDecoder(net, cfg.block_size, cfg.vocab_size)
        slot, first = decoder.start(ids[0].tolist())
        steps.append(torch.stack([first, decoder.step({slot: [3]})[slot]]))
    assert torch.allclose(steps[0], steps[1], atol=1e-5, rtol=0)
    linears.load(other.state_dict())
    assert torch.allclose(packed((ids, positions)), other((ids, positions)), atol=1e-5, rtol=0)
    assert not torch.allclose(other((ids, positions)), dense((ids, positions)), atol=1e-3)  # new weights, new logits
