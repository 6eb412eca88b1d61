"""Property-based proofs that no value reshapes a job file (hypothesis), over every renderer and every kind
of value a job takes: names, namespaces, images, SLURM's option values, OpenPAI's labels, hosts, etcd
endpoints, numbers, and the example's own flags as arbitrary text.

- YAML (OpenPAI, Kubeflow) loads back to exactly the data meant, its argv to exactly the argv meant, read
  as the platforms read it (fixtures.platform_yaml: y, 0o17 or 1e-3 unquoted would be a boolean or a number there);
- the sbatch script, run by bash with a recorder in place of srun, runs exactly the intended argv and
  nothing else (nothing on stderr: any other command would be "not found"), and sbatch's #SBATCH words
  are exactly the options meant;
- a command run by a shell (OpenPAI's, the ssh remote command) is exactly that argv when a shell runs it,
  and `docker run` gets the image as its image and none of the values as its own options;
- every header line is a comment of printable ASCII, and its `trainpod job ...` line, read by bash, is
  exactly the command line that renders the file.
"""

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures import platform_yaml
from fixtures.cli import in_process
from trainpod import jobs
from trainpod import settings as settings_module
from trainpod.errors import UsageError
from trainpod.examples.options import COMMON
from trainpod.jobs.base import comment
from trainpod.jobs.values import ImageReference, Invalid, shell_line

PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHELL_HOSTILE = list("'\"$`\\#;&|<>*?~!{}[]()=:, \u00a0\u00fc\u4e2d\ufeff\U0001f600-%^")
# Text a value may be (no control characters: those are refused, test_job_safety.py)
TEXT = st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp"))
ARG = st.one_of(st.text(TEXT, max_size=12), st.text(st.sampled_from(SHELL_HOSTILE), max_size=8),
                st.sampled_from(["", "--", "-", "$(touch /tmp/p)", "`id`", "a'b", "x\\", "#", "~", "null", "yes", "1e3", "- x",
                                 "key: value", "[1]", "{a: 1}", "&anchor", "*alias", "!!python/object", "'", '"', "%", "@",
                                 "y", "N", "on", "0o17", "1e-3", "-1E5", ".inf", "0x1F", "1:20", "--lr", "<% $secrets.x %>"]))


def example_values(words):
    """The words as an example's flags after --: each the value of --output-dir (a string option every example has),
    as its own argv word where the example's parser takes it so, else after '--output-dir=' (a word like '-1e-3' reads
    as a flag). `trainpod job` parses the example's flags as its ranks will; no parser takes an empty value."""
    args = []
    for word in words:
        for form in (["--output-dir", word], [f"--output-dir={word}"]):
            try:
                settings_module.parse_args("cifar10-ddp", "", COMMON, form, {})
            except UsageError:
                continue
            args += form
            break
    return args


ARGS = st.lists(ARG, max_size=6).map(example_values)

# --- valid values of each kind ---------------------------------------------------------------------

NAME = st.from_regex(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", fullmatch=True)
NAMESPACE = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
_ALNUM = st.from_regex(r"[a-z0-9]{1,5}", fullmatch=True)
_PATH_COMPONENT = st.builds(lambda first, rest: first + "".join(s + a for s, a in rest), _ALNUM,
                            st.lists(st.tuples(st.sampled_from([".", "_", "__", "-", "---"]), _ALNUM), max_size=2))
_DOMAIN = st.one_of(st.lists(st.from_regex(r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,5}[a-zA-Z0-9])?", fullmatch=True), min_size=1,
                             max_size=3).map(".".join), st.just("[fd00::1]"))
IMAGE = st.builds(
    lambda domain, port, path, tag, digest: (f"{domain}{port}/" if domain else "") + path + tag + digest,
    st.one_of(st.none(), _DOMAIN), st.sampled_from(["", ":5000"]), st.lists(_PATH_COMPONENT, min_size=1, max_size=3).map("/".join),
    st.one_of(st.just(""), st.from_regex(r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"@sha256:[0-9a-f]{64}", fullmatch=True)))
HOST = st.one_of(st.from_regex(r"[a-z][a-z0-9-]{0,8}[a-z0-9](\.[a-z][a-z0-9]{0,5}){0,2}", fullmatch=True),
                 st.sampled_from(["10.0.0.1", "192.168.7.20", "fd00::2"]))
USER = st.one_of(st.none(), st.from_regex(r"[a-z_][a-z0-9_.-]{0,8}", fullmatch=True))
PORT = st.integers(1, 65535)
C_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
OUTPUT = st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp", "Zs"), exclude_characters="'\"\\#"),
                 min_size=1, max_size=20).filter(lambda text: not any(c.isspace() for c in text))
TIME = st.sampled_from(["30", "90:00", "2:00:00", "1-12", "1-0:30", "7-00:00:00", "UNLIMITED", "infinite"])
EXAMPLES = {"openpai": ["cifar10-ddp", "cifar10-dp", "imagenet-elastic", "imagenet-ddp"],
            "kubeflow": ["cifar10-ddp", "cifar10-dp", "imagenet-elastic", "cifar10-ddp-amp"],
            "slurm": ["cifar10-ddp", "cifar10-dp", "imagenet-elastic", "imagenet-ddp"],
            "ssh": ["cifar10-ddp", "cifar10-dp", "cifar10-ddp-amp"]}


@st.composite
def requests(draw, scheduler):
    """(example, flags by setting name, variables, args): a job any scheduler takes, each value from its flag
    or its TRAINPOD_JOB_* variable."""
    example = draw(st.sampled_from(EXAMPLES[scheduler]))
    given = {"name": draw(st.one_of(st.none(), NAME)), "image": draw(st.one_of(st.none(), IMAGE)),
             "cpus": draw(st.one_of(st.none(), st.integers(1, 512))), "memory_mb": draw(st.one_of(st.none(), st.integers(256, 10**6))),
             "shm_mb": draw(st.one_of(st.none(), st.integers(64, 10**5))),
             "term_grace": draw(st.one_of(st.none(), st.sampled_from(["25", "0.5", "300", "12.25", "1234567", "0.1"])))}
    gpus = draw(st.sampled_from([None, 0, 1, 4]))
    given["gpus"] = gpus
    if gpus:
        given["backend"] = draw(st.sampled_from([None, "gloo", "nccl"]))
    if example == "imagenet-elastic" and (scheduler == "openpai" or draw(st.booleans())):
        given["rdzv_endpoint"] = ",".join(f"{'[' + h + ']' if ':' in h else h}:{p}"
                                          for h, p in draw(st.lists(st.tuples(HOST, PORT), min_size=1, max_size=3)))
    if scheduler == "openpai":
        given.update(pai_role=draw(st.one_of(st.none(), C_NAME)),
                     pai_port_label=draw(st.one_of(st.none(), C_NAME.filter(lambda label: label not in ("ssh", "http")))),
                     virtual_cluster=draw(st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,10}", fullmatch=True))))
    elif scheduler == "kubeflow":
        given.update(namespace=draw(st.one_of(st.none(), NAMESPACE)), master_port=draw(st.one_of(st.none(), PORT)),
                     backoff_limit=draw(st.one_of(st.none(), st.integers(0, 1000))))
    elif scheduler == "slurm":
        given.update(partition=draw(st.one_of(st.none(), st.from_regex(r"[a-z0-9_.][a-z0-9_.-]{0,8}(,[a-z0-9_.]{1,5}){0,2}",
                                                                        fullmatch=True))),
                     time=draw(st.one_of(st.none(), TIME)), output=draw(st.one_of(st.none(), OUTPUT)))
    else:
        count = 1 if example == "cifar10-dp" else draw(st.integers(1, 3))
        hosts = draw(st.lists(st.tuples(USER, HOST, st.one_of(st.none(), PORT)), min_size=count, max_size=count,
                              unique_by=lambda target: target[1]))
        given["hosts"] = ",".join((f"{user}@" if user else "") + (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
                                  for user, host, port in hosts)
        given.update(no_docker=draw(st.sampled_from([None, True])), master_addr=draw(st.one_of(st.none(), HOST)),
                     master_port=draw(st.one_of(st.none(), PORT)))
    flags, env = {}, {}
    settings_by_name = {s.name: s for s in (*jobs.SETTINGS, *jobs.REGISTRY[scheduler].settings)}
    for name, value in given.items():
        if value is None:
            continue
        text = "1" if value is True else str(value)
        if draw(st.booleans()):
            flags[name] = True if value is True else text
        else:
            env[settings_by_name[name].var] = text
    return example, flags, env, draw(ARGS)


# --- what a shell makes of it ----------------------------------------------------------------------

INTERPRETERS = {name: shutil.which(name) for name in ("bash", "sh")}
# Each call: its argument count, then each argument, NUL-terminated (no argv holds a NUL).
RECORDER = '#!/bin/sh\n{ printf "%s\\0" "$#"; for word in "$@"; do printf "%s\\0" "$word"; done; } >> "$RECORD"\n'


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """run(interpreter, script_or_command) -> (argv of each command the recorders saw, stdout, stderr); PATH
    holds nothing but the recorders (srun, docker, env, trainpod) and sh, so any other command fails."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name in ("srun", "docker", "env", "trainpod"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "sh").symlink_to("/bin/sh")
    record = bin_dir.parent / "record"

    def run(argv):
        record.write_bytes(b"")
        done = subprocess.run([INTERPRETERS[argv[0]], *argv[1:]], env={"PATH": str(bin_dir), "RECORD": str(record), "LC_ALL": "C"},
                              capture_output=True, timeout=30, cwd=bin_dir.parent)
        words, calls = record.read_bytes().split(b"\0")[:-1], []
        while words:
            count, words = int(words[0]), words[1:]
            calls.append([word.decode("utf-8", "surrogateescape") for word in words[:count]])
            words = words[count:]
        return calls, done
    return run


def check_header(text, job, *, shebang=False):
    """Every line before the body is a comment of printable ASCII; its command line is the one asked for."""
    lines = text.splitlines()
    if shebang:
        assert lines.pop(0) == "#!/bin/bash"
    header = []
    for line in lines:
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        header.append(line)
    assert all(re.fullmatch(r"#( [ -~]*)?", line) for line in header), header
    generated = [re.fullmatch(r"# Generated by `(.*)`[.:]", line) for line in header]
    return next(match[1] for match in generated if match)


def check_command_line(shell, line, job):
    calls, done = shell(["bash", "-c", "env " + line])
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    assert calls == [list(job.request.command_line)]


def args_after_dashes(argv):
    return argv[argv.index("--") + 1:] if "--" in argv else []


# --- the properties --------------------------------------------------------------------------------

@pytest.mark.slow
@PROPERTY
@given(requests("openpai"))
def test_openpai_loads_back_to_what_was_meant(shell, request):
    example, flags, env, args = request
    if any("<%" in arg for arg in args):  # OpenPAI's template tag: refused, its server would render it
        with pytest.raises(UsageError, match="OpenPAI renders each command as a template"):
            jobs.build("openpai", example, flags, env, args)
        return
    job, _ = jobs.build("openpai", example, flags, env, args)
    text = job.render()
    loaded = platform_yaml.load(text)
    assert loaded == job.data()
    assert loaded["name"] == flags.get("name", env.get("TRAINPOD_JOB_NAME", f"trainpod-{example}"))
    assert loaded["prerequisites"][0]["uri"] == job.request.image
    (role,) = loaded["taskRoles"]
    (command,) = loaded["taskRoles"][role]["commands"]
    calls, done = shell(["bash", "-c", command])  # OpenPAI runs the commands with bash
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    assert calls == [job.request.run_argv()[1:]]
    assert args_after_dashes(calls[0]) == args
    check_command_line(shell, check_header(text, job), job)


@pytest.mark.slow
@PROPERTY
@given(requests("kubeflow"))
def test_kubeflow_loads_back_to_what_was_meant(shell, request):
    example, flags, env, args = request
    job, _ = jobs.build("kubeflow", example, flags, env, args)
    text = job.render()
    loaded = platform_yaml.load(text)
    assert loaded == job.data()
    assert list(loaded) == ["apiVersion", "kind", "metadata", "spec"]
    metadata = {"name": flags.get("name", env.get("TRAINPOD_JOB_NAME", f"trainpod-{example}"))}
    if flags.get("namespace", env.get("TRAINPOD_JOB_NAMESPACE")):
        metadata["namespace"] = flags.get("namespace", env.get("TRAINPOD_JOB_NAMESPACE"))
    assert loaded["metadata"] == metadata
    for replicas in loaded["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replicas["template"]["spec"]["containers"]
        assert container["args"] == job.request.run_argv() and args_after_dashes(container["args"]) == args
        assert container["image"] == job.request.image
    check_command_line(shell, check_header(text, job), job)


@pytest.mark.slow
@PROPERTY
@given(requests("slurm"))
def test_the_sbatch_script_runs_exactly_the_intended_command(shell, tmp_path_factory, request):
    example, flags, env, args = request
    job, _ = jobs.build("slurm", example, flags, env, args)
    text = job.render()
    # sbatch: the #SBATCH lines before the first command, each one word (split at blanks, as sbatch does)
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    directives = [line.split()[1:] for line in lines[:first_command] if line.startswith("#SBATCH")]
    assert directives == [[option] for option in job.sbatch_options()]
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:])
    script = tmp_path_factory.mktemp("sbatch") / "job.sh"
    script.write_bytes(text.encode("utf-8"))
    calls, done = shell(["bash", str(script)])
    assert done.returncode == 0 and done.stderr == b"" and done.stdout == b"", (done.stdout, done.stderr)
    assert calls == [job.srun_argv()[1:]]
    assert calls[0][:3] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", f"--cpus-per-task={job.request.cpus}"]
    assert calls[0][3:5] == ["trainpod", "run"] and args_after_dashes(calls[0]) == args
    check_command_line(shell, check_header(text, job, shebang=True), job)


def docker_run(argv):
    """What `docker run` makes of argv: (its options, the image, the command), as its parser reads them."""
    assert argv[:2] == ["docker", "run"]
    options, rest = [], argv[2:]
    while rest[0].startswith("-"):
        takes_value = rest[0] in ("-e", "--name")
        options.append(tuple(rest[:2]) if takes_value else rest[0])
        rest = rest[2:] if takes_value else rest[1:]
    return options, rest[0], rest[1:]


@pytest.mark.slow
@PROPERTY
@given(requests("ssh"))
def test_each_host_runs_exactly_the_intended_command(shell, request):
    example, flags, env, args = request
    job, _ = jobs.build("ssh", example, flags, env, args)
    text = job.render()
    listing = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(listing) == len(job.targets)
    for rank, (target, line) in enumerate(zip(job.targets, listing)):
        shown, command = line.split(": ", 1)
        argv = job.node_argv(rank)
        assert shown == str(target) and shlex.split(command) == argv
        # sshd runs the remote command with the user's shell: `sh -c COMMAND`
        calls, done = shell(["sh", "-c", job.remote_command(rank)])
        assert done.returncode == 0 and done.stderr == b"", done.stderr
        assert re.fullmatch(rb"trainpod-ssh-pid [0-9]+\n", done.stdout)
        assert calls == [argv[1:]]
        if argv[0] == "docker":
            options, image, command = docker_run(argv)
            assert image == job.request.image and command == job.request.run_argv()
            assert ("--name", f"{job.request.name}-node{rank}") in options
            r = job.request
            assert {o for o in options if isinstance(o, str)} <= {"--rm", "--net=host", f"--gpus={r.gpus}", f"--cpus={r.cpus}",
                                                                   f"--memory={r.memory_mb}m", f"--shm-size={r.shm_mb}m",
                                                                   f"--stop-timeout={r.stop_grace_s}"}
        assert args_after_dashes(argv) == args
    check_command_line(shell, check_header(text, job), job)


# --- the pieces ------------------------------------------------------------------------------------

@pytest.mark.slow
@PROPERTY
@given(st.lists(st.text(st.characters(exclude_characters="\0", exclude_categories=("Cs",)), max_size=10), max_size=5))
def test_the_header_command_line_is_printable_ascii_that_bash_reads_back(shell, argv):
    line = shell_line(argv)
    assert re.fullmatch(r"[ -~]*", line)
    calls, done = shell(["bash", "-c", "env " + line])
    assert calls == [argv], done.stderr


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=4))
def test_a_comment_stays_a_comment(lines):
    text = comment(lines)
    assert len(text.splitlines()) == len(lines) and all(re.fullmatch(r"#( [ -~]*)?", line) for line in text.splitlines())
    assert yaml.safe_load(text + "a: 1\n") == {"a": 1}


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), IMAGE.map(lambda image: image + " "), IMAGE))
def test_an_image_reference_is_a_single_docker_argument(text):
    try:
        image = ImageReference()(text)
    except Invalid:
        return
    assert image == text.strip() and (image[0].isalnum() or image[0] == "[") and image.isascii() and not any(c.isspace() for c in image)
    assert docker_run(["docker", "run", "--rm", image, "x"]) == (["--rm"], image, ["x"])


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(IMAGE)
def test_every_generated_reference_is_accepted(image):
    assert ImageReference()(image) == image


def test_the_recorder_sees_a_smuggled_command(shell):
    """The proof's own check: a line that would run a command is seen (as the old header's was)."""
    calls, done = shell(["bash", "-c", "# Generated by `x`\ntouch /tmp/p\nexec srun a"])
    assert b"touch" in done.stderr and calls == [["a"]]  # touch is not on PATH: "not found", on stderr


# Each read as a boolean or a number by some platform's YAML reader, were it written without quotes.
NOT_STRINGS = ["y", "n", "Y", "N", "yes", "off", "true", "null", "~", "0o17", "-0o17", "0x1F", "1e3", "1e-3", "1E5", "-1e-3",
               "+1e3", "1.5e3", "012", "0.1", ".5", "1:30", ".inf", ".NaN", "0", "-0", "+1", "2001-12-14", "=", "<<"]
# ...as the example's flags (its parser takes all but '-0o17' and '-1e-3' as words of their own)
NOT_STRING_ARGS = example_values(NOT_STRINGS)
KUBERNETES_JOBS = {"pytorchjob": ("kubeflow", ["--name", "n", "--namespace", "y"]),
                   "trainjob": ("kubeflow", ["--api", "trainer-v2", "--name", "n", "--namespace", "y"]),
                   "openpai": ("openpai", ["--name", "n", "--virtual-cluster", "N"])}


@pytest.mark.parametrize("job", KUBERNETES_JOBS)
def test_a_value_any_platform_reads_as_a_boolean_or_a_number_stays_a_string(job):
    scheduler, flags = KUBERNETES_JOBS[job]
    text = render(scheduler, flags)
    for document in platform_yaml.load_all(text):
        assert not [value for value in walk(document) if isinstance(value, platform_yaml.Ambiguous)]
        strings = {value for value in walk(document) if isinstance(value, str)}
        if scheduler == "openpai":  # (the example's flags are words of the shell command, one string)
            assert (document["name"], document["defaults"]["virtualCluster"]) == ("n", "N")
        elif document["kind"] != "TrainingRuntime":
            assert {"n", "y", *NOT_STRING_ARGS} <= strings


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed: the YAML check above still runs")
@pytest.mark.parametrize("job", ["pytorchjob", "trainjob"])
def test_kubectl_reads_every_value_as_the_string_it_was(job, tmp_path):
    # kubectl is the reader that counts (Go's YAML); --local reads the file without a cluster.
    scheduler, flags = KUBERNETES_JOBS[job]
    (tmp_path / "job.yaml").write_text(render(scheduler, flags))
    read = subprocess.run(["kubectl", "label", "--local", "-f", str(tmp_path / "job.yaml"), "checked=yes", "-o", "json"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "KUBECONFIG": "/dev/null"})
    assert read.returncode == 0, read.stderr
    decoder, documents, at = json.JSONDecoder(), [], 0
    while read.stdout[at:].strip():  # one JSON object per YAML document
        document, at = decoder.raw_decode(read.stdout, at + len(read.stdout[at:]) - len(read.stdout[at:].lstrip()))
        documents.append(document)
    assert len(documents) == len(list(platform_yaml.load_all((tmp_path / "job.yaml").read_text())))
    for document in documents:
        if document["kind"] == "TrainingRuntime":
            continue
        assert (document["metadata"]["name"], document["metadata"]["namespace"]) == ("n", "y")
        containers = [c for c in walk(document) if isinstance(c, dict) and "args" in c or isinstance(c, dict) and "command" in c]
        (argv,) = {tuple(c.get("command", []) + c.get("args", [])) for c in containers}
        assert list(argv[argv.index("--") + 1:]) == NOT_STRING_ARGS


def render(scheduler, flags):
    result = in_process(["job", scheduler, "cifar10-ddp", *flags, "--", *NOT_STRING_ARGS], {"PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr
    return result.stdout


def walk(value):
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


@pytest.mark.parametrize("scheduler", ["openpai", "kubeflow", "slurm"])
@pytest.mark.parametrize("grace", ["1234567", "12.25", "0.1"])
def test_a_term_grace_reaches_the_nodes_and_the_header_exactly_as_given(scheduler, grace):
    job, _ = jobs.build(scheduler, "cifar10-ddp", {"term_grace": grace}, {})
    argv = job.request.run_argv()
    assert argv[argv.index("--term-grace") + 1] == grace  # ({:g} made 1234567 1.23457e+06: another grace)
    assert f"--term-grace {grace}" in job.request.generated_by()
