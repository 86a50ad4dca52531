"""``ProTrainTrainer`` against a plain ``transformers.Trainer`` given the same TrainingArguments.

Tiny Llama (no biases) and GPT-2 (dropout 0.1: the random streams must advance alike), fp32,
20 updates of 2 micro-batches with an epoch's short last window every 7 updates, some chunks
offloaded: the logged losses, gradient norms and learning rates, the eval and predict losses and
the logits of the model ``save_model`` wrote (reloaded with ``from_pretrained``) are the
Trainer's within rounding; so are a PEFT LoRA run (its adapter saved) and a bf16 one (looser). A
run resumed from a ``checkpoint-N`` ends bit-identical to the uninterrupted one; a skipped update
holds the scheduler. The spec and the TrainingArguments hold one value per setting: a
disagreement is refused naming both, and Trainer options that clash with the engine are refused
naming the ProTrain way.
"""

from __future__ import annotations

import math
import shutil
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain.runtime.integrations.hf_spec import reconcile, set_paths, user_spec, with_decay_groups
from tests.helpers import assert_state_equal
from tests.hf_trainer_runs import MEMORY, CausalWindows, run_trainer, tiny_model, training_args

RTOL = 1e-5


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_protrain_trainer_trains_what_the_trainer_trains(tmp_path: Path, kind: str) -> None:
    plain = run_trainer(
        kind=kind, protrain=False, output_dir=str(tmp_path / "plain"), save_to=str(tmp_path / "p")
    )
    ours = run_trainer(
        kind=kind, protrain=True, output_dir=str(tmp_path / "ours"), save_to=str(tmp_path / "o")
    )
    assert len(ours["losses"]) == len(plain["losses"]) == 20
    assert ours["losses"] == pytest.approx(plain["losses"], rel=RTOL)
    # The engine's norm sums squares over flat shards, torch's over per-tensor norms: rounding.
    assert ours["grad_norms"] == pytest.approx(plain["grad_norms"], rel=RTOL)
    assert ours["lrs"] == plain["lrs"]  # the Trainer's scheduler owns them, through the facade
    assert ours["eval_loss"] == pytest.approx(plain["eval_loss"], rel=RTOL)
    assert ours["predict_loss"] == pytest.approx(plain["predict_loss"], rel=RTOL)
    bound = RTOL * plain["logits"].abs().max().item()
    assert (ours["logits"] - plain["logits"]).abs().max().item() <= bound
    assert set(ours["state"]) == set(plain["state"])


def test_bf16_is_the_engines_autocast_as_the_trainers(tmp_path: Path) -> None:
    """bf16=True: the engine autocasts (the Accelerator does not, twice); bf16 rounding differs
    with the order of operations, hence the looser, stated tolerance."""
    plain = run_trainer(kind="llama", protrain=False, output_dir=str(tmp_path / "p"), bf16=True, max_steps=8)
    ours = run_trainer(kind="llama", protrain=True, output_dir=str(tmp_path / "o"), bf16=True, max_steps=8)
    assert ours["losses"] == pytest.approx(plain["losses"], rel=2e-3)
    assert ours["eval_loss"] == pytest.approx(plain["eval_loss"], rel=2e-3)


@pytest.mark.skips_steps
def test_a_skipped_update_holds_the_trainers_scheduler(tmp_path: Path) -> None:
    """A non-finite loss under on_nonfinite_loss: skip: the engine skips the update and the
    Trainer, reading step_was_skipped off the engine's optimizer, does not step its scheduler."""
    from protrain.runtime.integrations.hf import ProTrainTrainer

    class NanAtUpdateTwo(ProTrainTrainer):
        def compute_loss(self, model: Any, inputs: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, **kwargs)
            return loss * float("nan") if self.state.global_step == 2 else loss

    trainer = NanAtUpdateTwo(
        model=tiny_model("llama"),
        args=training_args(tmp_path, max_steps=5, logging_nan_inf_filter=False),
        train_dataset=CausalWindows(26),
        protrain={**MEMORY, "on_nonfinite_loss": "skip"},
    )
    try:
        trainer.train()
        engine = trainer.protrain_engine
        assert engine is not None and engine.skipped_steps == 1 and engine.global_step == 4
        lrs = [record["learning_rate"] for record in trainer.state.log_history if "loss" in record]
        # Update 3 was skipped: update 4 runs at update 3's learning rate, and so on.
        assert lrs[2] == lrs[3] and len(set(lrs)) == 4
    finally:
        trainer.end()


def test_after_end_the_trainer_refuses_what_needs_the_closed_engine(tmp_path: Path) -> None:
    """end() closes the engine, and the model's parameters (chunk memory) go with it: evaluating
    after it gave a NaN loss (a new engine over the placeholders) and save_model a safetensors
    error; both now say to call end() last."""
    from protrain.runtime.integrations.hf import ProTrainTrainer

    trainer = ProTrainTrainer(
        model=tiny_model("llama"),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=CausalWindows(26),
        eval_dataset=CausalWindows(2, start=26),
        protrain=MEMORY,
    )
    trainer.train()
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    trainer.end()
    with pytest.raises(RuntimeError, match=r"closed by trainer.end\(\).*call end\(\) last"):
        trainer.evaluate()
    with pytest.raises(RuntimeError, match=r"closed by trainer.end\(\)"):
        trainer.save_model(str(tmp_path / "after"))
    assert not (tmp_path / "after").exists()


def test_a_lora_model_trains_and_saves_its_adapter_as_under_the_trainer(tmp_path: Path) -> None:
    """PEFT LoRA (frozen base in frozen chunks, adapters and the whole head trained): save_model
    writes the adapter directory that PeftModel.from_pretrained loads."""
    runs = {
        name: run_trainer(
            kind="llama",
            protrain=name == "ours",
            output_dir=str(tmp_path / name),
            save_to=str(tmp_path / name / "a"),
            lora=True,
            max_steps=8,
        )
        for name in ("plain", "ours")
    }
    plain, ours = runs["plain"], runs["ours"]
    assert (tmp_path / "ours" / "a" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "ours" / "a" / "model.safetensors").exists()  # the adapter only
    assert ours["losses"] == pytest.approx(plain["losses"], rel=RTOL)
    assert ours["eval_loss"] == pytest.approx(plain["eval_loss"], rel=RTOL)
    bound = RTOL * plain["logits"].abs().max().item()
    assert (ours["logits"] - plain["logits"]).abs().max().item() <= bound


def test_a_run_resumed_from_a_checkpoint_ends_bit_identical(tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": 10}
    whole = run_trainer(
        kind="gpt2", protrain=True, output_dir=str(tmp_path / "whole"), save_to=str(tmp_path / "w"), **saving
    )
    stopped = tmp_path / "resumed"
    stopped.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-10", stopped / "checkpoint-10")
    assert (stopped / "checkpoint-10" / "protrain").is_dir()  # the engine's checkpoint rides along
    resumed = run_trainer(
        kind="gpt2",
        protrain=True,
        output_dir=str(stopped),
        save_to=str(tmp_path / "r"),
        resume=True,
        **saving,
    )
    # The first 10 records come back with the checkpoint's trainer state, the last 10 are new.
    assert resumed["resumed_from"] == str(stopped / "checkpoint-10" / "protrain" / "step-00000010")
    assert resumed["global_step"] == 20 and len(resumed["losses"]) == 20
    assert resumed["losses"] == whole["losses"] and resumed["grad_norms"] == whole["grad_norms"]
    assert resumed["lrs"] == whole["lrs"]
    assert_state_equal(resumed["state"], whole["state"])


def test_per_group_learning_rates_hold_under_the_trainers_scheduler(tmp_path: Path) -> None:
    """DeepSpeed#6873 (a Trainer's per-group learning rates all became one under ZeRO-3): the
    spec's group at 5x the learning rate trains as a plain Trainer given the same AdamW groups,
    the Trainer's warmup-cosine scaling every group's own peak. A group that matches nothing
    stays an empty param group (DeepSpeed dropped those, and a scheduler over the groups then
    crashed or gave the wrong group's rate), and changes nothing."""
    from transformers import Trainer

    from protrain.runtime.integrations.hf import ProTrainTrainer

    head_lr, steps = 1e-2, 6
    empty = {"match": ["no_such_module.*"], "lr": 1.0}
    model = tiny_model("llama")
    by_hand: list[dict[str, Any]] = [
        {"params": [], "weight_decay": 0.1},
        {"params": [], "weight_decay": 0.0},
        {"params": [], "weight_decay": 0.1, "lr": head_lr},
    ]
    for name, param in model.named_parameters():
        by_hand[2 if name == "lm_head.weight" else 1 if "norm" in name else 0]["params"].append(param)
    optimizer = torch.optim.AdamW(by_hand, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
    plain = Trainer(
        model=model,
        args=training_args(tmp_path / "plain", max_steps=steps),
        train_dataset=CausalWindows(26),
        optimizers=(optimizer, None),
    )
    plain.train()
    ours = ProTrainTrainer(
        model=tiny_model("llama"),
        args=training_args(tmp_path / "ours", max_steps=steps),
        train_dataset=CausalWindows(26),
        protrain={**MEMORY, "optimizer": {"groups": [{"match": ["lm_head.weight"], "lr": head_lr}, empty]}},
    )
    try:
        ours.train()
        engine = ours.protrain_engine
        assert engine is not None
        assert ours.lr_scheduler.base_lrs == [2e-3, head_lr, 1.0]  # each group's own peak
        assert [len(group["params"]) for group in engine.optimizer.param_groups][1:] == [1, 0]
        head_weight = engine.state_dict()["lm_head.weight"]
    finally:
        ours.end()

    def losses(trainer: Any) -> list[float]:
        return [record["loss"] for record in trainer.state.log_history if "loss" in record]

    assert len(losses(ours)) == steps and losses(ours) == pytest.approx(losses(plain), rel=RTOL)
    torch.testing.assert_close(head_weight, model.lm_head.weight.detach(), rtol=RTOL, atol=1e-6)


def test_a_spec_schedule_runs_as_the_trainers_scheduler(tmp_path: Path) -> None:
    spec = {**MEMORY, "scheduler": {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": 6}}
    # The Trainer's own schedule left at its defaults (linear, no warmup): the spec's runs.
    unset = {"warmup_steps": 0, "lr_scheduler_type": "linear"}
    ours = run_trainer(kind="llama", protrain=True, output_dir=str(tmp_path), spec=spec, max_steps=6, **unset)
    # Warmup from lr/2, then a half cosine down to 0.1 x lr at update 6 (runtime/training/schedule.py).
    factors = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert ours["lrs"] == pytest.approx([2e-3 * factor for factor in factors])


# ------------------------------------------------------------------------------ one value per setting


def test_a_value_set_differently_in_both_places_is_refused_naming_both(tmp_path: Path) -> None:
    spec = user_spec({"optimizer": {"lr": 1e-4}})
    with pytest.raises(ValueError, match=r"optimizer.lr=0.0001 in the ProTrain spec and learning_rate=0.002"):
        reconcile(spec, training_args(tmp_path))
    spec = user_spec({"optimizer": {"betas": [0.9, 0.95]}})
    with pytest.raises(ValueError, match="adam_beta1=0.9, adam_beta2=0.99 in TrainingArguments"):
        reconcile(spec, training_args(tmp_path, adam_beta2=0.99))
    with pytest.raises(ValueError, match="sets scheduler and TrainingArguments set lr_scheduler_type"):
        reconcile(user_spec({"scheduler": {"type": "constant"}}), training_args(tmp_path))
    with pytest.raises(ValueError, match="checkpoint.resume in the ProTrain spec does not apply"):
        reconcile(user_spec({"checkpoint": {"resume": "never"}}), training_args(tmp_path))


def test_each_side_fills_what_the_other_left_unset(tmp_path: Path) -> None:
    args = training_args(tmp_path)  # learning_rate, weight_decay, batch... set; adam_epsilon default
    spec = user_spec({"optimizer": {"eps": 1e-6}, "gradient_clipping": 0.5, "precision": "fp32", **MEMORY})
    settled = reconcile(spec, args)
    engine_spec = settled.spec
    assert engine_spec.optimizer.lr == 2e-3 and engine_spec.optimizer.weight_decay == 0.1
    assert engine_spec.optimizer.betas == (0.9, 0.999) and engine_spec.seed == 7  # Trainer's defaults too
    assert engine_spec.micro_batch_size == 2 and engine_spec.gradient_accumulation_steps == 2
    assert engine_spec.gradient_clipping == 0.5 and engine_spec.memory.chunk_size == 64 * 1024
    assert engine_spec.checkpoint.dir is None and engine_spec.checkpoint.resume == "never"
    assert engine_spec.output_dir == str(tmp_path / "protrain")
    # The spec's epsilon goes to the Trainer; equal values set in both places are fine.
    assert settled.args_updates == {"adam_epsilon": 1e-6}
    assert args.adam_epsilon == 1e-8  # the caller's arguments are left as they were


def test_auto_training_values_are_filled_from_the_training_arguments(tmp_path: Path) -> None:
    """As in a DeepSpeed config: "auto" in the spec's training fields takes the TrainingArguments
    value; without a Trainer, initialize refuses it naming the fields."""
    autos = {
        "optimizer": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        "micro_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "precision": "auto",
        "gradient_clipping": "auto",
        "seed": "auto",
        **MEMORY,
    }
    engine_spec = reconcile(user_spec(autos), training_args(tmp_path)).spec
    assert engine_spec.optimizer.lr == 2e-3 and engine_spec.optimizer.betas == (0.9, 0.999)
    assert engine_spec.optimizer.eps == 1e-8 and engine_spec.optimizer.weight_decay == 0.1
    assert engine_spec.micro_batch_size == 2 and engine_spec.gradient_accumulation_steps == 2
    assert engine_spec.precision.value == "fp32" and engine_spec.gradient_clipping == 0.5
    assert engine_spec.seed == 7
    from protrain import runtime
    from tests.hf_trainer_runs import tiny_model

    with pytest.raises(ValueError, match=r"seed, micro_batch_size, gradient_accumulation_steps, precision"):
        runtime.initialize(tiny_model("llama"), config={**autos, "output_dir": str(tmp_path / "runs")})


def test_the_spec_protrain_run_hands_over_knows_which_keys_were_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protrain.runtime.config.spec_io import RESOLVED_SPEC_ENV, ResolvedSpec, validate_spec, write_resolved

    written = validate_spec({"optimizer": {"lr": 2e-3}, "memory": {"n_persist": "auto"}}, source="job.yaml")
    path = tmp_path / "spec.json"
    write_resolved(ResolvedSpec.of(written, source="job.yaml"), path)
    monkeypatch.setenv(RESOLVED_SPEC_ENV, str(path))
    spec = user_spec(None)  # protrain=None under protrain-run: the launcher's spec
    assert spec == written and set_paths(spec) == {"optimizer", "optimizer.lr", "memory"}
    # weight_decay was not written: TrainingArguments' 0.05 fills it (not the spec default's 0.1),
    # no disagreement.
    settled = reconcile(spec, training_args(tmp_path, weight_decay=0.05))
    assert settled.spec.optimizer.weight_decay == 0.05


def test_a_micro_batch_set_in_the_spec_only_is_the_batch_the_trainer_loads(tmp_path: Path) -> None:
    """TrainingArguments leave the batch at its default (8): the spec's 2 is what the training
    DataLoader yields (Trainer.__init__ reads its batch size off the caller's arguments)."""
    from protrain.runtime.integrations.hf import ProTrainTrainer

    args = training_args(tmp_path, per_device_train_batch_size=8, per_device_eval_batch_size=8)
    trainer = ProTrainTrainer(
        model=tiny_model("llama"),
        args=args,
        train_dataset=CausalWindows(26),
        protrain={**MEMORY, "micro_batch_size": 2},
    )
    assert trainer.args.per_device_train_batch_size == 2 and args.per_device_train_batch_size == 8
    assert next(iter(trainer.get_train_dataloader()))["input_ids"].shape[0] == 2


class RaggedWindows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token windows of 12 to 31 tokens, as an SFT set of unequal examples."""

    def __init__(self, num_samples: int) -> None:
        tokens = CausalWindows(num_samples).windows.windows
        self.items = [window[: 12 + (index * 7) % 20] for index, window in enumerate(tokens)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[index]}


def pad_to_longest(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padding to the batch's longest example, padded labels ignored (-100)."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["input_ids"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_batches_of_varying_length_train_under_a_plan_for_the_longest(tmp_path: Path) -> None:
    """A padding collator gives batches of varying length: the plan made for the first batch
    refuses a longer one, naming example_batch; planned on the longest batch, the run trains."""
    from protrain.runtime.integrations.hf import ProTrainTrainer

    data = RaggedWindows(12)
    kwargs: dict[str, Any] = {
        "args": training_args(tmp_path, max_steps=4, gradient_accumulation_steps=1),
        "train_dataset": data,
        "data_collator": pad_to_longest,
        "protrain": MEMORY,
    }
    first_is_short = ProTrainTrainer(model=tiny_model("llama"), **kwargs)
    try:
        with pytest.raises(ValueError, match=r"ProTrainTrainer\(\.\.\., example_batch=\.\.\.\)"):
            first_is_short.train()
    finally:
        first_is_short.end()
    longest = pad_to_longest([max(data, key=lambda item: len(item["input_ids"]))] * 2)
    trainer = ProTrainTrainer(model=tiny_model("llama"), example_batch=longest, **kwargs)
    try:
        trainer.train()
        losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    finally:
        trainer.end()
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)


def test_evaluation_batches_stay_within_the_planned_training_batch(tmp_path: Path) -> None:
    # Left at its default (8), the eval batch takes the training batch (2); set larger, refused.
    settled = reconcile(user_spec(None), training_args(tmp_path, per_device_eval_batch_size=8))
    assert settled.args_updates == {"per_device_eval_batch_size": 2}
    with pytest.raises(ValueError, match="per_device_eval_batch_size=4 is larger than the training batch"):
        reconcile(user_spec(None), training_args(tmp_path, per_device_eval_batch_size=4))


def test_the_trainers_decay_split_becomes_the_spec_groups() -> None:
    spec = with_decay_groups(user_spec(None), ["model.norm.weight", "a*b?[c]"])
    assert spec.optimizer.no_decay == ()
    (group,) = spec.optimizer.groups
    assert group.weight_decay == 0.0 and group.lr is None  # the rest: the top level's
    assert group.match == ("a[*]b[?][[]c]", "model.norm.weight")  # each name exactly, nothing else
    assert fnmatchcase("a*b?[c]", group.match[0]) and not fnmatchcase("axbx[c]", group.match[0])
    own = with_decay_groups(user_spec({"optimizer": {"no_decay": ["bias"]}}), ["model.norm.weight"])
    assert own.optimizer.groups == () and own.optimizer.no_decay == ("bias",)


def test_the_engine_optimizer_holds_the_trainers_param_groups(tmp_path: Path) -> None:
    from transformers import Trainer

    from protrain.runtime.integrations.hf import ProTrainTrainer

    plain = Trainer(
        model=tiny_model("gpt2"), args=training_args(tmp_path / "p"), train_dataset=CausalWindows(4)
    )
    ours = ProTrainTrainer(
        model=tiny_model("gpt2"),
        args=training_args(tmp_path / "o"),
        train_dataset=CausalWindows(4),
        protrain=MEMORY,
    )
    try:
        expected, got = plain.create_optimizer(), ours.create_optimizer()
        assert got is ours.protrain_engine.optimizer

        def names(trainer: Any, group: dict[str, Any]) -> set[str]:
            return {
                name for name, p in trainer.model.named_parameters() if any(p is q for q in group["params"])
            }

        assert len(got.param_groups) == len(expected.param_groups) == 2
        for mine, theirs in zip(got.param_groups, expected.param_groups, strict=True):
            assert (
                names(ours, mine) == names(plain, theirs) and mine["weight_decay"] == theirs["weight_decay"]
            )
            assert (mine["lr"], mine["betas"], mine["eps"]) == (theirs["lr"], theirs["betas"], theirs["eps"])
    finally:
        ours.end()
    assert ours.protrain_engine is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Set after construction: TrainingArguments would import DeepSpeed or need FSDP's ranks first.
        ({"deepspeed": "ds_zero3.json"}, "deepspeed: ProTrain shards and offloads"),
        ({"fsdp": "full_shard"}, "fsdp: ProTrain shards the model state across ranks itself"),
        ({"gradient_checkpointing": True}, "leave memory.n_checkpoint auto or set it in the spec"),
        ({"torch_compile": True}, "torch_compile: the engine's chunk and activation hooks"),
        ({"use_liger_kernel": True}, "use_liger_kernel: Liger's fused LM-head loss reads the head's weight"),
        ({"optim": "adamw_8bit"}, "optim='adamw_8bit' is not one of the optimizers ProTrain runs"),
        ({"optim": "adafactor"}, "row and column sums of each whole weight matrix"),
        ({"load_best_model_at_end": True}, "load_best_model_at_end: not supported under ProTrain yet"),
    ],
)
def test_clashing_trainer_options_are_refused_naming_the_protrain_way(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    from protrain.runtime.integrations.hf import ProTrainTrainer

    args = training_args(tmp_path)
    for name, value in extra.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=message):
        ProTrainTrainer(model=tiny_model("llama"), args=args, train_dataset=CausalWindows(4))


def test_an_optimizer_of_the_callers_own_is_refused(tmp_path: Path) -> None:
    from protrain.runtime.integrations.hf import ProTrainTrainer

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="optimizers=/optimizer_cls_and_kwargs="):
        ProTrainTrainer(
            model=model,
            args=training_args(tmp_path),
            train_dataset=CausalWindows(4),
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
        )


def test_a_meta_model_streams_its_weights_into_the_chunks_and_trains_what_the_trainer_trains(tmp_path: Path) -> None:
    """``from_pretrained`` holds the whole model in host memory on every rank before the engine
    chunks it; ``ProTrainTrainer(model=<built on the meta device>, weights=<save_pretrained
    directory>)`` reads each parameter into its chunk instead, and trains as the Trainer does with
    the loaded model."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from protrain.runtime.integrations.hf import ProTrainTrainer
    from tests.hf_trainer_runs import training_args

    tiny_model("llama").save_pretrained(tmp_path / "base")
    plain = run_trainer(kind="llama", protrain=True, output_dir=str(tmp_path / "plain"))
    with init_empty_weights():
        meta = LlamaForCausalLM(LlamaConfig.from_pretrained(tmp_path / "base"))
    assert all(p.is_meta for p in meta.parameters())
    trainer = ProTrainTrainer(
        model=meta,
        args=training_args(tmp_path / "streamed"),
        train_dataset=CausalWindows(26),
        eval_dataset=CausalWindows(6, start=26),
        protrain=MEMORY,
        weights=str(tmp_path / "base"),
    )
    try:
        trainer.train()
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        assert losses == pytest.approx(plain["losses"], rel=RTOL)
        assert trainer.evaluate()["eval_loss"] == pytest.approx(plain["eval_loss"], rel=RTOL)
    finally:
        trainer.end()
