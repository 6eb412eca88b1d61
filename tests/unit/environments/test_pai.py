import re

import pytest

from fixtures.pai_runtime import pai_environment
from trainpod.environments.pai import PAIEnvironment
from trainpod.errors import ConfigError, UsageError
from trainpod.launcher.resolve import Options, resolve_topology


def discover(env, **flags):
    return PAIEnvironment(env, flags).discover()


def test_detects_only_with_a_current_role():
    assert PAIEnvironment.detect(pai_environment({"worker": 2}, ("worker", 0), {"SyncPort": 1}))
    assert not PAIEnvironment.detect({"MASTER_ADDR": "10.0.0.1"})


@pytest.mark.parametrize("index", [0, 1])
def test_two_instances_of_one_role(index):
    env = pai_environment({"worker": 2}, ("worker", index), {"SyncPort": 1})
    found = discover(env)
    assert (found.nnodes, found.node_rank) == (2, index)
    assert found.master_addr == env["PAI_HOST_IP_worker_0"]
    assert found.master_port == int(env["PAI_PORT_LIST_worker_0_SyncPort"])
    assert found.origins["master_port"] == "PAI_PORT_LIST_worker_0_SyncPort"
    assert found.origins["master_addr"] == "PAI_HOST_IP_worker_0"


def test_port_lists_take_the_first_port():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 3})
    assert "," in env["PAI_PORT_LIST_worker_0_SyncPort"]
    assert discover(env).master_port == int(env["PAI_PORT_LIST_worker_0_SyncPort"].split(",")[0])


def test_legacy_port_spelling_alone():
    env = {k: v for k, v in pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 2}).items()
           if not k.startswith("PAI_PORT_LIST_")}
    found = discover(env)
    assert found.master_port == int(env["PAI_worker_0_SyncPort_PORT"].split(",")[0])
    assert found.origins["master_port"] == "PAI_worker_0_SyncPort_PORT"


def test_older_runtime_index_variable():
    env = pai_environment({"worker": 3}, ("worker", 2), {"SyncPort": 1})
    del env["PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX"]
    assert discover(env).node_rank == 2


def test_several_trainer_roles_in_order():
    env = pai_environment({"master": 1, "worker": 3}, ("worker", 2), {"SyncPort": 1})
    found = discover(env, pai_roles="master,worker")
    assert (found.nnodes, found.node_rank) == (4, 3)
    assert found.master_addr == env["PAI_HOST_IP_master_0"]
    assert found.master_port == int(env["PAI_PORT_LIST_master_0_SyncPort"])


def test_roles_from_the_environment_variable():
    env = pai_environment({"master": 1, "worker": 3}, ("master", 0), {"SyncPort": 1})
    env["TRAINPOD_PAI_ROLES"] = "master, worker"
    found = discover(env)
    assert (found.nnodes, found.node_rank) == (4, 0)


def test_non_trainer_roles_do_not_count():
    env = pai_environment({"worker": 2, "tensorboard": 1}, ("worker", 1), {"SyncPort": 1})
    assert discover(env).nnodes == 2


def test_role_names_with_underscores_do_not_borrow_ports():
    # "worker_0" instance 0's variables start with "PAI_PORT_LIST_worker_0_0_": they are not worker's.
    env = pai_environment({"worker": 2, "worker_0": 1}, ("worker", 1), {"SyncPort": 1})
    env["PAI_PORT_LIST_worker_0_0_extra"] = "31000"
    env["PAI_worker_0_0_extra_PORT"] = "31000"
    found = discover(env)
    assert found.master_port == int(env["PAI_PORT_LIST_worker_0_SyncPort"])


def test_underscored_role_is_found_by_its_full_name():
    env = pai_environment({"dist_train": 2}, ("dist_train", 1), {"sync_port": 1})
    found = discover(env)
    assert found.master_port == int(env["PAI_PORT_LIST_dist_train_0_sync_port"])
    assert found.master_addr == env["PAI_HOST_IP_dist_train_0"]


def test_no_label_besides_ssh_and_http_warns_and_uses_29500():
    found = discover(pai_environment({"worker": 2}, ("worker", 1)))
    assert found.master_port == 29500
    assert "29500" in found.warnings[0] and "ports" in found.warnings[0]


def test_chosen_label_among_several():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1, "tensorboard": 1})
    assert discover(env, pai_port_label="SyncPort").master_port == int(env["PAI_PORT_LIST_worker_0_SyncPort"])
    env["TRAINPOD_PAI_PORT_LABEL"] = "tensorboard"
    assert discover(env).master_port == int(env["PAI_PORT_LIST_worker_0_tensorboard"])


# --- bad input: one line naming the variable, exit 78 (64 when a flag is at fault) ---

def resolve_error(env, **flags):
    with pytest.raises((ConfigError, UsageError)) as caught:
        resolve_topology(Options(**flags), env, resolve_names=False)
    assert "\n" not in str(caught.value)
    return caught.value


def test_non_numeric_index():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    env["PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX"] = "one"
    error = resolve_error(env)
    assert error.exit_code == 78 and "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX='one'" in str(error)


def test_index_not_below_count():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    env["PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX"] = "2"
    error = resolve_error(env)
    assert error.exit_code == 78 and "PAI_TASK_ROLE_TASK_COUNT_worker=2" in str(error)


def test_master_host_ip_missing_mentions_the_gang_barrier():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    del env["PAI_HOST_IP_worker_0"]
    error = resolve_error(env)
    assert error.exit_code == 78 and "PAI_HOST_IP_worker_0" in str(error) and "gang" in str(error)


def test_master_host_ip_missing_but_given_as_a_flag():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    del env["PAI_HOST_IP_worker_0"]
    topology = resolve_topology(Options(master_addr="10.9.9.9"), env, resolve_names=False)
    assert topology.master_addr == "10.9.9.9" and topology.origins["master_addr"] == "--master-addr"


def test_unknown_port_label_lists_the_labels():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    env["TRAINPOD_PAI_PORT_LABEL"] = "sync"
    error = resolve_error(env)
    assert error.exit_code == 78
    assert "TRAINPOD_PAI_PORT_LABEL='sync'" in str(error) and "SyncPort, http, ssh" in str(error)


def test_unknown_port_label_from_the_flag_is_a_usage_error():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    error = resolve_error(env, pai_port_label="nope")
    assert error.exit_code == 64 and "--pai-port-label='nope'" in str(error)


def test_ambiguous_port_labels():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1, "tensorboard": 1})
    error = resolve_error(env)
    assert error.exit_code == 78 and "SyncPort, tensorboard" in str(error) and "--pai-port-label" in str(error)


def test_ambiguous_port_labels_do_not_matter_with_a_port_flag():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1, "tensorboard": 1})
    assert resolve_topology(Options(master_port=23456), env, resolve_names=False).master_port == 23456


@pytest.mark.parametrize("value", ["abc", "0", "70000", ",29500"])
def test_bad_port_values(value):
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    env["PAI_PORT_LIST_worker_0_SyncPort"] = value
    error = resolve_error(env)
    assert error.exit_code == 78 and "PAI_PORT_LIST_worker_0_SyncPort" in str(error)


def test_current_role_not_a_trainer_role():
    env = pai_environment({"master": 1, "worker": 2}, ("worker", 0), {"SyncPort": 1})
    env["TRAINPOD_PAI_ROLES"] = "master"
    error = resolve_error(env)
    assert error.exit_code == 78 and "'worker'" in str(error) and "TRAINPOD_PAI_ROLES" in str(error)


def test_trainer_role_without_a_count():
    env = pai_environment({"worker": 2}, ("worker", 0), {"SyncPort": 1})
    error = resolve_error(env, pai_roles="worker,ps")
    assert error.exit_code == 78 and "PAI_TASK_ROLE_TASK_COUNT_ps" in str(error) and "worker" in str(error)


def test_non_numeric_count():
    env = pai_environment({"worker": 2}, ("worker", 0), {"SyncPort": 1})
    env["PAI_TASK_ROLE_TASK_COUNT_worker"] = "two"
    assert "PAI_TASK_ROLE_TASK_COUNT_worker='two'" in str(resolve_error(env))


def test_the_job_and_its_attempt_name_the_rendezvous():
    from fixtures.pai_runtime import pai_environment
    from trainpod.launcher.resolve import Options, resolve_topology

    env = {**pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1}), "FC_FRAMEWORK_ATTEMPT_ID": "2"}
    topology = resolve_topology(Options(rdzv_backend="etcd-v3", rdzv_endpoint="etcd:2379"), env, resolve_names=False)
    # OpenPAI's user~job name, kept exactly as it reads (trainpod.rendezvous.ids)
    assert topology.rdzv.id == "alice~cifar10-ddp-2node-a2"
    assert topology.origins["rdzv_id"] == "PAI_JOB_NAME + FC_FRAMEWORK_ATTEMPT_ID"  # nothing escaped: nothing to say


@pytest.mark.parametrize("role", ["work\ner", "w\rx", "w x", "w\u2028x", "w\x85x"])
def test_a_role_name_with_a_line_break_or_blank_is_one_line(role):
    # (found by tests/unit/test_fuzz.py: the role went raw into the variable names the errors quote)
    env = {"PAI_CURRENT_TASK_ROLE_NAME": role, "PAI_TASK_INDEX": "0"}
    with pytest.raises(ConfigError) as raised:
        discover(env)
    assert len(str(raised.value).splitlines()) == 1 and "PAI_CURRENT_TASK_ROLE_NAME=" in str(raised.value)
    with pytest.raises(UsageError) as raised:
        discover(pai_environment({"worker": 2}, ("worker", 0), {"SyncPort": 1}), pai_roles=f"worker,{role}")
    assert len(str(raised.value).splitlines()) == 1


def test_known_roles_are_listed_on_one_line():
    env = {**pai_environment({"worker": 2}, ("worker", 0), {"SyncPort": 1}), "PAI_TASK_ROLE_LIST": "ps\r,x\ny"}
    with pytest.raises(ConfigError) as raised:
        discover(env, pai_roles="worker,ps")
    assert len(str(raised.value).splitlines()) == 1 and "roles: " in str(raised.value)


@pytest.mark.parametrize("roles,says", [(",", "--pai-roles=',': expected the trainer task roles, comma-separated"),
                                        ("master", "--pai-roles='master': the current role PAI_CURRENT_TASK_ROLE_NAME='worker'")])
def test_a_pai_roles_flag_that_cannot_be_is_a_usage_error_that_says_why(roles, says):
    env = pai_environment({"worker": 2, "master": 1}, ("worker", 0), {"SyncPort": 1})
    with pytest.raises(UsageError, match=f"^{re.escape(says)}"):
        discover(env, pai_roles=roles)


def test_a_port_list_whose_first_port_is_empty_is_named_as_it_reads():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    env["PAI_PORT_LIST_worker_0_SyncPort"] = ",29877"
    del env["PAI_worker_0_SyncPort_PORT"]  # (the older runtime's spelling, which is read too)
    assert str(resolve_error(env)).startswith("PAI_PORT_LIST_worker_0_SyncPort=',29877': expected the ports OpenPAI reserved")
