"""scripts/bench_nvme.py --smoke --clip: two tiny steps with the state in memory and on NVMe,
interleaved, gradients clipped (so kept, in files beside the state); the report's lines are
there, the disk moved what the tier is said to move, and the two runs end bit-identical (the
script exits non-zero otherwise)."""

from __future__ import annotations

import re

from tests.helpers import run_script_smoke


def test_bench_nvme_smoke() -> None:
    stdout = run_script_smoke("bench_nvme.py", "--clip", timeout=180)
    assert "final weights bit-identical: True" in stdout, stdout
    assert re.search(r"NVMe step / in-memory step: [\d.]+x", stdout), stdout
    assert re.search(r"cost model: NVMe step predicted [\d.]+ s", stdout), stdout
    written = re.search(r"written ([\d.]+) MiB \(predicted ([\d.]+), the files ([\d.]+)\)", stdout)
    assert written, stdout
    # Every update writes each file once: what the process sent to the disk, the prediction and
    # the files agree (to the printed hundredth of a MiB).
    assert written.group(1) == written.group(2) == written.group(3), stdout
    # Reads: the state of the chunks sharing a host slot, the gradients the buffers lost.
    read = re.search(r"read ([\d.]+) MiB \(expected ([\d.]+)\)", stdout)
    assert read and read.group(1) == read.group(2) and float(read.group(1)) > 0, stdout
