"""The GPU matrix: every bundled example natively on a CUDA host, with samples/s, checksums and resume checks.

    python3 bench/gpu_matrix.py [--out DIR] [--cases NAME,...] [--list]

For a machine with CUDA and no Docker (the examples' GPU paths never run in CI): each case is
`trainpod run --no-supervise` of a bundled example, one process per visible GPU, its metrics read
from metrics.json. Prints one line per case and writes DIR/gpu-matrix.json. The resume cases kill
a rank mid checkpoint write (TRAINPOD_FAILPOINTS; torchrun restarts the worker group) or stop it
with SIGTERM and run it again, and compare the final weights with the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import results_page

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "entrypoint"))
sys.path.insert(0, str(ROOT / "tests"))

CIFAR = ["--synthetic-samples", "8192", "--epochs", "2", "--log-every", "32"]
IMAGENET = ["--image-size", "224", "--batch-size", "64", "--max-steps", "60", "--log-every", "20", "--synthetic-classes", "100"]
RESUME = ["--synthetic-samples", "4096", "--epochs", "1", "--checkpoint-every", "8", "--log-every", "16"]

# name -> (example, args)
CASES = {
    "cifar10-ddp-nccl": ("cifar10-ddp", CIFAR),
    "cifar10-dp": ("cifar10-dp", CIFAR),
    "amp-fp16-sgd": ("cifar10-ddp-amp", [*CIFAR, "--apex", "off"]),
    "amp-bf16-sgd": ("cifar10-ddp-amp", [*CIFAR, "--apex", "off", "--amp-dtype", "bfloat16"]),
    "amp-fp16-adam": ("cifar10-ddp-amp", [*CIFAR, "--apex", "off", "--optimizer", "adam", "--lr", "0.003"]),
    "amp-fp16-apex-adam": ("cifar10-ddp-amp", [*CIFAR, "--apex", "on", "--optimizer", "adam", "--lr", "0.003"]),
    "amp-fp16-apex-sgd": ("cifar10-ddp-amp", [*CIFAR, "--apex", "on"]),
    "amp-bf16-apex-adam": ("cifar10-ddp-amp", [*CIFAR, "--apex", "on", "--amp-dtype", "bfloat16", "--optimizer", "adam",
                                               "--lr", "0.003"]),
    "imagenet-synthetic-224": ("imagenet-ddp", [*IMAGENET, "--synthetic-samples", "2048"]),
    "imagenet-jpeg-224": ("imagenet-ddp", [*IMAGENET, "--data-dir", "{jpegs}"]),
}
RESUME_CASES = {
    "resume-cifar10-kill": ("cifar10-ddp", RESUME, "kill", 24),
    "resume-cifar10-sigterm": ("cifar10-ddp", [*RESUME, "--log-every", "4"], "sigterm", 20),
    "resume-amp-fp16-kill": ("cifar10-ddp-amp", [*RESUME, "--apex", "off"], "kill", 24),
    "resume-imagenet-kill": ("imagenet-ddp", ["--image-size", "64", "--batch-size", "32", "--synthetic-samples", "1024",
                                              "--synthetic-classes", "10", "--checkpoint-every", "8", "--max-steps", "32"],
                             "kill", 16),
}


def trainpod_run(example: str, args: list[str], out: Path, env: dict[str, str] | None = None, **popen):
    command = [sys.executable, "-m", "trainpod", "run", "--no-supervise", "--master-port", str(29500 + os.getpid() % 1000),
               "--example", example, "--", *args]
    path = os.pathsep.join(filter(None, [str(ROOT / "entrypoint"), os.environ.get("PYTHONPATH")]))  # Apex may be there
    env = {**os.environ, "PYTHONPATH": path, "TRAINPOD_OUTPUT_DIR": str(out), "TRAINPOD_PROGRESS": "lines", **(env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finish(process, log: Path, timeout: float = 540) -> int:
    output, _ = process.communicate(timeout=timeout)
    log.write_text(output)
    return process.returncode


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def run_case(name: str, example: str, args: list[str], work: Path) -> dict:
    out = work / name
    started = time.monotonic()
    code = finish(trainpod_run(example, args, out), work / f"{name}.log")
    result = {"case": name, "code": code, "wall_s": round(time.monotonic() - started, 1)}
    if code == 0:
        m = metrics(out)
        result.update({k: m[k] for k in ("precision", "apex", "optimizer", "world_size", "gpus_per_process", "steps",
                                          "samples_per_sec", "final_loss", "test_accuracy", "checksum")})
        result["loss_first"] = m["loss_curve"][0][1]
        result["checksums_agree"] = len(set(m["rank_checksums"])) == 1
    return result


def run_resume(name: str, example: str, args: list[str], how: str, step: int, work: Path) -> dict:
    reference = work / f"{name}-reference"
    code = finish(trainpod_run(example, [*args, "--checkpoint-dir", str(reference / "ckpt")], reference), work / f"{name}-ref.log")
    result = {"case": name, "how": how, "at_step": step, "reference_code": code}
    if code:
        return result
    out = work / name
    checkpoints = out / "ckpt"
    if how == "kill":
        # The rank SIGKILLs itself while step STEP's checkpoint is half written; torchrun restarts it.
        code = finish(trainpod_run(example, [*args, "--checkpoint-dir", str(checkpoints)], out,
                                   env={"TRAINPOD_FAILPOINTS": f"checkpoint-write@{step}"}), work / f"{name}.log")
        result["restarted"] = "restarting the worker group" in (work / f"{name}.log").read_text()
    else:
        process = trainpod_run(example, [*args, "--checkpoint-dir", str(checkpoints)], out, start_new_session=True)
        lines = []
        for line in process.stdout:
            lines.append(line)
            reached = re.search(r" step (\d+)/", line)
            if reached and int(reached.group(1)) >= step:
                os.killpg(process.pid, signal.SIGTERM)  # as docker stop would: the agent and its ranks
                break
        rest, _ = process.communicate(timeout=120)
        (work / f"{name}-stop.log").write_text("".join(lines) + rest)
        result["stop_code"] = process.returncode  # 143: stopped after a step, that step checkpointed
        code = finish(trainpod_run(example, [*args, "--checkpoint-dir", str(checkpoints)], out), work / f"{name}.log")
    result["code"] = code
    if code == 0:
        result["identical"] = metrics(out)["checksum"] == metrics(reference)["checksum"]
        result["checksum"] = metrics(out)["checksum"][:16]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/gpu-matrix")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true")
    options = parser.parse_args()
    everything = [*CASES, *RESUME_CASES]
    if options.list:
        print("\n".join(everything))
        return 0
    chosen = options.cases.split(",") if options.cases else everything
    work = Path(options.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    jpegs = work / "jpegs"
    if any("jpeg" in name for name in chosen) and not jpegs.exists():
        from fixtures.jpeg_tree import make_jpeg_tree

        for split in ("train", "val"):
            make_jpeg_tree(jpegs / split, classes=[f"n{i:04d}" for i in range(100)], per_class=40 if split == "train" else 8,
                           size=(320, 256), seed=1 if split == "train" else 2)
    results = []
    for name in chosen:
        if name in CASES:
            example, args = CASES[name]
            result = run_case(name, example, [a.replace("{jpegs}", str(jpegs)) for a in args], work)
        else:
            result = run_resume(name, *RESUME_CASES[name], work)
        results.append(result)
        print("gpu-matrix: " + json.dumps(result), flush=True)
        (work / "gpu-matrix.json").write_text(json.dumps(results, indent=2) + "\n")
    results_page.record("gpu-matrix", "\n".join("gpu-matrix: " + json.dumps(result) for result in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
