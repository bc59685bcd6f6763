"""What the parity tests of both TorchTitan releases check of a converted model against
its stock twin (same weights, same parallelization): the state dict's layout, outputs,
loss and gradients, and checkpoints loaded both ways. Version-free: the models come
built from each release's test module."""

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from problems import rel_err


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor, else the tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same_state_dict_layout(stock: nn.Module, converted: nn.Module) -> list[str]:
    """Same keys in the same order, with the same shapes, types and placements; returns the keys."""
    stock_sd, converted_sd = stock.state_dict(), converted.state_dict()
    assert list(stock_sd) == list(converted_sd), set(stock_sd) ^ set(converted_sd)
    for key in stock_sd:
        a, b = stock_sd[key], converted_sd[key]
        assert a.shape == b.shape, key
        assert type(a) is type(b), key
        if isinstance(a, DTensor):
            assert a.placements == b.placements, key
            assert a.device_mesh.mesh_dim_names == b.device_mesh.mesh_dim_names, key
    return list(converted_sd)


def assert_training_step_matches(stock: nn.Module, converted: nn.Module, tokens: torch.Tensor,
                                 labels: torch.Tensor, tolerance: float) -> list[str]:
    """One forward and backward of each model on the same batch: logits, loss and every
    parameter's gradient within ``tolerance`` (relative), every stock gradient nonzero.
    Returns the names of the parameters compared."""
    results = {}
    for name, model in (("stock", stock), ("converted", converted)):
        logits = full(model(tokens))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        results[name] = (logits.detach(), loss.detach())
    assert rel_err(results["converted"][0], results["stock"][0]) < tolerance
    assert rel_err(results["converted"][1], results["stock"][1]) < tolerance
    stock_params = dict(stock.named_parameters())
    compared = []
    for name, p in converted.named_parameters():
        g_conv, g_stock = full(p.grad), full(stock_params[name].grad)
        assert g_stock.abs().max() > 0, f"{name} got no gradient in the stock model"
        assert rel_err(g_conv, g_stock) < tolerance, name
        compared.append(name)
    return compared


def assert_checkpoints_load_both_ways(stock: nn.Module, converted: nn.Module, checkpoint_dir: str) -> None:
    """A distributed checkpoint of the stock model loads into the converted one (whose
    weights were first changed), then one of the converted model loads into the stock
    one, bit for bit. Each loaded state dict goes back through ``load_state_dict``: a
    model may hand out copies (TorchTitan 0.3.0's fused QKV projection)."""
    originals = {k: full(v).clone() for k, v in stock.state_dict().items()}
    dcp.save(stock.state_dict(), checkpoint_id=f"{checkpoint_dir}/stock")
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(1.0)
    converted_sd = converted.state_dict()
    dcp.load(converted_sd, checkpoint_id=f"{checkpoint_dir}/stock")
    converted.load_state_dict(converted_sd)
    for key, value in converted.state_dict().items():
        assert torch.equal(full(value), originals[key]), key

    with torch.no_grad():
        for p in converted.parameters():
            p.mul_(0.5)
    dcp.save(converted.state_dict(), checkpoint_id=f"{checkpoint_dir}/converted")
    stock_sd = stock.state_dict()
    dcp.load(stock_sd, checkpoint_id=f"{checkpoint_dir}/converted")
    stock.load_state_dict(stock_sd)
    converted_now = {k: full(v) for k, v in converted.state_dict().items()}
    for key, value in stock.state_dict().items():
        assert torch.equal(full(value), converted_now[key]), key
