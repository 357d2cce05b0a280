"""Copy / cast / flatten kernels (csrc/copy) and their plain-torch references.

    copy_(dst, src)                          dst <- src; casts when dtypes differ (like dst.copy_(src))
    flat_layout(tensors, align=4096, dtype=None) -> (offsets, total_numel)
    flatten(tensors, out=None, align=4096, dtype=None) -> (flat, offsets)
    unflatten(flat, offsets, outs)           outs[i] <- flat[offsets[i] : offsets[i] + outs[i].numel()]

Casts float32 <-> bfloat16 / float16 are bitwise what `tensor.to(dtype)` gives on CPU (round to nearest
even, denormals kept, every fp32 NaN -> bf16 0xFFFF as torch writes it). One documented difference:
torch converts the last `n % 8` elements of an fp16 -> fp32 call with a scalar routine that turns every
fp16 NaN into 0x7FFFFFFF; ours keeps the NaN's sign and payload everywhere (like the vector path torch
uses for the rest). Values that are not NaN are always identical.

Offsets are in elements of the flat buffer's dtype; every tensor starts at a byte offset that is a
multiple of `align` (4096 by default, for O_DIRECT), and the flat buffer itself starts at an
`align`-aligned address. Padding between tensors is zero, so files written from it are deterministic.

CPU tensors go through the multi-threaded C++ kernels (thread count: offload._C.set_num_threads); any
other device, or a machine without the extension, goes through torch (`*_reference`, warned once).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import _ext

__all__ = [
    "copy_",
    "copy_reference",
    "flat_layout",
    "flatten",
    "flatten_reference",
    "unflatten",
    "unflatten_reference",
    "aligned_empty",
]

_CASTS = {
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float16, torch.float32),
}


def _check_align(align: int) -> None:
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two (bytes), got {align!r}")


def _check_pair(dst_name: str, dst: torch.Tensor, src_name: str, src: torch.Tensor) -> None:
    if dst.numel() != src.numel():
        raise ValueError(
            f"{dst_name} has {dst.numel()} elements but {src_name} has {src.numel()}; sizes must match"
        )
    if dst.dtype != src.dtype and (src.dtype, dst.dtype) not in _CASTS:
        raise ValueError(
            f"cannot cast {src_name} ({src.dtype}) to {dst_name} ({dst.dtype}); supported: same dtype, "
            "float32<->bfloat16, float32<->float16"
        )
    if not dst.is_contiguous():
        raise ValueError(f"{dst_name} must be contiguous (got strides {tuple(dst.stride())})")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes `t` can touch (its whole extent when it is not contiguous)."""
    if t.numel() == 0:
        return 0, 0
    reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + reach * t.element_size()


def _check_disjoint(items: list[tuple[str, torch.Tensor, bool]]) -> None:
    """ValueError naming the first pair where a written tensor (flag True) shares bytes with another
    tensor: the kernels run chunks in any order, so the result would depend on timing (torch's copy_
    refuses partial overlap too). Both paths (kernel and plain torch) check, so both raise alike."""
    by_device: dict = {}
    for name, t, written in items:
        lo, hi = _span(t)
        if hi > lo:
            by_device.setdefault(t.device, []).append((lo, hi, name, written))
    for ranges in by_device.values():
        ranges.sort(key=lambda r: r[0])
        far_w = far_r = None  # earlier written / read range reaching furthest (sort-and-sweep)
        for r in ranges:
            hit = far_w if far_w and far_w[1] > r[0] else (far_r if r[3] and far_r and far_r[1] > r[0] else None)
            if hit:
                a, b = (hit, r) if hit[3] else (r, hit)
                raise ValueError(f"{a[2]} and {b[2]} overlap in memory; each output needs its own buffer")
            if r[3]:
                far_w = r if far_w is None or r[1] > far_w[1] else far_w
            else:
                far_r = r if far_r is None or r[1] > far_r[1] else far_r


def _kernel_ok(*tensors: torch.Tensor):
    """The extension when every tensor is a CPU tensor it can take, else None (torch path). A conjugate or negative
    view takes the torch path: its bytes are not its values (the kernels read bytes)."""
    if not all(t.device.type == "cpu" and not t.is_conj() and not t.is_neg() for t in tensors):
        return None
    mod = _ext.get()
    if mod is None:
        _ext.warn_fallback("copy/cast")
    return mod


def copy_reference(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Plain torch: dst <- src (cast like .to())."""
    if src.is_contiguous():
        _check_disjoint([("dst", dst, True), ("src", src, False)])
    dst.view(-1).copy_(src.reshape(-1))
    return dst


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst <- src, element for element (shapes may differ, numel must match); casts float32 <->
    bfloat16/float16 when the dtypes differ. Returns dst."""
    _check_pair("dst", dst, "src", src)
    if src.is_contiguous():  # a strided src is copied to a fresh buffer first, on both paths
        _check_disjoint([("dst", dst, True), ("src", src, False)])
    mod = _kernel_ok(dst, src)
    if mod is None:
        return copy_reference(dst, src)
    mod.copy_many([dst], [src.contiguous()])
    return dst


def _numels(tensors) -> list[int]:
    out = []
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            out.append(t.numel())
        elif isinstance(t, int) and t >= 0:
            out.append(t)
        else:
            raise ValueError(f"tensors[{i}] must be a tensor or a non-negative element count, got {t!r}")
    return out


def flat_layout(
    tensors: Sequence[torch.Tensor | int], align: int = 4096, dtype: torch.dtype | None = None
) -> tuple[list[int], int]:
    """Element offsets of each tensor (or element count) in a flat buffer of `dtype` (default: the
    first tensor's), every one starting at a multiple of `align` bytes, and the total numel (the last
    tensor ends the buffer: no trailing padding)."""
    _check_align(align)
    if dtype is None:
        first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if first is None:
            raise ValueError("flat_layout: give dtype when tensors holds only element counts")
        dtype = first.dtype
    item = torch.empty((), dtype=dtype).element_size()
    if align % item:
        raise ValueError(f"align ({align}) must be a multiple of the flat dtype's size ({item} bytes)")
    step = align // item
    offsets, cursor = [], 0
    for n in _numels(tensors):
        cursor = -(-cursor // step) * step
        offsets.append(cursor)
        cursor += n
    return offsets, cursor


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, align: int = 4096) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data pointer is a multiple of `align` (torch only promises 64):
    over-allocates by one alignment and slices; the slice keeps the base alive. The package's one helper for
    aligned buffers outside the pinned arena (kernels' outputs, O_DIRECT I/O in the aio engine and bench)."""
    _check_align(align)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * item + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    return raw[skip : skip + numel * item].view(dtype)


def _check_flat(flat: torch.Tensor, name: str, total: int, align: int) -> None:
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor (got shape {tuple(flat.shape)})")
    if flat.numel() < total:
        raise ValueError(f"{name} has {flat.numel()} elements but the layout needs {total}")
    if flat.device.type == "cpu" and flat.data_ptr() % align:
        raise ValueError(
            f"{name} is not {align}-byte aligned (data_ptr % {align} = {flat.data_ptr() % align}); "
            "allocate it with offload.ops.aligned_empty or the store's arena"
        )


def _check_casts(kind: str, dtypes, flat_dtype, tensors_name: str, flat_name: str, to_flat: bool) -> None:
    for i, dt in dtypes:
        pair = (dt, flat_dtype) if to_flat else (flat_dtype, dt)
        if dt != flat_dtype and pair not in _CASTS:
            src, dst = (f"{tensors_name}[{i}] ({dt})", f"{flat_name} ({flat_dtype})")
            if not to_flat:
                src, dst = dst, src
            raise ValueError(
                f"{kind}: cannot cast {src} to {dst}; supported: same dtype, float32<->bfloat16, float32<->float16"
            )


def _prepare_flatten(tensors, out, align, dtype):
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}] must be a tensor, got {type(t).__name__}")
    if dtype is None:
        dtype = out.dtype if out is not None else (tensors[0].dtype if tensors else torch.float32)
    if out is not None and out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but dtype={dtype} was asked for")
    seen: dict = {}
    for i, t in enumerate(tensors):
        seen.setdefault(t.dtype, i)
    _check_casts("flatten", [(i, dt) for dt, i in seen.items()], dtype, "tensors", "out", True)
    offsets, total = flat_layout(tensors, align, dtype) if tensors else ([], 0)
    if out is None:
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type == "cpu":
            out = aligned_empty(total, dtype, align)
        else:
            out = torch.empty(total, dtype=dtype, device=device)
    else:
        _check_flat(out, "out", total, align)
        out = out[:total]
        # out is written whole (padding too) before or while the tensors are read.
        _check_disjoint([("out", out, True)] + [(f"tensors[{i}]", t, False) for i, t in enumerate(tensors)])
    return tensors, out, offsets


def _zero_padding(flat: torch.Tensor, offsets: list[int], numels: list[int]) -> None:
    cursor = 0
    for off, n in zip(offsets, numels):
        if off > cursor:
            flat[cursor:off].zero_()
        cursor = off + n


def flatten_reference(tensors, out=None, align: int = 4096, dtype=None):
    """Plain torch flatten (same layout and padding as flatten)."""
    tensors, flat, offsets = _prepare_flatten(tensors, out, align, dtype)
    _zero_padding(flat, offsets, [t.numel() for t in tensors])
    for off, t in zip(offsets, tensors):
        flat[off : off + t.numel()].copy_(t.reshape(-1))
    return flat, offsets


def flatten(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    align: int = 4096,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Copy (casting to `dtype`, default out's or the first tensor's) every tensor into one flat
    buffer at `align`-byte aligned offsets. `out`, when given, must be 1-D, contiguous, `align`-aligned
    and hold at least the layout's total; the returned flat is `out[:total]`."""
    tensors, flat, offsets = _prepare_flatten(tensors, out, align, dtype)
    mod = _kernel_ok(flat, *tensors)
    if mod is None:
        return flatten_reference(tensors, flat, align, flat.dtype)
    mod.flatten_into(flat, tensors, offsets)  # copies, casts and zeroes the padding in one parallel run
    return flat, offsets


def _prepare_unflatten(flat, offsets, outs):
    outs = list(outs)
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(outs):
        raise ValueError(f"offsets has {len(offsets)} entries but outs has {len(outs)}")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a contiguous 1-D tensor (got shape {tuple(flat.shape)})")
    seen: dict = {}
    end = 0
    for i, (off, o) in enumerate(zip(offsets, outs)):
        if not isinstance(o, torch.Tensor):
            raise ValueError(f"outs[{i}] must be a tensor, got {type(o).__name__}")
        n = o.numel()
        if off < end or off + n > flat.numel():
            raise ValueError(
                f"offsets[{i}] = {off} with outs[{i}].numel() = {n} overlaps the previous slice or runs past "
                f"flat's {flat.numel()} elements"
            )
        if not o.is_contiguous():
            raise ValueError(f"outs[{i}] must be contiguous (got strides {tuple(o.stride())})")
        seen.setdefault(o.dtype, i)
        end = off + n
    _check_casts("unflatten", [(i, dt) for dt, i in seen.items()], flat.dtype, "outs", "flat", False)
    _check_disjoint([("flat", flat, False)] + [(f"outs[{i}]", o, True) for i, o in enumerate(outs)])
    return outs, offsets


def unflatten_reference(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]):
    """Plain torch unflatten."""
    outs, offsets = _prepare_unflatten(flat, offsets, outs)
    for o, off in zip(outs, offsets):
        o.view(-1).copy_(flat[off : off + o.numel()])
    return outs


def unflatten(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """outs[i] <- flat[offsets[i] : offsets[i] + outs[i].numel()], casting to each out's dtype.
    Returns outs."""
    outs, offsets = _prepare_unflatten(flat, offsets, outs)
    mod = _kernel_ok(flat, *outs)
    if mod is None:
        return unflatten_reference(flat, offsets, outs)
    mod.unflatten_from(flat, outs, offsets)
    return outs
