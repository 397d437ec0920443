"""What the tests ask of `transformers` (a test-only dependency): load a folder exactly as a user would and
compare its logits with this repo's forward of the same weights."""
import json
import os

import torch

from model import build_model
from training.export import load_export

CLASSES = {"GPT2LMHeadModel", "LlamaForCausalLM"}


def load_in_transformers(folder: str):
    import transformers

    with open(os.path.join(folder, "config.json")) as f:
        (architecture,) = json.load(f)["architectures"]
    assert architecture in CLASSES, architecture
    model, info = getattr(transformers, architecture).from_pretrained(folder, output_loading_info=True,
                                                                       dtype=torch.float32)
    # from_pretrained only warns about tensors it did not find or could not place: here each is a failure
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@torch.no_grad()
def assert_export_matches_transformers(folder: str, tokens: int = 16) -> None:
    """An export's logits in transformers equal this repo's forward of the export (fp32, max diff <= 1e-5)."""
    cfg, state, _ = load_export(folder)
    ours = build_model(cfg)
    ours.load_state_dict(state)
    theirs = load_in_transformers(folder)
    idx = torch.randint(0, cfg.vocab_size, (2, min(tokens, cfg.block_size)), generator=torch.Generator().manual_seed(0))
    expected = ours.eval()(idx)[..., : cfg.vocab_size]
    got = theirs(idx).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5, (got - expected).abs().max().item()
