"""The compute device, the threads that use it, and its streams and events: the runtime's only CUDA-specific
code. On the CPU every stream is None and every event call is a no-op, so the ordering logic around them
(which lane issues what, who waits for whom) is the same code on CPU/gloo as on GPU/NCCL.

    device = compute_device()            # cuda:(LOCAL_RANK % device_count), else cpu
    bind_thread(device)                  # first thing in every thread of ours
    streams = Streams(device)            # one side stream per lane on a GPU
    with streams.use(Lane.GATHER):       # work queued here runs on the gather stream
        ...
        done = record(device)            # an event on the current stream (None on the CPU)
    wait(done, device)                   # the current stream waits for it (the host does not)
    sync(done)                           # the host waits for it (a lane, for bytes it reads next)
    retire(t)                            # t was used on the current stream: the allocator reuses it after
    prefer_expandable_segments()         # a process of ours, before CUDA starts: segments that grow in place

What the device's memory did (its allocator's peak, what was free then) is device_memory.py's, above the store
whose host pool is the CPU's allocator.

Why record_stream (retire): a tensor allocated on one stream and read on another must not be handed out
again by the caching allocator until the reader's stream has passed its use. Freeing it after a wait is not
enough: the host runs ahead of every stream.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

__all__ = ["compute_device", "bind_thread", "Streams", "record", "wait", "sync", "retire", "prefer_expandable_segments"]


EXPANDABLE_SEGMENTS = "expandable_segments:True"


def prefer_expandable_segments(environ=os.environ) -> bool:
    """For a process whose CUDA work is all ours (`offload finetune` run as the program), called before anything
    starts CUDA: torch's caching allocator then maps memory into segments that grow in place, so the gathered
    units, full gradients and activations of ever-different sizes do not strand free memory in blocks cut for
    other sizes (fragmentation: memory reserved but unusable). A PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) the user set is theirs and
    stays. True when it set the variable. A library call (offload.init) leaves the process's allocator alone."""
    if "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS  # read when CUDA's allocator starts: not yet
    return True


def compute_device() -> torch.device:
    """cuda:(LOCAL_RANK % device_count) where CUDA is available, else the CPU. The modulo serves both one
    process per GPU on a node (torchrun: LOCAL_RANK = GPU index) and one visible GPU per process (Slurm,
    Kubernetes: CUDA_VISIBLE_DEVICES narrows each process to one, whose index is 0 whatever LOCAL_RANK is)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def resolve(device: torch.device | str) -> torch.device:
    """A device with its index ("cuda" alone means the current device, which differs per thread)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def bind_thread(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device: it is per thread and starts at 0, so a thread that
    skipped this would create a context on GPU 0 (every rank's stray 500 MiB) and queue its work there."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def thread_initializer(device: torch.device):
    """For ThreadPoolExecutor(initializer=...): each worker binds the device before its first work."""
    return lambda: bind_thread(device)


class Streams:
    """One side stream per lane on a GPU, created once; None on the CPU (use() is then a no-op)."""

    def __init__(self, device: torch.device, high_priority=()):
        self.device = device
        self.high_priority = frozenset(high_priority)  # lanes whose kernels go first (the collectives', as FSDP2)
        self._streams: dict = {}
        self._lock = threading.Lock()

    def get(self, lane):
        if self.device.type != "cuda":
            return None
        with self._lock:
            s = self._streams.get(lane)
            if s is None:
                s = self._streams[lane] = torch.cuda.Stream(self.device, priority=-1 if lane in self.high_priority
                                                            else 0)
            return s

    @contextlib.contextmanager
    def use(self, lane):
        """Work queued inside runs on `lane`'s stream (on the CPU: where it is, synchronously)."""
        s = self.get(lane)
        if s is None:
            yield None
            return
        with torch.cuda.stream(s):
            yield s


def record(device: torch.device):
    """An event on `device`'s current stream now (None on the CPU, where work is done when queued)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event(blocking=True)  # a host waiting on it sleeps instead of spinning a core the CPU Adam needs
    ev.record(torch.cuda.current_stream(device))
    return ev


def wait(event, device: torch.device) -> None:
    """The current stream waits for `event` (the host does not block)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def sync(event) -> None:
    """The host waits for `event` (callers say why in a comment: each such wait stalls a thread)."""
    if event is not None:
        event.synchronize()


# See [Note: buffers that cross streams] in docs/zero-runtime.md
def retire(t: torch.Tensor | None) -> None:
    """`t` was used on the current stream: the caching allocator hands its memory out again only after
    this stream has passed what is queued now (no-op off CUDA)."""
    if t is not None and t.is_cuda and t.untyped_storage().nbytes():
        t.record_stream(torch.cuda.current_stream(t.device))


def is_out_of_memory(exc: BaseException) -> bool:
    """`exc` is an allocator's refusal: torch.OutOfMemoryError (CUDA), or the CPU allocator's "can't allocate
    memory" RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError)
                                                       and "can't allocate memory" in str(exc))
