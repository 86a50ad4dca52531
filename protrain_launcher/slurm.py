"""What Slurm tells a task started by ``srun``: the nodes, this node's place among them, the job.

``protrain-run`` under ``srun`` reads it instead of ``--nnodes``, ``--node-rank`` and
``--master-addr``. The job's nodes are ``SLURM_JOB_NODELIST`` (expanded here, without
``scontrol``); the first serves the rendezvous unless ``launcher.master_addr`` is set, on a port
derived from ``SLURM_JOB_ID`` unless ``launcher.master_port`` is set (every task derives the
same one). With one task per node, each task spawns its node's ranks and this node is
``SLURM_NODEID``. With more tasks than nodes (one per GPU), each task is one rank: the job's
"nodes" for the rendezvous are its tasks (``SLURM_NTASKS``, this one ``SLURM_PROCID``, one rank
each), and the rank's place on its machine is ``SLURM_LOCALID`` among the node's tasks
(``SLURM_TASKS_PER_NODE``). A command line or spec that says otherwise about the counts or this
task's rank is refused, naming both.
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


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` per node: ``2(x3),1`` is 2, 2, 2, 1."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise SlurmError(f"{part!r} in {text!r} is not a task count (like 8 or 8(x4))")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """The job as ``srun`` describes it to one of its tasks."""

    job_id: str
    nodes: tuple[str, ...]
    node_id: int
    tasks: int
    """``SLURM_NTASKS``: one per node (each spawns its node's ranks), or one per rank."""
    proc_id: int = 0
    local_id: int = 0
    tasks_here: int = 1
    """This node's tasks (one per node: 1)."""

    @property
    def per_task(self) -> bool:
        """More tasks than nodes: each task is one rank (one per GPU)."""
        return self.tasks > len(self.nodes)

    @property
    def master_port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits) % PORT_SPAN

    def launcher_values(self) -> dict[str, str]:
        """The spec's launcher keys Slurm decides, as override strings."""
        values = {
            "nnodes": str(self.tasks if self.per_task else len(self.nodes)),
            "node_rank": str(self.proc_id if self.per_task else self.node_id),
            "master_addr": self.nodes[0],
            "master_port": str(self.master_port),
        }
        if self.per_task:
            values["nproc_per_node"] = "1"
        return values

    def source(self, key: str) -> str:
        """Where a launcher value came from, for messages."""
        names = {
            "nnodes": f"SLURM_NTASKS={self.tasks}, one rank each"
            if self.per_task
            else f"SLURM_JOB_NODELIST={','.join(self.nodes)}",
            "node_rank": f"SLURM_PROCID={self.proc_id}" if self.per_task else f"SLURM_NODEID={self.node_id}",
            "nproc_per_node": f"SLURM_NTASKS={self.tasks} on {len(self.nodes)} node(s): each task is one rank",
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
    job_id = need("SLURM_JOB_ID")
    if tasks < nnodes:
        raise SlurmError(f"SLURM_NTASKS={tasks} is below SLURM_NNODES={nnodes}: give every node a task")
    if tasks == nnodes:
        return SlurmJob(job_id=job_id, nodes=nodes, node_id=node_id, tasks=tasks)
    per_node = need("SLURM_TASKS_PER_NODE")
    try:
        counts = expand_tasks_per_node(per_node)
    except SlurmError as err:
        raise SlurmError(f"SLURM_TASKS_PER_NODE: {err}") from None
    if len(counts) != nnodes or sum(counts) != tasks:
        raise SlurmError(f"SLURM_TASKS_PER_NODE={per_node} does not give SLURM_NTASKS={tasks} over {nnodes} node(s)")
    proc_id, local_id = number("SLURM_PROCID"), number("SLURM_LOCALID")
    if proc_id >= tasks or local_id >= counts[node_id]:
        raise SlurmError(
            f"SLURM_PROCID={proc_id}, SLURM_LOCALID={local_id} do not fit SLURM_NTASKS={tasks} with "
            f"{counts[node_id]} task(s) on this node"
        )
    return SlurmJob(
        job_id=job_id,
        nodes=nodes,
        node_id=node_id,
        tasks=tasks,
        proc_id=proc_id,
        local_id=local_id,
        tasks_here=counts[node_id],
    )
