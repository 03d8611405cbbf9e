"""``scripts/device_check.py`` runs as is everywhere: without CUDA it says so and passes.

Its GPU checks run only on a machine with one (see the script); the same script with
``--cpu`` runs the checkpoint and node-kill checks on the CPU, by hand, not in the suite
(the node kill is covered by ``test_in_process.py``).
"""

from __future__ import annotations

import subprocess

from elastic_rt.harness import PYTHON, REPO, child_env


def test_without_cuda_the_device_check_says_skipped_in_one_line_and_exits_0() -> None:
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so this holds on a GPU machine too.
    result = subprocess.run([PYTHON, str(REPO / "scripts" / "device_check.py")],
                            env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "CUDA" in lines[0], result.stdout
