"""A join's state stream alone: two holders to one newcomer, over TCP and through gloo.

``scripts/bench/recovery.py --cases inproc-join`` measures the stream where it runs, beside
the holders' training; on a small machine that training takes the cores the stream
needs, and the figure says as much about the machine as about the stream. This runs the
runtime's own :class:`~elastic_rt.worker.trainers.replica_transfer.Stream` with nothing
beside it: three processes on loopback (ranks 0 and 1 hold ``--state-mb`` of float32
tensors, rank 2 receives into tensors of its own whose pages are already written, as a
newcomer's are after ``prepare``), each repeat once over the stream's TCP connections and
once through gloo (``ELASTIC_RT_STREAM_OVER_TCP=0``), alternating. Printed: the stream's
own time and rate (its ``wire_seconds``), against one TCP connection on loopback measured
in the same run; every repeat checks that the receiver's tensors equal the holders'.

    python scripts/bench/stream.py --state-mb 1200 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import loopback_rate

from elastic_rt.config import NODE_HOST_ENV, STREAM_OVER_TCP_ENV
from elastic_rt.worker.trainers.replica_transfer import Agreement, Stream

HOLDERS, RECEIVER = (0, 1), 2
TENSORS = 8  # the state in this many tensors, as a model's are several


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mb", type=int, default=1200, help="bytes streamed, in MB")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def _tensors(state_mb: int, rank: int) -> list[torch.Tensor]:
    numel = state_mb * 10**6 // 4 // TENSORS
    if rank == RECEIVER:
        return [torch.zeros(numel) for _ in range(TENSORS)]  # written: pages in place
    generator = torch.Generator().manual_seed(7)
    return [torch.rand(numel, generator=generator) for _ in range(TENSORS)]


def _worker(rank: int, port: int, state_mb: int, repeats: int, results: mp.Queue) -> None:
    os.environ[NODE_HOST_ENV] = "127.0.0.1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    group = dist.group.WORLD
    assert group is not None  # init_process_group has just made it
    tensors = _tensors(state_mb, rank)
    want = [float(t.sum()) for t in _tensors(state_mb, 0)] if rank == RECEIVER else []
    for repeat in range(repeats):
        for over_tcp in (True, False):
            os.environ[STREAM_OVER_TCP_ENV] = "1" if over_tcp else "0"
            if rank == RECEIVER:
                for tensor in tensors:
                    tensor.zero_()
            dist.barrier(group=group)
            stream = Stream(tensors, Agreement(step=repeat, holders=HOLDERS,
                                               receivers=(RECEIVER,)), group)
            moved = stream.finish()
            if rank == RECEIVER:
                equal = [float(t.sum()) for t in tensors] == want
                results.put((over_tcp, moved, stream.wire_seconds, equal))
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    loopback = loopback_rate()
    print(f"loopback TCP, one connection (best of 3): {loopback / 1e9:.2f} GB/s", flush=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results: mp.Queue = mp.get_context("spawn").Queue()
    workers = mp.start_processes(_worker, args=(port, args.state_mb, args.repeats, results),
                                 nprocs=3, join=False, start_method="spawn")
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(2 * args.repeats):
        over_tcp, moved, seconds, equal = results.get(timeout=600)
        if not equal:
            raise SystemExit("the receiver's tensors differ from the holders': a broken stream")
        rates[over_tcp].append(moved / seconds)
        print(f"  {'tcp ' if over_tcp else 'gloo'}: {moved / 1e6:.0f} MB in {seconds:.2f} s, "
              f"{moved / seconds / 1e9:.2f} GB/s ({moved / seconds / loopback:.2f} of loopback)",
              flush=True)
    workers.join()
    for over_tcp, name in ((True, "over TCP"), (False, "through gloo")):
        rate = statistics.median(rates[over_tcp])
        print(f"stream {name}, median of {args.repeats}: {rate / 1e9:.2f} GB/s, "
              f"{rate / loopback:.2f} of loopback (target >= 0.50)")
    print(f"load average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
