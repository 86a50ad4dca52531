"""Trainers whose loss reads the LM head's weight outside the head's forward.

TRL's fused loss (``trl.trainer.utils.add_fused_lm_head``, used by ``SFTTrainer`` and
``DPOTrainer``, and Liger's kernels the same way) runs the backbone, then hands
``model.get_output_embeddings().weight`` straight to its kernel: the head module's forward never
runs, so its pre-hook never brings the head's chunk to the device. With that chunk offloaded the
read is refused (runtime/chunks/released.py). So the head's parameters are gathered
(``engine.gathered``) from the end of the backbone's forward to the end of the model's: one
chunk buffer while the loss is computed, which a plain head's forward would take too. The
kernel saves the weight for backward like any read of chunk memory, and its gradient takes the
chunk's reduce-scatter path.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from protrain.runtime.training.engine import Engine


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The model whose ``forward`` TRL patches: a PEFT model's base model, else the model."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def gather_head_after_backbone(model: nn.Module, engine: Engine) -> list[RemovableHandle]:
    """Hooks that hold the output embedding's parameters on the device from the backbone's end
    to the model's; none for a model without a separate head and backbone."""
    causal_lm = causal_lm_of(model)
    get_head = getattr(causal_lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    backbone = getattr(causal_lm, "base_model", None)
    if not isinstance(head, nn.Module) or not isinstance(backbone, nn.Module) or backbone is causal_lm:
        return []
    held = contextlib.ExitStack()

    def after_backbone(_module: nn.Module, _args: Any, _output: Any) -> None:
        engine.chunks.end_forward()  # the backbone's modules are done with their chunks
        held.enter_context(engine.gathered(head.parameters()))

    def after_model(_module: nn.Module, _args: Any, _output: Any) -> None:
        held.close()

    return [
        backbone.register_forward_hook(after_backbone),
        causal_lm.register_forward_hook(after_model, always_call=True),
    ]
