"""What every benchmark records about the run: the machine it ran on and where its JSON goes.

Absolute numbers on a shared VM are noise; the machine block says what produced them (CPU model
and the vector / matrix extensions its matmuls can use, memory, disk, load while running), and
`write_results` keeps one timestamped JSON per run plus a `-latest` copy, each written atomically.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys

import numpy as np

from kvcache import __version__

# ISA extensions that decide which matmul kernels a CPU gets (oneDNN's AMX bf16 path, AVX-512, AVX2)
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

def _proc(path: str, parse):
    try:
        with open(path) as f:
            return parse(f.read())
    except (OSError, IndexError, ValueError):
        return None


def load_now() -> dict:
    """Load average and pressure stalls (% of time, last 60 s): other work skews the numbers."""
    some60 = lambda text: float(text.split()[2].split("=")[1])  # noqa: E731
    return {"loadavg": os.getloadavg(), "pressure_cpu_some_avg60": _proc("/proc/pressure/cpu", some60),
            "pressure_io_some_avg60": _proc("/proc/pressure/io", some60)}


def _filesystem(path: str) -> dict:
    st, out = os.statvfs(path), {"path": os.path.abspath(path)}
    out.update(size_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)
    try:
        df = subprocess.run(["df", "-PT", path], capture_output=True, text=True, timeout=10).stdout.splitlines()
        out.update(zip(("device", "type"), df[1].split()[:2]), mount=df[1].split()[-1])
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return out


def _cpu() -> dict:
    """The CPU's model name and the matmul-relevant flags it reports (Linux /proc/cpuinfo)."""
    def parse(text: str) -> dict:
        first = text.split("\n\n")[0]           # the first processor's entry
        fields = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in first.splitlines() if ":" in ln)}
        flags = set(fields.get("flags", "").split())
        return {"model": fields.get("model name") or platform.processor(),
                "matmul_flags": [f for f in MATMUL_FLAGS if f in flags]}
    return _proc("/proc/cpuinfo", parse) or {"model": platform.processor(), "matmul_flags": []}


def machine_info(data_dir: str) -> dict:
    return {"uname": platform.uname()._asdict(), "cpu": _cpu(), "cpu_count": os.cpu_count(), "mem_total_bytes": _proc(
                "/proc/meminfo", lambda t: int(t.split("MemTotal:")[1].split()[0]) * 1024),
            "filesystem": _filesystem(data_dir), "python": sys.version.split()[0],
            "python_impl": platform.python_implementation(), "kvcache": __version__, "numpy": np.__version__,
            "load_at_end": load_now()}


def write_results(doc: dict, out_dir: str, name: str = "tier_throughput") -> tuple[str, str]:
    """<name>-<UTC time>.json and <name>-latest.json, each written atomically."""
    os.makedirs(out_dir, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, latest = (os.path.join(out_dir, f"{name}-{s}.json") for s in (stamp, "latest"))
    doc["files"] = {"json": os.path.abspath(path), "latest": os.path.abspath(latest)}
    text = json.dumps(doc, indent=2) + "\n"
    for p in (path, latest):
        with open(p + ".tmp", "w") as f:
            f.write(text)
        os.replace(p + ".tmp", p)
    return path, latest

