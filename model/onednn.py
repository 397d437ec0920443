"""fp32 linear layers through oneDNN for inference on a CPU, each large weight packed once into oneDNN's layout.
PyTorch's dense fp32 matmul reads a (1, 768) x (768, 3072) weight at a third of the memory bandwidth a decode step
is bound by; packed, oneDNN's is about twice as fast. At the Llama-124M shape on a 2-core AMD EPYC a decode step
goes from 30 to 19 ms at one sequence and from 84 to 58 ms at 16, a 256-token prefill from 314 to 204 ms, the
logits equal to 1e-5. bf16 gains nothing there: a bf16 model is left as it is.

PyTorch's own torch.utils.mkldnn.to_mkldnn packs the same way, but replaces each module with a jit ScriptModule
that takes 2-D inputs only and holds oneDNN tensors in its state dict; here each nn.Linear and LM head stays in
place, its forward swapped, its dense weight given up for the packed one (the memory of one copy), and `load`
packs new weights from a state dict (the server's weight reload).
"""
import types

import torch
from torch import nn

from model.layers import LMHead

LINEAR = (nn.Linear, LMHead)
# A packed call costs about 30 us more whatever its size (the input's conversion to oneDNN's layout and back), so
# small weights stay dense: at 2-core AMD EPYC, a 768 x 768 weight read from memory gains, a 256 x 256 one loses 4x.
MIN_PACKED = 2**19


def packable(model: nn.Module) -> bool:
    """Whether the model's linear layers would run faster packed: fp32 on a CPU with oneDNN."""
    first = next(model.parameters())
    return first.device.type == "cpu" and first.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinears:
    def __init__(self, model: nn.Module):
        self.model = model
        self.linears = {name: m for name, m in model.named_modules()
                        if isinstance(m, LINEAR) and m.weight.numel() >= MIN_PACKED}
        self.load(model.state_dict())

    def load(self, state: dict) -> None:
        """The model's weights from a state dict of its dense form: the linear layers' packed, the others copied."""
        packed = {f"{name}.{p}" for name in self.linears for p in ("weight", "bias")}
        missing, unexpected = self.model.load_state_dict({k: v for k, v in state.items() if k not in packed},
                                                         strict=False)
        assert not unexpected and set(missing) <= packed, (missing, unexpected)
        for name, module in self.linears.items():
            weight, bias = state[f"{name}.weight"], state.get(f"{name}.bias")
            module.packed_weight = weight.detach().float().contiguous().to_mkldnn()
            module.packed_bias = (bias.detach().float() if bias is not None
                                  else torch.zeros(weight.size(0))).contiguous().to_mkldnn()
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)  # the packed copy replaces it
            if bias is not None:
                module.bias = nn.Parameter(bias.new_empty(0), requires_grad=False)
            module.forward = types.MethodType(_packed_forward, module)


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.size(-1)).to_mkldnn()
    return torch._C._nn.mkldnn_linear(rows, self.packed_weight, self.packed_bias).to_dense().reshape(
        *x.shape[:-1], -1)
