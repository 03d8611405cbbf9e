"""slice_exchange in real gloo processes: every slice lands whole, whatever the waves cut.

Three ranks send each other (and themselves) slices of two dtypes and many sizes, empty ones
included, some not contiguous on the sender or at the place they go; the wave size is cut to
a few dozen bytes, so slices are split across waves and waves carry parts of several slices.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.worker.trainers import slice_exchange
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

SHAPES = [(3, 5), (0,), (7,), (4, 6), (1,), (9, 2)]


def _slices(src: int, dest: int) -> list[torch.Tensor]:
    """What ``src`` sends ``dest``: values naming the pair, alternating dtypes."""
    out = []
    for i, shape in enumerate(SHAPES[: 2 + (src + dest) % len(SHAPES)]):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        count = torch.Size(shape).numel()
        out.append((torch.arange(count) + 1000 * src + 100 * dest + 10 * i)
                   .reshape(shape).to(dtype))
    return out


def _exchange(env: WorkerEnv, wave_bytes: int) -> dict[str, Any]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    slice_exchange.WAVE_BYTES, slice_exchange._MIN_CHUNK = wave_bytes, 1
    sends = []
    for dest in range(env.nprocs):
        slices = _slices(env.rank, dest)
        # every other slice read through a transposed (non-contiguous) view of its values
        sends.append([s.t().contiguous().t() if s.dim() == 2 and i % 2 else s
                      for i, s in enumerate(slices)])
    received: list[list[torch.Tensor]] = []
    places = []
    for src in range(env.nprocs):
        wanted = _slices(src, env.rank)
        received.append([torch.full((s.shape[1], s.shape[0]) if s.dim() == 2 else s.shape,
                                    -1.0, dtype=s.dtype) for s in wanted])
        # 2-D places are transposed views of their buffers: not contiguous
        places.append([r.t() if r.dim() == 2 else r for r in received[-1]])
    world = dist.group.WORLD
    assert world is not None
    slice_exchange.exchange_slices(sends, places, world)
    dist.destroy_process_group()
    return {"got": [[p.contiguous() for p in row] for row in places]}


@pytest.mark.parametrize("wave_bytes", [40, 1 << 20], ids=["many-waves", "one-wave"])
def test_every_slice_lands_whole_in_its_place(wave_bytes: int) -> None:
    for rank, result in enumerate(run_workers(_exchange, 3, args=(wave_bytes,))):
        for src, row in enumerate(result["got"]):
            for got, want in zip(row, _slices(src, rank), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
