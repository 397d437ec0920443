"""Autoregressive sampling, for any callable that maps token ids to logits (a module or an engine)."""
import torch


@torch.no_grad()
def generate(forward, idx: torch.Tensor, max_new_tokens: int, block_size: int, vocab_size: int,
             temperature: float = 1.0, top_k: int | None = None, generator: torch.Generator | None = None,
             stop_id: int | None = None):
    """Extend `idx` (batch, time) by max_new_tokens tokens, or (one sequence) until it draws `stop_id`. Logits
    past vocab_size are vocab padding and never sampled; temperature 0 takes the most likely token."""
    for _ in range(max_new_tokens):
        logits = forward(idx[:, -block_size:])[:, -1, :vocab_size].float()
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, vocab_size)).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, next_id], dim=1)
        if stop_id is not None and idx.size(0) == 1 and next_id.item() == stop_id:
            break
    return idx
