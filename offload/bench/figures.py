"""What an `offload bench --json` file says about the machine, as the fields of the plan's Machine (read by
`offload plan --bench-json` and `offload.Config.machine`). Beside the bench that writes the file; no torch."""
from __future__ import annotations

import json


def bench_figures(path: str, setting: str) -> dict:
    """Machine fields an `offload bench --json` file gives: nvme read/write (the striped aggregate when several
    drives were measured), pinned PCIe, the fused CPU AdamW's rate. `setting` names the flag or field that gave
    the path, for the error."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{setting} {path}: cannot read it as an offload bench JSON ({exc}); run "
                         "`offload bench all --json FILE` and give that file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{setting} {path}: not an offload bench JSON (a JSON object with nvme / pcie / adam)")
    out = {}
    nv = data.get("nvme", {})
    if "read_gbps" in nv:
        out["nvme_read_Bps"] = nv["read_gbps"] * 1e9
    if "write_gbps" in nv:
        out["nvme_write_Bps"] = nv["write_gbps"] * 1e9
    striped = nv.get("striped")
    if striped:  # several drives measured at once: the node's aggregate is what the states are spread over
        out["nvme_read_Bps"] = striped["read_striped_gbps"] * 1e9
        out["nvme_write_Bps"] = striped["write_striped_gbps"] * 1e9
    pcie = data.get("pcie", {})
    if pcie.get("h2d_pinned_gbps"):
        out["pcie_Bps"] = pcie["h2d_pinned_gbps"] * 1e9
    if (data.get("machine") or {}).get("cpus"):
        out["host_cores"] = int(data["machine"]["cpus"])
    adam = data.get("adam", {})
    if adam.get("offload_params_per_s"):
        out["adam_params_per_s"] = adam["offload_params_per_s"]
    return out
