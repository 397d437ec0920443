"""What every benchmark records next to its figures: the device, the software and the date; and the
markdown table it prints."""
import datetime
import json
import os
import platform
import re

import torch


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def device_slug() -> str:
    """The first accelerator's (else the CPU's) name as a folder name: benchmarks/results/<slug>/."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    name = device_description(device).split(" (")[0]
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(device: torch.device) -> dict:
    import deepspeed  # the GPU machine may lack it until its wheel is installed; only needed here
    return {"date": datetime.date.today().isoformat(), "device": device_description(device),
            "software": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "python": platform.python_version(), "cuda": torch.version.cuda}}


def print_table(header: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
