"""Mixture-of-experts feed-forward networks (Mixtral's block: a softmax router picks k of n SwiGLU experts per
token, their outputs weighted by the renormalized router probabilities), through DeepSpeed's MoE layer; with a
shared expert, Qwen2-MoE's block: an always-on SwiGLU added behind a sigmoid gate.

DeepSpeed's layer (deepspeed.moe.layer.MoE) holds the router and this rank's experts, and exchanges tokens with
the other ranks of its expert-parallel group (all-to-all). It is used with its second choice deterministic
(top2_2nd_expert_sampling=False: by default it samples it with Gumbel noise, evaluation included) and without
random token selection, so a model's output is a function of its weights and inputs alone.

Added around it:
- the experts start distinct and alike at every expert-parallel degree: DeepSpeed deep-copies one expert, so
  each is initialized again from a seed of its global index;
- the load-balancing loss reaches the gradients without travelling with the activations (Megatron-LM's way,
  its MoEAuxLossAutoScaler): each layer's loss is attached to its output, whose backward adds the loss's
  gradient. So it needs no second output from any layer, and pipeline stages pass the hidden states alone;
- the router's z-loss (ST-MoE), attached the same way, and the count of the routes a capacity factor drops,
  which DeepSpeed's layer does not report;
- under sequence parallelism, the load-balancing loss of the whole sequence, not of a rank's slice of it
  (BalancingGate).
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import TopKGate, top2gating, topkgating
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from model.layers import SwiGLU, init_weights
from model.recompute import recomputed


@dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel degree, and this rank's place in its group (its experts are rank x n/size on)."""
    size: int = 1
    rank: int = 0


NO_EXPERT_PARALLEL = ExpertParallel()


class _AttachLoss(torch.autograd.Function):
    """Identity on the hidden states; the backward also sends a gradient of 1 down `loss`, as if it were added to
    the training loss."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class BalancingGate(TopKGate):
    """DeepSpeed's gate (its router and settings taken over: checkpoints name it alike) computing the
    load-balancing loss itself, by DeepSpeed's formula for k: E^2 x the mean over experts of (mean router
    probability x share of routes), the routes first choices for k <= 2, all k of them over k for more. Its two
    means are taken over the tokens of every rank of `balance_group` when one is set: under sequence parallelism
    each rank holds a slice of the same windows, and one process balances over all their tokens
    (training/moe.py sets it). The probability's mean is all-reduced with its gradient, so each rank's tokens
    get the gradient of the whole sequence's loss."""

    def __init__(self, gate: TopKGate):
        with torch.random.fork_rng(devices=[]):  # its own router, thrown away, draws nothing from the model's seed
            super().__init__(gate.wg.in_features, gate.wg.out_features, gate.k, gate.capacity_factor,
                             gate.eval_capacity_factor, gate.min_capacity, gate.noisy_gate_policy, gate.drop_tokens,
                             gate.use_rts, None, gate.top2_2nd_expert_sampling)
        self.wg, self.balance_group = gate.wg, getattr(gate, "balance_group", None)

    @recomputed()  # as DeepSpeed's own gate (MoEFeedForward)
    def forward(self, input: torch.Tensor, used_token=None, sparse_routes: bool = False, use_tutel: bool = False):
        logits = F.linear(input.float(), self.wg.weight.float())
        probs = F.softmax(logits, dim=-1)
        routed, routes = self.route(input, logits, probs, sparse_routes)
        return (self.balancing_loss(probs, routes), *routed[1:])

    def route(self, input: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, sparse_routes: bool):
        """DeepSpeed's gating's output, and the routes its loss counts (a bool mask, tokens x experts)."""
        routed = super().forward(input, sparse_routes=sparse_routes)
        if self.k > 2:
            return routed, torch.zeros_like(probs, dtype=torch.bool).scatter_(1, probs.topk(self.k).indices, True)
        return routed, F.one_hot(probs.argmax(dim=1), probs.size(1)).bool()

    def balancing_loss(self, probs: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        me, ce = probs.mean(0), routes.float().mean(0)
        if self.balance_group is not None:
            size = dist.get_world_size(self.balance_group)
            me = differentiable_all_reduce(me, group=self.balance_group) / size
            dist.all_reduce(ce, group=self.balance_group)
            ce = ce / size
        experts = probs.size(1)
        return (me * ce).mean() * experts * experts / self.routes_per_token

    @property
    def routes_per_token(self) -> int:
        """The routes of a token the loss counts: DeepSpeed's top-1 and top-2 count the first choice alone."""
        return self.k if self.k > 2 else 1


class BiasedGate(BalancingGate):
    """DeepSpeed's gate with DeepSeek-V3's balancing without an auxiliary loss: a per-expert bias, added to the
    router's probabilities for the choice of the k experts only; their weights stay the renormalized
    probabilities. DeepSpeed's gating takes the choice and the weights from one softmax, so the choice is made
    here and handed to it as logits with every other expert at -inf (their softmax is the chosen experts'
    probabilities renormalized). The load-balancing loss is computed from the unbiased probabilities and the
    choice (top-k's formula, E^2 / k x mean over experts of mean probability x share of routes)."""

    def __init__(self, gate: TopKGate):
        super().__init__(gate)
        # Not "expert_...": DeepSpeed's MoE checkpoint takes every state name with "expert" in it for an expert's.
        self.register_buffer("choice_bias", torch.zeros(gate.wg.out_features))

    def init_buffers(self) -> None:
        """No bias: the model as built, before training moves it (build_empty; a checkpoint's holds its own)."""
        self.choice_bias = torch.zeros(self.choice_bias.shape)

    routes_per_token = property(lambda self: self.k)

    def route(self, input: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, sparse_routes: bool):
        choice = (probs + self.choice_bias).topk(self.k).indices
        chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, choice, True)
        capacity = self.capacity_factor if self.training else self.eval_capacity_factor
        masked = logits.masked_fill(~chosen, float("-inf"))
        if self.k == 2:
            return top2gating(masked, capacity, self.min_capacity, self.drop_tokens, self.ep_group, False,
                              sparse_routes), chosen
        return topkgating(masked, self.k, capacity, self.min_capacity, self.drop_tokens, self.ep_group,
                          sparse_routes=sparse_routes), chosen


class MoEFeedForward(nn.Module):
    """n_experts SwiGLU experts of width `hidden`, k of them per token; `capacity_factor` None routes every
    token (dropless), else an expert takes at most capacity_factor x its even share of tokens and drops the rest.
    shared_hidden > 0: Qwen2-MoE's shared expert, a SwiGLU of that width every token goes through, its output
    weighted by sigmoid(x . shared_gate) and added to the experts'. aux_loss_scale and z_loss_scale: the weights in
    the gradients of the load-balancing loss and of the router's z-loss (training/moe.py sets them: each
    coefficient over the accumulation steps, as DeepSpeed scales the language-model loss)."""

    def __init__(self, n_embd: int, hidden: int, n_experts: int, k: int, n_layer: int,
                 capacity_factor: float | None = None, ep: ExpertParallel = NO_EXPERT_PARALLEL,
                 balancing_bias: bool = False, shared_hidden: int = 0):
        super().__init__()
        dropless = capacity_factor is None
        if shared_hidden:
            # Dense weights, held whole on every expert-parallel rank. Registered before the experts, so the block's
            # initialization draws them before this rank's share of experts: alike at every degree. Beside
            # DeepSpeed's MoE module, not in it, and named clear of "expert": its checkpoint takes every state name
            # within it that holds the word for an expert's.
            self.shared_mlp = SwiGLU(n_embd, shared_hidden)
            self.shared_gate = nn.Linear(n_embd, 1, bias=False)
        else:
            self.shared_mlp = self.shared_gate = None
        self.moe = MoE(n_embd, SwiGLU(n_embd, hidden), num_experts=n_experts, ep_size=ep.size, k=k,
                       capacity_factor=capacity_factor or 1.0, eval_capacity_factor=capacity_factor or 1.0,
                       drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False)
        if balancing_bias:
            self.moe.deepspeed_moe.gate = BiasedGate(self.moe.deepspeed_moe.gate)
        else:  # under selective recomputation the routing runs again (it is small): DeepSpeed's gating divides its
            # einsums' outputs in place, which a kept output may not be
            self.moe.deepspeed_moe.gate.forward = recomputed()(self.moe.deepspeed_moe.gate.forward)
        self.load = torch.zeros(n_experts)  # routes per expert since the last bias update (training/moe.py)
        # One seed per global expert, drawn alike on every rank (init_experts uses them): expert e starts the
        # same at any degree.
        self.seeds, self.n_layer, self.ep = torch.randint(2**62, (n_experts,), device="cpu").tolist(), n_layer, ep
        self.aux_loss_scale = self.z_loss_scale = 0.0
        # (load-balancing loss, routes per expert, routes dropped, z-loss) of each training forward since the last
        # read, and of each evaluation forward while `recording` (training/moe.py: an evaluation's figures)
        self.routed, self.evaluated, self.recording = [], [], False

    def init_experts(self) -> None:
        """This rank's experts initialized from their seeds (GPT-2 init, the down map a residual projection).
        Called by the block once its own initialization, which draws for this rank's experts only, is done."""
        for local, expert in enumerate(self.experts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seeds[self.ep.rank * len(self.experts) + local])
                init_weights(expert, self.n_layer, residual=("down.weight",))

    @property
    def router(self) -> nn.Linear:
        return self.moe.deepspeed_moe.gate.wg

    @property
    def experts(self) -> nn.ModuleList:
        """This rank's experts, in the order of their global indices."""
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    def dropped(self, counts: torch.Tensor, tokens: int) -> torch.Tensor:
        """The routes past their expert's capacity, which DeepSpeed's gate drops: its capacity rule (k x
        capacity_factor x an even share of this rank's tokens, at least min_capacity), which it does not report."""
        gate = self.moe.deepspeed_moe.gate
        if not gate.drop_tokens:
            return torch.zeros((), device=counts.device)
        capacity = max(math.ceil(tokens / len(counts) * gate.capacity_factor * gate.k), gate.min_capacity)
        return (counts - capacity).clamp(min=0).sum()

    def z_loss(self, x: torch.Tensor) -> torch.Tensor:
        """ST-MoE's router z-loss, which DeepSpeed's layer lacks: the mean over tokens of the squared log-sum-exp
        of the router's logits (computed again here, in fp32 as its gate does), keeping them small."""
        logits = x.reshape(-1, x.size(-1)).float() @ self.router.weight.float().t()
        return torch.logsumexp(logits, dim=-1).square().mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, aux_loss, counts = self.moe(x)
        if self.shared_mlp is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared_mlp(x)
        training = torch.is_grad_enabled()  # under activation checkpointing: the recomputation, once
        if training or self.recording:
            z_loss = self.z_loss(x) if self.z_loss_scale else torch.zeros((), device=x.device)
            (self.routed if training else self.evaluated).append(
                (aux_loss.detach(), counts, self.dropped(counts, x.numel() // x.size(-1)), z_loss.detach()))
        if training:
            if isinstance(self.moe.deepspeed_moe.gate, BiasedGate):
                self.load = self.load.to(counts.device) + counts
            if self.aux_loss_scale or self.z_loss_scale:
                out = _AttachLoss.apply(out, self.aux_loss_scale * aux_loss + self.z_loss_scale * z_loss)
        return out


def expert_parallel(specs: list, ep: ExpertParallel) -> list:
    """The layer list with its mixture-of-experts blocks (the LayerSpecs built with moe=True) holding this rank's
    experts of `ep` (PipelineModule builds each stage's layers itself, so the degree travels with the specs)."""
    for spec in specs:
        if spec.module_kwargs.get("moe"):
            spec.module_kwargs["ep"] = ep
    return specs


def global_expert_names(model: nn.Module) -> dict[str, str]:
    """This rank's expert parameter names -> the names a one-rank model gives them (their global indices), as
    DeepSpeed names them in its checkpoints' expert files."""
    names = {}
    for prefix, layer in model.named_modules():
        if isinstance(layer, MoEFeedForward):
            first = layer.ep.rank * len(layer.experts)
            for local, expert in enumerate(layer.experts):
                for name, _ in expert.named_parameters():
                    names[f"{prefix}.moe.deepspeed_moe.experts.deepspeed_experts.{local}.{name}"] = \
                        f"{prefix}.moe.deepspeed_moe.experts.deepspeed_experts.{first + local}.{name}"
    return names


def balance_over(model: nn.Module, group) -> None:
    """Every MoE layer's load-balancing loss taken over the tokens of every rank of `group` (BalancingGate)."""
    for layer in moe_layers(model):
        gate = layer.moe.deepspeed_moe.gate
        if not isinstance(gate, BalancingGate):
            gate = layer.moe.deepspeed_moe.gate = BalancingGate(gate)
        gate.balance_group = group


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]
