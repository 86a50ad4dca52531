"""Exporting trained weights for use without ProTrain: safetensors files (sharded past
``max_shard_size``, with an index), Hugging Face directories, PEFT adapter directories.

``engine.export`` streams from the engine's chunks (``from_engine``: never the whole model at
once, on the device or in host memory); the functions here export a state dict the caller
holds (``from_state_dict``). See each module's docstring.
"""

from protrain.runtime.model_io.from_state_dict import (
    export_adapter,
    export_hf,
    export_safetensors,
    load_safetensors_export,
)
from protrain.runtime.model_io.targets import TIED_METADATA_KEY

__all__ = ["TIED_METADATA_KEY", "export_adapter", "export_hf", "export_safetensors", "load_safetensors_export"]
