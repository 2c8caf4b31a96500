"""Several processes, one model: the cache sharded by heads and by layers, and shipped between machines.

Introduced in chapter 10. Everything runs on `torch.distributed` with the gloo backend, N processes on
this machine talking over loopback exactly as they would across machines:

- `launch`: start N processes joined in one process group (a free port, a deadline), or join one
  that `torchrun` started;
- `tensor_parallel`: each process owns H/N query heads and their key/value heads in every layer,
  keeps only that shard of the cache, and the partial outputs are summed with an all-reduce;
- `pipeline`: each process owns a run of layers and their cache; activations cross with send/recv;
- `transfer`: a cache serialised with a checked header, shipped from a prefill process to a decode
  process;
- `jobs`: what each process runs (importable, so that a fork server or `spawn` can start them);
- `costs`: shipping a cache against recomputing it, at the scale of published models.

Importing this package starts nothing: no process, no port, no thread.
"""

from labcode.distributed.launch import LaunchError, free_port, launch
from labcode.distributed.pipeline import PipelineStage, stage_layers
from labcode.distributed.tensor_parallel import HeadShard, head_shard, shard_model, tp_cache_bytes
from labcode.distributed.transfer import TransferError, fingerprint, pack, payload_bytes, unpack

__all__ = [
    "HeadShard",
    "LaunchError",
    "PipelineStage",
    "TransferError",
    "fingerprint",
    "free_port",
    "head_shard",
    "launch",
    "pack",
    "payload_bytes",
    "shard_model",
    "stage_layers",
    "tp_cache_bytes",
    "unpack",
]
