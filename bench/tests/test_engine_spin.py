import os
from pathlib import Path

from bench.engine_spin import cores, process_names


def test_cores_are_cpu_seconds_over_the_window() -> None:
    assert cores({"VLLM::Worker": 0.505, "python": 0.0}, 0.5) == {
        "VLLM::Worker": 1.01,
        "python": 0.0,
    }


def test_a_process_tree_is_grouped_by_each_process_name() -> None:
    me = os.getpid()
    name = Path(f"/proc/{me}/comm").read_text().strip()
    assert me in process_names(me)[name]
