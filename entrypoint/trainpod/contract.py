"""What crosses between trainpod's processes, named once: the variables, the files, the exit codes.

    trainpod run (the launcher)          -- TRAINPOD_RUN_SPEC: the RunSpec, JSON (trainpod.runspec) -->
      supervisord -> trainpod.supervisor.job        -- the same RunSpec, and the launch plan's variables -->
        the agent (torchrun's, trainpod.agent) -- the ranks' variables (RunSpec.rank_env) -->
          the ranks (the training script; trainpod's library: progress, checkpoint, preemption, ...)

A user's setting (--term-grace, TRAINPOD_TERM_GRACE) is declared in trainpod.settings, and an
example's option in its module: those declarations own their variables. Everything else that one
trainpod process writes and another reads is named here, so that a reader finds who writes a
variable and who reads it by searching for one constant, and a test (tests/unit/test_contract.py)
fails when a TRAINPOD_* name is written as a literal anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- variables: written by one process, read by another -------------------------------------------

RUN_SPEC_VAR = "TRAINPOD_RUN_SPEC"  # the launcher -> job -> agent: the RunSpec as JSON
NODE_RANK_VAR = "TRAINPOD_NODE_RANK"  # the launch plan -> agent, ranks: the node's label in log prefixes
SUPERVISOR_DIR_VAR = "TRAINPOD_SUPERVISOR_DIR"  # run_supervised -> job, agent, listener: where budget.json is
PROGRESS_DIR_VAR = "TRAINPOD_PROGRESS_DIR"  # the agent -> ranks: where each rank's progress file goes
AGENT_PID_VAR = "TRAINPOD_AGENT_PID"  # the agent -> ranks: the process that reads their stacks on a hang
INPROCESS_MAX_VAR = "TRAINPOD_INPROCESS_MAX"  # the agent -> keepers: in-process replacements per rank
INPROCESS_GENERATION_VAR = "TRAINPOD_INPROCESS_GENERATION"  # a keeper -> its rank: 0, then 1, 2, ...
RDZV_BASE_ID_VAR = "TRAINPOD_RDZV_BASE_ID"  # the job -> agent: the etcd rendezvous id before its generation
RDZV_GENERATION_VAR = "TRAINPOD_RDZV_GENERATION"  # the job -> agent: this run's generation of it
FAILPOINTS_VAR = "TRAINPOD_FAILPOINTS"  # tests -> any process: faults to inject (trainpod.failpoints)
# The example options that trainpod's own processes read too (the examples' settings declare them).
OUTPUT_DIR_VAR = "TRAINPOD_OUTPUT_DIR"  # metrics, and the hang watch's stacks in <output>/hangs
CHECKPOINT_DIR_VAR = "TRAINPOD_CHECKPOINT_DIR"  # checkpoints (the directory lock holds it)
WORKERS_VAR = "TRAINPOD_WORKERS"  # DataLoader workers per rank (/dev/shm is checked for them)

# --- files ---------------------------------------------------------------------------------------

BUDGET_FILE = "budget.json"  # in the supervisor's directory: the restart budget (trainpod.supervisor.restarts)
SUPERVISORD_PIDFILE = "supervisord.pid"  # in the supervisor's directory (trainpod.supervisor.orphans)
OUTCOME_FILE = "outcome.json"  # in the supervisor's directory: the code run_supervised exits with
STOP_SIGNAL_FILE = "stop-signal"  # in the supervisor's directory: the signal run_supervised passed on
LOCK_FILE = ".trainpod-job.lock"  # in each output and checkpoint directory (trainpod.supervisor.dirlock)
HANGS_DIR = "hangs"  # under the output directory: the stacks of a hang
STRAGGLERS_FILE = "stragglers.jsonl"  # under the output directory: the straggler watch's events
RECORDS_DIR = "records"  # under the output directory: each node's run records (trainpod.records)
REPORT_FILE = "report.html"  # under the output directory: what `trainpod report` writes (trainpod.launcher.report)
PROGRESS_DIR = "progress"  # in the supervisor's directory: the ranks' progress files (it outlives an agent)
PEER_COPIES_FILE = "peer-copies.json"  # in the progress directory: every node's copy server, by group rank (the
# agent writes it each round before it starts the ranks, which read it: a rank forked from the warm server has the
# server's environment, not what the agent set after the server started)

# --- the job's command: what run_supervised gives supervisord ---------------------------------------

JOB_MODULE = "trainpod.supervisor.job"
# Room in the job's command line for the titles of the processes forked from it: the node's fork server is a copy
# of the job's process (trainpod.agent.zygote), every rank a copy of that, and each shows in `ps` only the command
# line that fits where the job's argv was (trainpod.proctitle). The job blanks the argument as it starts.
JOB_TITLE_ROOM = 4096


def job_command(executable: str) -> list[str]:
    """The job's command, as supervisord starts it (and restarts it)."""
    return [executable, "-m", JOB_MODULE, "--title-room=" + "." * JOB_TITLE_ROOM]


# --- peer copies: HTTP from a rank to another node's agent (trainpod.agent.peercopy) -----------------

PEER_COPY_PATH = "/copy"  # PUT: a committed checkpoint's bytes, its manifest in PEER_COPY_MANIFEST_HEADER
PEER_MANIFEST_PATH = "/manifest"  # GET: the manifest of the copy held (404: none)
PEER_DATA_PATH = "/data"  # GET ?step=N: the bytes of the copy held, if it is still step N (409: another)
PEER_JOB_HEADER = "X-Trainpod-Job"  # every request: the job's run id (TORCHELASTIC_RUN_ID); another job's is refused
PEER_COPY_MANIFEST_HEADER = "X-Trainpod-Manifest"  # the manifest, JSON on one line

# --- exit codes ----------------------------------------------------------------------------------

EXIT_OK = 0
EXIT_USAGE = 64  # EX_USAGE: bad or conflicting command-line flags
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the master could not be reached within the preflight timeout
EXIT_CANTCREAT = 73  # EX_CANTCREAT: a checkpoint cannot be written (no space, no permission): every retry fails alike
EXIT_CONFIG = 78  # EX_CONFIG: the environment (cluster variables) is wrong or incomplete
EXIT_HANG = 124  # what `timeout` exits with: a hang ended the restart budget
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped (docker stop, pre-emption), after a checkpoint


@dataclass(frozen=True)
class ExitCode:
    code: str  # "64", or "128+N", "other"
    meaning: str
    retried: str  # whether trainpod (and a scheduler that reads the code) should try again


# The one table: `trainpod --help`, the README's and the manual's tables are made from it.
EXIT_CODES = (
    ExitCode(str(EXIT_OK), "success", ""),
    ExitCode(str(EXIT_USAGE), "usage error: a bad or conflicting flag (one line names it)", "no: fix the command"),
    ExitCode(str(EXIT_UNAVAILABLE), "the master (or etcd, --rdzv-endpoint) did not resolve or answer within "
             "--connect-timeout, or its port is taken; an elastic job's nodes stayed fewer than MIN", "yes: transient"),
    ExitCode(str(EXIT_UNAVAILABLE), "the master went away after the job started and did not come back within "
             "--rejoin-timeout", "no (said in one line)"),
    ExitCode(str(EXIT_CANTCREAT), "a checkpoint could not be written: no space left (ENOSPC, EDQUOT, EFBIG) or no "
             "permission (EACCES, EPERM, EROFS)", "no: free space or fix the permissions"),
    ExitCode(str(EXIT_CONFIG), "configuration error: a cluster variable is missing or malformed, etcd lacks the API "
             "the backend needs or refuses this node's TLS, user or permissions, the checkpoint or output directory "
             "cannot be used or is held by another job, a checkpoint does not fit the job or holds more than tensors "
             "and plain values, a package is missing (one line names it)", "no: fix the job"),
    ExitCode(str(EXIT_HANG), "a rank hung: the hang watch (--hang-timeout) wrote every rank's stack and stopped the "
             "ranks; the same hang twice without progress ends the job", "within the budget"),
    ExitCode(str(EXIT_INTERRUPTED), "stopped by SIGINT (Ctrl-C); the ranks checkpoint as for SIGTERM", "no"),
    ExitCode(str(EXIT_TERMINATED), "stopped by SIGTERM, on this node or on another node of the job (docker stop, "
             "pre-emption), after the ranks checkpointed", "no"),
    ExitCode("128+N", "a rank was killed by signal N (137: SIGKILL; the kernel's OOM killer is named, with the "
             "cgroup's limit, and the same OOM twice is not restarted)", "yes, within the budget"),
    ExitCode("other", "the first failing rank's own exit code", "yes, within the budget; never the same failure twice"),
)
