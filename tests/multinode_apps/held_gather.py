"""`all_gather_object` whose tensors stay alive until the process ends.

On torch before 2.8, destroying a gloo process group can deadlock: the group's destructor
holds the GIL while it joins its worker threads, and a worker that drops the last reference
to a tensor a collective used needs the GIL to free it (pytorch/pytorch#154976, fixed in
2.8). `all_gather_object` makes its tensors itself and drops them as it returns, so
`all_gather_object(...); destroy_process_group()` hangs a rank now and then under plain
torchrun too (on torch 2.6, 2 nodes x 2 ranks over loopback: more than one run in three).
Keeping every tensor handed to a collective referenced avoids it on every torch.
"""

import pickle
from typing import Any, List

import torch
import torch.distributed as dist

# every tensor a collective of this module used: freed when the process ends, after the
# group was destroyed
_HELD: List[torch.Tensor] = []


def all_gather_held(obj: Any) -> List[Any]:
    """Every rank's `obj`, in rank order, as `dist.all_gather_object` returns them."""
    world = dist.get_world_size()
    data = torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded)
    _HELD.extend([size, *sizes, padded, *gathered])
    return [pickle.loads(bytes(t[: int(s.item())].tolist())) for t, s in zip(gathered, sizes)]
