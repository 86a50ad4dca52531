"""``ProTrainTrainer`` under protrain-run: the spec comes from the launcher (``protrain=None``),
its written keys reconcile with TrainingArguments on every rank, and a value set differently in
both places ends the job with exit 2 and one message naming both."""

from __future__ import annotations

import json

from tests.e2e.conftest import Job

# job.yaml (BASE_SPEC) writes seed 1, micro_batch_size 2, optimizer.lr 1e-3 and a constant
# schedule; the script's TrainingArguments set weight_decay and leave the rest at their defaults.
TRAINER_SCRIPT = """\
import json, sys
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from protrain.runtime.integrations.hf import ProTrainTrainer
from tests.hf_trainer_runs import CausalWindows
from tests.helpers import TINY_LLAMA

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
args = TrainingArguments(output_dir="out", report_to=[], use_cpu=True, dataloader_num_workers=0,
                         disable_tqdm=True, per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                         weight_decay=0.05, save_strategy="no")
trainer = ProTrainTrainer(model=model, args=args, train_dataset=CausalWindows(16))
trainer.train()
engine = trainer.protrain_engine
result = {
    "world_size": engine.world_size,
    "learning_rate": trainer.args.learning_rate,
    "seed": trainer.args.seed,
    "weight_decay": engine.settings.optimizer.weight_decay,
    "lrs": [r["learning_rate"] for r in trainer.state.log_history if "loss" in r],
}
Path(f"rank{engine.rank}.json").write_text(json.dumps(result))
trainer.end()
"""


def test_the_launchers_spec_reconciles_with_training_arguments_on_every_rank(job: Job) -> None:
    script = job.workdir / "trainer.py"
    script.write_text(TRAINER_SCRIPT)
    result = job.run("--nproc-per-node", "2", str(script), "--config", str(job.spec), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        ran = json.loads((job.workdir / f"rank{rank}.json").read_text())
        assert ran["world_size"] == 2
        # Written in the spec only: the Trainer took them; set in TrainingArguments only: the engine.
        assert ran["learning_rate"] == 1e-3 and ran["seed"] == 1 and ran["weight_decay"] == 0.05
        assert ran["lrs"] == [1e-3] * 3  # the spec's constant schedule ran as the Trainer's scheduler

    refused = job.run(
        "--nproc-per-node", "2", str(script), "--config", str(job.spec), "--set", "optimizer.weight_decay=0.2"
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (
        "protrain-run: error: optimizer.weight_decay=0.2 in the ProTrain spec and weight_decay=0.05 in "
        "TrainingArguments disagree"
    ) in refused.stderr
