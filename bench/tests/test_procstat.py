from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.procstat import CpuMeter, children, cpu_seconds, times_scheduled, write_syscalls


def test_cpu_seconds_grow_with_work() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds(os.getpid()) > before


def test_children_and_a_gone_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert child.pid in children(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) == 0.0


def test_meter_reports_each_group() -> None:
    meter = CpuMeter({"me": [os.getpid()]})
    meter.start()
    sum(i * i for i in range(2_000_000))
    assert meter.delta()["me"] > 0


def test_the_kernels_share_is_part_of_the_cpu() -> None:
    meter = CpuMeter({"me": [os.getpid()]})
    meter.start()
    for _ in range(100_000):
        os.stat("/")  # system calls: kernel time
    sum(i * i for i in range(1_000_000))
    system, total = meter.system_delta()["me"], meter.delta()["me"]
    assert 0 < system <= total


def test_minor_faults_count_fresh_pages_touched() -> None:
    from bench.procstat import minor_faults

    before = minor_faults(os.getpid())
    pages = bytearray(64 * 1024 * 1024)  # fresh anonymous memory, faulted in as touched
    for offset in range(0, len(pages), 4096):
        pages[offset] = 1
    assert minor_faults(os.getpid()) - before >= 1_000
    assert minor_faults(2**22 + 12345) == 0


def test_runqueue_wait_is_read_for_a_live_process_only() -> None:
    from bench.procstat import runqueue_wait_seconds

    assert runqueue_wait_seconds(os.getpid()) >= 0.0
    assert runqueue_wait_seconds(2**22 + 12345) == 0.0


def test_threads_split_tells_the_main_thread_from_the_others() -> None:
    import threading

    from bench.procstat import thread_cpu_seconds, threads_split

    pid = os.getpid()
    before = thread_cpu_seconds(pid)
    assert pid in before
    done, release = threading.Event(), threading.Event()

    def burn() -> None:
        sum(i * i for i in range(3_000_000))
        done.set()
        release.wait()  # alive until read: an ended thread is not in the reading

    worker = threading.Thread(target=burn)
    worker.start()
    done.wait()
    during = thread_cpu_seconds(pid)
    release.set()
    worker.join()
    split = threads_split(pid, before, during)
    assert split["other_threads"] > 0
    assert split["main"] < split["other_threads"]  # the main thread only waited
    assert thread_cpu_seconds(2**22 + 12345) == {}


def test_a_thread_that_sleeps_and_wakes_is_counted_on_a_cpu_each_time() -> None:
    meter = CpuMeter({"me": [os.getpid()], "gone": [2**22 + 7]})
    meter.start()
    for _ in range(50):
        time.sleep(0.001)
    runs = meter.runs_delta()
    assert runs["me"] >= 50  # at least one run after each sleep
    assert runs["gone"] == 0
    assert times_scheduled(2**22 + 7) == 0


def test_each_write_system_call_is_counted_for_its_process() -> None:
    meter = CpuMeter({"me": [os.getpid()], "gone": [2**22 + 7]})
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        meter.start()
        for _ in range(40):
            os.write(fd, b"x")
        writes = meter.writes_delta()
    finally:
        os.close(fd)
    assert 40 <= writes["me"] < 60  # these 40, and what else this process wrote meanwhile
    assert writes["gone"] == 0
    assert write_syscalls(2**22 + 7) == 0


def _allowed(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_pin_threads_pins_every_thread_and_the_threads_started_later() -> None:
    from bench.procstat import pin_threads

    cpu = max(os.sched_getaffinity(0))
    # A process with a second thread now, which starts a third when told (stdin).
    code = (
        "import sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('up', flush=True); sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('more', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "up"
        assert pin_threads(child.pid, [cpu]) == 2
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "more"
        allowed = _allowed(child.pid)
        assert len(allowed) == 3
        assert all(cpus == {cpu} for cpus in allowed.values())
    finally:
        child.kill()
        child.wait()
    assert pin_threads(child.pid, [cpu]) == 0  # gone: nothing to pin
