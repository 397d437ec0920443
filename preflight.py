"""Check a multi-node layout before spending a real job on it. Start it exactly like the training run:

    deepspeed --hostfile hostfile preflight.py --ds_config ds_configs/pipe2.json [--config RUN.yaml] [key=value ...]

Every rank must join the process group within train.dist_timeout_s and an all-reduce must give the expected
sum. Each rank reports its host, local rank and device, whether the prepared dataset (data.dir) is readable
on its node, whether train.out_dir is writable from it, and whether it is the same storage rank 0 writes
to: multi-node checkpoints need that, since every rank writes its own shards into one directory that rank 0
then marks complete. On GPUs each rank also reports its GPU's UUID (two ranks on one GPU fail the check)
and the NCCL version, and the job measures its all-reduce bus bandwidth (NCCL-tests' busbw), with a warning
below --min_busbw (GB/s). Rank 0 prints one line per rank and the world = dp x pp layout; the exit code is 0
only if every check passed on every rank.

At a scale this machine does not have, check the layout without starting any rank (training/dry_run.py):

    python preflight.py --dry_run --world 1024 --gpus_per_node 8 --config RUN.yaml --ds_config DS.json
"""
import common  # noqa: F401 (first: its filter of DeepSpeed's log must be in place before DeepSpeed is imported)

# isort: split
import argparse
import dataclasses
import os
import socket
import time
import uuid

import torch
from deepspeed.accelerator import get_accelerator

from common.checks import ConfigError, ToolParser, exit_bad_input
from data.token_data import TokenData
from training.checkpoints import checkpoint, resume
from training.launch.failure import PHASE, join_process_group, leave_process_group, run_rank
from training.memory_plan import plan
from training.startup import (
    check_checkpoint_room,
    configure,
    count_parameters,
    load_configs,
    with_schedule_length,
    with_vocabulary,
)
from training.topology import describe_hosts

PROBE_DIR = ".preflight"
BANDWIDTH_MB = {True: 256, False: 16}  # the all-reduce measured on GPUs (NCCL-tests' large-message range) and CPUs


def main(argv=None) -> None:
    preflight_args, rest = parse_args(argv)
    if preflight_args.dry_run:
        return print_dry_run(preflight_args, rest)
    # train.py's start-up, up to what needs the dataset (every rank reports on it below) or a checkpoint
    cfg, ds = load_configs(rest)
    settings = configure(cfg, ds)[1].engine_settings
    layout, world = settings.layout, settings.layout.world_size
    PHASE.now(f"joining the process group (world {world})")
    join_process_group(cfg.train.dist_timeout_s)
    rank = torch.distributed.get_rank()

    PHASE.now("all-reducing the ranks' numbers")
    # Ranks 0..n-1 sum to n(n-1)/2, on the device and backend training uses.
    total = torch.tensor([float(rank)], device=get_accelerator().device_name())
    torch.distributed.all_reduce(total)
    expected = world * (world - 1) / 2

    PHASE.now("checking data and out_dir")
    token = [uuid.uuid4().hex if rank == 0 else None]
    torch.distributed.broadcast_object_list(token, src=0)
    report = local_checks(cfg, settings.ds, layout, token[0])
    fit = memory_fit(cfg, ds, layout, preflight_args.gpu_gb, report) if rank == 0 else None
    if total.item() != expected:
        report["problems"].append(f"all-reduce gave {total.item():g}, expected {expected:g}")
    PHASE.now("measuring the all-reduce bandwidth")
    busbw = all_reduce_busbw(world)
    check_out_dir_shared(cfg.train.out_dir, report, token[0], rank)
    reports = [None] * world
    torch.distributed.all_gather_object(reports, report)
    for problem, ranks in shared_devices(reports):
        for r in ranks:
            reports[r]["problems"].append(problem)
    if rank == 0:
        print_reports(reports, layout.describe(), cfg.train.out_dir)
        print_bandwidth(busbw, world, preflight_args.min_busbw)
        if fit:
            print(fit)
    leave_process_group()
    if any(r["problems"] for r in reports):
        raise SystemExit(1)


def parse_args(argv) -> tuple:
    """preflight's own arguments, checked, and the rest: train.py's."""
    own = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="Every other argument is train.py's (python train.py --help): --config, --ds_config and "
                            "key=value overrides, as the run it checks takes them.")
    # 10 GB/s: far below NVLink (hundreds) and InfiniBand NDR (about 45), above TCP over 25-100 GbE.
    own.add_argument("--min_busbw", type=float, default=10.0, help="GB/s below which the all-reduce warns (GPUs)")
    own.add_argument("--dry_run", action="store_true", help="start no rank: print and check the groups of --world "
                                                            "ranks, the stages and each rank's parameters")
    own.add_argument("--world", type=int, help="with --dry_run: the number of ranks (GPUs)")
    own.add_argument("--gpus_per_node", type=int, help="with --dry_run: GPUs of a node (default 8)")
    own.add_argument("--gpu_gb", type=float, help="a GPU's memory, against the memory plan (default: the GPU's own; "
                                                   "none on a CPU)")
    args, rest = own.parse_known_args(argv)
    if not args.dry_run and (args.world is not None or args.gpus_per_node is not None):
        exit_bad_input(f"--{'world' if args.world is not None else 'gpus_per_node'} is an option of --dry_run, "
                       f"which checks a layout at that scale without starting a rank; fix: add --dry_run, or leave it "
                       f"out (a launched preflight's world is the launcher's)")
    if args.dry_run and args.gpus_per_node is None:
        args.gpus_per_node = 8
    if args.gpu_gb is not None and not args.gpu_gb > 0:  # NaN included; before any rank starts
        exit_bad_input(f"--gpu_gb {args.gpu_gb}: must be > 0 (a GPU's memory in GB); fix: e.g. --gpu_gb 80, "
                       f"or leave it out to take the GPU's own")
    if not args.dry_run and not args.min_busbw >= 0:  # NaN included
        raise ConfigError(f"--min_busbw {args.min_busbw}: must be >= 0 (GB/s; 0 never warns); fix: pass the "
                          f"bus bandwidth below which to warn, e.g. --min_busbw 10")
    return args, rest


def check_out_dir_shared(out_dir: str, report: dict, token: str, rank: int) -> None:
    """Shared storage: rank 0 leaves a file in out_dir, every rank looks for it, and rank 0 removes it."""
    marker = os.path.join(out_dir, PROBE_DIR, f"shared-{token}")
    if rank == 0 and report["writable"]:
        with open(marker, "w") as f:
            f.write(token)
    torch.distributed.barrier()
    if report["writable"] and not os.path.exists(marker):
        report["problems"].append(f"train.out_dir {out_dir} is not shared with rank 0 (its files are not "
                                  f"visible here): checkpoints need a directory every node mounts at the same path")
    torch.distributed.barrier()  # every rank has looked before rank 0 removes it
    if rank == 0 and os.path.exists(marker):
        os.remove(marker)
    try:  # the probes' folder, once empty: by whichever rank of a node's disk comes last
        os.rmdir(os.path.dirname(marker))
    except OSError:
        pass


def print_dry_run(args, rest: list[str]) -> None:
    from training.dry_run import dry_run

    try:
        for flag, value in (("--world", args.world), ("--gpus_per_node", args.gpus_per_node)):
            if value is None or value < 1:
                raise ConfigError(f"--dry_run needs {flag} N >= 1 (now {value}); fix: e.g. --world 1024 "
                                  f"--gpus_per_node 8")
        cfg, ds = load_configs(rest)
        if cfg.model.vocab_size is None:
            raise ConfigError("--dry_run counts parameters: model.vocab_size is unset (a run takes it from its "
                              "dataset); fix: pass model.vocab_size=N")
        print(dry_run(cfg, ds, args.world, args.gpus_per_node, args.gpu_gb))
    except ConfigError as e:  # no rank started: a tool's refusal, not a job's
        exit_bad_input(e)


def memory_fit(cfg, ds: dict, layout, gpu_gb: float | None, report: dict) -> str | None:
    """The memory plan of the layout against a GPU's memory (`gpu_gb`, else this GPU's; none on a CPU): its line,
    or a problem in `report` naming the layout the planner would choose (training/dry_run.py memory_check)."""
    from training.device import memory_capacity
    from training.dry_run import memory_check
    from training.launch.launcher_env import ranks_on_this_node
    from training.memory_plan import GB

    if gpu_gb is None and get_accelerator().device_name() != "cuda":
        return None
    gpu_gb = gpu_gb or memory_capacity(torch.device("cuda", torch.cuda.current_device()), 1)[0] / GB
    if cfg.model.vocab_size is None:
        try:
            vocab = TokenData(cfg.data.dir, cfg.data.tokenizer, cfg.model.block_size, cfg.data.sources).meta
        except (ValueError, OSError, KeyError):
            return None  # the data's problem is reported already
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab["vocab_size"]))
    try:
        return memory_check(cfg, ds, layout, ranks_on_this_node(), gpu_gb)
    except ConfigError as e:
        report["problems"].append(str(e))
        return None


def local_checks(cfg, ds: dict, layout, token: str) -> dict:
    """This rank's identity and what it can see (the data, out_dir, and the disk and host memory its checkpoints
    need); problems as text, so that every rank gets to report. `ds`: as DeepSpeed is given it (its precision
    resolved)."""
    report = {"rank": torch.distributed.get_rank(), "host": socket.gethostname(),
              "local_rank": int(os.environ["LOCAL_RANK"]), "device": device_name(), "problems": [], "writable": True}
    data = None
    try:
        data = TokenData(cfg.data.dir, cfg.data.tokenizer, cfg.model.block_size, cfg.data.sources)
    except (ValueError, OSError, KeyError) as e:  # ConfigError, and what a damaged dataset's files raise: reported
        report["problems"].append(f"data: {e}")
    probe = os.path.join(cfg.train.out_dir, PROBE_DIR, f"{report['host']}-rank{report['rank']}-{token}")
    try:
        os.makedirs(os.path.dirname(probe), exist_ok=True)
        with open(probe, "w") as f:
            f.write(token)
        os.remove(probe)
    except OSError as e:
        report["writable"] = False
        report["problems"].append(f"train.out_dir {cfg.train.out_dir} is not writable from this node: {e}")
    if data is not None and report["writable"]:
        try:
            resume_dir = resume.find_resume(cfg.train.out_dir, cfg.train.resume)
            start = checkpoint.read_run_state(resume_dir)["step"] if resume_dir else 0
            run_cfg = with_schedule_length(with_vocabulary(cfg, data), ds, layout.world_size, data)
            device_type = get_accelerator().device_name()
            planned = plan(run_cfg.model, ds, layout.world_size, run_cfg.train.mlp_tiles, device_type,
                           run_cfg.train.compile)
            check_checkpoint_room(run_cfg, ds, layout, device_type, planned, count_parameters(run_cfg), start,
                                  resume_dir)
        except ConfigError as e:
            report["problems"].append(str(e))
    return report


def device_name() -> str:
    if get_accelerator().device_name() == "cuda":
        index = torch.cuda.current_device()
        return (f"cuda:{index} ({torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(index).uuid}, "
                f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})")
    return get_accelerator().device_name()


def shared_devices(reports: list[dict]) -> list[tuple[str, list[int]]]:
    """(problem, ranks) for each GPU that more than one rank of a host drives (a wrong CUDA_VISIBLE_DEVICES
    or --num_gpus): they would share its memory and serialize on it."""
    ranks_of = {}
    for r in reports:
        if r["device"].startswith("cuda"):
            ranks_of.setdefault((r["host"], r["device"].split(" (", 1)[1]), []).append(r["rank"])
    return [(f"GPU shared by ranks {ranks}: give each rank its own GPU (--num_gpus, --include, or "
             f"CUDA_VISIBLE_DEVICES)", ranks) for ranks in ranks_of.values() if len(ranks) > 1]


def all_reduce_busbw(world: int, rounds: int = 5) -> float:
    """The all-reduce bus bandwidth in GB/s (NCCL-tests' busbw: bytes x 2(n-1)/n per second, what each link
    carries in a ring), best of a few rounds after a warm-up, on the device training uses."""
    device = get_accelerator().device_name()
    x = torch.ones(BANDWIDTH_MB[device == "cuda"] * 2**20 // 4, device=device)
    torch.distributed.all_reduce(x)  # warm-up: connections and buffers set up
    best = float("inf")
    for _ in range(rounds):
        get_accelerator().synchronize()
        start = time.perf_counter()
        torch.distributed.all_reduce(x)
        get_accelerator().synchronize()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 * 2 * (world - 1) / world / best / 1e9 if world > 1 else float("nan")


def print_bandwidth(busbw: float, world: int, minimum: float) -> None:
    if world == 1:
        print("all-reduce: one rank, nothing to measure")
        return
    print(f"all-reduce bus bandwidth: {busbw:.2f} GB/s ({BANDWIDTH_MB[get_accelerator().device_name() == 'cuda']} MB "
          f"fp32, rank 0's best of 5)")
    if get_accelerator().device_name() == "cuda" and busbw < minimum:
        print(f"WARNING: all-reduce bus bandwidth {busbw:.2f} GB/s is below --min_busbw {minimum:g} GB/s: NCCL may "
              f"be on TCP sockets instead of NVLink/InfiniBand (check NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE, and "
              f"the NCCL_DEBUG=INFO lines)")


def print_reports(reports: list[dict], layout: str, out_dir: str) -> None:
    failed = [r for r in reports if r["problems"]]
    print(f"preflight: {layout}\nhosts: {describe_hosts([r['host'] for r in reports])}")
    for r in reports:
        status = "ok" if not r["problems"] else "FAIL: " + " | ".join(r["problems"])
        print(f"  rank {r['rank']:>4} on {r['host']}, local rank {r['local_rank']}, {r['device']}: {status}")
    if not failed:
        print(f"out_dir {out_dir}: writable and shared by every rank")
    print("preflight passed" if not failed else f"preflight FAILED on {len(failed)} of {len(reports)} ranks",
          flush=True)


if __name__ == "__main__":
    run_rank(main)
