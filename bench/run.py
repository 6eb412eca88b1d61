"""`make bench`: trainpod's costs, each measured side by side with its baseline in one run.

1. Launcher overhead, in one container: the CIFAR-10 example through `trainpod run` vs bare
   `torchrun` (same processes, threads, steps): steady-state samples/s and the time from launch
   to the first completed step. Runs alternate, medians are reported.
2. Collective bandwidth between the two compose nodes: gloo all_reduce bus bandwidth of large
   tensors vs a raw TCP stream between the same two containers.
3. Checkpoints (bench/checkpoint.py, on this host): save()+wait() vs writing the same bytes raw,
   and the training loop's stall per checkpoint vs a synchronous save.
4. Recovery (bench/recovery.py, on this host): from SIGKILL of one rank to the next completed step,
   `trainpod run` (restart, and --recovery in-process) vs bare `torchrun --max-restarts 3` on the same
   job; alternating runs, medians.
5. The examples (bench/examples.py, in the compose nodes): samples/s of each, DDP scaling from 1
   to 2 processes and from 1 to 2 nodes, and JPEG decoding vs the synthetic input.
6. Launchers (bench/launchers.py): from `trainpod job slurm|ssh ... --submit` to the job's first step
   on compose/slurm and compose/ssh, vs `docker compose up` of compose/pai-2node (make demo).
7. Hangs (bench/hangs.py, on this host): from each hang's start (a rank asleep before
   init_process_group, a skipped collective, a SIGSTOP) to the one-line report with --hang-timeout 10;
   the progress signal's and the hang watch's cost on steady samples/s, side by side.
8. The images (bench/images.py, first, as it builds and runs nothing): each flavour's size and
   layers, its cold and warm build times, and the Apex build's time, memory and wheel size.
9. Elastic recovery (bench/elastic.py, on this host with a real etcd): from a lost node to the survivor's
   first step at world 1, per backend (etcd-v3, etcd), `trainpod run` vs bare torchrun with the same rendezvous.
10. Launch phases (bench/launch.py, on this host): a trivial 2-process job, `trainpod run` vs bare
   torchrun, alternating: when the agent starts, the workers start, rank 0 is ready, the group
   finishes, the launcher exits; and the same job on the two compose nodes (2 x 2 processes).
11. The restart round (bench/restart_round.py, on this host): both ranks of a 2-node c10d job exit at once;
   from their exit to the next attempt's ranks running, trainpod's agent vs torch's, alternating.
12. The consistency check (bench/consistency.py, on this host): the fingerprint, once per agent, and the exchange
   after each rendezvous round on a real TCPStore, against one set and get per node.
13. The network check (bench/netcheck.py, on this host): --netcheck's wall time after a rendezvous round at 2 and 3
   nodes over loopback, beside a Python process's start with torch.
14. Stragglers (bench/stragglers.py, on this host): from a rank turning slow (its own work doubled) to its agent's
   line at the default --straggler-window, and what progress.measure()'s hooks cost a step, side by side.
15. The metrics endpoint (bench/metrics.py, on this host): the CIFAR-10 example with --metrics-port scraped every
   second against the same run without it, alternating: samples/s and the agent's CPU.
16. Recovery by world size (bench/recovery_scale.py, on this host): recovery.py's kill at 2, 4 and 8 ranks, in-process
   and restart.
17. Peer copies (bench/peer_copies.py, on this host): a checkpoint's save without and with --peer-copies, and its load
   from the disk and from a peer's memory.
18. A spare's takeover by world size (bench/spare_scale.py, on this host with a real etcd): a lost node to the first
   step at the same world again, the survivor and a waiting spare, at 1, 2, 4 and 8 ranks a node.
19. A node while its ranks train (bench/idle.py, on this host): the CPU of a 2-node job's launch layers and etcd
   while its paced ranks wait, `trainpod run` vs bare torchrun with the same rendezvous.
20. DDP's gradient buckets (bench/ddp_buckets.py, on this host): a rank's CPU a step of the CIFAR-10 model on gloo
   with one bucket per parameter and with trainpod.train.distributed.reproducible_ddp, both resumed bit-identically.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import examples  # bench/ is on the path: python3 bench/run.py
import launch
import launchers
import results_page
from hangs import report as hangs_report
from recovery import report as recovery_report
from restart_round import bench as restart_round_bench
from restart_round import report as restart_round_report

import images

HERE = Path(__file__).resolve().parent
COMPOSE = ["docker", "compose", "-f", str(HERE / "compose.yaml")]
ROUNDS = 3
EXAMPLE_ARGS = "--output-dir /tmp/bench --epochs 8 --max-steps 80 --synthetic-samples 8192 --log-every 20"
TCP_MB = 1024


def exec_in(service: str, command: str) -> subprocess.Popen:
    return subprocess.Popen([*COMPOSE, "exec", "-T", service, "sh", "-c", command],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, what: str) -> str:
    output, _ = process.communicate(timeout=900)
    if process.returncode != 0:
        sys.exit(f"bench: {what} failed ({process.returncode}):\n{output[-3000:]}")
    return output


def tagged(output: str, tag: str) -> dict:
    lines = [line.split(tag, 1)[1] for line in output.splitlines() if tag in line]
    if not lines:
        sys.exit(f"bench: no '{tag}' line in:\n{output[-3000:]}")
    return json.loads(lines[-1])


def launch_once(variant: str, port: int) -> dict:
    if variant == "trainpod":
        run = f"trainpod run --nproc-per-node 2 --master-port {port} --example cifar10-ddp -- {EXAMPLE_ARGS}"
    else:
        run = f"torchrun --nproc-per-node 2 --master-port {port} -m trainpod.examples.cifar10 {EXAMPLE_ARGS}"
    output = finish(exec_in("node0", f"date +%s.%N; exec {run}"), variant)
    launched = float(output.splitlines()[0])
    metrics = tagged(output, "trainpod-metrics: ")
    return {"samples_per_sec": metrics["samples_per_sec"], "to_first_step_s": metrics["first_step_unix"] - launched}


def bench_launcher() -> dict:
    runs: dict[str, list[dict]] = {"trainpod": [], "torchrun": []}
    for round_ in range(ROUNDS):
        order = ("trainpod", "torchrun") if round_ % 2 == 0 else ("torchrun", "trainpod")
        for variant in order:
            runs[variant].append(launch_once(variant, 29510 + len(runs[variant]) + (10 if variant == "torchrun" else 0)))
    return {variant: {key: statistics.median(r[key] for r in results) for key in results[0]} for variant, results in runs.items()}


def bench_tcp(port: int) -> float:
    server = exec_in("node0", f"python3 /bench/tcp_stream.py serve {port}")
    finish(exec_in("node1", f"python3 /bench/tcp_stream.py send node0 {port} {TCP_MB}"), "tcp send")
    return tagged(finish(server, "tcp serve"), "bench-tcp: ")["bytes_per_s"]


def bench_allreduce(port: int) -> dict:
    nodes = [exec_in(f"node{rank}", f"trainpod run --nnodes 2 --node-rank {rank} --master-addr node0 --master-port {port} "
                                    "-- python3 /bench/allreduce.py") for rank in (0, 1)]
    outputs = [finish(node, f"all_reduce node{rank}") for rank, node in enumerate(nodes)]
    # Global rank 0 is wherever the rendezvous put it (the lower address), not necessarily node0.
    return tagged("\n".join(outputs), "bench-allreduce: ")


def metrics_of(service: str, command: str) -> dict:
    return tagged(finish(exec_in(service, command), command), "trainpod-metrics: ")


def metrics_of_pair(command: str, what: str) -> dict:
    nodes = [exec_in(f"node{rank}", command.format(rank=rank)) for rank in (0, 1)]
    return tagged("\n".join(finish(node, f"{what} node{rank}") for rank, node in enumerate(nodes)), "trainpod-metrics: ")


def bench_examples() -> dict:
    return examples.measure(metrics_of, metrics_of_pair, lambda command: finish(exec_in("node0", command), "prepare"))


def bench_checkpoint() -> dict:
    output = subprocess.run([sys.executable, str(HERE / "checkpoint.py")], capture_output=True, text=True, check=True).stdout
    return tagged(output, "bench-checkpoint: ")


def bench_recovery() -> dict:
    done = subprocess.run([sys.executable, str(HERE / "recovery.py")], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: recovery failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return tagged(done.stdout, "bench-recovery: ")


def bench_hangs() -> dict:
    done = subprocess.run([sys.executable, str(HERE / "hangs.py")], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: hangs failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return tagged(done.stdout, "bench-hangs: ")


def bench_elastic() -> str:
    done = subprocess.run([sys.executable, str(HERE / "elastic.py")], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: elastic failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout[done.stdout.index("elastic recovery:"):].rstrip()


def bench_launch() -> str:
    done = subprocess.run([sys.executable, str(HERE / "launch.py")], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: launch failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout.rstrip()


def main() -> int:
    image_report = images.report()
    print(image_report, flush=True)
    print("\n" + bench_launch(), flush=True)
    # The consistency check's cost (bench/consistency.py records its own section).
    subprocess.run([sys.executable, str(HERE / "consistency.py")], check=True)
    subprocess.run([sys.executable, str(HERE / "netcheck.py")], check=True)  # records its own section too
    checkpoint = bench_checkpoint()
    recovery = bench_recovery()
    restart_round = restart_round_bench(5)
    elastic = bench_elastic()
    hangs = bench_hangs()
    subprocess.run([sys.executable, str(HERE / "stragglers.py")], check=True)  # records its own section
    subprocess.run([sys.executable, str(HERE / "metrics.py")], check=True)  # records its own section
    subprocess.run([sys.executable, str(HERE / "recovery_scale.py")], check=True)  # records its own section
    subprocess.run([sys.executable, str(HERE / "peer_copies.py")], check=True)  # records its own section
    subprocess.run([sys.executable, str(HERE / "spare_scale.py")], check=True)  # records its own section
    subprocess.run([sys.executable, str(HERE / "idle.py")], check=True)  # records its own section
    subprocess.run([sys.executable, str(HERE / "ddp_buckets.py")], check=True)  # records its own section
    subprocess.run([*COMPOSE, "up", "-d", "--no-build"], check=True, capture_output=True)
    try:
        launcher = bench_launcher()
        launch_2node = launch.measure_compose(exec_in, finish)
        tcp = [bench_tcp(29700)]
        allreduce = bench_allreduce(29600)
        tcp.append(bench_tcp(29701))
        example_figures = bench_examples()
    finally:
        subprocess.run([*COMPOSE, "down", "-t", "2"], capture_output=True)

    trainpod, bare = launcher["trainpod"], launcher["torchrun"]
    overhead = "\n".join([
        f"launcher overhead (one container, 2 processes, CIFAR-10 example, median of {ROUNDS} alternating runs)",
        f"  {'':28}{'trainpod run':>14}{'bare torchrun':>15}{'ratio':>8}",
        f"  {'steady-state samples/s':28}{trainpod['samples_per_sec']:>14.1f}{bare['samples_per_sec']:>15.1f}"
        f"{trainpod['samples_per_sec'] / bare['samples_per_sec']:>8.3f}",
        f"  {'launch to first step (s)':28}{trainpod['to_first_step_s']:>14.2f}{bare['to_first_step_s']:>15.2f}"
        f"{trainpod['to_first_step_s'] / bare['to_first_step_s']:>8.3f}",
        f"  extra time to the first step: {trainpod['to_first_step_s'] - bare['to_first_step_s']:+.2f} s"])

    tcp_rate = statistics.median(tcp)
    bandwidth = [f"bandwidth between the two compose nodes (raw TCP: median of {len(tcp)} streams of {TCP_MB} MiB)",
                 f"  {'size':>10}{'all_reduce busbw':>20}{'raw TCP':>14}{'ratio':>8}"]
    for result in allreduce["results"]:
        busbw = result["busbw_bytes_per_s"]
        bandwidth.append(f"  {result['size_mb']:>7} MiB{busbw / 1e9:>16.2f} GB/s{tcp_rate / 1e9:>9.2f} GB/s{busbw / tcp_rate:>8.3f}")

    c = checkpoint
    checkpoints = "\n".join([
        f"checkpoints of a {c['state_bytes'] / 2**20:.0f} MiB state on this host (median of 5 interleaved runs)",
        f"  save()+wait() {c['save_s'] * 1e3:.0f} ms vs serialise+write+fsync raw {c['raw_s'] * 1e3:.0f} ms: "
        f"ratio {c['save_s'] / c['raw_s']:.2f} (goal <= 1.2)",
        f"  stall inside save() {c['stall_s'] * 1e3:.1f} ms vs synchronous torch.save+fsync {c['sync_s'] * 1e3:.0f} ms: "
        f"ratio {c['stall_s'] / c['sync_s']:.3f} (goal <= 0.1)"])

    round_text, examples_text = restart_round_report(restart_round), examples.report(example_figures)
    launchers_text = launchers.report(launchers.measure())
    for text in (overhead, launch_2node, "\n".join(bandwidth), checkpoints, recovery_report(recovery), round_text, elastic,
                 examples_text, launchers_text, hangs_report(hangs)):
        print("\n" + text)
    # recovery.py, elastic.py, hangs.py and launch.py ran as commands of their own and wrote their sections of
    # docs/results.md; the rest ran here, and this run writes theirs.
    results_page.record("images", image_report)
    results_page.record("launcher-overhead", overhead)
    results_page.record("launch-compose", launch_2node)
    results_page.record("bandwidth", "\n".join(bandwidth))
    results_page.record("checkpoints", checkpoints)
    results_page.record("restart-round", round_text)
    results_page.record("examples", examples_text)
    results_page.record("launchers", launchers_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
