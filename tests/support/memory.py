"""Shared by the memory tests (moved from unit/train/test_memory.py, whose tests still use them)."""

from __future__ import annotations

from collections.abc import Callable

from typer.testing import CliRunner

from gpupoor.cli import app
from support.runs import read_metrics


runner = CliRunner()


def _run(make_recipe, tmp_path, name, **sections):
    result = runner.invoke(app, ["train", str(make_recipe(f"{name}.yaml", **sections)), "--output-dir",
                                 str(tmp_path / name)])
    assert result.exit_code == 0, result.output
    return [r for r in read_metrics(tmp_path / name) if "loss" in r], result.output


HEAP_PROBE = """
import ctypes, sys
from gpupoor.train.heap import malloc_trim

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def anon_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024

libc.free(libc.malloc(16 * 2**20))  # a freed mmapped block raises glibc's mmap threshold to 16 MiB, as torch's do
blocks = [libc.malloc(2**20) for _ in range(200)]  # now served from the heap
for block in blocks:
    ctypes.memset(block, 1, 2**20)  # resident
for block in blocks[:-1]:  # the last one stays: the heap's top cannot shrink past it
    libc.free(block)
before = anon_mib()
trim = malloc_trim() if sys.argv[1] == "trim" else (lambda: None)
trim()
print(before, anon_mib())
"""


REUSE_PROBE = """
import ctypes, resource, sys
from gpupoor.train.heap import serve_tensors_from_heap

pinned = serve_tensors_from_heap() if sys.argv[1] == "pinned" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 24 * 2**20  # an intermediate-wide activation of the real model (4,096 tokens x 1,536 x fp32)
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)  # what a step does with an activation; the next step asks for the same size again
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)
ctypes.memset(block, 2, size)
print(int(pinned), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


class _Saved:
    """What the saved-tensors hook packs: alive exactly as long as autograd keeps the tensor for backward."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def saved_tensor_bytes(model, forward: Callable) -> int:
    """Bytes of what autograd keeps for backward at the end of `forward()`: unique storages, `model`'s parameters
    excluded, only tensors still held then (DoRA's B@A builds a graph it frees within the forward)."""
    import weakref

    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []

    def keep(tensor):
        box = _Saved(tensor)
        packed.append((weakref.ref(box), tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return box

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda box: box.tensor):
        out = forward()
    held = {ptr: size for ref, ptr, size in packed if ref() is not None and ptr not in params}
    del out
    return sum(held.values())
