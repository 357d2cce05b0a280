"""`offload export CKPT OUT`: a checkpoint's fp32 master weights, consolidated over its ranks, as a Hugging
Face directory for inference (safetensors, sharded with an index when large, plus the config and tokenizer
files the run stored in the checkpoint). No runtime and no model code are needed: the manifest has every
unit's slots (names, shapes, offsets), and each unit is assembled from the rank files' slices one at a time.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from ..config import parse_size
from ..store.sizes import format_bytes
from .files import CheckpointError, open_private, safe_member
from .hf_writer import write_hf_weights
from .manifest import rank_file, verified

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_checkpoint(ckpt, out, max_shard_bytes: int = 2 << 30, dtype: torch.dtype = torch.float32) -> Path:
    from safetensors import safe_open

    path, manifest = verified(ckpt)
    wrapped = next((s["name"] for u in manifest["units"] for s in u["slots"]
                    if ".lora_A." in s["name"] or ".base_layer." in s["name"]), None)
    if wrapped is not None:  # PEFT's names over the base: neither transformers nor PEFT could load the directory
        raise CheckpointError(f"{path}: a LoRA run's checkpoint (PEFT's wrapped names, such as {wrapped!r}); export "
                              "writes a full model's weights under the model's own names, which these are not. The "
                              "adapters are what the run saves at its end (offload finetune --lora-r: its --output, "
                              "a PEFT adapter directory): resume the run to its end to get them")
    world = manifest["world_size"]
    handles = [safe_open(str(path / rank_file(r, world)), framework="pt") for r in range(world)]

    def tensors():
        for unit in manifest["units"]:
            numel, shard = unit["numel"], unit["padded_numel"] // world
            full = torch.empty(numel, dtype=torch.float32)
            for r, h in enumerate(handles):
                lo, hi = r * shard, min((r + 1) * shard, numel)
                if lo < hi:
                    full[lo:hi] = h.get_slice(f"{unit['uid']}/master")[0:hi - lo]
            for slot in unit["slots"]:
                n = 1
                for d in slot["shape"]:
                    n *= d
                yield slot["name"], full[slot["offset"]:slot["offset"] + n].view(slot["shape"]).to(dtype)

    def add_files(tmp: Path) -> None:
        for name, entry in manifest["files"].items():
            if entry.get("aux"):  # verified above; copied without following a link
                with open_private(safe_member(path, name, "the manifest's aux files"), write=False) as src, \
                        open(tmp / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if (tmp / "config.json").is_file():  # the dtype written, always: transformers loads a model in the config's
            import json  # dtype (dtype="auto"), so fp32 weights under a bf16 source config came back as bf16

            config = json.loads((tmp / "config.json").read_text())
            name = str(dtype).removeprefix("torch.")  # float32 / bfloat16 / float16
            config["dtype"] = name
            if "torch_dtype" in config:  # (transformers 4's spelling)
                config["torch_dtype"] = name
            (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return write_hf_weights(out, tensors(), max_shard_bytes, add_files)


def _cmd_export(args: argparse.Namespace) -> int:
    import sys
    import time

    t0 = time.perf_counter()
    try:
        max_shard = parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as exc:  # (a number without a unit, among others: one line, exit 2)
        print(f"offload export: error: {exc}", file=sys.stderr)
        return 2
    try:
        out = export_checkpoint(args.checkpoint, args.out, max_shard, _DTYPES[args.dtype])
    except CheckpointError as exc:
        print(f"offload export: error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
    print(f"exported {args.checkpoint} -> {out} ({format_bytes(size)} of {args.dtype} weights, "
          f"{time.perf_counter() - t0:.1f} s)")
    return 0


def add_export_parser(sub, help_line: str) -> None:
    p = sub.add_parser("export", help=help_line,
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory, or the directory of checkpoints (its `latest`)")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                   help="dtype of the written weights, cast from the fp32 master (default fp32)")
    p.add_argument("--max-shard-size", default="2GiB", help="largest safetensors file written (default 2GiB)")
    p.set_defaults(func=_cmd_export)
