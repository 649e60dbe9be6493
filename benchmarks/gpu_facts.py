"""The facts of the machine a GPU check runs on, printed first in its summary: interpreter, torch and CUDA, the GPU,
cores, RAM, the disk tier's free space, and the Python packages the project needs (a missing one is carried as a
wheel: docs/gpu.md)."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata

import torch

PACKAGES = ("numpy", "rich", "safetensors", "transformers", "tokenizers", "pytest", "pytest-timeout", "pytest-xdist")


def main(disk_dirs: list[str]) -> None:
    print("python", platform.python_version(), sys.executable)
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("gpu", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs",
              "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print("cpus", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)), f"ram {ram / 2**30:.1f} GiB")
    for d in disk_dirs:
        print("disk free", d, f"{shutil.disk_usage(d).free / 2**30:.1f} GiB")
    for name in PACKAGES:
        try:
            print(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            print(name, "MISSING")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
