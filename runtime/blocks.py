"""Finding the transformer block list whose members get one activation mode each."""

from __future__ import annotations

from torch import nn


class BlocksNotFoundError(ValueError):
    pass


def find_blocks(model: nn.Module, path: str | None) -> tuple[str, nn.ModuleList]:
    """The block list at ``path`` (e.g. ``model.layers``), or found automatically: the
    ``ModuleList`` whose members are Hugging Face ``_no_split_modules`` classes, else the longest
    ``ModuleList`` of modules that all share one class."""
    if path is not None:
        return path, _at_path(model, path)
    candidates: list[tuple[int, str, nn.ModuleList]] = []
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        classes = {type(child).__name__ for child in module}
        if len(classes) != 1:
            continue
        preferred = 1 if classes & no_split else 0
        candidates.append((preferred * 10**9 + len(module), name, module))
    if not candidates:
        raise BlocksNotFoundError(
            f"no list of repeated transformer blocks found in {type(model).__name__}; set "
            "memory.blocks to the module path of the block list (e.g. model.layers)"
        )
    _, name, blocks = max(candidates, key=lambda item: item[0])
    return name, blocks


def _at_path(model: nn.Module, path: str) -> nn.ModuleList:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise BlocksNotFoundError(
            f"memory.blocks: {type(model).__name__} has no submodule {path!r}"
        ) from None
    if not isinstance(module, nn.ModuleList):
        raise BlocksNotFoundError(
            f"memory.blocks: {path!r} is a {type(module).__name__}, expected a ModuleList of blocks"
        )
    return module
