"""Sequence tiling of the MLP (training.checkpoint.mlp_tile_tokens), after DeepSpeed's ALST.

A dense MLP is a function of each token alone, and its intermediate ([tokens, intermediate],
3.5x the hidden size in a Llama-8B) is what dominates a layer's memory at long lengths. The tiled
MLP runs the module's own forward on token tiles without keeping anything but its input; its
backward runs each tile again with gradients and calls autograd on that tile alone, so no more
than one tile's intermediate exists at a time, in forward or backward.

  forward   x [..., hidden] flattened to [N, hidden]; for each tile of `tile_tokens` rows
            y[tile] = mlp(x[tile]) under no_grad; only x is saved.
  backward  for each tile: x_t = x[tile] (detached, requiring grad), y_t = mlp(x_t),
            autograd.grad(y_t, [x_t, trainable params], dy[tile]); dx rows are written in place,
            parameter gradients summed over tiles in float32 and returned to autograd (so they
            accumulate, and any gradient hooks fire, as for an untiled MLP).

The price is the MLP's forward once more per step (a recompute), except under non-reentrant
activation checkpointing with early stop (torch's default, and hasten's), where it costs nothing:
a layer's recompute in backward ends at the last tensor its forward saved, and x is saved by a
Function of its own (_TileInput) that runs before the tiles, so in a layer where nothing after
the MLP saves a tensor (a Llama layer ends in the residual add) the recompute stops before the
MLP, whose forward then runs twice per step (the forward's tiles, and each tile again with
gradients in backward) as an untiled checkpointed MLP's does; with a norm after the MLP (Gemma 2)
the recompute goes on through the tiles, as it must. Applied only to dense MLPs
(the decoder layer's `mlp` whose class is an ...MLP: routed experts pick per tile differently
for their load statistics), without dropout (a recompute would draw other masks), when the
layer sees more than `tile_tokens` tokens with gradients on.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from hasten.instance_forward import HOOKED_REASON, hooked, replace_forward, restore_forward
from hasten.memory.offload import decoder_layers


class _TileInput(torch.autograd.Function):
    """Saves the MLP input x (N, hidden) for _TiledMLP's backward and returns it as a view.

    A Function of its own so that x is packed (the saved-tensor hooks run when a Function returns)
    before the tiles run: under checkpointing with early stop the recompute can then end here (see
    the module docstring). `anchor` is a trainable parameter of the MLP, passed when x itself needs
    no gradient (a LoRA model's first layer), so that this node, and so the saving of x, exists."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.needs_input_grad[0] else None), None


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tile_tokens: int, wants_x: bool, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # x is _TileInput's output: its node holds the saved x, read back in backward
        ctx.run, ctx.tile_tokens, ctx.wants_x, ctx.input_node = run, tile_tokens, wants_x, x.grad_fn
        # the backward's recompute runs under the forward's autocast (as torch's checkpoint does):
        # mixed precision on float32 weights would otherwise recompute in float32
        device_type = x.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.params = params  # leaves: kept by reference, not as saved activations
        with torch.no_grad():
            first = run(x[:tile_tokens])
            out = first.new_empty((x.shape[0], *first.shape[1:]))
            out[:tile_tokens] = first
            del first
            for start in range(tile_tokens, x.shape[0], tile_tokens):
                out[start:start + tile_tokens] = run(x[start:start + tile_tokens])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.input_node.saved_tensors
        params, tile = ctx.params, ctx.tile_tokens
        wants_x = ctx.wants_x and ctx.needs_input_grad[3]
        wanted = [p for p, needed in zip(params, ctx.needs_input_grad[4:], strict=True) if needed]
        grad_x = torch.empty_like(x) if wants_x else None
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in wanted]
        device_type, autocast_on, autocast_dtype = ctx.autocast
        for start in range(0, x.shape[0], tile):
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                x_tile = x[start:start + tile].detach().requires_grad_(wants_x)
                y_tile = ctx.run(x_tile)
                inputs = ([x_tile] if wants_x else []) + wanted
                grads = torch.autograd.grad(y_tile, inputs, grad_out[start:start + tile], allow_unused=True)
            if wants_x:
                grad_x[start:start + tile] = grads[0]
                grads = grads[1:]
            for total, grad in zip(sums, grads, strict=True):
                if grad is not None:
                    total += grad
        by_param = iter(total.to(p.dtype) for total, p in zip(sums, wanted, strict=True))
        param_grads = [next(by_param) if needed else None for needed in ctx.needs_input_grad[4:]]
        return (None, None, None, grad_x, *param_grads)


_ROUTING_CHILDREN = ("experts", "router", "gate")  # an MoE block's (a dense MLP's gate is `gate_proj`)


def tiling_refusal(mlp: nn.Module) -> str | None:
    """Why this decoder layer's `mlp` is not tiled; None when it is a dense MLP without dropout: an
    ...MLP class with a `down_proj` and no experts or router (gpt-oss's GptOssMLP is an MoE block,
    and returns its router scores too)."""
    name = type(mlp).__name__
    routed = [child for child in _ROUTING_CHILDREN if isinstance(getattr(mlp, child, None), nn.Module)]
    if not name.endswith("MLP") or routed or not isinstance(getattr(mlp, "down_proj", None), nn.Module):
        return f"{name} is not a dense MLP (routed experts are not tiled)"
    for child in mlp.modules():
        if isinstance(child, nn.Dropout) and child.p > 0:
            return f"{name} applies dropout (p={child.p}), which a tile's recompute would draw anew"
    return None


def tiled_mlp_forward(mlp: nn.Module, run, x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """run(x) in token tiles (see the module docstring); run(x) itself where tiling saves nothing."""
    tokens = x.numel() // x.shape[-1] if x.dim() else 0
    if not torch.is_grad_enabled() or tokens <= tile_tokens:
        return run(x)
    params = [p for p in mlp.parameters() if p.requires_grad]
    if not x.requires_grad and not params:
        return run(x)
    flat = x.reshape(tokens, x.shape[-1])
    kept = _TileInput.apply(flat, None if x.requires_grad else params[0])
    out = _TiledMLP.apply(run, tile_tokens, x.requires_grad, kept, *params)
    return out.view(*x.shape[:-1], out.shape[-1])


def install_mlp_tiling(model: nn.Module, tile_tokens: int):
    """Tile every decoder layer's dense MLP. Returns (undo, number tiled, reasons others were not).

    Wraps whatever forward the MLP has at call time (transformers', or hasten's fused one installed
    before this), so it is installed after the kernel patches and undone before them."""
    if tile_tokens <= 0:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
    tiled, refused = [], set()
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            continue
        reason = f"MLPs: {HOOKED_REASON}" if hooked(mlp) else tiling_refusal(mlp)
        if reason is not None:
            refused.add(reason)
            continue
        previous = mlp.__dict__.get("forward")
        run = previous if previous is not None else types.MethodType(type(mlp).forward, mlp)

        def forward(self, x, *, _run=run):
            return tiled_mlp_forward(self, _run, x, tile_tokens)

        replace_forward(mlp, types.MethodType(forward, mlp))
        tiled.append(mlp)

    def undo() -> None:
        for mlp in tiled:
            restore_forward(mlp)

    return undo, len(tiled), sorted(refused)
