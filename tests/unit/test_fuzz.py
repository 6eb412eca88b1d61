"""Fuzz (hypothesis) over every environment parser and every job renderer: whatever text the variables and
flags hold, the only way out besides success is a TrainpodError of one line, never a traceback.

The values are arbitrary text (control characters, lone surrogates as undecodable bytes of an environment
give them, huge numbers, other scripts' digits) mixed with plausible ones, so that one odd value meets
otherwise good ones and the parsers get past their first check.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainpod import environments, jobs
from trainpod.environments.slurm import JOB_ID_VARS, NODELIST_VARS
from trainpod.environments.torchrun import DETECT_VARS, RDZV_VARS
from trainpod.errors import TrainpodError
from trainpod.examples import EXAMPLES
from trainpod.launcher.resolve import Options, resolve_topology

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Any text, lone surrogates included (os.environ holds an undecodable byte as one).
ANY = st.text(st.characters(exclude_categories=()), max_size=30)
PLAUSIBLE = st.one_of(
    st.from_regex(r"[+-]?[0-9]{1,25}", fullmatch=True),
    st.from_regex(r"[0-9]{1,6}(:[0-9]{1,6})?(,[0-9]{1,6}){0,2}", fullmatch=True),
    st.from_regex(r"[a-z]{1,6}(\[[0-9]{1,6}(-[0-9]{1,6})?(,[0-9]{1,3}(-[0-9]{1,6})?){0,3}\])?[a-z0-9]{0,3}(,[a-z]{1,4}(\[[0-9,-]{1,9}\])?){0,2}",
                  fullmatch=True),
    st.from_regex(r"([a-z]{1,3}\[[0-9]{1,5}-[0-9]{1,5}\]){1,4}", fullmatch=True),  # bracket groups multiply
    st.from_regex(r"(https?://)?([a-z]{1,5}@)?[a-z0-9.]{1,10}(:[0-9]{0,6})?(,[a-z0-9.]{1,8}:[0-9]{1,5}){0,2}", fullmatch=True),
    st.sampled_from(["", " ", "worker", "worker_0", "ps", "SyncPort", "ssh", "http", "c10d", "etcd", "etcd-v3", "auto", "gpu", "1:4",
                     "4:1", "0", "-1", "1e3", "٢", "1_0", "65536", "99999999999999999999999", "10.0.0.1", "[::1]", "::1", "fd00::2",
                     "node[01-99999]", "n[1-65535],m[1-65535]", "a[1-300]b[1-300]", "[", "]", "a[]", "a[1-2", "x,,y", "29877,22353"]),
)
VALUE = st.one_of(ANY, PLAUSIBLE)


def one_line(error: TrainpodError) -> None:
    message = str(error)
    assert message and len(message.splitlines()) == 1 and message == message.strip(), repr(message)
    assert error.exit_code in (64, 69, 73, 78), error.exit_code


# --- the environment parsers ----------------------------------------------------------------------
# Each source's variables as its cluster sets them (the parser gets past its first checks), then some of
# them replaced by any value, and some left out.

def mutated(base, names):
    """`base` with some variables of `names` set to any value and some removed."""
    @st.composite
    def build(draw):
        env = dict(draw(base) if isinstance(base, st.SearchStrategy) else base)
        env.update(draw(st.dictionaries(st.sampled_from(names), VALUE, max_size=3)))
        for name in draw(st.lists(st.sampled_from(sorted(env) or [""]), max_size=2)):
            env.pop(name, None)
        return env
    return build()


ROLE = st.one_of(st.sampled_from(["worker", "worker_0", "ps"]), ANY)
LABEL = st.one_of(st.sampled_from(["SyncPort", "ssh", "http"]), ANY)


@st.composite
def pai_base(draw):
    role, other, label = draw(ROLE), draw(ROLE), draw(LABEL)
    env = {"PAI_CURRENT_TASK_ROLE_NAME": role, "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": "1", f"PAI_TASK_ROLE_TASK_COUNT_{role}": "2",
           f"PAI_TASK_ROLE_TASK_COUNT_{other}": "1", f"PAI_HOST_IP_{role}_0": "10.0.0.1", f"PAI_PORT_LIST_{role}_0_ssh": "22",
           f"PAI_PORT_LIST_{role}_0_{label}": "29877,22353", f"PAI_{other}_0_{label}_PORT": "5000",
           "PAI_TASK_ROLE_LIST": draw(st.one_of(st.just(f"{role},{other}"), VALUE)), "PAI_JOB_NAME": "alice~job",
           "FC_FRAMEWORK_ATTEMPT_ID": "0"}
    if draw(st.booleans()):
        env["TRAINPOD_PAI_ROLES"] = draw(st.one_of(st.just(f"{other},{role}"), VALUE))
    if draw(st.booleans()):
        env["TRAINPOD_PAI_PORT_LABEL"] = draw(st.one_of(st.just(label), VALUE))
    return env


PAI_NAMES = ["PAI_CURRENT_TASK_ROLE_NAME", "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX", "PAI_TASK_INDEX", "PAI_TASK_ROLE_TASK_COUNT_worker",
             "PAI_HOST_IP_worker_0", "PAI_PORT_LIST_worker_0_SyncPort", "PAI_worker_0_SyncPort_PORT", "PAI_TASK_ROLE_LIST",
             "PAI_JOB_TASK_ROLE_LIST", "PAI_JOB_NAME", "FC_FRAMEWORK_ATTEMPT_ID", "TRAINPOD_PAI_ROLES", "TRAINPOD_PAI_PORT_LABEL"]
SLURM_NAMES = [*JOB_ID_VARS, *NODELIST_VARS, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "MASTER_PORT",
               "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_TASKS_PER_NODE",
               "SLURM_LOCALID"]
SLURM_BASE = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
              "SLURM_GPUS_ON_NODE": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
              "SLURM_LOCALID": "0"}
TORCHRUN_NAMES = [*DETECT_VARS, *RDZV_VARS, "WORLD_SIZE", "RANK", "LOCAL_RANK", "PET_NPROC_PER_NODE"]
TORCHRUN_BASE = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "MASTER_ADDR": "trainer-0", "MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "auto",
                 "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "trainer-0:23456", "PET_RDZV_ID": "job", "PET_MAX_RESTARTS": "3"}
ETCD_NAMES = ["TRAINPOD_RDZV_BACKEND", "TRAINPOD_RDZV_ENDPOINT", "TRAINPOD_RDZV_ID", "TRAINPOD_RDZV_CONF"]
ETCD_BASE = {"TRAINPOD_RDZV_BACKEND": "etcd-v3", "TRAINPOD_RDZV_ENDPOINT": "etcd1:2379,etcd2:2379"}

ENVS = {"pai": mutated(pai_base(), PAI_NAMES), "slurm": mutated(SLURM_BASE, SLURM_NAMES),
        "torchrun": mutated(TORCHRUN_BASE, TORCHRUN_NAMES), "etcd": mutated(ETCD_BASE, ETCD_NAMES),
        "single": mutated({}, SLURM_NAMES[:2] + TORCHRUN_NAMES[:2] + ETCD_NAMES[:1])}


def test_every_environment_is_fuzzed():
    assert set(ENVS) == set(environments.REGISTRY)


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(environments.REGISTRY))
@FUZZ
@given(data=st.data())
def test_an_environment_parser_never_raises_anything_but_one_line(source, data):
    cls = environments.REGISTRY[source]
    env = data.draw(ENVS[source], label="env")
    flags = data.draw(st.dictionaries(st.sampled_from([s.name for s in cls.settings] + ["rdzv_endpoint"]), VALUE), label="flags")
    try:
        cls.detect(env)
        cls.present(env)
        discovery = cls(env, flags).discover()
    except TrainpodError as error:
        one_line(error)
        return
    for message in (*discovery.missing.values(), *discovery.warnings):
        assert len(message.splitlines()) == 1, repr(message)


TOPOLOGY_FLAGS = ["nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "backend", "interface", "rdzv_backend",
                  "rdzv_endpoint", "rdzv_id", "rdzv_conf", "source"]


@pytest.mark.slow
@FUZZ
@given(env=st.one_of(*ENVS.values()), flags=st.dictionaries(st.sampled_from(TOPOLOGY_FLAGS), VALUE, max_size=4))
def test_the_whole_resolution_never_raises_anything_but_one_line(env, flags):
    # resolve_names=False: no DNS; the interface is picked from this host's own addresses and routes.
    try:
        resolve_topology(Options(**flags), env, resolve_names=False)
    except TrainpodError as error:
        one_line(error)


# --- the job renderers ----------------------------------------------------------------------------

# A job each scheduler takes, then some of its settings (flag or variable) replaced by any value.
GOOD = {"name": "job-1", "image": "registry:5000/team/trainpod:cpu", "cpus": "8", "memory_mb": "4096", "shm_mb": "2048",
        "term_grace": "25", "gpus": "2", "backend": "gloo", "nproc_per_node": "2", "rdzv_endpoint": "etcd1:2379,etcd2:2379"}
OWN_GOOD = {"openpai": {"pai_role": "trainer", "pai_port_label": "Sync", "virtual_cluster": "vc1"},
            "kubeflow": {"namespace": "team", "master_port": "23456", "backoff_limit": "3"},
            "slurm": {"partition": "gpu", "time": "1:00:00", "output": "out-%j.log"},
            "ssh": {"hosts": "h1,alice@h2:2222", "master_addr": "10.0.0.1", "master_port": "29500", "log_dir": "logs"}}


@st.composite
def job_request(draw, scheduler):
    own = jobs.REGISTRY[scheduler].settings
    by_name = {s.name: s for s in (*jobs.SETTINGS, *own) if s.name != "submit"}
    example = draw(st.sampled_from(sorted(EXAMPLES)))
    good = {**GOOD, **OWN_GOOD[scheduler]}
    if EXAMPLES[example].min_nodes is None:
        del good["rdzv_endpoint"]
    chosen = draw(st.lists(st.sampled_from(sorted(good)), unique=True))
    given = {name: good[name] for name in chosen}
    if scheduler == "ssh" and draw(st.integers(0, 9)):
        given["hosts"] = good["hosts"] if EXAMPLES[example].max_nodes is None else "h1"
    given.update(draw(st.dictionaries(st.sampled_from(sorted(by_name)), VALUE, max_size=3)))
    flags, env = {}, {}
    for name, value in given.items():
        if by_name[name].var and draw(st.booleans()):
            env[by_name[name].var] = value
        else:
            flags[name] = value
    arg = st.one_of(ANY, st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=10),
                    st.sampled_from(["--epochs", "1", "--x=y"]))
    return example, flags, env, draw(st.lists(arg, max_size=4))


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", sorted(jobs.REGISTRY))
@FUZZ
@given(data=st.data())
def test_a_job_renderer_never_raises_anything_but_one_line(scheduler, data):
    example, flags, env, args = data.draw(job_request(scheduler))
    try:
        renderer, _ = jobs.build(scheduler, example, flags, env, args)
        text = renderer.render()
    except TrainpodError as error:
        one_line(error)
        return
    text.encode("utf-8")  # no lone surrogate reached the file
    if scheduler in ("openpai", "kubeflow"):
        assert text.isascii()  # YAML written in ASCII, the header too


@pytest.mark.slow
@FUZZ
@given(identity=ANY, known_hosts=ANY, auth_sock=st.sampled_from(["", "/tmp/agent.sock"]))
def test_the_ssh_key_files_never_raise_anything_but_one_line(identity, known_hosts, auth_sock):
    from trainpod.jobs.ssh_keys import client_options

    env = {"TRAINPOD_JOB_SSH_IDENTITY": identity, "TRAINPOD_JOB_SSH_KNOWN_HOSTS": known_hosts, "SSH_AUTH_SOCK": auth_sock}
    try:
        renderer, _ = jobs.build("ssh", "cifar10-ddp", {"hosts": "h1"}, env)
        client_options(renderer.options, env)
    except TrainpodError as error:
        one_line(error)
