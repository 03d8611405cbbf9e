"""The worker's heap tuning: the pinned mmap threshold and the trimmer's policy and effect."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from elastic_rt.worker.allocator import HeapTrimmer, pin_heap

MiB = 1 << 20


def test_the_heap_threshold_is_pinned_unless_the_user_chose_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert pin_heap() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert pin_heap() is True  # this machine's C library is glibc


def _trimmer(sizes_mib: list[int]) -> tuple[HeapTrimmer, list[int]]:
    readings = iter(s * MiB for s in sizes_mib)
    trimmed_at: list[int] = []
    trimmer = HeapTrimmer(rss=lambda: next(readings), trim=lambda: trimmed_at.append(1))
    return trimmer, trimmed_at


def test_a_steady_process_is_never_trimmed() -> None:
    trimmer, trimmed = _trimmer([800, 820, 790, 900, 800, 927])
    assert not any(trimmer.after_step() for _ in range(6))
    assert trimmed == []


def test_growth_past_the_margin_is_trimmed_and_the_size_settles_again() -> None:
    # settled at 800: margin max(128, 800/8=100) = 128 MiB; 950 > 928 trims; the next
    # step (830) is the new settled size, so 950 (< 830 + 128) is left alone.
    trimmer, _ = _trimmer([800, 950, 830, 950, 1000])
    assert [trimmer.after_step() for _ in range(5)] == [False, True, False, False, True]
    assert trimmer.trims == 2


def test_a_working_set_that_really_grows_costs_one_trim_per_margin() -> None:
    sizes = [1000 + 10 * i for i in range(100)]  # +10 MiB every step, 990 MiB in all
    trimmer, _ = _trimmer(sizes)
    for _ in sizes:
        trimmer.after_step()
    assert 0 < trimmer.trims <= 990 // 128 + 1


def test_a_user_tuning_glibc_turns_the_trimmer_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    trimmer = HeapTrimmer(rss=lambda: 10_000 * MiB)
    assert not any(trimmer.after_step() for _ in range(3))


def test_free_chunks_below_a_live_block_are_returned_to_the_system() -> None:
    """A real glibc heap grown by 512 MiB with half of it freed in holes: the trimmer gives
    the holes back (glibc alone keeps them: each lies below a live block)."""
    program = textwrap.dedent("""
        import psutil
        from elastic_rt.worker.allocator import HeapTrimmer, pin_heap
        assert pin_heap()
        trimmer = HeapTrimmer()
        trimmer.after_step()  # settles at the interpreter's size
        blocks = [bytearray(4 << 20) for _ in range(128)]  # from the heap (< 32 MiB)
        for block in blocks:
            block[::4096] = bytes(1024)  # touch every page
        del blocks[::2]
        rss = psutil.Process().memory_info().rss
        trimmed = trimmer.after_step()
        print(trimmed, (rss - psutil.Process().memory_info().rss) >> 20)
    """)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) >= 200, f"only {out[1]} MiB returned"


@pytest.mark.parametrize("trim_threshold, kept", [(None, False), (256 * MiB, True)])
def test_a_freed_block_at_the_heap_top_is_kept_for_the_next_step_under_fsdp(
    trim_threshold: int | None, kept: bool,
) -> None:
    """The sharded path's trim threshold keeps a freed 16 MiB block (an FSDP unit's gathered
    parameters) resident, so allocating it again faults no page in; the plain pinned
    threshold gives it back to the system and every page faults in again."""
    program = textwrap.dedent(f"""
        import resource
        from elastic_rt.worker.allocator import pin_heap
        assert pin_heap(trim_threshold_bytes={trim_threshold})

        def touched(size):
            block = bytearray(size)  # from the heap (< 32 MiB)
            block[::4096] = bytes(len(block[::4096]))
            return block

        block = touched(16 << 20)
        del block
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = touched(16 << 20)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    faults = int(out)
    if kept:
        assert faults < 500, f"{faults} page faults: the freed block was not kept"
    else:
        assert faults > 3000, f"only {faults} page faults: the freed block was kept"


@pytest.mark.parametrize("pinned, arenas", [(False, "several"), (True, "one")])
def test_threads_allocate_from_the_main_heap_once_it_is_pinned(pinned: bool, arenas: str) -> None:
    """Threads started after ``pin_heap`` (gloo's, which allocate each collective's
    temporaries) share the main heap, whose trim threshold keeps freed blocks resident;
    otherwise each gets an arena of its own (glibc's ``malloc_info`` lists every heap)."""
    program = textwrap.dedent(f"""
        import ctypes, ctypes.util, os, tempfile, threading
        from elastic_rt.worker.allocator import pin_heap
        if {pinned}:
            assert pin_heap(trim_threshold_bytes=256 << 20)
        together = threading.Barrier(4)

        def allocate():
            blocks = [bytearray(1 << 20) for _ in range(4)]
            together.wait()  # all four alive at once: glibc would give each its own arena
            del blocks

        threads = [threading.Thread(target=allocate) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.fopen.restype = ctypes.c_void_p
        with tempfile.NamedTemporaryFile(suffix=".xml") as report:
            stream = libc.fopen(report.name.encode(), b"w")
            libc.malloc_info(0, ctypes.c_void_p(stream))
            libc.fclose(ctypes.c_void_p(stream))
            print(open(report.name).read().count("<heap nr="))
    """)
    untuned = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60, check=True, env=untuned)
    heaps = int(out.stdout)
    assert (heaps == 1) if arenas == "one" else heaps > 1, f"{heaps} arenas"
