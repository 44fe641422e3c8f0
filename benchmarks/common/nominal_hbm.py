"""The GPUs' nominal memory bandwidth, by name: kernels.py's "% of HBM" and gpu-check's env
probe read the same table."""

# Nominal HBM bandwidth in GB/s by device-name substring, first match wins (so the more
# specific names come first). From the vendors' data sheets: not measured.
NOMINAL_HBM_GBPS = [
    ("GH200", 4000.0), ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0),
    ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("L40S", 864.0), ("B200", 8000.0),
]


def nominal_hbm_gbps(device_name: str) -> float | None:
    return next((gbps for key, gbps in NOMINAL_HBM_GBPS if key in device_name), None)
