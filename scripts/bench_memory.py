"""What a run holds in host memory, measured from outside the runtime (the process's resident set),
against what the plan and the issue's bounds say it may hold.

    .venv/bin/python scripts/bench_memory.py            # a 285M-parameter Llama, fp32, on CPU
    .venv/bin/python scripts/bench_memory.py --smoke    # a tiny Llama (a test)

Each part runs in a fresh process (``PROTRAIN_STRICT_DEVICE=0``: no device wall, whose counting
costs time; on CPU the device tier is host RAM, so the resident set holds both tiers):

- **export**: a trained engine (a device budget of a quarter of the model's fp32 size, so chunks
  are offloaded) exports its weights as safetensors shards of ``--shard-mib``. Measured: the
  peak resident set during the export less the resident set just before it (the kernel's peak,
  ``VmHWM``, reset through ``/proc/self/clear_refs``). Bound: one shard plus one chunk. Beside it,
  in the same process and way, the old path: ``engine.state_dict()`` then safetensors'
  ``save_file``, which holds the whole fp32 model at once (4 bytes per parameter).
- **lora**: a PEFT LoRA model (rank 8 on q and v) whose frozen fp32 base is persistent (the whole
  model on the device; the plan keeps every chunk). Measured: the resident set after two
  updates (freed memory handed back with ``malloc_trim``) less the resident set before the model
  was built. Bound: one copy of the base, within 5%.
- **predict**: the model trained from the start of the process to its last save (a checkpoint
  and an export) under the quarter budget. Measured: the process's peak resident set over its
  whole life (``VmHWM``). Predicted: the plan's peak host bytes (which include the process's
  own memory at ``initialize``, the baseline) plus its peak device bytes. Bound: within 5%.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("export", "lora", "predict")
MIB = 2**20


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The kernel's high-water mark of the resident set since the process began (or the last
    ``reset_peak``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> None:
    """Set ``VmHWM`` to the resident set now (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the kernel, so the resident set says
    what is held, not what glibc keeps for later."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


# ------------------------------------------------------------------------- one part, in its process


def llama_config(smoke: bool) -> Any:
    import transformers

    if smoke:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=512)
    else:
        shape = dict(
            hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, intermediate_size=4096, vocab_size=8192
        )
    return transformers.LlamaConfig(**shape, max_position_embeddings=256, tie_word_embeddings=False)


def build_model(smoke: bool, *, lora: bool = False) -> Any:
    import torch
    import transformers

    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(llama_config(smoke))
    if not lora:
        return model
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def spec(workdir: Path, *, device_budget: int | str, chunk_size: int | str = "auto") -> dict[str, Any]:
    return {
        "seed": 1,
        "micro_batch_size": 1,
        "optimizer": {"lr": 1e-4},
        "memory": {"device_budget": device_budget, "chunk_size": chunk_size},
        "profiler": {"cache_dir": str(workdir / "cache")},
        "checkpoint": {"dir": str(workdir / "checkpoints")},
        "output_dir": str(workdir / "runs"),
    }


def train(engine: Any, steps: int, seq_len: int) -> None:
    from protrain_demo.corpus import LMBatches, stdlib_text_corpus

    data = LMBatches(
        tokens=stdlib_text_corpus(),
        seq_len=seq_len,
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        world_size=1,
        seed=1,
    )
    for update in range(steps):
        out = engine(**data.batch(update, 0, 0))
        engine.backward(out.loss)
        engine.step()


def quarter_budget(model: Any, smoke: bool) -> int:
    """A quarter of the model's fp32 size (the tiny smoke model's quarter is below the smallest
    plan: its activations and transient peak are most of it, so it gets a few MiB)."""
    return 4 * MIB if smoke else sum(p.numel() * 4 for p in model.parameters()) // 4


def part_export(smoke: bool, workdir: Path, shard_bytes: int) -> dict[str, Any]:
    from protrain import runtime

    model = build_model(smoke)
    parameters = sum(p.numel() for p in model.parameters())
    engine = runtime.initialize(model, config=spec(workdir, device_budget=quarter_budget(model, smoke)))
    train(engine, 1, seq_len=32)
    trim()
    before = rss_bytes()
    reset_peak()
    engine.export(workdir / "export" / "model.safetensors", max_shard_size=shard_bytes)
    export_added = peak_rss_bytes() - before
    files = sorted(path.name for path in (workdir / "export").iterdir())
    # The old way, in the same process: the whole state_dict on the host, then one file.
    from safetensors.torch import save_file

    trim()
    before = rss_bytes()
    reset_peak()
    state = engine.state_dict()
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(workdir / "whole.safetensors"))
    whole_added = peak_rss_bytes() - before
    del state
    plan = engine.plan
    engine.close()
    return {
        "parameters": parameters,
        "chunk_bytes": plan.chunk_size,
        "n_persist": plan.n_persist,
        "num_chunks": plan.num_chunks,
        "shard_bytes": shard_bytes,
        "files": len(files),
        "export_added": export_added,
        "whole_added": whole_added,
    }


def part_lora(smoke: bool, workdir: Path) -> dict[str, Any]:
    import peft  # noqa: F401 - imported before the baseline: the libraries are not the model
    import transformers  # noqa: F401

    from protrain import runtime

    trim()
    baseline = rss_bytes()
    model = build_model(smoke, lora=True)
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trim()
    built = rss_bytes() - baseline
    engine = runtime.initialize(model, config=spec(workdir, device_budget="auto"))
    train(engine, 2, seq_len=32)
    trim()
    held = rss_bytes() - baseline
    plan = engine.plan
    engine.close()
    return {
        "base_bytes": base,
        "adapter_parameters": adapters,
        "built_added": built,
        "held_added": held,
        "resident": plan.n_persist == plan.num_chunks,
    }


def part_predict(smoke: bool, workdir: Path, shard_bytes: int) -> dict[str, Any]:
    from protrain import runtime

    model = build_model(smoke)
    engine = runtime.initialize(model, config=spec(workdir, device_budget=quarter_budget(model, smoke)))
    train(engine, 3, seq_len=64)
    engine.save_checkpoint()
    engine.export(workdir / "export" / "model.safetensors", max_shard_size=shard_bytes)
    plan = engine.plan
    measured = peak_rss_bytes()
    engine.close()
    return {
        "predicted_host": plan.predicted_peak_host_bytes,
        "host_fixed": plan.host_fixed_bytes,
        "predicted_device": plan.predicted_peak_device_bytes,
        "measured_peak": measured,
        "n_persist": plan.n_persist,
        "num_chunks": plan.num_chunks,
    }


def run_part(part: str, smoke: bool, shard_bytes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-memory-{part}-") as tmp:
        workdir = Path(tmp)
        if part == "export":
            return part_export(smoke, workdir, shard_bytes)
        if part == "lora":
            return part_lora(smoke, workdir)
        return part_predict(smoke, workdir, shard_bytes)


# ------------------------------------------------------------------------- the report


def measure(part: str, smoke: bool, shard_bytes: int) -> dict[str, Any]:
    """Run one part in a fresh process; its result."""
    env = {
        **os.environ,
        "PROTRAIN_STRICT_DEVICE": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]),
    }
    argv = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--shard-mib", str(shard_bytes / MIB)]
    started = time.monotonic()
    result = subprocess.run(
        [*argv, *(["--smoke"] if smoke else [])], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"bench_memory: part {part} failed:\n{result.stdout}\n{result.stderr}")
    line = [text for text in result.stdout.splitlines() if text.startswith("{")][-1]
    return {**json.loads(line), "seconds": time.monotonic() - started}


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.1f} MiB"


def verdict(ok: bool) -> str:
    return "meets the target" if ok else "MISSES the target"


def report(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    export = results["export"]
    bound = export["shard_bytes"] + export["chunk_bytes"]
    per_param = export["export_added"] / export["parameters"]
    lines += [
        f"export: {export['parameters'] / 1e6:,.0f}M parameters, {export['num_chunks']} chunks of "
        f"{_mib(export['chunk_bytes'])} ({export['n_persist']} on the device), shards of "
        f"{_mib(export['shard_bytes'])} ({export['files']} files)",
        f"  streamed export adds {_mib(export['export_added'])} ({per_param:.2f} bytes per parameter); "
        f"state_dict() + save_file adds {_mib(export['whole_added'])} "
        f"({export['whole_added'] / export['parameters']:.2f} bytes per parameter): "
        f"{export['whole_added'] / max(1, export['export_added']):.1f}x",
        f"export: {_mib(export['export_added'])} against one shard + one chunk {_mib(bound)}: "
        f"{verdict(export['export_added'] <= bound)}",
    ]
    lora = results["lora"]
    ratio = lora["held_added"] / lora["base_bytes"]
    lines += [
        f"lora: frozen base {_mib(lora['base_bytes'])}, {lora['adapter_parameters'] / 1e6:.2f}M adapter "
        f"parameters, plan {'resident' if lora['resident'] else 'OFFLOADED'}; built model "
        f"{_mib(lora['built_added'])}, held after two updates {_mib(lora['held_added'])}",
        f"lora: held {ratio:.3f}x one copy of the base: {verdict(abs(ratio - 1) <= 0.05)} (within 5%)",
    ]
    predict = results["predict"]
    predicted = predict["predicted_host"] + predict["predicted_device"]
    ratio = predict["measured_peak"] / predicted
    lines += [
        f"predict: plan {predict['n_persist']} of {predict['num_chunks']} chunks on the device; predicted "
        f"host {_mib(predict['predicted_host'])} (of which {_mib(predict['host_fixed'])} the process at "
        f"initialize) + device {_mib(predict['predicted_device'])} = {_mib(predicted)}",
        f"predict: measured peak resident set {_mib(predict['measured_peak'])}, {ratio:.3f}x the "
        f"prediction: {verdict(abs(ratio - 1) <= 0.05)} (within 5%)",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama (a test)")
    parser.add_argument("--shard-mib", type=float, default=None, help="export shard size (default 64, smoke 0.25)")
    parser.add_argument("--parts", default=",".join(PARTS), help="which parts: " + ", ".join(PARTS))
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part, in this process
    args = parser.parse_args(argv)
    shard_mib = args.shard_mib if args.shard_mib is not None else (0.25 if args.smoke else 64.0)
    shard_bytes = int(shard_mib * MIB)
    if args.part:
        print(json.dumps(run_part(args.part, args.smoke, shard_bytes)), flush=True)
        return
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    results = {}
    for part in parts:
        results[part] = measure(part, args.smoke, shard_bytes)
        print(f"{part}: measured in {results[part]['seconds']:.0f} s", flush=True)
    if set(parts) == set(PARTS):
        print("\n".join(report(results)))
    else:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
