"""What a mixture of experts adds to the training loop (model/architecture.py TrainingHooks), declared by its
architecture: after each step, the biased routers' bias moved toward even load (DeepSeek-V3's balancing without an
auxiliary loss); at each progress line and evaluation, the routing its layers recorded: the load-balancing loss,
how evenly the experts were loaded, the routes a capacity factor dropped, the z-loss, the largest bias."""
import contextlib

import torch

from model.architecture import NO_HOOKS, TrainingHooks
from model.config import ModelConfig
from model.moe import BiasedGate, MoEFeedForward, moe_layers


class RouterHooks(TrainingHooks):
    """`n_layers`: the model's layer list's length (a layer is named by its index in it, in both builds)."""

    def __init__(self, cfg: ModelConfig, n_layers: int):
        self.cfg, self.n_layers = cfg, n_layers

    def after_step(self, model, driver) -> None:
        if self.cfg.router_bias_rate:
            update_router_biases(model, self.cfg, driver.data_parallel_group)

    def progress(self, model) -> tuple[dict, str]:
        figures = routing_figures(model, self.cfg, self.n_layers)
        return figures, (f" | aux {figures['moe_aux_loss']:.4f}, expert load max {figures['expert_load_max']:.2f}"
                         if figures else "")

    def evaluating(self, model):
        return recording_evaluation(model)

    def evaluation(self, model) -> tuple[dict, str]:
        figures = {f"eval_{name}": value for name, value in
                   routing_figures(model, self.cfg, self.n_layers, evaluation=True).items()
                   if name != "router_bias_max"}
        return figures, (f", expert load max {figures['eval_expert_load_max']:.2f}" if figures else "")


def router_hooks(cfg: ModelConfig, n_layers: int) -> TrainingHooks:
    return RouterHooks(cfg, n_layers) if cfg.n_experts else NO_HOOKS


@torch.no_grad()
def update_router_biases(model: torch.nn.Module, cfg: ModelConfig, group) -> None:
    """After a training step (collective over the data-parallel `group`): each biased router's per-expert bias
    moves by router_bias_rate toward even load, up for the experts that took fewer routes than the mean, down for
    those that took more (DeepSeek-V3's rule), from the step's routes on every data-parallel rank."""
    for layer in moe_layers(model):
        gate = layer.moe.deepspeed_moe.gate
        if isinstance(gate, BiasedGate):
            load = layer.load.to(gate.choice_bias.device, torch.float32)
            torch.distributed.all_reduce(load, group=group)
            gate.choice_bias += cfg.router_bias_rate * torch.sign(load.mean() - load)
            layer.load = torch.zeros_like(layer.load)


@contextlib.contextmanager
def recording_evaluation(model: torch.nn.Module):
    """Within it, the MoE layers record the routing of their evaluation forwards (never otherwise: sampling and
    serving would pile it up), for routing_figures(evaluation=True)."""
    layers = moe_layers(model)
    for layer in layers:
        layer.recording = True
    try:
        yield
    finally:
        for layer in layers:
            layer.recording = False


def routing_figures(model: torch.nn.Module, cfg: ModelConfig, n_layers: int, evaluation: bool = False) -> dict:
    """Collective over all ranks (a pipeline stage without an MoE layer takes part with zeros): the routing of
    every MoE layer's training forwards since the last call (then forgotten), whichever stage holds it: the mean
    load-balancing loss, the tokens each expert took (all ranks' tokens) as max / mean load, the worst layer's and
    the mean over layers, and under a capacity factor the share of routes dropped, with a z-loss its mean, with
    biased routers the largest bias. Empty for a dense model.
    n_layers: the model's layer list's length (a layer is named by its index in it, in both builds)."""
    if not cfg.n_experts:
        return {}
    source = "evaluated" if evaluation else "routed"  # an evaluation's forwards, or the training steps'
    device = next(model.parameters()).device
    counts = torch.zeros(n_layers, cfg.n_experts, device=device)
    # the load-balancing losses' sum, how many, the routes dropped, the z-losses' sum
    aux = torch.zeros(4, dtype=torch.float64, device=device)
    bias = torch.zeros((), device=device)
    for name, layer in model.named_modules():
        if not isinstance(layer, MoEFeedForward):
            continue
        if getattr(layer, source):
            losses, routes, dropped, z_losses = zip(*getattr(layer, source))
            aux += torch.stack([torch.stack(losses).double().sum(), torch.tensor(len(losses), device=device),
                                torch.stack(dropped).double().sum(), torch.stack(z_losses).double().sum()])
            counts[int(name.split(".")[0])] += torch.stack(routes).float().sum(dim=0)
        setattr(layer, source, [])
        if isinstance(layer.moe.deepspeed_moe.gate, BiasedGate):
            bias = torch.maximum(bias, layer.moe.deepspeed_moe.gate.choice_bias.abs().max())
    torch.distributed.all_reduce(aux)
    torch.distributed.all_reduce(counts)
    torch.distributed.all_reduce(bias, op=torch.distributed.ReduceOp.MAX)
    if not aux[1]:
        return {}
    dropped = (aux[2] / counts.sum()).item()
    counts = counts[counts.sum(dim=1) > 0]  # the MoE layers
    load = counts.max(dim=1).values / counts.mean(dim=1)
    return {"moe_aux_loss": (aux[0] / aux[1]).item(), "expert_load_max": load.max().item(),
            "expert_load_mean": load.mean().item(),
            **({"dropped_routes": dropped} if cfg.capacity_factor is not None else {}),
            **({"router_z_loss": (aux[3] / aux[1]).item()} if cfg.router_z_loss_coef else {}),
            **({"router_bias_max": bias.item()} if cfg.router_bias_rate else {})}
