"""`offload bench`: measurements of this machine (NVMe now; PCIe, memcpy and CPU Adam join later) as JSON."""
