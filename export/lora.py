"""Fold a LoRA adapter into a Hugging Face model's weights before export (`build --lora DIR`).

    W [out, in] (nn.Linear)  +=  scaling · B [out, r] · A [r, in]          (PEFT's merge_and_unload)
    W [in, out] (GPT-2 Conv1D, fan_in_fan_out)  +=  (scaling · B A)^T

The exported graph then has no trace of the adapter: every pass, backend and KV layout runs it as a
plain model. Each adapted module must exist in the model and have the adapter's shapes.
"""

from __future__ import annotations

import torch

from enginesmith.core.errors import UserError
from enginesmith.models.lora_adapter import Adapter


def fold_lora(model: torch.nn.Module, adapter: Adapter) -> int:
    """Add every update of `adapter` to `model`'s weights in place; returns the modules changed."""
    modules = dict(model.named_modules())
    for update in adapter.updates:
        module = modules.get(update.module)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
            raise UserError(f"the LoRA adapter {adapter.path} adapts {update.module}, which this model has no "
                            "linear layer at", "fold an adapter trained on this base model")
        delta = torch.from_numpy(update.delta())
        transposed = adapter.fan_in_fan_out or type(module).__name__ == "Conv1D"
        if transposed:
            delta = delta.T
        if tuple(delta.shape) != tuple(weight.shape):
            raise UserError(f"the LoRA update of {update.module} is {tuple(delta.shape)}, the weight is "
                            f"{tuple(weight.shape)}", "fold an adapter trained on this base model")
        with torch.no_grad():
            weight += delta.to(weight.dtype)
    return len(adapter.updates)
