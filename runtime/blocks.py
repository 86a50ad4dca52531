"""Finding the transformer blocks whose members get one activation mode each."""

from __future__ import annotations

from torch import nn


class BlocksNotFoundError(ValueError):
    pass


def find_blocks(model: nn.Module, path: str | None) -> tuple[str, list[nn.Module]]:
    """The blocks at ``path`` (e.g. ``model.layers``; several lists joined by commas, in forward
    order, e.g. ``encoder.block,decoder.block``), or found automatically: every ``ModuleList``
    whose members are Hugging Face ``_no_split_modules`` classes (an encoder-decoder model has
    two), else the longest ``ModuleList`` of modules that all share one class."""
    if path is not None:
        paths = [part.strip() for part in path.split(",") if part.strip()]
        if not paths:
            raise BlocksNotFoundError("memory.blocks: empty module path")
        return ",".join(paths), [block for part in paths for block in _at_path(model, part)]
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    preferred: list[tuple[str, nn.ModuleList]] = []
    uniform: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        classes = {type(child).__name__ for child in module}
        if len(classes) != 1:
            continue
        (preferred if classes & no_split else uniform).append((name, module))
    if preferred:
        # Module order is forward order for the models we know (encoder before decoder).
        return ",".join(name for name, _ in preferred), [b for _, blocks in preferred for b in blocks]
    if not uniform:
        raise BlocksNotFoundError(
            f"no list of repeated transformer blocks found in {type(model).__name__}; set "
            "memory.blocks to the module path of the block list (e.g. model.layers)"
        )
    name, blocks = max(uniform, key=lambda item: len(item[1]))
    return name, list(blocks)


def refuse_foreign_activation_handling(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Activation modes wrap the blocks' forwards and hook every saved tensor: a model that
    already recomputes its blocks itself or was compiled as a whole would bypass or break that,
    so it is refused with what to do instead."""
    # Hugging Face marks the modules that recompute with a gradient_checkpointing attribute of
    # their own (read from the instance: a wrapper such as a PeftModel forwards unknown
    # attributes to the model inside, through properties that warn).
    if any(vars(module).get("gradient_checkpointing") is True for module in model.modules()):
        raise ValueError(
            "the model has Hugging Face gradient checkpointing enabled; call "
            "model.gradient_checkpointing_disable() and let ProTrain recompute blocks instead "
            "(memory.n_checkpoint or memory.block_modes)"
        )
    compiled = [m for m in (model, *blocks) if type(m).__name__ == "OptimizedModule"]
    if compiled:
        raise ValueError(
            "the model (or one of its blocks) is wrapped by torch.compile; pass the uncompiled "
            "module to runtime.initialize (the engine's hooks on parameters and saved tensors do "
            "not reach into compiled graphs)"
        )


def _at_path(model: nn.Module, path: str) -> nn.ModuleList:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise BlocksNotFoundError(f"memory.blocks: {type(model).__name__} has no submodule {path!r}") from None
    if not isinstance(module, nn.ModuleList):
        raise BlocksNotFoundError(
            f"memory.blocks: {path!r} is a {type(module).__name__}, expected a ModuleList of blocks"
        )
    return module
