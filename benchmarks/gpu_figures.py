"""What benchmarks/record.sh recorded for a device, as the markdown rows of docs/performance.md's table of GPU
figures; and the vocabulary record.sh gives a preset it trains on the character data.

    python -c "from benchmarks.gpu_figures import main; main()" benchmarks/results/DEVICE PRESET ...
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import print_table


def preset_vocab(path: str) -> str:
    """The preset's vocabulary size as an override value: its own, else N for a `bpe:N` tokenizer trained to N ids,
    else null (the dataset's, as train.py takes it)."""
    from training.config import load_run_config

    cfg = load_run_config(path, [])
    if cfg.model.vocab_size:
        return str(cfg.model.vocab_size)
    tokenizer = cfg.data.tokenizer or ""
    return tokenizer.split(":", 1)[1] if tokenizer.startswith("bpe:") else "null"


def read(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def tier_result(results: str) -> str:
    """The GPU tier's result line (record.sh writes the date, then pytest's last line)."""
    path = os.path.join(results, "gpu_tests.txt")
    lines = open(path).read().splitlines() if os.path.isfile(path) else []
    return lines[1].strip("= ") if len(lines) > 1 else "not run"


def plan_beside(plan: dict | None, throughput: dict, stage: str) -> dict:
    """The memory plan's probe of the same settings as a throughput row (train.compile aside), else nothing: a probe
    left from a run at other settings (record.sh's MEMORY=0) is not that row's."""
    def settings(overrides: list[str]) -> list[str]:
        return [o for o in overrides if not o.startswith("train.compile=")]
    same = plan and settings(plan["overrides"]) == settings(throughput["overrides"])
    return plan["results"].get(f"{stage}.json", {}) if same else {}


def main(argv: list[str] | None = None) -> None:
    results, *presets = sys.argv[1:] if argv is None else argv
    tier, rows = tier_result(results), []
    for preset in presets:
        for name in sorted(os.listdir(results)):
            if not (name.startswith(f"throughput_{preset}_") and name.endswith(".json")):
                continue
            report = read(os.path.join(results, name))
            stage = name[len(f"throughput_{preset}_"):-len(".json")].removesuffix("_compiled")
            memory = plan_beside(read(os.path.join(results, f"memory_plan_{preset}_{stage}.json")), report, stage)
            for r in report["results"]:
                rows.append([report["date"], report["device"], preset, stage, f"{r['tokens_per_step']:,}",
                             r["precision"], "yes" if name.endswith("_compiled.json") else "no",
                             r.get("attention") or "",
                             f"{r['deepspeed']['tokens_per_s']:,.0f}", f"{r['reference']['tokens_per_s']:,.0f}",
                             f"{r['ratio']:.3f}", f"{100 * r['deepspeed']['mfu']:.1f}%",
                             f"{r['peak_tflops']:.4g} TFLOP/s ({r['peak_source']})",
                             f"{memory['measured'] / 2**30:.2f} GiB" if memory else "",
                             f"{memory['plan'] / 2**30:.2f} GiB" if memory else "", tier])
    print_table(["date", "device", "preset", "ds_config", "tokens a step", "precision", "train.compile",
                 "attention kernel", "DeepSpeed tokens/s", "reference tokens/s", "DeepSpeed / reference", "MFU", "peak",
                 "peak memory", "memory plan", "GPU tier"], rows)
