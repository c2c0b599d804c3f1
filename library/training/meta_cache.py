"""Memoized meta kernels: what an aten op returns on `meta` is a function of its inputs' metadata
(shapes, strides, dtypes) and its other arguments, so one answer serves every later call with the
same ones. The planner (memory_plan.LiveBytes) runs the same block ops 19-60 times per step and
the same step for several settings (base precision x checkpointing); most meta kernels are Python
(torch._refs / _prims), ~150 us a call, and a cache hit rebuilds the outputs in a few us.

Only ops that return fresh tensors are cached: an op whose schema says an output aliases an input
(views, `out=` and in-place ops) or that mutates an input always runs, since its output must share
the input's storage (LiveBytes counts storages). A rebuilt output has the recorded shape, stride,
dtype, storage offset and storage size, and outputs that shared a storage share a new one: what
LiveBytes counts is the same as for the kernel's own outputs. Anything the key cannot state (a
non-meta tensor, a tensor subclass, a symbolic size, an unknown argument type) runs uncached.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

MAX_ENTRIES = 200_000  # distinct (op, input metadata) pairs; a full planner run of a preset holds ~10k
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


class Uncacheable(Exception):
    pass


def _fresh_outputs(func) -> bool:
    """Whether the op's schema promises outputs that alias no input and mutates nothing."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def _key_of(x):
    """A hashable statement of an argument: a tensor's metadata, a plain value with its type."""
    kind = type(x)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if not x.is_meta or x.layout != torch.strided:
            raise Uncacheable
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if kind is list or kind is tuple:
        return (kind, *[_key_of(v) for v in x])
    if kind is dict:
        return (dict, *[(k, _key_of(v)) for k, v in sorted(x.items())])
    if kind in _PLAIN:
        return (kind, x)  # 1, 1.0 and True are equal keys otherwise
    if isinstance(x, torch.Generator):
        return (torch.Generator,)  # meta kernels draw nothing
    raise Uncacheable


def _describe(out, inputs: list) -> tuple:
    """(leaves, spec) to rebuild `out`: tensors as (shape, stride, dtype, offset, storage bytes,
    index of the storage among the outputs', plain: torch.empty_strided makes exactly this one),
    other leaves as themselves."""
    leaves, spec = tree_flatten(out)
    if type(out) is torch.Tensor:
        spec = None  # _rebuild returns the one leaf
    taken = [t.untyped_storage() for t in inputs if isinstance(t, torch.Tensor)]
    storages, described = [], []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if type(leaf) not in _PLAIN:
                raise Uncacheable
            described.append(leaf)
            continue
        if type(leaf) is not torch.Tensor or leaf.device.type != "meta" or leaf.layout != torch.strided:
            raise Uncacheable
        storage = leaf.untyped_storage()
        if any(storage is s for s in taken):  # an alias the schema did not declare
            raise Uncacheable
        index = next((i for i, s in enumerate(storages) if s is storage), None)
        if index is None:
            index = len(storages)
            storages.append(storage)
        shape, stride, nbytes = tuple(leaf.shape), leaf.stride(), storage.nbytes()
        plain = leaf.storage_offset() == 0 and nbytes == _strided_bytes(shape, stride, leaf.dtype)
        described.append((shape, stride, leaf.dtype, leaf.storage_offset(), nbytes, index, plain))
    if len(storages) < sum(isinstance(leaf, tuple) for leaf in described):  # outputs sharing a storage
        described = [leaf[:-1] + (False,) if isinstance(leaf, tuple) else leaf for leaf in described]
    return described, spec


def _strided_bytes(shape, stride, dtype) -> int:
    """The storage size torch.empty_strided gives these sizes and strides."""
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").untyped_storage().nbytes()


def _rebuild(described: list, spec):
    if spec is None and described[0][-1]:  # one tensor, plain: most ops
        shape, stride, dtype = described[0][:3]
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    storages, leaves = {}, []
    for leaf in described:
        if not isinstance(leaf, tuple):
            leaves.append(leaf)
            continue
        shape, stride, dtype, offset, nbytes, index, plain = leaf
        if plain:  # the common case: one output, a storage of exactly its extent
            leaves.append(torch.empty_strided(shape, stride, dtype=dtype, device="meta"))
            continue
        if index not in storages:
            storages[index] = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        leaves.append(torch.empty(0, dtype=dtype, device="meta").set_(storages[index], offset, shape, stride))
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


class MetaKernelCache:
    """func(*args, **kwargs) on meta tensors, answered from earlier calls with the same metadata."""

    def __init__(self):
        self.results: dict = {}
        self.fresh: dict = {}  # op -> _fresh_outputs(op)
        self.hits = self.misses = 0

    def __call__(self, func, args, kwargs):
        fresh = self.fresh.get(func)
        if fresh is None:
            fresh = self.fresh[func] = _fresh_outputs(func)
        if not fresh:
            return func(*args, **kwargs)
        try:
            key = (func, _key_of(args), _key_of(kwargs), torch.get_default_dtype())
        except Uncacheable:
            return func(*args, **kwargs)
        found = self.results.get(key)
        if found is not None:
            self.hits += 1
            return _rebuild(*found) if found else func(*args, **kwargs)
        self.misses += 1
        out = func(*args, **kwargs)
        if len(self.results) >= MAX_ENTRIES:
            self.results.clear()
        try:
            self.results[key] = _describe(out, tree_flatten((args, kwargs))[0])
        except Uncacheable:
            self.results[key] = ()  # run it every time
        return out


# One cache per process: meta kernels are pure functions of the key, whichever plan asks.
META_KERNELS = MetaKernelCache()
