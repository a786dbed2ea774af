"""Export a model that lives on meta as if it lived on the device it will train on.

A model on the meta device is traced without memory, but its code sees `tensor.device` as
meta. Code that branches on the device type then records the branch of a device it will
never run on: transformers' mixture-of-experts picks `torch.histc`'s input dtype that way
(float on "cpu", int elsewhere), so a graph traced on meta holds an int histogram that the
CPU kernel refuses when the stage runs. Tracing on fake tensors that report the training
device takes the branch that will run, and still allocates nothing.

The exported program is handed back as a trace on meta would give it: its parameters and
buffers are the model's own (meta) tensors, and constants made in forward are meta tensors
of the same shape (their values come from partition.stages.lifted_constant_values, as for
any trace on meta).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.export import ExportedProgram

from .._torch_internals import buffer_table, fake_tensor_mode, parameter_table


@contextlib.contextmanager
def _swapped_state(model: nn.Module, device: torch.device, mode) -> Iterator[None]:
    """Every parameter and buffer of `model` replaced by a fake one on `device` (tied ones stay tied), then put back."""
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, torch.Tensor]] = []

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                value = torch.empty(t.shape, dtype=t.dtype, device=device)
            fakes[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
        return fakes[id(t)]

    try:
        for module in model.modules():
            for table in (parameter_table(module), buffer_table(module)):
                for name, t in list(table.items()):
                    if t is not None:
                        saved.append((table, name, t))
                        table[name] = fake_of(t)
        yield
    finally:
        for table, name, t in saved:
            table[name] = t


def export_on_device(model: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> ExportedProgram | None:
    """`torch.export` (non-strict) of a meta `model` whose tensors and inputs report `device`; None where fake
    tensors are unavailable (the caller exports on meta)."""
    mode = fake_tensor_mode()  # None where this torch lacks it: the caller then traces on meta
    if mode is None:
        return None
    with mode:
        fake_call = lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)  # noqa: E731
        fake_args = tuple(fake_call(a) for a in args)
        fake_kwargs = {k: fake_call(v) for k, v in kwargs.items()}
    originals = dict(model.named_parameters(remove_duplicate=False))
    originals.update(model.named_buffers(remove_duplicate=False))
    with _swapped_state(model, device, mode):
        exported = torch.export.export(model, fake_args, kwargs=fake_kwargs, strict=False)
    # the program speaks of the model's own (meta) tensors, as a trace on meta would
    for name in list(exported.state_dict):
        exported.state_dict[name] = originals[name]
    for name, value in list(exported.constants.items()):
        if isinstance(value, torch.Tensor):
            exported.constants[name] = originals.get(name, torch.empty(value.shape, dtype=value.dtype, device="meta"))
    return exported
