"""scripts/finetune_hf.py (LoRA through ProTrainTrainer) runs, and its adapter reloads with the
trained model's eval loss."""

from __future__ import annotations

import pytest

from tests.helpers import run_script_smoke

pytest.importorskip("peft")


def test_finetune_hf_smoke() -> None:
    out = run_script_smoke("finetune_hf.py", timeout=180)
    assert "the adapter reloaded with PeftModel.from_pretrained" in out
    assert "adapter_model.safetensors" in out
