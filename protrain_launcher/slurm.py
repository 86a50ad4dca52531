"""What Slurm tells a task started by ``srun``: the nodes, this node's place among them, the job.

``protrain-run`` under ``srun`` with one task per node reads it instead of ``--nnodes``,
``--node-rank`` and ``--master-addr``: the job's nodes are ``SLURM_JOB_NODELIST`` (expanded here,
without ``scontrol``), this node is ``SLURM_NODEID``, the first node serves the rendezvous unless
``launcher.master_addr`` is set, and the port is derived from ``SLURM_JOB_ID`` unless
``launcher.master_port`` is set (every node derives the same one). A command line or spec that
says otherwise about the node count or this node's rank is refused, naming both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

PORT_BASE = 20000
PORT_SPAN = 10000
"""Derived rendezvous ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN): above the well-known and
registered ports most clusters run services on, below Linux's ephemeral range (32768-60999)."""

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


class SlurmError(ValueError):
    """Slurm's environment cannot be read, or disagrees with the command line or the spec."""


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``node[01-04,07]``, ``a1,b[2-3]``,
    ``rack[1-2]-n[01-02]`` (every combination, the last bracket varying fastest). A range keeps
    its zero padding (``n[08-10]``: n08 n09 n10). Raises ``SlurmError`` naming the bad part."""
    names: list[str] = []
    for item in _split_top_level(text):
        if not item:
            raise SlurmError(f"an empty host name in {text!r}")
        names.extend(_expand_item(item, text))
    return names


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"nested brackets in {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"a ']' without its '[' in {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise SlurmError(f"a '[' without its ']' in {text!r}")
    parts.append(text[start:])
    return parts


def _expand_item(item: str, text: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        if "[" in item or "]" in item:
            raise SlurmError(f"unbalanced brackets in {item!r} of {text!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    rests = _expand_item(tail, text)
    return [f"{head}{value}{rest}" for value in _expand_ranges(match.group(1), text) for rest in rests]


def _expand_ranges(spec: str, text: str) -> list[str]:
    values: list[str] = []
    for part in spec.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise SlurmError(f"{part!r} in {text!r} is not a number or a range of numbers (like 01-04)")
        if not dash:
            values.append(low)
            continue
        first, last = int(low), int(high)
        if last < first:
            raise SlurmError(f"the range {part!r} in {text!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(number).zfill(width) for number in range(first, last + 1))
    return values


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """The job as ``srun`` describes it to one of its tasks."""

    job_id: str
    nodes: tuple[str, ...]
    node_id: int
    tasks: int
    """``SLURM_NTASKS``: one per node, as protrain-run spawns each node's ranks itself."""

    @property
    def master_port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits) % PORT_SPAN

    def launcher_values(self) -> dict[str, str]:
        """The spec's launcher keys Slurm decides, as override strings."""
        return {
            "nnodes": str(len(self.nodes)),
            "node_rank": str(self.node_id),
            "master_addr": self.nodes[0],
            "master_port": str(self.master_port),
        }

    def source(self, key: str) -> str:
        """Where a launcher value came from, for messages."""
        names = {
            "nnodes": f"SLURM_JOB_NODELIST={','.join(self.nodes)}",
            "node_rank": f"SLURM_NODEID={self.node_id}",
            "master_addr": "the first of SLURM_JOB_NODELIST",
            "master_port": f"derived from SLURM_JOB_ID={self.job_id}",
        }
        return f"Slurm ({names[key]})"


def under_srun(environ: Mapping[str, str]) -> bool:
    """A task ``srun`` started (not an ``sbatch`` script itself, which runs on the first node
    alone and has no step)."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" in environ


def read_slurm_job(environ: Mapping[str, str]) -> SlurmJob:
    """The job from a task's environment; ``SlurmError`` names a missing or malformed variable."""

    def need(*names: str) -> str:
        for name in names:
            if environ.get(name):
                return environ[name]
        raise SlurmError(f"{names[0]} is not set, but SLURM_JOB_ID and SLURM_STEP_ID are (is this an srun task?)")

    def number(name: str) -> int:
        value = need(name)
        if not value.isdigit():
            raise SlurmError(f"{name}={value!r} is not a whole number")
        return int(value)

    nodelist = need("SLURM_JOB_NODELIST", "SLURM_NODELIST")
    try:
        nodes = tuple(expand_nodelist(nodelist))
    except SlurmError as err:
        raise SlurmError(f"SLURM_JOB_NODELIST: {err}") from None
    nnodes, node_id, tasks = number("SLURM_NNODES"), number("SLURM_NODEID"), number("SLURM_NTASKS")
    if nnodes != len(nodes):
        raise SlurmError(f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST={nodelist} names {len(nodes)} node(s)")
    if node_id >= nnodes:
        raise SlurmError(f"SLURM_NODEID={node_id} is not below SLURM_NNODES={nnodes}")
    if tasks != nnodes:
        raise SlurmError(
            f"SLURM_NTASKS={tasks} on SLURM_NNODES={nnodes}: protrain-run starts each node's ranks itself, "
            "so run one task per node (srun --ntasks-per-node=1 protrain-run ...)"
        )
    return SlurmJob(job_id=need("SLURM_JOB_ID"), nodes=nodes, node_id=node_id, tasks=tasks)
